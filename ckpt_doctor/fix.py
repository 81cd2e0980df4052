"""Plans a repair (which tensors, under which names, in which format) and carries it out, verified."""

from __future__ import annotations

import enum
import os
import re
from collections import Counter, OrderedDict
from ._record import field, record, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .assemble import stream, whole_piece_runs
from .dtypes import FLOATING, QUANTIZED, element_size, user_dtype_name
from .errors import PlanError, UsageError, WriteError, one_line
from .records import Assembly, Checkpoint, Format, GlobalRef, TensorRecord, Verdict, ancestors, relative_to_root
from .safepickle.unpickler import Device, DType, Opaque, RawTensor, SizeValue
from .tensordata import tensor_bytes
from .transforms import Op, Transform, ordered, plan_keys
from .tree import has_tensor, join, run_nested
from .writers.atomic import atomic_output, check_destination
from .writers.pickler import TensorOut, dumps
from .writers.safetensors_writer import TensorBytes, write_safetensors
from .writers.stream import (CHUNK, Progress, WrittenRanges, copy_range, crc32, crc32_combine, deflated_producer,
                             write_bytes)
from .writers.torch_writer import StorageOut, write_torch_zip

if TYPE_CHECKING:  # the comparison is imported only with --model: a plain repair starts that much sooner
    from typing import Generator

    from .modelspec import ModelKeys


class OutputFormat(str, enum.Enum):
    TORCH = "torch"
    SAFETENSORS = "safetensors"
    DCP = "dcp"  # a torch.distributed.checkpoint folder, written by torch's own DCP writer


SUFFIX_FORMAT = {".safetensors": OutputFormat.SAFETENSORS, ".pt": OutputFormat.TORCH, ".pth": OutputFormat.TORCH,
                 ".bin": OutputFormat.TORCH, ".ckpt": OutputFormat.TORCH, ".tar": OutputFormat.TORCH}


def output_format(output: Path, requested: OutputFormat | None) -> OutputFormat:
    if requested is not None:
        return requested
    fmt = SUFFIX_FORMAT.get(output.suffix.lower())
    if fmt is None:
        raise UsageError(f"{output}: cannot tell the format from the suffix {output.suffix!r}; use .pt/.pth/.bin "
                         "or .safetensors, or pass --format torch|safetensors")
    return fmt


@record
class FixOptions:
    transforms: tuple[Transform, ...] = ()
    select: str | None = None
    map_location: tuple[tuple[str, str], ...] = ()  # (saved device or "*", new device)
    dtype: str | None = None
    model: ModelKeys | None = None
    reorder: bool = False
    auto: bool = False
    map_by_order: bool = False
    force: bool = False
    format: OutputFormat | None = None
    allow_missing: str | None = None  # with --model: model keys the output may lack (a new head)
    allow_unexpected: str | None = None  # with --model: output keys the model may lack
    ties: tuple[tuple[str, str], ...] = ()  # (alias, key): write `alias` as the same tensor as `key`
    closest: tuple[str, ...] = ()  # with --auto: the flags of the fix inspect --model infers, for the message
    dry_run: bool = False  # planned to be shown, not written: what only writing needs (--force) is not asked


@record
class OutTensor:
    key: str  # full key in the output
    source: TensorRecord
    dtype: str
    device: str


@record
class FixPlan:
    input: Path
    output: Path
    format: OutputFormat
    applied: tuple[str, ...]
    renamed: dict[str, str]
    dropped: tuple[str, ...]
    tensors: tuple[OutTensor, ...]
    tree: Any = None  # torch output: containers with OutTensor leaves
    notes: tuple[str, ...] = ()
    tied: dict[str, str] = field(default_factory=dict)  # safetensors: duplicate key -> key written
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__
    ambiguous: tuple[str, ...] = ()  # --map-by-order: the keys whose place another of their shape could take

    @property
    def nbytes(self) -> int:
        seen, total = set(), 0
        for t in self.tensors:
            if t.key in self.tied:
                continue
            ident = t.source.storage.ident if t.source.storage else t.key
            if self.format is OutputFormat.SAFETENSORS:
                total += t.source.numel * element_size(t.dtype)
            elif ident not in seen:
                seen.add(ident)
                total += _converted_nbytes(t.source.storage.nbytes, t.source.dtype, t.dtype) if t.source.storage else 0
        return total


@record
class FixResult:
    plan: FixPlan
    bytes: int
    verified: bool
    unknown_globals: tuple[str, ...] = ()
    shards: tuple[Path, ...] = ()  # with --max-shard-size: the shard files; plan.output is then the index


def _converted_nbytes(nbytes: int, src: str, dst: str) -> int:
    return nbytes // element_size(src) * element_size(dst)


def _device_for(saved: str, table: tuple[tuple[str, str], ...]) -> str:
    for old, new in table:
        if old == "*" or old == saved or (old == "cuda" and saved.startswith("cuda")):
            return new
    return saved


def plan_fix(ckpt: Checkpoint, output: Path, opts: FixOptions) -> FixPlan:
    ckpt.refuse_values("rewrite it")
    if ckpt.distributed.get("shard_of"):
        raise PlanError(f"{ckpt.path}: one rank's shard of a distributed checkpoint holds only parts of its tensors; "
                        f"consolidate the folder: ckpt-doctor fix {ckpt.distributed['shard_of']} -o {output}")
    fmt = output_format(output, opts.format)
    applied: list[str] = []
    notes: list[str] = []
    transforms = list(opts.transforms)
    select = opts.select
    user_ties = set(opts.ties)  # --tie as given: checked strictly; those --auto infers fit by construction
    auto_select = False
    if opts.auto or opts.map_by_order or opts.reorder:
        if opts.model is None:
            raise UsageError("--auto, --map-by-order and --reorder need --model SPEC")
    if (opts.allow_missing or opts.allow_unexpected) and opts.model is None:
        raise UsageError("--allow-missing and --allow-unexpected need --model SPEC (what the output must load into)")
    if opts.auto:
        from .compare import compare_checkpoint

        comparison = compare_checkpoint(ckpt, opts.model, select=select)
        auto_select = select is None and bool(comparison.fix_root or comparison.state_dict_root)
        if auto_select:
            select = comparison.fix_root or comparison.state_dict_root
        if comparison.paired and comparison.ambiguous and not (opts.force or opts.dry_run):
            from .errors import Rerun

            raise PlanError(f"--auto: {len(comparison.ambiguous)} of the renames it infers pair keys of one shape by "
                            f"their order (first: {comparison.ambiguous[0]}), so a swap would go unnoticed; see the "
                            "mapping with {0}, and write it, once checked, with {1}",
                            reruns=(Rerun(add=("--dry-run",)), Rerun(add=("--force",))))
        transforms += list(comparison.transforms)
        if comparison.fix_kind == "map-by-order":
            opts = replace(opts, map_by_order=True)
        # A new head's keys stay missing: accepted only by an explicit --allow-missing (the line inspect prints
        # holds it), never silently by --auto.
        opts = replace(opts, ties=opts.ties + comparison.ties, closest=comparison.suggested_fix)
        if comparison.missing_devices and not opts.map_location:
            opts = replace(opts, map_location=(("*", "cpu"),))
        shown = list(comparison.suggested_fix)
        if "--map-location" in shown:  # listed once, as its own step, below
            at = shown.index("--map-location")
            del shown[at:at + 2]
        applied.append("--auto → " + (" ".join(shown) or "(nothing to change)"))
    nested_format = fmt in (OutputFormat.TORCH, OutputFormat.DCP)  # formats that hold a tree, not only tensors
    if select is not None:
        _check_select(ckpt, select)
        if not (opts.auto and auto_select):  # --auto's own --select is already in its line
            applied.append(f"--select {select or chr(39) * 2}")
    # `--select ''` is all of the file. A format that holds a tree keeps it nested as saved: a training checkpoint
    # exactly as without --select (its state_dict renamed in place); a distributed one, or a file without a
    # state_dict, whole as saved (what dcp_to_torch_save writes). A tensors-only format gets every tensor.
    everything = select == "" and nested_format
    if everything and not ckpt.distributed and ckpt.state_dict_root is not None and isinstance(ckpt.root, dict):
        select = None
    root = select if select is not None else ckpt.state_dict_root
    if root is None:
        tops = ", ".join(sorted({t.key.split(".", 1)[0] for t in ckpt.tensors})[:8])
        raise PlanError(f"{ckpt.path}: no state_dict found to repair (no container holds mostly tensors); name the "
                        f"part to write with --select PATH (entries with tensors: {tops or 'none'}), or write all of "
                        "it with --select ''")
    # A distributed checkpoint (DCP, ZeRO) gives its model weights by default, in any format.
    whole_tree = everything and select == ""
    # An optimizer's state_dict ({"state", "param_groups"}) is only loadable whole: selected, it keeps its nesting.
    subtree = _subtree(ckpt.root, select) if select else _MISSING
    optimizer_select = isinstance(subtree, dict) and "state" in subtree and "param_groups" in subtree
    if optimizer_select and fmt is OutputFormat.SAFETENSORS:
        notes.append(f"{select!r} is an optimizer's state_dict: safetensors holds its tensors only (no param_groups), "
                     "which Optimizer.load_state_dict cannot take; write a .pt to keep it whole")
        optimizer_select = False
    whole_tree = whole_tree or optimizer_select
    flat_output = not whole_tree and (select is not None or fmt is OutputFormat.SAFETENSORS or root == ""
                                      or _is_module_root(ckpt, root) or bool(ckpt.distributed))
    notes += ckpt.distributed.get("fix_notes", [])
    if ckpt.distributed and select is None and root:
        notes.append(f"a distributed checkpoint: wrote the model's state_dict at {root!r}, as load_state_dict takes "
                     "it; the rest (optimizer state, other values) with --select PATH, all of it with --select ''")
    elif fmt is OutputFormat.SAFETENSORS and select is None and root:
        notes.append(f"safetensors holds tensors only: wrote the state_dict at {root!r}; the rest of the "
                     "checkpoint (optimizer, metadata) is left out")

    drops = [t for t in transforms if t.op is Op.DROP]
    renames = [t for t in transforms if t.op is not Op.DROP]
    sd = relative_to_root(ckpt.tensors, root)
    prefix = root + "." if root else ""
    kept, dropped = [], []
    # A --drop that names the state_dict itself, or a container above it, drops all of it.
    whole = any(_dropped(path, drops) for path in ancestors(root))
    for t in sd:
        if whole or _dropped(t.key, drops) or _dropped(prefix + t.key, drops):
            dropped.append(t.key)
        else:
            kept.append(t)
    seen_keys: set[str] = set()
    for t in kept if flat_output else ckpt.tensors:  # a nested output finds every tensor by its dotted path
        if t.key in seen_keys:
            raise PlanError(f"{ckpt.path}: two tensors are both named {t.key!r} once their nesting is joined with "
                            "dots ({'a.b': {'c': x}} and {'a': {'b.c': y}}); ckpt-doctor cannot tell them apart in "
                            "its output: write one of them with --select PATH")
        seen_keys.add(t.key)
    plan = plan_keys([t.key for t in kept], renames)
    applied += [" ".join(t.flags()) for t in transforms if not opts.auto]
    mapping = dict(plan.mapping)
    ambiguous: list[str] = []
    if opts.map_by_order:
        mapping = _map_by_order(kept, mapping, opts.model, opts.force, notes, opts.dry_run, ambiguous)
        applied.append("--map-by-order")
    if opts.reorder:
        rank = {e.key: i for i, e in enumerate(opts.model.entries)}
        mapping = dict(sorted(mapping.items(), key=lambda kv: rank.get(kv[1], len(rank))))
        applied.append("--reorder")
    if opts.dtype:
        applied.append(f"--dtype {opts.dtype}")
    if opts.map_location:
        applied.append("--map-location " + ",".join(f"{a}={b}" if a != "*" else b for a, b in opts.map_location))

    by_key = {t.key: t for t in kept}
    versions = None if opts.map_by_order or fmt is not OutputFormat.TORCH else \
        _versions(ckpt, root, [t for t in transforms if t.op is not Op.DROP])

    def out_tensor(key: str, record: TensorRecord) -> OutTensor:
        dtype = opts.dtype if opts.dtype and record.dtype in FLOATING else record.dtype
        return OutTensor(key, record, dtype, _device_for(record.device, opts.map_location))

    problems: list = []  # (path, global) of objects the output could not hold
    out_prefix = "" if flat_output else prefix  # nested output: the state_dict keeps its place in the tree
    state = OrderedDict((new, out_tensor(out_prefix + new, by_key[old])) for old, new in mapping.items())
    if versions is not None:
        state._metadata = versions  # type: ignore[attr-defined]
    _tie(state, opts.ties, fmt, out_prefix, notes, applied, user_ties)
    written: set[str] = set()  # the source tensors the output holds, by their full paths
    extra_renamed: dict[str, str] = {}  # state_dict entries that are no tensors, renamed with the tensors
    if flat_output:
        tree: Any = state
        outs = list(state.values())
        if root == "" and select is None and nested_format and isinstance(ckpt.root, dict):
            # A flat state_dict with a few other entries (a version number, a config): keep them as they were.
            full_records = {t.key: t for t in ckpt.tensors}
            nested: set[str] = set()
            cut: set[str] = set()
            for key, value in ckpt.root.items():
                path = join("", key)
                if isinstance(value, RawTensor):
                    continue
                if isinstance(key, Opaque) or isinstance(key, type) and issubclass(key, Opaque):
                    check_writable(key, path, problems)
                if _dropped(path, drops):
                    cut.add(path)
                    continue
                extra: list[OutTensor] = []
                # (with root "" every tensor is in sd, so the loop above has listed the dropped ones)
                # a state_dict entry that is no tensor (an `_extra_state`) is renamed as the tensors beside it are
                name = plan_keys([key], renames).mapping[key] if isinstance(key, str) and renames else key
                if name != key:
                    if name in state or name in tree:
                        raise PlanError(f"{key!r} would be renamed {name!r}, which the output already holds; "
                                        "nothing written")
                    extra_renamed[key] = name
                tree[name] = _rebuild(value, path, "\0", state, full_records, drops, extra, out_tensor, cut,
                                      problems)
                nested.update(o.source.key for o in extra)
            dropped += [p for p in cut if not any(k == p or k.startswith(p + ".") for k in dropped)]
            if nested:  # tensors inside such an entry stay there, and are not written a second time as keys
                for new in [k for k, o in state.items() if isinstance(o, OutTensor) and o.source.key in nested]:
                    del state[new]
                mapping = {old: new for old, new in mapping.items() if old not in nested}
            if not opts.reorder:  # the entries in the file's order, tensors and the rest as they were interleaved
                tree = _in_source_order(tree, ckpt.root, {**mapping, **extra_renamed})
                if versions is not None:
                    tree._metadata = versions
            outs = _out_tensors(tree)
            written |= nested
        if _is_module_root(ckpt, root) and select is None:
            notes.append(f"whole-model pickle of {ckpt.model_class}: written as its state_dict")
    else:
        outs = []
        full_records = {t.key: t for t in ckpt.tensors}
        cut = set()
        if whole_tree:  # every tensor where it was saved: none is taken out as the state_dict
            if renames or opts.model is not None:
                raise PlanError(f"--select {select or chr(39) * 2} writes that part as it was saved; renames and "
                                "--model apply to a model's state_dict: name it with --select PATH")
            state.clear()
            mapping = {}
        base, base_path = (subtree, select) if optimizer_select else (ckpt.root, "")
        cut_prefix = len(select) + 1 if optimizer_select else 0  # the output's keys are the selected part's own

        def maker(key: str, record: TensorRecord) -> OutTensor:
            return out_tensor(key[cut_prefix:], record)

        tree = _rebuild(base, base_path, "\0" if whole_tree else root, state, full_records, drops, outs, maker,
                        cut, problems)
        written.update(o.source.key for o in outs)  # rebuilt where they were saved: full paths
        outs = list(state.values()) + outs
        under = _tensors_under(cut - {root}, full_records, prefix)
        dropped += under + sorted(cut - {root})  # the tensors, and the entries around them (an optimizer's groups)
    refuse_unwritable(problems)
    if flat_output:  # a state_dict's keys are written as the strings its tensors are named by
        node = _subtree(ckpt.root, root) if root else ckpt.root
        odd = [k for k in node if not isinstance(k, str)] if isinstance(node, dict) else []
        if odd:
            notes.append(f"{len(odd)} keys of the state_dict are no strings ({', '.join(repr(k) for k in odd[:3])}"
                         f"{', …' if len(odd) > 3 else ''}): written as the text they are listed by "
                         f"({', '.join(repr(join('', k)) for k in odd[:3])})")
    if opts.model is not None:
        extras = {k for k, v in tree.items() if isinstance(k, str) and k.endswith("_extra_state")
                  and not isinstance(v, OutTensor)} if flat_output and isinstance(tree, dict) else set()
        _check_loads(state, opts, notes, str(ckpt.path), extras)
    # Nothing leaves without being listed: what lies beside the written part, and what a tensors-only output (or
    # the state_dict's place in a nested one) cannot hold.
    if optimizer_select:  # the optimizer alone: the rest of the file is left out
        listed = set(dropped)
        dropped += [p for p in left_out(ckpt.root, select or "", beside=True, inside=False) if p not in listed]
    elif not whole_tree and isinstance(ckpt.root, (dict, list, tuple)):
        part = root if flat_output else None
        keeps_extras = flat_output and root == "" and select is None and nested_format and isinstance(ckpt.root, dict)
        listed = set(dropped)
        for path in left_out(ckpt.root, part if part is not None else root, beside=part is not None,
                             inside=not keeps_extras):
            if path not in listed and not _dropped(path, drops):
                dropped.append(path)
    written.update(prefix + old for old in mapping)
    dropped += _unlisted_tensors(ckpt.tensors, written, dropped, prefix)
    if ckpt.non_persistent:  # a whole pickled model's buffers its state_dict() leaves out: its storages are not written
        listed = set(dropped)
        left = [k for k in ckpt.non_persistent if k not in listed]
        dropped += left
        if left:
            notes.append(f"{len(left)} non-persistent buffer(s) of the pickled model left out, as its state_dict() "
                         f"leaves them out ({', '.join(left[:3])}{', …' if len(left) > 3 else ''})")
    tied: dict[str, str] = {}
    metadata: dict[str, str] = {}
    if fmt is OutputFormat.SAFETENSORS:
        tied = _tied_duplicates(outs)
        if tied:
            notes.append("safetensors cannot share storage: " + ", ".join(f"{d} is written once as {k}"
                                                                          for d, k in tied.items())
                         + "; re-tie after loading (e.g. model.tie_weights()), and load with strict=False or "
                           "copy the kept tensor into the tied name")
            metadata["ckpt_doctor.tied"] = ",".join(f"{d}={k}" for d, k in tied.items())
        if ckpt.format is Format.SAFETENSORS:
            metadata.update({k: v for k, v in ckpt.metadata.items() if isinstance(v, str)})
        metadata.setdefault("format", "pt")
    for t in outs:
        if t.source.storage is None:
            raise PlanError(f"{t.source.key}: has no data in the file (a meta tensor); drop it with --drop")
    quantized = [t.key for t in outs if t.source.dtype in QUANTIZED]
    if quantized:
        from .errors import Rerun

        pattern = "^(" + "|".join(re.escape(k) for k in quantized[:50]) + ")$" if len(quantized) <= 50 else None
        raise PlanError(f"{len(quantized)} quantized tensors ({', '.join(quantized[:3])}"
                        f"{', …' if len(quantized) > 3 else ''}): ckpt-doctor does not read their scale and zero point, "
                        "so it would write them without; nothing written" + ("; leave them out with {0}" if pattern
                                                                             else ""),
                        reruns=(Rerun(add=("--drop", pattern)),) if pattern else ())
    if fmt is OutputFormat.DCP and any(t.device != "cpu" for t in outs):
        notes.append("a DCP folder holds CPU tensors: the saved devices are not kept (dcp.load fills the tensors "
                     "of the model it is given, wherever they are)")
    if fmt is OutputFormat.TORCH:
        from .devices import missing_devices

        absent = missing_devices(sorted({t.device for t in outs}))
        if absent:
            notes.append(f"the output keeps the device tags {', '.join(absent)}, which this machine lacks: "
                         "torch.load here needs map_location; add --map-location cpu to rewrite them for good")
    return FixPlan(ckpt.path, output, fmt, tuple(applied), {**mapping, **extra_renamed},
                   tuple(dropped), tuple(outs), tree, tuple(notes), tied, metadata, tuple(ambiguous))


def _tie(state: "OrderedDict[str, OutTensor]", ties: tuple[tuple[str, str], ...], fmt: OutputFormat,
         out_prefix: str, notes: list[str], applied: list[str], given: set | None = None) -> None:
    """Write each tied alias as the same tensor as the key it shares a Parameter with (one storage in a torch
    file), so that load_state_dict(strict=True) finds both names."""
    from .transforms import well_formed

    done = []
    for alias, key in ties:
        if (alias, key) not in (given or ()):
            if alias in state or key not in state:
                continue
        elif not well_formed(alias):
            raise UsageError(f"--tie {alias}={key}: {alias!r} has an empty key component, which no module has")
        elif key not in state:
            raise UsageError(f"--tie {alias}={key}: the output has no tensor {key!r} to share (its keys after the "
                             "renames are the ones --dry-run lists)")
        elif alias in state:
            if state[alias].source == state[key].source:
                continue  # already one tensor under both names
            raise UsageError(f"--tie {alias}={key}: the output already holds another tensor named {alias!r}; drop it "
                             "first (--drop) to write the tie")
        source = state[key]
        state[alias] = OutTensor(out_prefix + alias, source.source, source.dtype, source.device)
        done.append(f"{alias}={key}")
    if done:
        applied.append("--tie " + " --tie ".join(done))
        if fmt is OutputFormat.SAFETENSORS:
            notes.append("safetensors stores a tied tensor once: load it with the model's tie_weights(), or "
                         "write torch output (.pt) where both names share one storage")


def _check_loads(state: "OrderedDict[str, OutTensor]", opts: FixOptions, notes: list[str],
                 path: str = "", extras: set[str] | None = None) -> None:
    """With a model: what the output's state_dict would get from load_state_dict(strict=True), asked of torch's
    own loading code; refuse (exit 1, nothing written) when it would fail beyond --allow-missing/--allow-unexpected."""
    from .compare import _allowances, _check, _with_extras
    from .errors import CheckFailed

    assert opts.model is not None
    entries = [(k, tuple(o.source.shape), o.dtype) for k, o in state.items() if isinstance(o, OutTensor)]
    check = _with_extras(_check(opts.model, entries, None), extras or set())
    np_set = set(opts.model.non_persistent)
    unexpected = [k for k in check.unexpected if k not in np_set]
    allowed_m, allowed_u = _allowances(opts.allow_missing, opts.allow_unexpected, check, unexpected)
    missing = [k for k in check.missing if k not in allowed_m]
    mismatched = [m for m in check.mismatched if m.key not in allowed_m]
    unexpected = [k for k in check.unexpected if k not in allowed_u]
    from .compare import short_of_required

    short = short_of_required(opts.model, check, opts.allow_missing)
    if missing or mismatched or unexpected or check.errors or short:
        parts = [short] if short else []
        if missing:
            parts.append(f"{len(missing)} missing ({', '.join(missing[:3])}{'…' if len(missing) > 3 else ''})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({', '.join(unexpected[:3])}"
                         f"{'…' if len(unexpected) > 3 else ''})")
        if mismatched:
            parts.append(f"{len(mismatched)} of another shape ({', '.join(m.key for m in mismatched[:3])})")
        if check.errors:
            parts.append(f"the model's loading code: {one_line(check.errors[0], 160)}")
        import shlex

        from .advice import command_line, shell_path

        closest = (f"the closest fix: {' '.join(shlex.quote(f) for f in opts.closest)}" if opts.closest else
                   f"`{command_line(('inspect', shell_path(path), *opts.model.flags))}` shows the closest fix")
        raise CheckFailed(f"the output would still not load strictly into {opts.model.source}: {'; '.join(parts)}. "
                          f"Nothing was written; {closest} (--allow-missing/--allow-unexpected accept intended "
                          "differences)")
    if allowed_m or allowed_u:
        notes.append(f"accepted: {len(allowed_m)} model keys left missing (--allow-missing), {len(allowed_u)} extra "
                     "keys (--allow-unexpected)")


def _is_module_root(ckpt: Checkpoint, root: str) -> bool:
    return ckpt.model_class is not None and root == (ckpt.state_dict_root or "")


_MISSING = object()


def _subtree(obj: Any, path: str) -> Any:
    """The value at a dotted key path (keys that hold dots themselves are tried first), or _MISSING."""
    if path == "":
        return obj
    if isinstance(obj, dict):
        items = sorted(((str(k), v) for k, v in obj.items() if isinstance(k, (str, int))), key=lambda kv: -len(kv[0]))
    elif isinstance(obj, list):
        items = [(str(i), v) for i, v in enumerate(obj)]
    else:
        return _MISSING
    for name, value in items:
        if path == name:
            return value
        if path.startswith(name + "."):
            found = _subtree(value, path[len(name) + 1:])
            if found is not _MISSING:
                return found
    return _MISSING


def _unlisted_tensors(tensors: tuple[TensorRecord, ...], written: set[str], dropped: list[str],
                      prefix: str) -> list[str]:
    """Every source tensor the output does not hold and `dropped` does not name yet (itself or a container above
    it): none leaves unlisted, whatever part was selected (a whole pickled model's other modules included). A key
    of the state_dict is named as the state_dict names it, any other by its full path."""
    listed = set(dropped)
    out = []
    for t in tensors:
        if t.key in written:
            continue
        relative = t.key[len(prefix):] if prefix and t.key.startswith(prefix) else None
        if any(path in listed for path in ancestors(t.key)) or \
                relative is not None and any(path in listed for path in ancestors(relative)):
            continue
        out.append(relative if relative is not None else t.key)
    return out


def _versions(ckpt: Checkpoint, root: str | None, renames: list[Transform]) -> Any:
    """The state_dict's `_metadata` (each module's version, which its loading code reads: BatchNorm fills a
    counter files of version 1 lack) under the module names the renames give: written back, so that the repaired
    file loads as the original did. None when the file has none, or a rename leaves a module without a name."""
    from .compare import _metadata_of

    source = _metadata_of(ckpt, root)
    if not source:
        return None
    leaf = "\0leaf"
    out: OrderedDict[str, Any] = OrderedDict()
    for module, version in source.items():
        if not isinstance(module, str):
            return None
        new = module + "." + leaf if module else leaf
        for step in ordered(renames):
            new = step.apply(new) or ""
        if not new.endswith(leaf):
            continue  # the rename reached into the leaf: that module's name is gone, and so is its version
        name = new[:-len(leaf)].rstrip(".")
        out.setdefault(name, version)
    return out


def left_out(tree: Any, part: str, *, beside: bool, inside: bool) -> list[str]:
    """Paths of the source tree an output at `part` does not hold: with `beside`, every entry beside the part at
    each level above it (a training checkpoint's `optimizer`, `epoch` when its `model` is written alone); with
    `inside`, the entries within the part that hold no tensor (a state_dict's `version`, an `_extra_state` object),
    which a state_dict of tensors cannot hold. A container left out whole is one path."""
    out: list[str] = []
    node, at = tree, ""
    rest = part
    while rest:  # down the part's path; keys may hold dots themselves, so the longest matching name is taken
        items = _items(node)
        step = next(((name, value) for name, value in sorted(items, key=lambda kv: -len(kv[0]))
                     if rest == name or rest.startswith(name + ".")), None)
        if step is None:
            return out
        if beside:
            out += [join(at, name) for name, _ in items if name != step[0]]
        node, at = step[1], join(at, step[0])
        rest = rest[len(step[0]) + 1:]
    if inside:
        todo = [(at, node)]
        while todo:
            path, value = todo.pop()
            for name, child in _items(value):
                if isinstance(child, RawTensor):
                    continue
                if isinstance(child, (dict, list, tuple)) and has_tensor(child):
                    todo.append((join(path, name), child))
                elif not (isinstance(child, Opaque) and has_tensor(child)):  # a module's own tensors are written
                    out.append(join(path, name))
    return out


def _items(node: Any) -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        return [(k if isinstance(k, str) else str(k), v) for k, v in node.items()]
    if isinstance(node, (list, tuple)) and type(node) is not SizeValue:
        return [(str(i), v) for i, v in enumerate(node)]
    return []


def _check_select(ckpt: Checkpoint, select: str) -> None:
    if select == "" and ckpt.tensors:
        return  # the whole checkpoint
    if not any(t.key.startswith(select + ".") for t in ckpt.tensors):
        if ckpt.distributed.get("format") == "deepspeed" and select == "module":
            raise PlanError(f"{ckpt.path}: ZeRO-3 saves only 0-element placeholders in module; the weights are "
                            "fp32_weights (the default)")
        tops = sorted({t.key.split(".", 1)[0] for t in ckpt.tensors})[:8]
        raise PlanError(f"{ckpt.path}: --select {select!r} holds no tensors; the file's top-level entries with "
                        f"tensors are: {', '.join(tops)}")


def _map_by_order(kept: list[TensorRecord], mapping: dict[str, str], model: ModelKeys | None, force: bool,
                  notes: list[str], dry_run: bool = False, marked: list[str] | None = None) -> dict[str, str]:
    assert model is not None
    entries = list(model.entries)
    olds = list(mapping)
    if len(olds) != len(entries):
        raise PlanError(f"--map-by-order: the checkpoint has {len(olds)} tensors, the model {len(entries)}; "
                        "drop the extra ones first (--drop)")
    by_key = {t.key: t for t in kept}
    for i, (old, entry) in enumerate(zip(olds, entries)):
        shape = by_key[old].shape
        if tuple(shape) != tuple(entry.shape):
            raise PlanError(f"--map-by-order: position {i}: {old} {list(shape)} cannot become {entry.key} "
                            f"{list(entry.shape)}; the layers do not line up")
    from .compare import ambiguous_positions

    ambiguous = ambiguous_positions([by_key[old] for old in olds], [e.key for e in entries])
    if marked is not None:
        counts = Counter(tuple(by_key[old].shape) for old in olds)
        marked += [old for old in olds if by_key[old].numel > 1 and counts[tuple(by_key[old].shape)] > 1]
    if ambiguous and not (force or dry_run):
        from .errors import Rerun

        raise PlanError(f"--map-by-order: {len(ambiguous)} positions have a neighbour of the same shape (first: "
                        f"{ambiguous[0]}), so a swap would go unnoticed; see the mapping with {{0}}, and write it, "
                        "once checked, with {1}", reruns=(Rerun(add=("--dry-run",)), Rerun(add=("--force",))))
    if ambiguous and force:
        notes.append(f"--map-by-order with --force: {len(ambiguous)} ambiguous positions mapped by order")
    elif ambiguous:
        notes.append(f"--map-by-order: {len(ambiguous)} positions share their shape with another (marked ≈): a swap "
                     "among them would go unnoticed; writing this mapping needs --force")
    return {old: entry.key for old, entry in zip(olds, entries)}


def _rebuild(obj: Any, path: str, root: str, state: "OrderedDict[str, OutTensor]",
             records: dict[str, TensorRecord], drops: list[Transform], outs: list[OutTensor],
             out_tensor: Callable[[str, TensorRecord], OutTensor], cut: set[str], problems: list) -> Any:
    """The original tree with the state_dict at `root` replaced by `state`; dropped entries left out, and their
    paths added to `cut`; objects that cannot be written added to `problems` as (path, global)."""

    inside: set[int] = set()  # the containers being rebuilt: one met again within itself is a cycle

    def rebuilt(obj: Any, path: str) -> Generator:  # yields the rebuilding of each child, sent its result
        if path == root:
            return state
        if isinstance(obj, (dict, list, tuple)) and id(obj) in inside:
            raise PlanError(f"{path}: the {type(obj).__name__} holds itself (a cycle): torch.save writes that, fix "
                            f"writes trees; leave the repeat out with --drop '{re.escape(path)}$'")
        if isinstance(obj, RawTensor):
            record = records.get(path)
            if record is None:
                raise PlanError(f"internal: tensor at {path} not listed")
            out = out_tensor(path, record)
            outs.append(out)
            return out
        if isinstance(obj, dict):
            items = [(k, v) for k, v in obj.items() if _kept(join(path, k), drops, cut)]
            for k, _ in items:
                if isinstance(k, Opaque) or isinstance(k, type) and issubclass(k, Opaque):
                    check_writable(k, join(path, k), problems)
            pairs = []
            inside.add(id(obj))
            for k, v in items:
                pairs.append((k, (yield rebuilt(v, join(path, k)))))
            inside.discard(id(obj))
            return OrderedDict(pairs) if isinstance(obj, OrderedDict) else dict(pairs)
        if isinstance(obj, frozenset):  # written as builtins.frozenset, which torch.load(weights_only=True) refuses
            from .safepickle.policy import user_allowed

            if "builtins.frozenset" not in user_allowed():
                problems.append((path, GlobalRef("builtins", "frozenset", Verdict.SAFE, "a frozenset value")))
            return obj
        if isinstance(obj, (list, tuple)):
            if obj and all(o is None or isinstance(o, (bool, int, float, str)) for o in obj) or \
                    type(obj) is SizeValue:
                return obj
            values = []
            inside.add(id(obj))
            for i, v in enumerate(obj):
                if _kept(join(path, i), drops, cut):
                    values.append((yield rebuilt(v, join(path, i))))
            inside.discard(id(obj))
            return values if isinstance(obj, list) else tuple(values)
        if isinstance(obj, Opaque):
            if has_tensor(obj):
                raise PlanError(f"{path or 'the file'} is a pickled "
                                f"{obj.ckd.ref.qualname if obj.ckd.ref else 'object'} holding tensors; write its "
                                f"weights alone with --select {path or '…'}")
            check_writable(obj, path, problems)
        elif isinstance(obj, type) and issubclass(obj, Opaque):
            check_writable(obj, path, problems)
        else:
            check_leaf(obj, path, problems)
        return obj

    return run_nested(rebuilt(obj, path))


# What the output's pickle can hold as a plain value: what torch.load(weights_only=True) reads back.
_LEAVES = (type(None), bool, int, float, str, bytes, bytearray, complex, set, DType, Device)
_LONG1_BITS = 255 * 8 - 1  # ints past LONG1's 255 bytes need LONG4, which torch's weights_only unpickler refuses


def check_leaf(obj: Any, path: str, problems: list) -> None:
    """Note a plain value the output cannot hold as torch.load(weights_only=True) reads it (a slice, an int too
    big for LONG1): found while planning, so that a dry run, a rescue and the write agree."""
    if isinstance(obj, int) and not isinstance(obj, bool) and obj.bit_length() > _LONG1_BITS:
        problems.append((path, GlobalRef("builtins", "int", Verdict.SAFE, "an int of more than 255 bytes"), False))
    elif not isinstance(obj, _LEAVES):
        name = type(obj).__name__
        problems.append((path, GlobalRef(type(obj).__module__ or "builtins", name, Verdict.SAFE, f"a {name} value"),
                         False))


def check_writable(obj: Any, path: str, problems: list) -> None:
    """Note (in `problems`) an object the output would have to name a global for, unless torch.load(weights_only=
    True) accepts that global or the user allowed it: fix never writes what the allow-list does not hold."""
    from .safepickle.policy import TORCH_WEIGHTS_ONLY, resolve, user_allowed

    allowed = TORCH_WEIGHTS_ONLY | user_allowed()
    refs = [ref for ref in _refs_in(obj) if ".".join(resolve(ref.module, ref.name)) not in allowed]
    if refs and _holds_cycle(obj):  # --allow-global cannot keep it: the writer cannot write a cycle back
        article = "an" if refs[0].qualname[:1].lower() in "aeiou" else "a"
        problems.append((path, refs[0], False, f"{article} {refs[0].qualname} that holds itself (a cycle)"))
    else:
        problems.extend((path, ref) for ref in refs)


def refuse_unwritable(problems: list) -> None:
    """Exit 2 naming every object fix would have to leave out, with the one --drop that leaves them all out (as a
    command to paste; `.drop` holds its pattern for callers that plan a rescue)."""
    if not problems:
        return
    from .errors import Rerun
    from .safepickle.policy import resolve

    keepable = all(len(p) < 3 or p[2] for p in problems)  # a value the writer cannot hold is not kept by a flag
    pairs = list(dict.fromkeys((p[0], ".".join(resolve(p[1].module, p[1].name)), p[1].verdict) for p in problems))
    paths = list(dict.fromkeys(path for path, _, _ in pairs))
    names = list(dict.fromkeys(name for _, name, _ in pairs))
    dangerous = any(v is Verdict.DANGEROUS for _, _, v in pairs)
    reruns: list[Rerun] = []
    pattern = None
    if not all(paths):
        drop = "--select with the part that holds the tensors (the file's root itself is such an object)"
    else:
        pattern = f"^{re.escape(paths[0])}$" if len(paths) == 1 else \
            "^(" + "|".join(re.escape(p) for p in paths) + ")$"
        reruns.append(Rerun(add=("--drop", pattern)))
        drop = "{0}"
        tops = list(dict.fromkeys(p.split(".")[0] for p in paths))
        if len(paths) > 1 and len(tops) == 1:
            reruns.append(Rerun(add=("--drop", f"^{re.escape(tops[0])}$")))
            drop += " (or the whole entry: {1})"
    keep = ""
    if not dangerous and keepable:
        at = len(reruns)
        reruns.append(Rerun(add=tuple(a for n in names for a in ("--allow-global", n))))
        keep = (f", or keep {'it' if len(paths) == 1 else 'them'} with {{{at}}} (then torch.load needs "
                f"torch.serialization.add_safe_globals for {'it' if len(names) == 1 else 'them'})")
    refused = "which torch.load(weights_only=True) refuses and ckpt-doctor does not write"
    if len(pairs) == 1:
        path, name, verdict = pairs[0]
        plain = [p[3] if len(p) > 3 else p[1].reason for p in problems if len(p) > 2 and not p[2]]  # say what
        what = f"{path or 'the root'} holds " + (f"{plain[0]}, " if plain else
                                                 f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name} "
                                                 f"({verdict.value}), ")
        message = f"{what}{refused}. Leave it out with {drop}{keep}"
    else:
        by_path: dict[str, list[str]] = {}
        for path, name, _ in pairs:
            by_path.setdefault(path, []).append(name)
        shown = "; ".join(f"{p or 'the root'} ({', '.join(ns[:2])}{', …' if len(ns) > 2 else ''})"
                          for p, ns in list(by_path.items())[:6])
        more = f"; … {len(paths) - 6} more" if len(paths) > 6 else ""
        message = f"{len(paths)} entries hold objects {refused}: {shown}{more}. Leave them out with {drop}{keep}"
    error = PlanError(message, reruns=tuple(reruns))
    error.drop = pattern  # type: ignore[attr-defined]
    raise error


def _parts(item: Any) -> list | None:
    """What an object of the unpickled tree holds (what writing it writes too); None for a leaf."""
    if isinstance(item, Opaque):
        data = item.ckd
        return [data.args, data.kwargs, data.state, data.items, data.dictitems]
    if isinstance(item, dict):
        return [*item.keys(), *item.values()]
    if isinstance(item, (list, tuple, set, frozenset)):
        return list(item)
    return None


def _refs_in(obj: Any) -> list:
    """The globals an object of the unpickled tree would be written with (its class, and those of its parts)."""
    refs, stack, seen = [], [obj], set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, type) and issubclass(item, Opaque):
            if item.__ref__ is not None:
                refs.append(item.__ref__)
            continue
        if isinstance(item, Opaque) and item.ckd.ref is not None:
            refs.append(item.ckd.ref)
        stack.extend(_parts(item) or ())
    return refs


def _holds_cycle(obj: Any) -> bool:
    """Whether an object of the unpickled tree holds itself somewhere inside (omegaconf's nodes point back to their
    parents), which no pickle fix writes can hold: its _parts walked depth first, the open ones kept."""
    stack: list[tuple[Any, bool]] = [(obj, False)]
    open_: set[int] = set()
    done: set[int] = set()
    while stack:
        item, leaving = stack.pop()
        if leaving:
            open_.discard(id(item))
            done.add(id(item))
            continue
        if id(item) in open_:
            return True
        parts = None if id(item) in done else _parts(item)
        if parts is None:
            continue
        open_.add(id(item))
        stack.append((item, True))
        stack.extend((part, False) for part in parts)
    return False


def _in_source_order(tree: "OrderedDict[Any, Any]", source: dict, mapping: dict[str, str]) -> "OrderedDict[Any, Any]":
    """`tree`'s entries in the order their sources have in `source` (a tensor's under its new name); any other
    entry after them."""
    ordered: OrderedDict[Any, Any] = OrderedDict()
    for key in source:
        name = mapping.get(key if isinstance(key, str) else str(key), key)
        if name in tree and name not in ordered:
            ordered[name] = tree[name]
    for name, value in tree.items():
        ordered.setdefault(name, value)
    return ordered


def _out_tensors(obj: Any) -> list[OutTensor]:
    """The OutTensors inside a rebuilt entry, in order."""
    found: list[OutTensor] = []
    todo = [obj]  # depth first, on a list: an entry can nest as deep as torch.save writes
    while todo:
        item = todo.pop()
        if isinstance(item, OutTensor):
            found.append(item)
        elif isinstance(item, dict):
            todo.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            todo.extend(reversed(item))
    return found


def _dropped(path: str, drops: list[Transform]) -> bool:
    return any(re.search(d.arg, path) for d in drops)


def _kept(path: str, drops: list[Transform], cut: set[str]) -> bool:
    if _dropped(path, drops):
        cut.add(path)
        return False
    return True


def _tensors_under(cut: set[str], records: dict[str, TensorRecord], state_prefix: str) -> list[str]:
    """The tensors (full paths) inside the entries --drop cut from the tree, those of the state_dict excepted
    (already listed by their keys)."""
    if not cut:
        return []
    found = []
    for key in records:
        if state_prefix and key.startswith(state_prefix):
            continue
        if any(path in cut for path in ancestors(key)):
            found.append(key)
    return found


def _tied_duplicates(outs: list[OutTensor]) -> dict[str, str]:
    seen: dict[tuple, str] = {}
    tied = {}
    for t in outs:
        r = t.source
        ident = (*r.storage.ident, r.storage_offset, r.shape, r.stride, r.dtype) if r.storage else None
        if ident is None:
            continue
        if ident in seen:
            tied[t.key] = seen[ident]
        else:
            seen[ident] = t.key
    return tied


# --- execution --------------------------------------------------------------------------------------------

def _raise_open_files_limit() -> None:
    """A distributed checkpoint can hold thousands of files, each kept open once opened: lift the soft limit on open
    descriptors to the hard one (as `ulimit -n` would), which a process may always do."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    except (ImportError, ValueError, OSError):
        pass  # not POSIX, or not allowed: the default limit stays


class _Sources:
    """Open read-only descriptors of the input files, closed together."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        _raise_open_files_limit()

    def fd(self, path: Path) -> int:
        key = str(path)
        if key not in self.fds:
            self.fds[key] = os.open(path, os.O_RDONLY)
        return self.fds[key]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _convert_producer(src_fd: int, offset: int, nbytes: int, src: str, dst: str) -> Callable:
    """Converted bytes of a storage, chunk by chunk (floating storages only); returns their crc."""

    def produce(fd: int, at: int, progress: Progress | None) -> int:
        import torch

        elsize = element_size(src)
        step = CHUNK // elsize * elsize
        crc, done, written = 0, 0, 0
        while done < nbytes:
            chunk = bytearray(os.pread(src_fd, min(step, nbytes - done), offset + done))
            if not chunk:
                raise WriteError("input ended early while converting")
            data = tensor_bytes(torch.frombuffer(chunk, dtype=getattr(torch, src)).to(getattr(torch, dst)))
            write_bytes(fd, at + written, data)
            crc = crc32(data, crc)
            done += len(chunk)
            written += len(data)
            if progress:
                progress.advance(len(chunk))
        return crc

    return produce


def _assembly_producer(assembly: Assembly, what: str, dtype: str, sources: _Sources) -> Callable:
    """A tensor of several files' pieces (DCP, ZeRO), assembled straight into the output in CHUNK-sized blocks and
    converted on the way when asked; the tiling of its pieces is checked as it goes (a gap: nothing written)."""

    def produce(fd: int, at: int, progress: Progress | None) -> int:
        whole = whole_piece_runs(assembly, what) if dtype == assembly.dtype and crc32_combine is not None else None
        if whole is not None:  # each chunk a whole archived storage: kernel copies, crcs combined (see stream.py)
            crc, elsize = 0, element_size(dtype)
            for out, _src, piece, length in whole:
                nbytes = length * elsize
                copy_range(sources.fd(piece.file), piece.offset, nbytes, fd, at + out * elsize, progress,
                           known_crc=piece.crc)
                crc = crc32_combine(crc, piece.crc, nbytes)
            return crc
        state = [0, at]  # crc, where the next block goes

        def sink(block: bytes) -> None:
            if dtype != assembly.dtype:
                import torch

                block = tensor_bytes(torch.frombuffer(bytearray(block), dtype=getattr(torch, assembly.dtype))
                                     .to(getattr(torch, dtype)))
            write_bytes(fd, state[1], block)
            state[0] = crc32(block, state[0])
            state[1] += len(block)
            if progress:
                progress.advance(len(block))

        stream(assembly, what, sources.fd, sink, CHUNK)
        return state[0]

    return produce


def _contiguous_producer(record: TensorRecord, dtype: str) -> Callable:
    def produce(fd: int, at: int, progress: Progress | None) -> int:
        import torch

        from .tensordata import load_tensor

        tensor = load_tensor(record)
        if dtype != record.dtype:
            tensor = tensor.to(getattr(torch, dtype))
        data = tensor_bytes(tensor.contiguous()) if tensor.numel() else b""
        write_bytes(fd, at, data)
        if progress:
            progress.advance(record.nbytes)
        return crc32(data)

    return produce


def execute(plan: FixPlan, progress_callback: Callable[[int, int], None] | None = None,
            verify: bool = True, force: bool = False) -> FixResult:
    """Write the planned output atomically and, unless told not to, re-read it and compare every tensor."""
    if plan.format is OutputFormat.DCP:
        from .writers.dcp_writer import write_dcp

        size = write_dcp(plan, verify, force)
        return FixResult(plan, size, verify)
    check_destination(plan.output, (plan.input, *{t.source.storage.file for t in plan.tensors if t.source.storage}),
                      force=True)
    sources = _Sources()
    progress = Progress(plan.nbytes * (2 if verify else 1), progress_callback)
    unknown: list[str] = []
    try:
        with atomic_output(plan.output, plan.nbytes) as (fd, tmp):
            written = WrittenRanges(fd, str(tmp), verify, progress)
            try:
                if plan.format is OutputFormat.TORCH:
                    archive = _source_names(plan)
                    storages, expected = _torch_layout(plan, sources, archive)
                    pickle_bytes, unknown = dumps(_to_pickle_tree(plan.tree, expected))
                    write_torch_zip(fd, archive or _archive_name(plan.output), pickle_bytes, storages, progress,
                                    written)
                else:
                    entries = _safetensors_layout(plan, sources)
                    write_safetensors(fd, entries, plan.metadata, progress, written)
                if verify:
                    failed = written.failures()
                    if failed:
                        raise WriteError(f"{plan.output}: verification failed: {failed[0]} does not match its "
                                         f"source{f' (and {len(failed) - 1} more)' if len(failed) > 1 else ''}; "
                                         "the input may be corrupt; nothing written")
                    if plan.format is OutputFormat.TORCH:
                        _verify_torch_structure(tmp, plan, expected)
                    else:
                        _verify_safetensors_structure(tmp, entries)
            finally:
                written.close()
            size = os.fstat(fd).st_size
    finally:
        sources.close()
    return FixResult(plan, size, verify, tuple(unknown))


def parse_size(text: str) -> int:
    """`5GB`, `500MB`, `2GiB`, `1000000` -> bytes (decimal units as Hugging Face uses them, binary with `i`)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise UsageError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    number, unit, binary = float(match.group(1)), match.group(2).upper(), match.group(3)
    scale = (1024 if binary else 1000) ** "_KMGT".index(unit or "_")
    size = int(number * scale)
    if size <= 0:
        raise UsageError(f"--max-shard-size {text!r} must be positive")
    return size


def shard_paths(output: Path, count: int) -> tuple[list[Path], Path]:
    """`model.safetensors` -> model-00001-of-00003.safetensors …, and model.safetensors.index.json."""
    stem, suffix = output.name.rsplit(".", 1) if "." in output.name else (output.name, "")
    dot = "." + suffix if suffix else ""
    shards = [output.with_name(f"{stem}-{i:05d}-of-{count:05d}{dot}") for i in range(1, count + 1)]
    return shards, output.with_name(output.name + ".index.json")


def split_plan(plan: FixPlan, max_bytes: int) -> list[FixPlan]:
    """Consecutive groups of tensors under `max_bytes` each; tensors sharing a storage stay in one shard."""
    if not isinstance(plan.tree, OrderedDict) or any(t.key not in plan.tree for t in plan.tensors):
        raise PlanError("--max-shard-size writes a state_dict: add --select (e.g. --select state_dict)")
    groups: list[list[OutTensor]] = []
    where: dict[tuple[str, str], int] = {}
    size = 0
    for t in plan.tensors:
        st = t.source.storage
        ident = st.ident if st else ("", t.key)
        if ident in where:
            groups[where[ident]].append(t)
            continue
        nbytes = _converted_nbytes(st.nbytes, t.source.dtype, t.dtype) if st else 0
        if not groups or (size + nbytes > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(t)
        where[ident] = len(groups) - 1
        size += nbytes
    shards, _ = shard_paths(plan.output, len(groups))
    plans = []
    for path, members in zip(shards, groups):
        keys = {t.key for t in members}
        plans.append(replace(plan, output=path, tensors=tuple(members),
                             tree=OrderedDict((k, v) for k, v in plan.tree.items() if k in keys),
                             tied={d: k for d, k in plan.tied.items() if d in keys and k in keys}))
    return plans


def execute_sharded(plan: FixPlan, max_bytes: int, progress_callback: Callable[[int, int], None] | None = None,
                    verify: bool = True, force: bool = False) -> FixResult:
    """Write shards, each atomically and verified, then the index last: an index only ever names whole shards."""
    import json

    parts = split_plan(plan, max_bytes)
    shards, index_path = shard_paths(plan.output, len(parts))
    inputs = (plan.input, *{t.source.storage.file for t in plan.tensors if t.source.storage})
    for path in (*shards, index_path):
        check_destination(path, inputs, force)
    results = [execute(part, progress_callback, verify) for part in parts]
    weight_map = {t.key: part.output.name for part in parts for t in part.tensors if t.key not in part.tied}
    total = sum(part.nbytes for part in parts)
    index = json.dumps({"metadata": {"total_size": total, "written_by": "ckpt-doctor"}, "weight_map": weight_map},
                       indent=2).encode()
    with atomic_output(index_path) as (fd, _):
        write_bytes(fd, 0, index)
    return FixResult(replace(plan, output=index_path), sum(r.bytes for r in results) + len(index), verify,
                     tuple(sorted({g for r in results for g in r.unknown_globals})), tuple(shards))


def _archive_name(output: Path) -> str:
    stem = output.name.split(".")[0] or "archive"
    return re.sub(r"[^A-Za-z0-9_-]", "_", stem)


_STORAGE_ENTRY = re.compile(r"([^/]+)/data/([^/]+)")


def _source_names(plan: FixPlan) -> str | None:
    """The archive name of the one torch zip all storages come from, when its storage keys can be kept.

    Keeping the source's names makes each copied storage's local header byte-for-byte the one the output
    needs, so storages that lie back to back in the source are copied as one range (see ZipOut.add_run).
    torch.load does not care what the archive folder is called."""
    prefixes = set()
    files = set()
    for t in plan.tensors:
        st = t.source.storage
        match = _STORAGE_ENTRY.fullmatch(st.entry) if st is not None else None
        if match is None:
            return None
        prefixes.add(match.group(1))
        files.add(st.file)
    return prefixes.pop() if len(prefixes) == 1 and len(files) == 1 else None


def _torch_layout(plan: FixPlan, sources: _Sources,
                  archive: str | None) -> tuple[list[StorageOut], dict[str, TensorOut]]:
    storages: dict[tuple[str, str], StorageOut] = {}
    expected: dict[str, TensorOut] = {}
    for t in plan.tensors:
        rec = t.source
        st = rec.storage
        assert st is not None
        ident = st.ident
        out = storages.get(ident)
        if out is None:
            nbytes = _converted_nbytes(st.nbytes, rec.dtype, t.dtype)
            key = st.entry.rsplit("/", 1)[1] if archive is not None else str(len(storages))
            if st.assembly is not None:
                produce = _assembly_producer(st.assembly, rec.key, t.dtype, sources)
                storages[ident] = out = StorageOut(key, nbytes, produce=produce)
                expected[t.key] = TensorOut(rec, out.key, t.device, t.dtype, out.nbytes // element_size(t.dtype))
                continue
            fd = sources.fd(st.file)
            if st.deflated:  # a deflated member (a re-zipped file): inflated into the output as it is written
                convert = (rec.dtype, t.dtype) if t.dtype != rec.dtype else None
                out = StorageOut(key, nbytes, produce=deflated_producer(fd, st, 0, st.nbytes, rec.key, convert))
            elif t.dtype != rec.dtype:
                out = StorageOut(key, nbytes, produce=_convert_producer(fd, st.offset, st.nbytes, rec.dtype, t.dtype))
            else:
                out = StorageOut(key, nbytes, fd, st.offset, st.crc)
            storages[ident] = out
        numel = out.nbytes // element_size(t.dtype)
        expected[t.key] = TensorOut(rec, out.key, t.device, t.dtype, numel)  # rec's layout; key, dtype as planned
    return list(storages.values()), expected


def _to_pickle_tree(tree: Any, expected: dict[str, TensorOut]) -> Any:
    def converted(tree: Any) -> Generator:  # yields the conversion of each child, sent its result
        if isinstance(tree, OutTensor):
            return expected[tree.key]
        if isinstance(tree, dict):
            pairs = []
            for k, v in tree.items():
                pairs.append((k, (yield converted(v))))
            if not isinstance(tree, OrderedDict):
                return dict(pairs)
            out = OrderedDict(pairs)
            if getattr(tree, "_metadata", None) is not None:  # a state_dict keeps its module versions
                out._metadata = tree._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(tree, (list, tuple)) and type(tree) is not SizeValue:
            values = []
            for v in tree:
                values.append((yield converted(v)))
            return values if isinstance(tree, list) else tuple(values)
        return tree

    return run_nested(converted(tree))


def _safetensors_layout(plan: FixPlan, sources: _Sources) -> list[TensorBytes]:
    entries = []
    for t in plan.tensors:
        if t.key in plan.tied:
            continue
        rec = t.source
        st = rec.storage
        assert st is not None
        nbytes = rec.numel * element_size(t.dtype)
        if st.assembly is not None:
            entries.append(TensorBytes(t.key, t.dtype, rec.shape, nbytes,
                                       produce=_assembly_producer(st.assembly, rec.key, t.dtype, sources)))
        elif st.deflated and rec.is_contiguous:
            convert = (rec.dtype, t.dtype) if t.dtype != rec.dtype else None
            entries.append(TensorBytes(t.key, t.dtype, rec.shape, nbytes, produce=deflated_producer(
                sources.fd(st.file), st, rec.storage_offset * element_size(rec.dtype), rec.nbytes, rec.key, convert)))
        elif rec.is_contiguous and t.dtype == rec.dtype:
            whole = rec.storage_offset == 0 and nbytes == st.nbytes
            entries.append(TensorBytes(t.key, t.dtype, rec.shape, nbytes, sources.fd(st.file), rec.file_offset or 0,
                                       st.crc if whole else None))
        else:
            entries.append(TensorBytes(t.key, t.dtype, rec.shape, nbytes, produce=_contiguous_producer(rec, t.dtype)))
    return entries


def _verify_torch_structure(tmp: Path, plan: FixPlan, expected: dict[str, TensorOut]) -> None:
    """The written file, re-read by the same reader a user's inspect uses, holds exactly the planned tensors."""
    from .readers import read_checkpoint

    written = {t.key: t for t in read_checkpoint(tmp).tensors}
    if set(written) != set(expected):
        missing = sorted(set(expected) ^ set(written))[:3]
        raise WriteError(f"{plan.output}: verification failed: keys differ from the plan ({missing}); nothing written")
    for key, out in expected.items():
        got = written[key]
        want = out.record
        if (got.shape, got.stride, got.storage_offset, got.dtype, got.device) != \
                (want.shape, want.stride, want.storage_offset, out.dtype, out.device):
            raise WriteError(f"{plan.output}: verification failed for {key}: wrote {got.dtype}{list(got.shape)} on "
                             f"{got.device}, expected {out.dtype}{list(want.shape)}; nothing written")


def _verify_safetensors_structure(tmp: Path, entries: list[TensorBytes]) -> None:
    from .readers import read_checkpoint

    written = {t.key: t for t in read_checkpoint(tmp).tensors}
    for e in entries:
        got = written.get(e.key)
        if got is None or got.shape != tuple(e.shape) or got.dtype != e.dtype:
            raise WriteError(f"verification failed for {e.key}: the written header does not match; nothing written")
    if len(written) != len(entries):
        raise WriteError("verification failed: the written file holds other tensors than planned; nothing written")


def parse_map_location(values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`cpu` (every device) or `cuda:3=cuda:0` (one device), repeatable."""
    table = []
    for value in values:
        old, sep, new = value.partition("=")
        pair = (old, new) if sep else ("*", old)
        for device in pair:
            if device != "*" and not re.fullmatch(r"(cpu|meta|mps|xpu|hpu|cuda)(:\d+)?", device):
                raise UsageError(f"--map-location {value!r}: {device!r} is not a device (cpu, cuda:0, mps, …)")
        # the tag written must be one torch.load restores: `cpu:0` it refuses everywhere; `meta` loads no data
        if re.fullmatch(r"cpu:\d+", pair[1]):
            raise UsageError(f"--map-location {value!r}: torch.load restores `cpu`, not {pair[1]!r}; write cpu")
        if pair[1] == "meta":
            raise UsageError(f"--map-location {value!r}: a meta tag makes torch.load return tensors without their "
                             "data; keep the data with cpu")
        table.append(pair)
    return tuple(table)


def parse_dtype(value: str | None) -> str | None:
    if value is None:
        return None
    name = user_dtype_name(value)
    if name not in ("float16", "bfloat16", "float32", "float64"):
        raise UsageError(f"--dtype {value!r}: choose float16 (half, fp16), bfloat16 (bf16), float32 (float, fp32) "
                         "or float64 (double, fp64)")
    return name

