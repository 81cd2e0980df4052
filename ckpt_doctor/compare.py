"""Compares a checkpoint's state_dict with a model the way torch does, and infers the fix that makes it load.

torch is the oracle: the verdict is what `model.load_state_dict(state_dict, strict=True)` says when it is really
run — on the model built on the meta device, with meta tensors of the file's shapes and dtypes and the file's own
`_metadata` (module versions decide, e.g., whether BatchNorm fills a missing `num_batches_tracked`) — so every
`_load_from_state_dict` override and load hook the model registers has its say, and no tensor data is read. One
Parameter reachable under several names (tied weights) is filled by any of them: such a name is reported tied, not
missing. The fix is searched on names and shapes (fast), then checked by running torch's loading code again on
what the fixed file would hold. Against a reference checkpoint (no model), names and shapes are all there is.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from ._record import field, record, replace
from .advice import user_allowed
from .analyze import find_prefixes
from .devices import missing_devices
from .dtypes import FLOATING
from .errors import PlanError, percent
from .modelspec import ModelKeys, tied_names  # noqa: F401  (tied_names: re-exported)
from .records import Checkpoint, TensorRecord, relative_to_root
from .safepickle.unpickler import RawTensor
from .transforms import Op, Transform, add_prefix, exact_keys_regex, flags_for, plan_keys, rename, strip_prefix
from .tree import join, node_at, state_dict_metadata

BN_STATS = ("running_mean", "running_var")  # without them a BatchNorm normalizes with its initial statistics


@record
class Mismatch:
    key: str
    checkpoint_shape: tuple[int, ...]
    model_shape: tuple[int, ...]


@record
class LoadCheck:
    """What one strict load of a set of (key, shape, dtype) into the model says."""

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[Mismatch, ...]
    tied: tuple[tuple[str, str], ...] = ()  # (name left out, the name of the same Parameter that fills it)
    errors: tuple[str, ...] = ()  # anything else the model's own loading code reported
    matched: tuple[str, ...] = ()
    filled: frozenset[str] | None = None  # model names whose tensor torch's loading code copied into (None: unknown)
    overwritten: tuple[tuple[str, str], ...] = ()  # (key whose value stays, key copied first into one Parameter)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched or self.errors)


@record
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
    # none | rename | allowed (loads with the printed --allow-missing) | map-by-order | partial | retag (devices only)
    fix_kind: str = "none"
    fix_loaded_fraction: float | None = None
    ambiguous: tuple[str, ...] = ()  # positions where a mapping by order could permute tensors of one shape
    bn_stats_missing: tuple[str, ...] = ()
    allowed_missing: tuple[str, ...] = ()
    allowed_unexpected: tuple[str, ...] = ()
    min_loaded: float | None = None
    transforms: tuple[Transform, ...] = field(default=(), compare=False)
    tied: tuple[tuple[str, str], ...] = ()  # (alias the file lacks, the key that fills it)
    errors: tuple[str, ...] = ()  # what the model's own loading code reported besides the above
    renames: tuple[tuple[str, str], ...] = ()  # (old, new): keys the fix renames (all it keeps, under a fix_root)
    dropped: tuple[str, ...] = ()  # checkpoint keys the fix leaves out (leftovers, a replaced head)
    left_missing: tuple[str, ...] = ()  # model keys still missing after the fix (accepted only by --allow-missing)
    after: LoadCheck | None = None  # what a strict load of the fixed file would say
    missing_devices: tuple[str, ...] = ()  # saved devices torch.load(path) would fail on here
    oracle: bool = False  # the verdict comes from torch's own loading code (a model, not a reference checkpoint)
    replaced: tuple[str, ...] = ()  # of `dropped`: keys whose shape differs from the model's (a new head)
    model_key_count: int = 0
    fix_root: str | None = None  # the part of the file the fix selects, when not `state_dict_root`
    leftover_elements: int = 0  # elements of the dropped leftovers (not of a replaced head)
    # (key that stays, key overwritten): two different tensors of the file loaded into one tied Parameter
    tie_conflicts: tuple[tuple[str, str], ...] = ()
    ties: tuple[tuple[str, str], ...] = ()  # (alias, key) the fix writes as one tensor (names after the fix)
    paired: tuple[tuple[str, str], ...] = ()  # of `renames`: (old, new) inferred from shapes alone
    # The share of the model's parameters the check requires from the file: --min-loaded, else all that
    # --allow-missing does not name (None: no allowance, the strict load alone decides), and why, for the verdict.
    required_fraction: float | None = None
    required_reason: str = ""
    model_flags: tuple[str, ...] = ()  # how `fix` is told of the model: --model SPEC [--model-arg k=v …]
    # Globals of the file only --allow-global allows (advice.user_allowed): the fix line reads it with them, as here.
    allowed_globals: tuple[str, ...] = ()
    # Entries of the state_dict beside its tensors that hold none (a config, a version; no `_extra_state`): a strict
    # load counts their keys as unexpected, so the fix leaves them out (--drop); and whether that leaves out all that
    # only --allow-global allows (the output then loads with torch's defaults).
    dropped_entries: tuple[str, ...] = ()
    globals_left_out: bool = False

    @property
    def strict_ok(self) -> bool:
        """load_state_dict(strict=True) succeeds. Saved devices this machine lacks are no part of it: they are a fact
        of torch.load(path) (DefaultLoad), which --map-location or map_location= settles."""
        return not (self.missing or self.unexpected or self.mismatched or self.errors)

    @property
    def plain_strict_ok(self) -> bool:
        """A plain load_state_dict(strict=True) of the file succeeds: nothing accepted by --allow-*, and no tied
        name left out (torch calls it missing, though the Parameter it shares fills it: `ok` accepts that, as
        from_pretrained and tie_weights do)."""
        return self.strict_ok and not (self.allowed_missing or self.allowed_unexpected or self.tied)

    @property
    def ok(self) -> bool:
        """What CI asserts: a strict load succeeds, or only the differences explicitly allowed remain, and the file
        fills at least the required share of the model's parameters (no check passes on nothing)."""
        return self.strict_ok and not self.short

    @property
    def short(self) -> bool:
        """The file fills less of the model's parameters than the check requires."""
        return self.required_fraction is not None and self.loaded_fraction < self.required_fraction - 1e-9

    @property
    def only_beside(self) -> bool:
        """What fails a strict load is only the entries beside the tensors that hold none, which the fix line
        leaves out (`dropped_entries`)."""
        return bool(self.dropped_entries) and not (self.missing or self.mismatched or self.errors) \
            and set(self.unexpected) <= set(self.dropped_entries)

    @property
    def accepted(self) -> bool:
        """Whether what fails is all accepted by --allow-missing/--allow-unexpected."""
        return bool(self.allowed_missing or self.allowed_unexpected)


# --- torch's own verdict ------------------------------------------------------------------------------------------

_SIZE_MISMATCH = re.compile(r"^size mismatch for (.+?): copying a param with shape torch\.Size\(\[(.*?)\]\) from "
                            r"checkpoint, the shape in current model is torch\.Size\(\[(.*?)\]\)\.$", re.S)


# A model's loading code that reads a value (`.item()`, `.tolist()`) cannot run on meta tensors: its load is then
# checked again on the CPU, with zeros of the file's shapes, when the model and the file fit this many bytes.
CPU_RECHECK_BYTES = 2 << 30


def load_check(model: Any, entries: list[tuple[str, tuple[int, ...], str]], metadata: Any = None,
               device: str = "meta", others: tuple[str, ...] = ()) -> LoadCheck:
    """Run `model.load_state_dict(state_dict, strict=False)` on meta tensors of these keys, shapes and dtypes, and
    collect what torch reports: the missing and unexpected keys (from a post hook, so they are torch's own lists),
    shape mismatches and any other message the model's loading code raises. `model` is on the meta device. When
    that code fails only because meta tensors hold no values, the load is run again on the CPU (zeros).
    `others`: keys of the state_dict that hold no tensor (a version, a config): torch counts them as it counts a
    tensor's key, so they are loaded too, as a placeholder that is no tensor."""
    import warnings
    from collections import OrderedDict

    import torch

    sd: "OrderedDict[str, Any]" = OrderedDict()
    for key, shape, dtype in entries:
        sd[key] = torch.zeros(shape, dtype=_torch_dtype(torch, dtype), device=device)
    for key in others:
        sd[key] = _NO_TENSOR
    if metadata is not None:
        sd._metadata = metadata  # type: ignore[attr-defined]
    captured: dict[str, list[str]] = {}

    def record(module: Any, incompatible: Any) -> None:
        captured["missing"] = list(incompatible.missing_keys)
        captured["unexpected"] = list(incompatible.unexpected_keys)

    model = meta_twin(model)
    if device != "meta":
        model = model.to_empty(device=device)
    handle = model.register_load_state_dict_post_hook(record)
    messages: list[str] = []
    copied = _CopyTargets()
    try:
        with warnings.catch_warnings(), copied:
            warnings.simplefilter("ignore")  # meta tensors: "copying ... is a no-op"
            model.load_state_dict(sd, strict=False)
    except RuntimeError as exc:
        text = str(exc)
        head, _, body = text.partition(":\n\t")
        messages = body.split("\n\t") if body else [text]
    except Exception as exc:  # the model's own loading code can raise anything
        messages = [f"{type(exc).__name__}: {exc}"]
    finally:
        handle.remove()
    if device == "meta" and any("meta tensor" in m or "meta device" in m for m in messages):
        size = sum(int(torch.Size(shape).numel()) * 8 for _, shape, _ in entries)
        size += sum(t.numel() * 8 for t in model.state_dict().values() if hasattr(t, "numel"))
        if size <= CPU_RECHECK_BYTES:
            return load_check(model, entries, metadata, "cpu", others)
    mismatched, errors = [], []
    for message in messages:
        m = _SIZE_MISMATCH.match(message.strip())
        n = _NOT_A_TENSOR.match(message.strip())
        if m:
            mismatched.append(Mismatch(m.group(1), _dims(m.group(2)), _dims(m.group(3))))
        elif n and n.group(1) in others:
            errors.append(no_tensor_there(n.group(1)))
        elif message.strip():
            errors.append(message.strip())
    if "missing" not in captured:  # the model's code failed before torch finished: names alone
        names = set(model.state_dict().keys())
        captured["missing"] = [k for k in names if k not in sd]
        captured["unexpected"] = [k for k in sd if k not in names]
    bad = {m.key for m in mismatched}
    missing, tied = _tied(model, captured["missing"], sd, bad)
    unexpected = captured["unexpected"]
    matched = tuple(k for k in sd if k not in bad and k not in set(unexpected) and k not in set(others))
    filled = frozenset(name for name, t in [*model.named_parameters(remove_duplicate=False),
                                            *model.named_buffers(remove_duplicate=False)] if id(t) in copied.ids)
    key_of = {id(t): k for k, t in sd.items()}
    last: dict[int, str] = {}
    overwritten: list[tuple[str, str]] = []
    for target, source in copied.order:  # one Parameter filled from two keys: the last copy is what stays
        key = key_of.get(source)
        if key is None:
            continue
        if target in last and last[target] != key:
            overwritten.append((key, last[target]))
        last[target] = key
    return LoadCheck(tuple(missing), tuple(unexpected), tuple(mismatched), tuple(tied), tuple(errors), matched,
                     filled, tuple(overwritten))


class _NoTensor:
    """What a state_dict entry that holds no tensor is loaded as: torch sees its key, and no value of the file."""

    def __repr__(self) -> str:
        return "<no tensor>"


_NO_TENSOR = _NoTensor()
_NOT_A_TENSOR = re.compile(r'^While copying the parameter named "(.+?)", expected torch\.Tensor')


def no_tensor_there(key: str) -> str:
    return f"{key!r} holds no tensor, where the model has a tensor of that name"


class _CopyTargets:
    """The tensors torch's loading code copies a value into (`param.copy_(input_param)`), seen through a torch
    function mode: what a load fills, whatever names the model's own `_load_from_state_dict` reads them from."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.order: list[tuple[int, int]] = []  # (target, source) of every copy, in order
        self._mode: Any = None

    def __enter__(self) -> "_CopyTargets":
        from torch.overrides import TorchFunctionMode

        ids, order = self.ids, self.order

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") == "copy_" and args:
                    ids.add(id(args[0]))
                    if len(args) > 1:
                        order.append((id(args[0]), id(args[1])))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def meta_twin(model: Any) -> Any:
    """The model itself when it is on the meta device, else a copy of its structure whose parameters and buffers
    are meta tensors (tied ones stay tied): loading into it reads and writes no data."""
    import torch

    tensors = [t for _, t in (*model.named_parameters(remove_duplicate=False),
                              *model.named_buffers(remove_duplicate=False))]
    if all(t.is_meta for t in tensors):
        return model
    memo: dict[int, Any] = {}
    for t in tensors:
        if id(t) not in memo:
            twin = torch.empty_like(t, device="meta")
            memo[id(t)] = torch.nn.Parameter(twin, requires_grad=t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else twin
    from .modelspec import deepcopy_sharing

    return deepcopy_sharing(model, memo)


def _torch_dtype(torch: Any, name: str) -> Any:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        return torch.float32
    try:
        torch.empty(0, dtype=dtype, device="meta")
    except (RuntimeError, TypeError):
        return torch.uint8  # a dtype meta tensors cannot take (quantized): any placeholder of the shape will do
    return dtype


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _tied(model: Any, missing: list[str], provided: dict, bad: set[str]) -> tuple[list[str], list[tuple[str, str]]]:
    aliases = tied_names(model)
    still, tied = [], []
    for key in missing:
        source = next((a for a in aliases.get(key, ()) if a in provided and a not in bad), None)
        if source is None:
            still.append(key)
        else:
            tied.append((key, source))
    return still, tied


# --- the comparison -----------------------------------------------------------------------------------------------

def compare_checkpoint(ckpt: Checkpoint, model: ModelKeys, *, select: str | None = None,
                       allow_missing: str | None = None, allow_unexpected: str | None = None,
                       min_loaded: float | None = None) -> Comparison:
    """The verdict for the checkpoint's state_dict (or the part at `select`) and the fix, as `inspect --model`
    prints them."""

    root = select if select is not None else ckpt.state_dict_root
    tensors = _under(ckpt, root)
    metadata = state_dict_metadata(ckpt.root, root)
    extras, others = _no_tensors(ckpt, root, model)
    # The tensors inside an entry that holds no tensor itself (a dict beside the tensors) are no keys of the
    # state_dict: torch sees that entry's key alone.
    direct = {join("", k) for k, v in ckpt.root.items() if isinstance(v, RawTensor)} if others else set()
    comparison = compare_tensors(tensors, model, root=root, metadata=metadata, allow_missing=allow_missing,
                                 allow_unexpected=allow_unexpected, min_loaded=min_loaded, ckpt=ckpt,
                                 selected=select is not None, extras=extras, others=others,
                                 nested=frozenset(t.key for t in tensors if t.key not in direct) if others else None)
    devices = tuple(missing_devices(sorted({t.device for t in tensors})))
    if devices:
        flags = list(comparison.suggested_fix)
        if flags and "--map-location" not in flags:  # a file rewritten anyway: one that also loads here
            flags += ["--map-location", "cpu"]
        comparison = _replace(comparison, missing_devices=devices, suggested_fix=tuple(flags))
    allowed = user_allowed(ckpt.globals)
    beside = _beside(ckpt, comparison.fix_root if comparison.fix_root is not None else root, model)
    if beside:
        comparison = _replace(comparison, suggested_fix=(*comparison.suggested_fix, "--drop", exact_keys_regex(beside)),
                              dropped_entries=beside, globals_left_out=bool(allowed) and not extras)
    return _replace(comparison, model_flags=model.flags, allowed_globals=allowed)


def _beside(ckpt: Checkpoint, root: str | None, model: ModelKeys) -> tuple[str, ...]:
    """The entries a fix of the state_dict at the file's root writes beside its tensors (fix keeps a flat
    state_dict's plain entries) that hold no tensor and are no `_extra_state` the model takes:
    load_state_dict(strict=True) counts each key, and the model takes none of them."""
    return _no_tensors(ckpt, root, model)[1] if root == "" else ()


def _no_tensors(ckpt: Checkpoint, root: str | None, model: ModelKeys) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The keys of the state_dict (at the file's root: what `torch.load` returns is what is loaded) that hold no
    tensor, as torch's strict load sees them: (the `_extra_state` entries a module of the model takes through its
    own set_extra_state, the rest). Each of the rest is a key torch counts: unexpected where the model has no such
    name (a version, a config, a dict of tensors, an `_extra_state` of a module without set_extra_state)."""
    if root != "" or not isinstance(ckpt.root, dict):
        return _extra_states(ckpt, root), ()
    extras, others = [], []
    for k, v in ckpt.root.items():
        if isinstance(v, RawTensor):
            continue
        key = join("", k)
        if key.rsplit(".", 1)[-1] == "_extra_state" and takes_extra_state(model.model, key):
            extras.append(key)
        else:
            others.append(key)
    return tuple(extras), tuple(others)


def takes_extra_state(model: Any, key: str) -> bool:
    """Whether torch's loading code hands the entry `key` (`…._extra_state`) to a module's set_extra_state: the
    module of that name defines one (else a strict load counts the key as unexpected). True without a model."""
    if model is None:
        return True
    import torch

    owner = key[:-len("_extra_state")].rstrip(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    return getattr(type(module), "set_extra_state", torch.nn.Module.set_extra_state) \
        is not torch.nn.Module.set_extra_state


def _replace(c: Comparison, **changes: Any) -> Comparison:
    return replace(c, **changes)


def _under(ckpt: Checkpoint, root: str | None) -> list[TensorRecord]:
    return list(relative_to_root(ckpt.tensors, root)) if root is not None else []


def _extra_states(ckpt: Checkpoint, root: str | None) -> tuple[str, ...]:
    """The state_dict's entries that are no tensors but a module's `get_extra_state()` (any object), by key."""
    node = node_at(ckpt.root, root) if root is not None else None
    if not isinstance(node, dict):
        return ()
    return tuple(k for k, v in node.items() if isinstance(k, str) and k.rsplit(".", 1)[-1] == "_extra_state"
                 and not isinstance(v, RawTensor))


def with_extras(check: LoadCheck, extras: "set[str] | tuple[str, ...]") -> LoadCheck:
    """A load's verdict with the file's extra states counted: the meta load is given tensors only, so an
    `_extra_state` key the file holds (as an object) is not missing."""
    if not extras or not any(k in extras for k in check.missing):
        return check
    return _replace_check(check, missing=tuple(k for k in check.missing if k not in extras))


def _replace_check(check: LoadCheck, **changes: Any) -> LoadCheck:
    return replace(check, **changes)


def compare_tensors(tensors: list[TensorRecord], model: ModelKeys, *, root: str | None = "", metadata: Any = None,
                    allow_missing: str | None = None, allow_unexpected: str | None = None,
                    min_loaded: float | None = None, ckpt: Checkpoint | None = None,
                    selected: bool = False, extras: tuple[str, ...] = (),
                    others: tuple[str, ...] = (), nested: frozenset[str] | None = None) -> Comparison:
    """The verdict is torch's on the state_dict's keys: its tensors and `others`, the keys that hold no tensor
    (`nested`: the tensors inside those, no keys of it); the fix is inferred from the tensors (fix leaves out the
    others with a --drop of its own, `_beside`)."""
    entries = [(t.key, tuple(t.shape), t.dtype) for t in tensors]
    tensor_check = check = with_extras(check_entries(model, entries, metadata), extras)
    if others:
        check = with_extras(check_entries(model, [e for e in entries if e[0] not in (nested or ())], metadata,
                                          others), extras)
    by_key = model.by_key()
    np_set = set(model.non_persistent)
    non_persistent = tuple(k for k in check.unexpected if k in np_set)  # of the unexpected keys: named as such
    unexpected = list(check.unexpected)
    fraction = _fraction(model, check)
    dtypes = tuple((t.key, t.dtype, by_key[t.key].dtype) for t in tensors
                   if t.key in by_key and t.key in check.matched and t.dtype != by_key[t.key].dtype)
    fix = Fix()
    if not tensor_check.ok or non_persistent:
        fix = infer_fix(tensors, model, tensor_check, ckpt=ckpt, root=root, selected=selected, extras=extras)
    allowed_m, allowed_u = allowances(allow_missing, allow_unexpected, check, unexpected)
    select = fix.root if fix.root is not None else root
    flags = (["--select", select] if select else []) + fix.flags
    if fix.kind == "map-by-order":
        flags += [*model.flags, "--map-by-order"]  # refused while positions are ambiguous: --force is the user's
    ties = fix.after.tied if fix.after is not None else check.tied
    part = {t.key: t for t in _part_tensors(tensors, ckpt, root, fix.root)} if fix.dropped else {}
    leftover_elements = sum(part[k].numel for k in fix.dropped if k in part and k not in set(fix.replaced))
    for alias, source in ties:  # a plain load_state_dict(strict=True) wants every name: torch output writes both
        flags += ["--tie", f"{alias}={source}"]
    if fix.left_missing and fix.kind == "allowed":
        # fix checks its output against the model when told of one: the line names the model and what it accepts
        flags += [*model.flags, "--allow-missing", exact_keys_regex(fix.left_missing)]
    missing = tuple(k for k in check.missing if k not in allowed_m)
    required, reason = required_share(model, allow_missing, min_loaded)
    # What the file lacks once the fix renames its keys: a mapping by order fills every key of the model.
    still = () if fix.kind == "map-by-order" else fix.after.missing if fix.after else check.missing
    bn_missing = tuple(k for k in still if k.rsplit(".", 1)[-1] in BN_STATS and k in check.missing)
    return Comparison(
        model=model.source, state_dict_root=root, fix_root=fix.root, matched=check.matched, missing=missing,
        unexpected=tuple(k for k in unexpected if k not in allowed_u),
        mismatched=tuple(m for m in check.mismatched if m.key not in allowed_m), dtype_differs=dtypes,
        non_persistent=tuple(k for k in non_persistent if k not in allowed_u), loaded_fraction=fraction,
        suggested_fix=tuple(flags),
        fix_kind=fix.kind, fix_loaded_fraction=fix.fraction,
        ambiguous=tuple(fix.ambiguous), bn_stats_missing=bn_missing, allowed_missing=tuple(allowed_m),
        allowed_unexpected=tuple(allowed_u), min_loaded=min_loaded, transforms=tuple(fix.transforms),
        tied=check.tied, errors=check.errors, renames=tuple(fix.kept if fix.root is not None else fix.renames),
        dropped=tuple(fix.dropped),
        left_missing=tuple(fix.left_missing), after=fix.after, oracle=model.model is not None,
        replaced=tuple(fix.replaced), model_key_count=len(model.entries), ties=tuple(ties),
        leftover_elements=leftover_elements, tie_conflicts=_different_tensors(check.overwritten, tensors),
        paired=tuple(fix.paired), required_fraction=required, required_reason=reason)


def _different_tensors(pairs: tuple[tuple[str, str], ...],
                       tensors: list[TensorRecord]) -> tuple[tuple[str, str], ...]:
    """The pairs of keys that are not one tensor of the file under two names (a tied pair written tied)."""
    by_key = {t.key: t for t in tensors}

    def ident(key: str) -> tuple:
        t = by_key.get(key)
        if t is None or t.storage is None:
            return (key,)
        return (t.storage.ident, t.storage_offset, t.shape, t.stride)

    return tuple((kept, lost) for kept, lost in pairs if ident(kept) != ident(lost))


def check_entries(model: ModelKeys, entries: list[tuple[str, tuple[int, ...], str]], metadata: Any,
                  others: tuple[str, ...] = ()) -> LoadCheck:
    """torch's verdict when the model is there; names and shapes against a reference checkpoint. `others`: the
    state_dict's keys that hold no tensor (counted by a strict load as any key is)."""
    if model.model is not None:
        return load_check(model.model, entries, metadata, others=others)
    if others:
        names = model.by_key()
        check = check_entries(model, entries, metadata)
        return replace(check, unexpected=(*check.unexpected, *(k for k in others if k not in names)),
                       errors=(*check.errors, *(no_tensor_there(k) for k in others if k in names)))
    by_key = model.by_key()
    present = {k for k, _, _ in entries}
    mismatched = tuple(Mismatch(k, s, by_key[k].shape) for k, s, _ in entries
                       if k in by_key and tuple(s) != tuple(by_key[k].shape))
    bad = {m.key for m in mismatched}
    return LoadCheck(tuple(k for k in by_key if k not in present), tuple(k for k in present if k not in by_key
                                                                          and k not in set(model.non_persistent)) +
                     tuple(k for k, _, _ in entries if k in set(model.non_persistent)), mismatched,
                     matched=tuple(k for k, _, _ in entries if k in by_key and k not in bad))


def _fraction(model: ModelKeys, check: LoadCheck) -> float:
    """The share of the model's parameters (by elements, a tied Parameter once) a load would fill."""
    groups = model.parameter_groups()
    filled_names = check.filled if check.filled is not None else set(check.matched) | {a for a, _ in check.tied}
    total = sum(numel for numel, _ in groups)
    filled = sum(numel for numel, names in groups if any(n in filled_names for n in names))
    return filled / total if total else 1.0


def allowances(allow_missing: str | None, allow_unexpected: str | None, check: LoadCheck,
                unexpected: list[str]) -> tuple[list[str], list[str]]:
    allowed_m: list[str] = []
    allowed_u: list[str] = []
    if allow_missing:
        pattern = re.compile(allow_missing)
        allowed_m = [k for k in check.missing if pattern.search(k)] + \
            [m.key for m in check.mismatched if pattern.search(m.key)]
    if allow_unexpected:
        pattern = re.compile(allow_unexpected)
        allowed_u = [k for k in unexpected if pattern.search(k)]
    return allowed_m, allowed_u


def required_share(model: ModelKeys, allow_missing: str | None, min_loaded: float | None = None
                   ) -> tuple[float | None, str]:
    """The share of the model's parameters (elements, a tied Parameter once, as `_fraction` counts them) that a check
    requires the file to fill, and why: --min-loaded when given; else everything --allow-missing does not name. A
    pattern that matches every key of the model, or every parameter, names nothing in particular (`.*`, ``): then
    all of it is required. None without either: the strict load alone decides."""
    if min_loaded is not None:
        return min_loaded, f"--min-loaded {min_loaded:g}"
    if allow_missing is None:
        return None, ""
    import shlex

    pattern = re.compile(allow_missing)
    flag = f"--allow-missing {shlex.quote(allow_missing)}"
    if all(pattern.search(e.key) for e in model.entries):
        return 1.0, f"{flag} names every key; name the keys you mean, or set --min-loaded"
    groups = model.parameter_groups()
    total = sum(numel for numel, _ in groups)
    named = sum(numel for numel, names in groups if all(pattern.search(n) for n in names))
    if total and named == total:
        return 1.0, f"{flag} names every parameter; name the keys you mean, or set --min-loaded"
    return ((total - named) / total if total else 1.0), f"every parameter {flag} does not name"


def short_of_required(model: ModelKeys, check: LoadCheck, allow_missing: str | None,
                      min_loaded: float | None = None) -> str | None:
    """Why a load that torch accepts (within the allowances) still fails the check: it fills less of the model than
    required (`required_share`); None when it fills enough. For `fix --model --allow-missing`."""
    required, reason = required_share(model, allow_missing, min_loaded)
    filled = _fraction(model, check)
    if required is None or filled >= required - 1e-9:
        return None
    return (f"only {percent(filled)} of the model's parameters would come from the checkpoint (required: "
            f"{percent(required)}: {reason})")


# --- the fix --------------------------------------------------------------------------------------------------------

@record(frozen=False)
class Fix:
    kind: str = "none"  # none | rename | map-by-order | partial
    root: str | None = None  # a --select other than the file's state_dict root
    transforms: list[Transform] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    renames: list[tuple[str, str]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    left_missing: list[str] = field(default_factory=list)
    fraction: float | None = None
    ambiguous: list[str] = field(default_factory=list)
    after: LoadCheck | None = None
    matched: int = 0  # keys that already had the model's name
    replaced: list[str] = field(default_factory=list)  # dropped because the model's tensor there has another shape
    kept: list[tuple[str, str]] = field(default_factory=list)  # (old, new) of every key the model takes
    paired: list[tuple[str, str]] = field(default_factory=list)  # (old, new) of renames inferred from shapes alone


def infer_fix(tensors: list[TensorRecord], model: ModelKeys, check: LoadCheck, *, ckpt: Checkpoint | None = None,
              root: str | None = None, selected: bool = False, extras: tuple[str, ...] = ()) -> Fix:
    """The fewest changes that make a strict load succeed: another part of the file to select, prefixes stripped or
    added at any depth, leftovers the model has no place for dropped, a replaced head dropped (its keys then left
    missing, accepted only by --allow-missing), tied aliases filled; or a mapping by order when only the shapes
    agree. The result is checked by torch's own loading code."""
    model_keys = [e.key for e in model.entries]
    best: tuple[tuple, Fix] | None = None
    for part, part_tensors in _roots(tensors, model, ckpt, root, selected):
        keys = [t.key for t in part_tensors]
        by_key = {t.key: t for t in part_tensors}
        candidates = _candidates(keys, model_keys)
        moved = _with_module_renames(candidates, keys, by_key, model)  # candidate → keys its module renames move
        candidates += [list(transforms) for transforms in moved]
        if model.load_name is not None:  # the renames the model's library makes as it loads (transformers')
            known = set(model_keys)
            pairs = [(k, n) for k, n in ((k, model.load_name(k)) for k in keys) if n != k and n in known]
            if pairs:
                candidates.append(_renames_for(pairs, keys))
        for transforms in candidates:
            try:
                plan = plan_keys(keys, transforms)
            except PlanError:
                continue
            fix = _complete(plan.mapping, by_key, model, transforms)
            fix.root = part if part != root else None
            # A part inside the state_dict leaves out the rest of it as surely as a --drop would.
            inside = root is not None and part is not None and (root == "" or part.startswith(root + "."))
            left_out = len(tensors) - len(part_tensors) if inside and part != root else 0
            # Placed keys first; then fewer left out; then names over shapes (a prefix stripped rather than every
            # key paired by shape), the fewest guesses by position among them.
            # A module renamed whole is a guess from its keys' shapes as a pairing is, key by key; as sure (a wrapper
            # stripped and one layer paired is no worse), the module's own name is the better line.
            guessed = moved.get(tuple(transforms))
            score = (len(fix.renames) + fix.matched, -len(fix.dropped) - len(fix.left_missing) - left_out,
                     -len(fix.ambiguous), -len(fix.paired) - (guessed or 0), guessed is not None, part == root,
                     -len(transforms))
            if best is None or score > best[0]:
                best = (score, fix)
    fix = best[1] if best is not None else Fix()
    if fix.flags or fix.root is not None or fix.dropped:
        part_tensors = _part_tensors(tensors, ckpt, root, fix.root)
        fix.after = _after(model, part_tensors, fix)
        if extras and fix.root is None:
            moved = plan_keys(list(extras), [t for t in fix.transforms if t.op is not Op.DROP]).mapping
            fix.after = with_extras(fix.after, set(moved.values()))
        fix.fraction = _fraction(model, fix.after)
        if fix.after.ok:
            fix.kind = "rename"
        elif set(fix.after.missing) <= set(fix.left_missing) and not (fix.after.unexpected or fix.after.mismatched
                                                                       or fix.after.errors):
            fix.kind = "allowed"  # loads once the keys left missing are accepted (--allow-missing, in the line)
        else:
            fix.kind = "partial"
    if (fix.kind != "rename" or fix.paired) and len(tensors) == len(model.entries):
        # Renames paired by shape win over a mapping of the whole file by order when they fill more, or as much
        # with fewer positions left to a guess (or none).
        by_order = _map_by_order(tensors, model)
        if by_order is not None and (fix.kind != "rename" or (fix.fraction or 0) < 1.0
                                     or (fix.ambiguous and len(fix.ambiguous) >= len(by_order))):
            return Fix(kind="map-by-order", fraction=1.0, ambiguous=by_order)
    if fix.kind == "partial" and (fix.fraction or 0) <= _fraction(model, check) and not fix.dropped:
        fix = Fix()
    if fix.kind in ("allowed", "partial") and not fix.fraction:
        fix = Fix()  # a fix that fills nothing (drops every key, accepts every one missing) is no fix
    if fix.kind == "none" and check.missing and not (check.unexpected or check.mismatched or check.errors) \
            and _fraction(model, check) > 0:
        # Nothing in the file can fill them (a counter older files lack): loading is right only if the user
        # accepts that the model keeps its own values there, which the line says with --allow-missing.
        return Fix(kind="allowed", left_missing=list(check.missing), after=check, fraction=_fraction(model, check))
    return fix


def _roots(tensors: list[TensorRecord], model: ModelKeys, ckpt: Checkpoint | None, root: str | None,
           selected: bool) -> list[tuple[str | None, list[TensorRecord]]]:
    """The file's state_dict root, and other parts of the file that could be the model's weights: containers holding
    at least half as many tensors as the model has keys (a nested `state_dict.model`, an EMA copy)."""
    out: list[tuple[str | None, list[TensorRecord]]] = [(root, tensors)]
    if ckpt is None or selected:
        return out
    need = max(1, len(model.entries) // 2)
    counts: Counter[str] = Counter()
    for t in ckpt.tensors:
        parts = t.key.split(".")
        for i in range(1, min(len(parts), 4)):
            counts[".".join(parts[:i])] += 1

    for path, count in counts.most_common(24):
        if path != root and count >= need and node_at(ckpt.root, path) is not None:
            out.append((path, list(relative_to_root(ckpt.tensors, path))))
    return out


def _part_tensors(tensors: list[TensorRecord], ckpt: Checkpoint | None, root: str | None,
                  chosen: str | None) -> list[TensorRecord]:
    if chosen is None or ckpt is None:
        return tensors

    return list(relative_to_root(ckpt.tensors, chosen))


MAX_PAIRED_RENAMES = 64  # a fix line with more --rename flags than this is no suggestion a person can check


def _complete(mapping: dict[str, str], by_key: dict[str, TensorRecord], model: ModelKeys,
              transforms: list[Transform]) -> Fix:
    """After a rename: what matches, what to drop (no place in the model; another shape there), what stays
    missing; then the keys left over paired by shape with the model keys still missing (renamed, not dropped)."""
    fix = _place(mapping, by_key, model, transforms)
    if not fix.renames and not fix.matched:
        return fix  # nothing placed by name: pairing every key by shape alone is a mapping by order, not a rename
    added = ""
    for t in transforms:
        if t.op is Op.ADD_PREFIX:
            added = t.arg + added  # applied last, each in front of the one before
    leftovers = [old for old in fix.dropped if old not in set(fix.replaced)]
    missing = [k for k in fix.left_missing if k.startswith(added) and len(k) > len(added)]
    if not leftovers or not missing:
        return fix
    pairs, ambiguous = _pair_by_shape(leftovers, by_key, missing, model.by_key())
    if not pairs:
        return fix
    # A key paired by shape against its own layer numbers is a guess when a key of its shape was placed by name:
    # blocks.1,2,3 from layers.0,1,2 pairs 1 → 1 and 2 → 2 by name and 0 → 3 by shape — or is it a shift by one?
    placed = {(tuple(by_key[old].shape), by_key[old].dtype) for old, _ in fix.kept}
    ambiguous |= {old for old, new in pairs if not _numbers_agree(old, new)
                  and (tuple(by_key[old].shape), by_key[old].dtype) in placed}
    # The renames act on the names as --drop/--strip-prefix/--rename left them, before --add-prefix prepends.
    extra = _renames_for([(mapping[old][len(added):], new[len(added):]) for old, new in pairs],
                         [name[len(added):] for name in mapping.values()])
    if len(extra) > MAX_PAIRED_RENAMES:
        return fix
    paired = _place({**mapping, **dict(pairs)}, by_key, model, transforms + extra)
    paired.paired = list(pairs)
    position = {k: i for i, k in enumerate(by_key)}
    paired.ambiguous = [f"{position[old]}: {old} → {new} {list(by_key[old].shape)}"
                        for old, new in sorted(pairs, key=lambda pair: position[pair[0]])
                        if old in ambiguous and by_key[old].numel > 1]
    return paired


def _place(mapping: dict[str, str], by_key: dict[str, TensorRecord], model: ModelKeys,
           transforms: list[Transform]) -> Fix:
    model_by_key = model.by_key()
    np_set = set(model.non_persistent)
    tied = model.tied
    renames, dropped, replaced, kept, matched = [], [], [], [], 0
    provided: set[str] = set()
    for old, new in mapping.items():
        entry = model_by_key.get(new)
        if entry is None or new in np_set:
            dropped.append(old)
        elif tuple(by_key[old].shape) != tuple(entry.shape):
            dropped.append(old)
            replaced.append(old)  # a replaced head: the model's own tensor stays
        else:
            provided.add(new)
            kept.append((old, new))
            if old != new:
                renames.append((old, new))
            else:
                matched += 1
    left = [k for k in model_by_key if k not in provided and not any(a in provided for a in tied.get(k, ()))]
    fix = Fix(transforms=list(transforms), renames=renames, dropped=dropped, left_missing=left, replaced=replaced,
              kept=kept)
    fix.flags = flags_for(transforms)
    if dropped:
        fix.transforms = fix.transforms + [Transform(Op.DROP, exact_keys_regex(dropped))]
        fix.flags += ["--drop", exact_keys_regex(dropped)]
    fix.matched = matched
    return fix


def _after(model: ModelKeys, tensors: list[TensorRecord], fix: Fix) -> LoadCheck:
    """torch's verdict on what the fixed file would hold (a fresh state_dict: no `_metadata`)."""
    plan = plan_keys([t.key for t in tensors], fix.transforms)
    by_key = {t.key: t for t in tensors}
    entries = [(new, tuple(by_key[old].shape), by_key[old].dtype) for old, new in plan.mapping.items()]
    return check_entries(model, entries, None)


def _numbers_agree(old: str, new: str) -> bool:
    """Whether two names' layer numbers agree, one's a prefix of the other's (prefilt_layers.0 → prefilt_layers.0.0
    does; layers.0 → blocks.3 does not)."""
    a = [c for c in old.split(".") if c.isdigit()]
    b = [c for c in new.split(".") if c.isdigit()]
    return a[:len(b)] == b[:len(a)]


def _pair_by_shape(leftovers: list[str], by_key: dict[str, TensorRecord], missing: list[str],
                   model_by_key: dict[str, Any]) -> tuple[list[tuple[str, str]], set[str]]:
    """(checkpoint key, model key) pairs of one shape and kind (floating or not): first those that also share their
    last component (`weight`, `running_mean`) and their layer numbers, then their last component, then the shape
    alone. One of a kind on each side is a certain pair; several of one kind on each side pair by position (file
    order against model order), as a mapping by order does: those keys come back as ambiguous. A kind with more
    keys on one side than the other is not paired."""

    def signature(name: str, shape: tuple, dtype: str, detail: int) -> tuple:
        kind = (tuple(shape), dtype in FLOATING or dtype.startswith("complex"))
        if detail == 0:
            return kind
        leaf = name.rsplit(".", 1)[-1]
        return kind + (leaf,) if detail == 1 else kind + (leaf, tuple(c for c in name.split(".") if c.isdigit()))

    olds, news = list(leftovers), list(missing)
    pairs: list[tuple[str, str]] = []
    ambiguous: set[str] = set()
    level: dict[str, int] = {}  # old key -> the pass that paired it
    for detail in (2, 1, 0):
        sides: dict[tuple, tuple[list[str], list[str]]] = {}
        for old in olds:
            t = by_key[old]
            sides.setdefault(signature(old, t.shape, t.dtype, detail), ([], []))[0].append(old)
        for new in news:
            e = model_by_key[new]
            side = sides.get(signature(new, e.shape, e.dtype, detail))
            if side is not None:
                side[1].append(new)
        done: set[str] = set()
        for group_old, group_new in sides.values():
            if len(group_old) == len(group_new):
                pairs += zip(group_old, group_new)
                done.update(group_old, group_new)
                level.update((k, detail) for k in group_old)
                if len(group_old) > 1:
                    ambiguous.update(group_old)
        olds = [k for k in olds if k not in done]
        news = [k for k in news if k not in done]
    # Keys of one shape paired by their layer numbers are certain only when every key of that shape was: one left
    # to a later pass (layers.0 → blocks.3 beside 1 → 1 and 2 → 2) says the numbers were a guess for all of them.
    by_kind: dict[tuple, list[str]] = {}
    for old, _ in pairs:
        t = by_key[old]
        by_kind.setdefault(signature(old, t.shape, t.dtype, 0), []).append(old)
    for members in by_kind.values():
        if len(members) > 1 and len({level[k] for k in members}) > 1:
            ambiguous.update(members)
    return pairs, ambiguous


def _renames_for(pairs: list[tuple[str, str]], names: list[str]) -> list[Transform]:
    r"""Anchored renames that turn each old name of these pairs into its new one and touch no other of `names`.

    Pairs that move the same leaves (`weight`, `bias`) from one module to another share one rename
    (`^prefilt_layers\.0\.(weight|bias)$` → `prefilt_layers.0.0.\1`); such renames that differ only in layer
    numbers, the same in the old and the new name, share one with `(\d+)` (`^layers\.(\d+)\.norm\.(weight|bias)$`
    → `layers.\1.ln.\2`) when it names no other key; any other pair gets its own `^old$` → `new`."""
    moves: dict[tuple[str, str], list[str]] = {}  # (old module, new module) -> leaves
    singles: list[tuple[str, str]] = []
    for old, new in pairs:
        old_parent, _, leaf = old.rpartition(".")
        new_parent, _, new_leaf = new.rpartition(".")
        if leaf == new_leaf and old_parent and new_parent:
            moves.setdefault((old_parent, new_parent), []).append(leaf)
        else:
            singles.append((old, new))
    # Moves alike but for layer numbers: one rename for all, when it reaches exactly their keys.
    alike: dict[tuple, list[tuple[str, str]]] = {}
    for (old_parent, new_parent), leaves in moves.items():
        signature = _number_template(old_parent, new_parent) + (tuple(leaves),)
        alike.setdefault(signature, []).append((old_parent, new_parent))
    out: list[Transform] = []
    targets = {new for _, new in pairs}
    for signature, members in alike.items():
        leaves = list(signature[-1])
        if len(members) > 1 and signature[0] is not None:
            olds = {f"{old_parent}.{leaf}" for old_parent, _ in members for leaf in leaves}
            general = _numbered_rename(signature[0], signature[1], leaves)
            pattern = re.compile(general.arg)
            if all((n in olds) == bool(pattern.search(n)) for n in names) and \
                    not any(pattern.search(t) for t in targets):
                out.append(general)
                continue
        for old_parent, new_parent in members:
            if len(leaves) == 1:
                singles.append((f"{old_parent}.{leaves[0]}", f"{new_parent}.{leaves[0]}"))
            else:
                out.append(Transform(Op.RENAME, f"^{_literal(old_parent + '.')}({'|'.join(map(_literal, leaves))})$",
                                     _replacement(new_parent + ".") + "\\1"))
    out += [Transform(Op.RENAME, f"^{_literal(old)}$", _replacement(new)) for old, new in singles]
    return out


def _number_template(old: str, new: str) -> tuple:
    """(old components, new components) with the numbers out (None), when both hold the same numbers in the same
    order; else (None, (old, new)): a signature of its own."""
    o, n = old.split("."), new.split(".")
    numbers = [c for c in o if c.isdigit()]
    if not numbers or numbers != [c for c in n if c.isdigit()]:
        return (None, (old, new))
    return (tuple(None if c.isdigit() else c for c in o), tuple(None if c.isdigit() else c for c in n))


def _numbered_rename(old: tuple, new: tuple, leaves: list[str]) -> Transform:
    r"""`^layers\.(\d+)\.norm\.(weight|bias)$` → `layers.\1.ln.\2` from component templates (None: a number)."""
    def ref(i: int) -> str:
        return f"\\{i}" if i < 10 else f"\\g<{i}>"

    pattern = r"\.".join(r"(\d+)" if c is None else _literal(c) for c in old)
    repl, i = [], 0
    for c in new:
        if c is None:
            i += 1
            repl.append(ref(i))
        else:
            repl.append(_replacement(c))
    if len(leaves) == 1:
        tail_pattern, tail_repl = _literal(leaves[0]), _replacement(leaves[0])
    else:
        tail_pattern, tail_repl = "(" + "|".join(map(_literal, leaves)) + ")", ref(i + 1)
    return Transform(Op.RENAME, f"^{pattern}\\.{tail_pattern}$", ".".join(repl) + "." + tail_repl)


def _replacement(text: str) -> str:
    return text.replace("\\", "\\\\")  # re.sub reads a backslash in the replacement as an escape


def _literal(text: str) -> str:
    """A regex for exactly `text` that holds no `=` (the sign that splits --rename REGEX=REPL)."""
    return re.escape(text).replace("=", "\\x3d")


def _candidates(ckpt_keys: list[str], model_keys: list[str]) -> list[list[Transform]]:
    """Prefix changes worth trying: strip the checkpoint's wrappers, add the model's, or both; mid-key wrappers; and
    the model sub-tree the checkpoint's keys fit under (a backbone inside a bigger model)."""
    ck = find_prefixes(ckpt_keys)
    mk = find_prefixes(model_keys)
    strip_options: list[list[Transform]] = [[]]
    pieces = [p.prefix for p in ck if p.leading and p.count == p.total]
    for i in range(1, len(pieces) + 1):
        strip_options.append([strip_prefix("".join(pieces[:i]))])  # `_orig_mod.module.` whole or in part
    for p in ck:
        if p.leading and p.count < p.total:
            strip_options.append([strip_prefix(p.prefix)])
    for head in _shared_heads(ckpt_keys, model_keys):
        strip_options.append([strip_prefix(head)])
    for option in [o for o in strip_options if o]:  # a wrapper around a head the model lacks: `module.bert.`
        wrapper = option[0].arg
        inner = [k[len(wrapper):] for k in ckpt_keys if k.startswith(wrapper)]
        for head in _shared_heads(inner, model_keys):
            if [strip_prefix(wrapper + head)] not in strip_options:
                strip_options.append([strip_prefix(wrapper + head)])
    mids = [p for p in ck if not p.leading]
    if mids:
        renames = [rename(f"^{re.escape(p.where)}{re.escape(p.prefix)}={p.where}") for p in mids]
        strip_options += [opt + renames for opt in list(strip_options)]
        tokens = sorted({p.prefix for p in mids})  # the same wrapper at several depths: one rename for all
        strip_options += [opt + [rename(f"(^|\\.){re.escape(t[:-1])}\\.=\\1")] for opt in list(strip_options)
                          for t in tokens]
    add_options: list[list[Transform]] = [[]]
    pieces = [p.prefix for p in mk if p.leading and p.count == p.total]
    for i in range(1, len(pieces) + 1):
        add_options.append([add_prefix("".join(pieces[-i:]))])
    out = [s + a for s in strip_options for a in add_options]
    for s in strip_options:
        stripped = [(s[0].apply(k) or k) if s and s[0].op is Op.STRIP_PREFIX else k for k in ckpt_keys]
        for head in _model_heads(stripped, model_keys):
            out.append(s + [add_prefix(head)])
    return out


def _with_module_renames(candidates: list[list[Transform]], keys: list[str], by_key: dict[str, TensorRecord],
                         model: ModelKeys) -> dict[tuple[Transform, ...], int]:
    """Each candidate followed by the renames of whole modules its keys still lack (`_module_renames`) → how many
    keys those renames move."""
    model_shapes = {e.key: tuple(e.shape) for e in model.entries if e.key not in set(model.non_persistent)}
    out: dict[tuple[Transform, ...], int] = {}
    for transforms in candidates:
        if any(t.op is Op.ADD_PREFIX for t in transforms):
            continue  # renames act before --add-prefix: the names they see are not the model's
        try:
            mapping = plan_keys(keys, transforms).mapping
        except PlanError:
            continue
        renames = _module_renames({new: tuple(by_key[old].shape) for old, new in mapping.items()}, model_shapes)
        if renames:
            try:
                after = plan_keys(list(mapping.values()), renames).mapping
            except PlanError:
                continue
            out.setdefault(tuple(transforms + renames), sum(old != new for old, new in after.items()))
    return out


def _module_renames(ckpt_shapes: dict[str, tuple[int, ...]], model_shapes: dict[str, tuple[int, ...]]
                    ) -> list[Transform]:
    r"""`^old\.` → `new.` for each module of the checkpoint that the model holds under another name: every key under
    `old` is one the model lacks, every key under `new` one the checkpoint lacks, and the two hold the same keys
    below them with the same shapes, which no other module on either side does (`features` → `backbone`,
    `encoder.block` → `encoder.layer`). The outermost such module is renamed whole; one whose name is also a module
    on the other side (a swap, a shift) is left to the pairing by shape or by order."""

    def under(key: str, module: str) -> bool:
        return key == module or key.startswith(module + ".")

    def modules(shapes: dict[str, tuple[int, ...]], other: dict) -> dict[str, frozenset]:
        """Each module (a key's leading components) all of whose keys `other` lacks → its keys below it, shaped."""
        below: dict[str, set] = {}
        complete: dict[str, bool] = {}
        for key, shape in shapes.items():
            parts = key.split(".")
            for i in range(1, len(parts)):
                name = ".".join(parts[:i])
                below.setdefault(name, set()).add((".".join(parts[i:]), shape))
                complete[name] = complete.get(name, True) and key not in other
        return {name: frozenset(held) for name, held in below.items() if complete[name]}

    heads = {key.split(".", 1)[0] for key in ckpt_shapes}
    if len(heads) == 1 and "." in next(iter(ckpt_shapes), "") and not any(under(k, *heads) for k in model_shapes):
        return []  # one wrapper around every key (`module.`): stripped by another candidate, not renamed away
    old_modules = modules(ckpt_shapes, model_shapes)
    new_modules = modules(model_shapes, ckpt_shapes)
    if not old_modules or not new_modules:
        return []
    holders_old: dict[frozenset, list[str]] = {}
    holders_new: dict[frozenset, list[str]] = {}
    for name, held in old_modules.items():
        holders_old.setdefault(held, []).append(name)
    for name, held in new_modules.items():
        holders_new.setdefault(held, []).append(name)

    done: list[str] = []
    for old in sorted(old_modules, key=lambda n: n.count(".")):
        if any(under(old, d) for d in done):
            continue  # inside a module already renamed whole
        held = old_modules[old]
        if len(holders_old[held]) != 1 or len(holders_new.get(held, ())) != 1:
            continue  # no module of the model holds these keys, or several could: names cannot tell
        new = holders_new[held][0]
        if new == old or any(under(k, new) for k in ckpt_shapes) or any(under(k, old) for k in model_shapes):
            continue
        done.append(old)
    first = {}  # the modules in the order of the file's keys
    for i, key in enumerate(ckpt_shapes):
        for old in done:
            if under(key, old):
                first.setdefault(old, i)
    new_of = {old: holders_new[old_modules[old]][0] for old in done}
    return [Transform(Op.RENAME, f"^{_literal(old + '.')}", _replacement(new_of[old] + "."))
            for old in sorted(done, key=first.__getitem__)]


def _shared_heads(ckpt_keys: list[str], model_keys: list[str]) -> list[str]:
    """Leading components most checkpoint keys carry and no model key does (a Lightning module's `model.`, an
    `encoder.` the model does not have)."""
    model_heads = {k.split(".", 1)[0] for k in model_keys}
    counts = Counter(k.split(".", 1)[0] + "." for k in ckpt_keys if "." in k)
    return [h for h, n in counts.most_common(3) if n * 2 >= len(ckpt_keys) and h[:-1] not in model_heads]


def _model_heads(ckpt_keys: list[str], model_keys: list[str]) -> list[str]:
    """Model prefixes (up to two components) under which the checkpoint's keys fit: `backbone.` for a classifier's
    weights in a detector."""
    present = set(ckpt_keys)
    counts: Counter[str] = Counter()
    for key in model_keys:
        parts = key.split(".")
        for i in range(1, min(3, len(parts))):
            head = ".".join(parts[:i]) + "."
            if key[len(head):] in present:
                counts[head] += 1
    need = max(1, min(len(present), len(model_keys)) // 3)
    return [h for h, n in counts.most_common(2) if n >= need]


def _map_by_order(tensors: list[TensorRecord], model: ModelKeys) -> list[str] | None:
    """None unless the sequences of shapes agree; then the ambiguous positions."""
    if len(tensors) != len(model.entries) or not tensors:
        return None
    if any(tuple(t.shape) != tuple(e.shape) for t, e in zip(tensors, model.entries)):
        return None
    return ambiguous_positions(tensors, [e.key for e in model.entries])


def ambiguous_positions(tensors: list[TensorRecord], new_keys: list[str]) -> list[str]:
    """Positions of a mapping by order whose tensor shares its shape with any other position: a permutation of
    those tensors fits the model as well, so a mapping by position alone cannot tell them apart."""
    counts = Counter(tuple(t.shape) for t in tensors)
    return [f"{i}: {t.key} → {new} {list(t.shape)}" for i, (t, new) in enumerate(zip(tensors, new_keys))
            if t.numel > 1 and counts[tuple(t.shape)] > 1]
