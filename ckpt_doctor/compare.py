"""Compares a checkpoint's state_dict with a model's and infers the smallest fix that makes a strict load succeed."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from math import prod

from .analyze import find_prefixes
from .errors import PlanError
from .modelspec import ModelKeys
from .records import Checkpoint, TensorRecord
from .transforms import Op, Transform, add_prefix, flags_for, plan_keys, rename, strip_prefix

BN_STATS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class Mismatch:
    key: str
    checkpoint_shape: tuple[int, ...]
    model_shape: tuple[int, ...]


@dataclass(frozen=True)
class Comparison:
    """The verdict of a strict load of the checkpoint's state_dict into the model, and the fix for it."""

    model: str
    state_dict_root: str | None
    matched: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[Mismatch, ...]
    dtype_differs: tuple[tuple[str, str, str], ...]  # (key, checkpoint dtype, model dtype)
    non_persistent: tuple[str, ...]  # checkpoint keys that are non-persistent buffers of the model
    loaded_fraction: float
    suggested_fix: tuple[str, ...] = ()  # flags for `ckpt-doctor fix`
    fix_kind: str = "none"  # none | rename | map-by-order | partial
    fix_loaded_fraction: float | None = None
    ambiguous: tuple[str, ...] = ()  # positions where a mapping by order could swap tensors of one shape
    bn_stats_missing: tuple[str, ...] = ()
    allowed_missing: tuple[str, ...] = ()
    allowed_unexpected: tuple[str, ...] = ()
    min_loaded: float | None = None
    transforms: tuple[Transform, ...] = field(default=(), compare=False)

    @property
    def strict_ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched or self.non_persistent)

    @property
    def ok(self) -> bool:
        """What CI asserts: a strict load succeeds, or only the differences explicitly allowed remain."""
        return self.strict_ok and (self.min_loaded is None or self.loaded_fraction >= self.min_loaded)


def _match(ckpt: dict[str, TensorRecord], model: ModelKeys) -> tuple[list, list, list, list, list, list, float]:
    by_key = model.by_key()
    matched, missing, mismatched, dtypes = [], [], [], []
    for key, entry in by_key.items():
        t = ckpt.get(key)
        if t is None:
            missing.append(key)
        elif tuple(t.shape) != tuple(entry.shape):
            mismatched.append(Mismatch(key, tuple(t.shape), tuple(entry.shape)))
        else:
            matched.append(key)
            if t.dtype != entry.dtype:
                dtypes.append((key, t.dtype, entry.dtype))
    np_set = set(model.non_persistent)
    non_persistent = [k for k in ckpt if k not in by_key and k in np_set]
    unexpected = [k for k in ckpt if k not in by_key and k not in np_set]
    total = sum(prod(e.shape) for e in by_key.values() if e.is_parameter)
    filled = sum(prod(by_key[k].shape) for k in matched if by_key[k].is_parameter)
    fraction = filled / total if total else 1.0
    return matched, missing, unexpected, mismatched, dtypes, non_persistent, fraction


def compare_tensors(tensors: list[TensorRecord], model: ModelKeys, *, root: str | None = "",
                    allow_missing: str | None = None, allow_unexpected: str | None = None,
                    min_loaded: float | None = None) -> Comparison:
    ckpt = {t.key: t for t in tensors}
    matched, missing, unexpected, mismatched, dtypes, non_persistent, fraction = _match(ckpt, model)
    if missing or unexpected or mismatched:
        transforms, kind, fix_fraction, ambiguous = infer_fix(tensors, model, fraction)
    else:
        transforms, kind, fix_fraction, ambiguous = [], "none", None, []
    # Keys that are (or, once renamed, become) non-persistent buffers of the model: drop them by their old name.
    renamed = plan_keys(list(ckpt), transforms).mapping if transforms else {k: k for k in ckpt}
    np_set = set(model.non_persistent)
    to_drop = [old for old, new in renamed.items() if new in np_set]
    if to_drop:
        transforms = transforms + [Transform(Op.DROP, "^(" + "|".join(re.escape(k) for k in to_drop) + ")$")]
    allowed_m: list[str] = []
    allowed_u: list[str] = []
    if allow_missing:
        pattern = re.compile(allow_missing)
        allowed_m = [k for k in missing if pattern.search(k)] + [m.key for m in mismatched if pattern.search(m.key)]
    if allow_unexpected:
        pattern = re.compile(allow_unexpected)
        allowed_u = [k for k in unexpected if pattern.search(k)]
    bn_missing = tuple(k for k in missing if k.rsplit(".", 1)[-1] in BN_STATS)
    flags = (["--select", root] if root else []) + flags_for(transforms)
    if kind == "map-by-order":
        flags += [*model.flags, "--map-by-order"] + (["--force"] if ambiguous else [])
    suggested = tuple(flags)
    return Comparison(
        model=model.source, state_dict_root=root,
        matched=tuple(matched), missing=tuple(k for k in missing if k not in allowed_m),
        unexpected=tuple(k for k in unexpected if k not in allowed_u),
        mismatched=tuple(m for m in mismatched if m.key not in allowed_m), dtype_differs=tuple(dtypes),
        non_persistent=tuple(non_persistent), loaded_fraction=round(fraction, 6), suggested_fix=suggested,
        fix_kind=kind, fix_loaded_fraction=None if fix_fraction is None else round(fix_fraction, 6),
        ambiguous=tuple(ambiguous), bn_stats_missing=bn_missing, allowed_missing=tuple(allowed_m),
        allowed_unexpected=tuple(allowed_u), min_loaded=min_loaded, transforms=tuple(transforms))


def compare_checkpoint(ckpt: Checkpoint, model: ModelKeys, **kwargs) -> Comparison:
    return compare_tensors(list(ckpt.state_dict_tensors()), model, root=ckpt.state_dict_root, **kwargs)


def _candidates(ckpt_keys: list[str], model_keys: list[str]) -> list[list[Transform]]:
    """Prefix changes worth trying: strip the checkpoint's wrappers, add the model's, or both; mid-key wrappers."""
    ck = find_prefixes(ckpt_keys)
    mk = find_prefixes(model_keys)
    strip_options: list[list[Transform]] = [[]]
    leading = "".join(p.prefix for p in ck if p.leading and p.count == p.total)
    partial = [p.prefix for p in ck if p.leading and p.count < p.total]
    if leading:
        # `_orig_mod.module.` may be stripped whole or in part (the model may itself be wrapped).
        pieces = [p.prefix for p in ck if p.leading and p.count == p.total]
        for i in range(1, len(pieces) + 1):
            strip_options.append([strip_prefix("".join(pieces[:i]))])
    for p in partial:
        strip_options.append([strip_prefix(p)])
    mids = [p for p in ck if not p.leading]
    if mids:
        renames = [rename(f"^{re.escape(p.where)}{re.escape(p.prefix)}={p.where}") for p in mids]
        strip_options += [opt + renames for opt in list(strip_options)]
        # The same wrapper at several depths: one rename for all of them.
        tokens = sorted({p.prefix for p in mids})
        strip_options += [opt + [rename(f"(^|\\.){re.escape(t[:-1])}\\.=\\1")] for opt in list(strip_options)
                          for t in tokens]
    model_leading = "".join(p.prefix for p in mk if p.leading and p.count == p.total)
    add_options: list[list[Transform]] = [[]]
    if model_leading:
        pieces = [p.prefix for p in mk if p.leading and p.count == p.total]
        for i in range(1, len(pieces) + 1):
            add_options.append([add_prefix("".join(pieces[-i:]))])
    return [s + a for s in strip_options for a in add_options]


def infer_fix(tensors: list[TensorRecord], model: ModelKeys, fraction: float
              ) -> tuple[list[Transform], str, float | None, list[str]]:
    """(transforms, kind, loaded fraction after them, ambiguous positions); the fewest transforms that work."""
    keys = [t.key for t in tensors]
    by_key = {t.key: t for t in tensors}
    model_keys = [e.key for e in model.entries]
    best: tuple[float, int, list[Transform], float] | None = None  # (score, size, transforms, loaded fraction)
    for transforms in _candidates(keys, model_keys):
        if not transforms:
            continue
        try:
            plan = plan_keys(keys, transforms)
        except PlanError:
            continue
        renamed = [_with_key(by_key[old], new) for old, new in plan.mapping.items()]
        matched, missing, unexpected, mismatched, _, _, filled = _match({t.key: t for t in renamed}, model)
        if not (missing or unexpected or mismatched):
            return transforms, "rename", filled, []
        score = (len(matched) - len(unexpected) - len(mismatched)) / max(len(model_keys), 1)
        if best is None or (score, -len(transforms)) > (best[0], -best[1]):
            best = (score, len(transforms), transforms, filled)
    if fraction < 1.0:
        by_order = _map_by_order(tensors, model)
        if by_order is not None:
            return [], "map-by-order", 1.0, by_order
    if best is not None and best[3] > fraction:
        return best[2], "partial", best[3], []
    return [], "none", None, []


def _with_key(t: TensorRecord, key: str) -> TensorRecord:
    from dataclasses import replace

    return replace(t, key=key)


def _map_by_order(tensors: list[TensorRecord], model: ModelKeys) -> list[str] | None:
    """None unless the sequences of shapes agree; then the ambiguous positions."""
    if len(tensors) != len(model.entries) or not tensors:
        return None
    if any(tuple(t.shape) != tuple(e.shape) for t, e in zip(tensors, model.entries)):
        return None
    return ambiguous_positions(tensors, [e.key for e in model.entries])


def ambiguous_positions(tensors: list[TensorRecord], new_keys: list[str]) -> list[str]:
    """Positions of a mapping by order whose tensor has a neighbour of the same shape: a swap would go unnoticed."""
    ambiguous = []
    for i, (t, new) in enumerate(zip(tensors, new_keys)):
        neighbours = [j for j in (i - 1, i + 1) if 0 <= j < len(tensors)]
        if t.numel > 1 and any(tensors[j].shape == t.shape for j in neighbours):
            ambiguous.append(f"{i}: {t.key} → {new} {list(t.shape)}")
    return ambiguous


def fix_command(path: str, comparison: Comparison) -> str:
    """The full `ckpt-doctor fix` line a user can paste."""
    import shlex

    flags = list(comparison.suggested_fix)
    out = str(path).rstrip("/").rsplit("/", 1)[-1].rsplit(".", 1)[0] + "_fixed.pt"
    return " ".join(["ckpt-doctor", "fix", shlex.quote(str(path)), "-o", out] + [shlex.quote(f) for f in flags])
