"""Loads a checkpoint's state_dict on the devices this machine has, and loads it into a model with the inferred fix."""

from __future__ import annotations

import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ._record import replace as _replace
from .compare import Comparison, compare_checkpoint
from .devices import mapper
from .errors import ReadError, one_line
from .modelspec import model_keys
from .readers import read_checkpoint
from .records import Checkpoint, Format, relative_to_root
from .safepickle.policy import DEFAULT_POLICY, Policy
from .transforms import plan_keys


class StateDict(OrderedDict):
    """A state_dict, with `device_map` telling where each saved device was put ({"cuda:3": "cpu"})."""

    device_map: dict[str, str]
    source: Checkpoint


def _tensors_via_torch_load(ckpt: Checkpoint, device_map: dict[str, str]) -> dict[str, Any] | None:
    """torch.load(weights_only=True) for plain torch files; None where torch.load would run code or fail."""
    import torch

    from .default_load import default_load

    if ckpt.format not in (Format.TORCH_ZIP, Format.TORCH_LEGACY) or ckpt.unsafe_globals or ckpt.hazards \
            or type(ckpt.path).__name__ == "RemotePath":  # a URL: its records, read by range requests
        return None
    if default_load(ckpt).refused:  # torch's unpickler would refuse it (an argparse.Namespace): read the records
        return None
    try:
        loaded = torch.load(ckpt.path, map_location=device_map, weights_only=True)
    except (RuntimeError, ValueError, EOFError, OSError, pickle.UnpicklingError) as exc:
        raise ReadError(f"{ckpt.path}: torch.load(weights_only=True) failed: {one_line(exc)}") from None
    flat: dict[str, Any] = {}

    def walk(obj: Any, prefix: str) -> None:
        if isinstance(obj, torch.Tensor):
            flat[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{prefix}.{i}" if prefix else str(i))

    walk(loaded, "")
    return flat


def load(path: str | Path, device: Any = "auto", *, checkpoint: Checkpoint | None = None,
         select: str | None = None, policy: Policy = DEFAULT_POLICY) -> StateDict:
    """The state_dict inside any checkpoint, each tensor on a device this machine has.

    `device`: "auto" (cuda:N if present, else cuda:0, else mps, else cpu), a device ("cpu", "cuda:1"), or a
    dict like torch's map_location ({"cuda:3": "cuda:0"}). Never unpickles with weights_only=False: files that
    need their own classes (whole-model pickles, TorchScript) are read tensor by tensor from their records.
    `policy`: the allow-list the file is read under (`Policy.allowing([...])` adds names, as --allow-global does).
    """
    from .tensordata import load_tensor  # torch: ~1 s, only when tensors are loaded

    ckpt = checkpoint or read_checkpoint(path, policy=policy)
    ckpt.refuse_if_unsafe("load it", code_too=False)  # a pickled whole model is rescued tensor by tensor
    root = select if select is not None else ckpt.state_dict_root
    if root is None:
        raise ReadError(f"{ckpt.path}: no state_dict found (no container that holds mostly tensors); name the "
                        "part with select=")
    records = relative_to_root(ckpt.tensors, root)
    if not records:
        raise ReadError(f"{ckpt.path}: {root!r} holds no tensors")
    map_fn = mapper(device)
    device_map = {saved: map_fn(saved) for saved in ckpt.devices}
    by_path = _tensors_via_torch_load(ckpt, device_map)
    out = StateDict()
    for record in records:
        full = f"{root}.{record.key}" if root else record.key
        if by_path is not None and full in by_path:
            out[record.key] = by_path[full]
        else:
            out[record.key] = load_tensor(record).to(device_map[record.device])
    out.device_map = device_map
    out.source = ckpt
    return out


def load_into(model: Any, path: str | Path, fix: str | None = "auto", device: Any = None, *,
              select: str | None = None, allow_missing: str | None = None,
              allow_unexpected: str | None = None, policy: Policy = DEFAULT_POLICY) -> Comparison:
    """Load the checkpoint into `model` strictly, after the fix `inspect --model` infers, and return the comparison
    of what was loaded — the state after the fix, with the fix it applied in `suggested_fix`.

    `fix="auto"` applies the renames, drops and tied names `inspect --model` suggests (not a mapping by order,
    which only `ckpt-doctor fix --map-by-order` does, with its checks); `fix=None` loads the keys as they are.
    `select` picks another state_dict in the file (`model_ema`); `allow_missing` / `allow_unexpected` (regexes)
    accept intended differences, as on the command line: those keys keep the model's own values. Raises ReadError
    naming what still fails. `policy`: the allow-list the file is read under.
    """
    import re

    from .compare import compare_tensors  # compare: ~40 ms, only when loading into a model

    ckpt = read_checkpoint(path, policy=policy)
    keys = model_keys(model, type(model).__name__)
    before = compare_checkpoint(ckpt, keys, select=select)
    target = device
    if target is None:
        first = next((p for p in model.parameters()), None)
        target = str(first.device) if first is not None and first.device.type != "meta" else "auto"
    root = (before.fix_root or before.state_dict_root) if fix == "auto" else \
        (select if select is not None else ckpt.state_dict_root)
    state = load(path, target, checkpoint=ckpt, select=root)
    guessed = before.paired and before.ambiguous  # keys of one shape paired by their order: not guessed here
    transforms = list(before.transforms) if fix == "auto" and before.fix_kind in ("rename", "allowed", "none") \
        and not guessed else []
    plan = plan_keys(list(state), transforms)
    fixed = OrderedDict((new, state[old]) for old, new in plan.mapping.items())
    for alias, source in keys.tied.items():  # a tied name the file lacks is the same Parameter as one it has
        if alias not in fixed:
            present = next((s for s in source if s in fixed), None)
            if present is not None:
                fixed[alias] = fixed[present]
    missing_ok = re.compile(allow_missing) if allow_missing else None
    unexpected_ok = re.compile(allow_unexpected) if allow_unexpected else None
    for key in [k for k in fixed if unexpected_ok and unexpected_ok.search(k) and k not in keys.by_key()]:
        del fixed[key]
    own = model.state_dict()
    for key, value in own.items():  # accepted as missing or reshaped: the model keeps its own value
        if missing_ok and missing_ok.search(key) and (key not in fixed or _shape(fixed[key]) != _shape(value)):
            fixed[key] = value
    try:
        model.load_state_dict(fixed, strict=True)
    except RuntimeError as exc:
        raise ReadError(_load_failure(ckpt, model, exc, before, transforms, allow_missing or allow_unexpected)) \
            from None
    records = [t for t in (relative_to_root(ckpt.tensors, root) if root is not None else [])]
    by_key = {t.key: t for t in records}
    loaded = [_replace(by_key[old], key=new) for old, new in plan.mapping.items()]
    after = compare_tensors(loaded, keys, root=root, allow_missing=allow_missing, allow_unexpected=allow_unexpected)
    return _replace(after, suggested_fix=before.suggested_fix, fix_kind=before.fix_kind,
                    transforms=tuple(transforms), renames=before.renames, dropped=before.dropped)


def _load_failure(ckpt: Checkpoint, model: Any, exc: Exception, before: Comparison, transforms: list,
                  allowed: str | None) -> str:
    """Why the strict load failed, in one line of whole words: what is missing and unexpected, and the ways out a
    caller of load_into has (its keyword arguments; a mapping by order is `ckpt-doctor fix`'s alone)."""
    parts = []
    for label, head in (("missing", "Missing"), ("unexpected", "Unexpected")):
        found = re.search(head + r' key\(s\) in state_dict: ((?:"[^"]*"(?:, )?)+)', str(exc))
        names = re.findall(r'"([^"]*)"', found.group(1)) if found else []
        if names:
            parts.append(f"{len(names)} {label} ({', '.join(names[:3])}{', …' if len(names) > 3 else ''})")
    detail = "; ".join(parts) or one_line(exc)
    how = f"after the inferred fix ({' '.join(before.suggested_fix)})" if transforms else "as it is"
    ways = []
    if before.paired and before.ambiguous:
        ways.append(f"the renames that fit pair {len(before.ambiguous)} keys of one shape by their order, which "
                    "load_into does not guess: check them with ckpt-doctor fix --dry-run and write the file first")
    if before.fix_kind == "map-by-order":
        ways.append("the names differ and only a mapping by order fits, which load_into does not guess: write the "
                    "file with ckpt-doctor fix and its --map-by-order first")
    if not allowed:
        ways.append("pass allow_missing= / allow_unexpected= (regexes) to accept intended differences")
    return f"{ckpt.path}: strict load into {type(model).__name__} {how} failed: {detail}" + \
        ("; " + "; ".join(ways) if ways else "")


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if hasattr(value, "shape") else None
