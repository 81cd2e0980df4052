"""Builds the inspect report — everything `inspect` says about a checkpoint — as one frozen result object."""

from __future__ import annotations

import os
from pathlib import Path

from .dtypes import FLOATING
from ._record import field, record, replace
from .advice import Suggestion, fix_suggestions
from .analyze import PrefixFinding, find_prefixes, shared_groups
from .default_load import DefaultLoad, default_load
from .devices import missing_devices
from .errors import ReadError, SeveralCheckpoints, UsageError
from .readers import read_checkpoint
from .records import Checkpoint, Hazard, SharedGroup, TensorRecord, TensorTable, Verdict, relative_to_root
from .safepickle.policy import DEFAULT_POLICY, Policy
from .sniff import deep, walk_folder

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any


@record
class InspectReport:
    checkpoint: Checkpoint
    tensors: tuple[TensorRecord, ...]  # after --filter
    prefixes: tuple[PrefixFinding, ...]
    shared: tuple[SharedGroup, ...]
    parameter_count: int  # elements of the state_dict's parameters, as model.parameters() counts them (tied once)
    total_bytes: int  # of distinct storages
    storage_count: int
    stats: dict[str, Any] | None = None  # key -> stats.TensorStats, with --stats
    batchnorm_at_init: tuple[str, ...] = ()
    comparison: Any = None  # a Comparison when --model is given
    model_shapes: dict[str, tuple] = field(default_factory=dict)
    value_diffs: dict[str, float] | None = None  # --values against a reference checkpoint
    missing_devices: tuple[str, ...] = ()  # saved devices this machine lacks (known only when torch is loaded)
    filter: str | None = None
    extra_notes: tuple[str, ...] = field(default=())
    default_load: DefaultLoad | None = None  # what torch.load(path) with torch's defaults does here
    suggestions: tuple[tuple[str, Suggestion], ...] = ()  # (what it is for, the command): fix, dry run, rescue
    buffer_count: int = 0  # elements of its buffers (BatchNorm statistics, counters, masks), apart
    require_default_load: bool = False  # --require-default-load: a file torch.load(path) refuses is a problem

    @property
    def needs_code(self) -> bool:
        """The file names globals off the allow-list: loading it as saved needs (and runs) code."""
        return self.checkpoint.verdict is not Verdict.SAFE

    @property
    def problems(self) -> tuple[str, ...]:
        """What makes the exit code 1, each the one value its words are rendered from."""
        found = []
        if self.needs_code:
            found.append("unsafe")
        if bool(self.stats) and any(s is not None and (s.nan or s.inf) for s in self.stats.values()):
            found.append("values")
        if self.batchnorm_at_init:
            found.append("batchnorm")
        if self.comparison is not None and not self.comparison.ok:
            found.append("comparison")
        if self.require_default_load and self.default_load is not None and not self.default_load.ok:
            found.append("default-load")
        return tuple(found)

    @property
    def has_problems(self) -> bool:
        return bool(self.problems)

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0


def inspect_checkpoint(path: str | Path, *, stats: bool = False, filter: str | None = None,
                       checkpoint: Checkpoint | None = None, model: str | None = None,
                       model_args: dict[str, Any] | None = None, allow_missing: str | None = None,
                       allow_unexpected: str | None = None, min_loaded: float | None = None,
                       values: bool = False, select: str | None = None,
                       require_default_load: bool = False, policy: Policy = DEFAULT_POLICY) -> InspectReport:
    """What `inspect` reports; with `model`, also the comparison with that model (or reference checkpoint). Globals
    are judged by `policy` (the defaults unless passed; `Policy.allowing([...])` is --allow-global)."""

    path = deep(path)  # a path of any length opens (sniff.DeepPath)
    folder = checkpoint is None and path.is_dir()
    try:
        ckpt = checkpoint or read_checkpoint(path, policy=policy)
    except SeveralCheckpoints:
        raise  # `inspect` lists them; for anything else, the message says which to name
    except ReadError as exc:
        if not folder or exc.findings:
            raise
        # Which checkpoint to open is unclear, but what the folder's files would run is not: say it (exit 1).
        found = sibling_hazards(Path(path), (), policy=policy)
        if found:
            raise ReadError(f"{exc} — and files in it would run code: "
                            + "; ".join(h.what for h in found[:3]), tuple(h.what for h in found)) from None
        raise
    if folder:
        ckpt = replace(ckpt, hazards=ckpt.hazards + tuple(sibling_hazards(Path(path), ckpt.files, policy=policy)))
    comparison = None
    model_shapes: dict[str, tuple] = {}
    diffs = None
    keys = None
    if model is not None:
        from .compare import compare_checkpoint  # compare, modelspec: ~40 ms, only with --model
        from .modelspec import keys_from_spec
        from .transforms import compile_regex  # only with --filter

        for flag, pattern in (("--allow-missing", allow_missing), ("--allow-unexpected", allow_unexpected)):
            if pattern:
                compile_regex(pattern, flag)
        keys = keys_from_spec(model, model_args, checkpoint=path, policy=policy)
        model_shapes = {e.key: e.shape for e in keys.entries}
        if select is not None and not any(t.key.startswith(select + ".") for t in ckpt.tensors):
            raise UsageError(f"--select {select!r} holds no tensors in {ckpt.path}")
        comparison = compare_checkpoint(ckpt, keys, select=select, allow_missing=allow_missing,
                                        allow_unexpected=allow_unexpected, min_loaded=min_loaded)
        if values:
            diffs = value_differences(ckpt, model, policy=policy)
    elif values:
        raise UsageError("--values compares with a reference checkpoint: give one with --model OTHER_CKPT")
    tensors = ckpt.tensors
    if filter:
        from .transforms import compile_regex  # only with --filter

        pattern = compile_regex(filter, "--filter")
        table = TensorTable.of(tensors)
        tensors = table.take([i for i, key in enumerate(table.keys) if pattern.search(key)])
    root_keys = ckpt.state_dict_keys()
    table_stats = None
    bn: list[str] = []
    if stats:
        from .stats import batchnorm_at_init, tensor_stats  # stats read values (torch): only with --stats

        ckpt.refuse_values("compute --stats")

        table_stats = {t.key: tensor_stats(t, ckpt.value_bits.get(t.key, "")) for t in tensors}
        bn = batchnorm_at_init(list(tensors), table_stats)
    table = TensorTable.of(ckpt.tensors)
    total_bytes, storage_count = table.storage_totals()
    loads = default_load(ckpt)
    counts = parameter_counts(ckpt, keys if comparison is not None and comparison.oracle else None)
    return InspectReport(
        checkpoint=ckpt, tensors=tensors, prefixes=tuple(find_prefixes(root_keys, list(model_shapes) or None)),
        shared=tuple(shared_groups(table)), parameter_count=counts[0], buffer_count=counts[1],
        total_bytes=total_bytes, storage_count=storage_count,
        stats=table_stats, batchnorm_at_init=tuple(bn), filter=filter, comparison=comparison,
        model_shapes=model_shapes, value_diffs=diffs, missing_devices=tuple(missing_devices(ckpt.devices)),
        default_load=loads, require_default_load=require_default_load,
        suggestions=(*_suggestions(ckpt, comparison, loads, str(path) if folder else str(ckpt.path), policy),
                     *ckpt.advice))


def _suggestions(ckpt: Checkpoint, comparison: Any, loads: DefaultLoad,
                 source: str, policy: Policy = DEFAULT_POLICY) -> list[tuple[str, Suggestion]]:
    """The commands `inspect` suggests, each a value the summary, the JSON and the tests share: the fix a comparison
    infers (see `fix_suggestions`), else the rewrite after which torch.load(path) with torch's defaults loads the
    file here."""
    if comparison is not None and (comparison.suggested_fix or ckpt.verdict is not Verdict.SAFE):
        found = fix_suggestions(source, comparison, bool(ckpt.dangerous_globals),
                                plain=loads.ok and ckpt.verdict is Verdict.SAFE and not ckpt.model_class)
        if found:
            return found
        # no fix makes it load into this model: the rescue of its tensors is still said (the safety line's way out)
    refused = not loads.ok and loads.applies and (loads.refused or loads.missing_devices)
    if refused or loads.applies and ckpt.verdict is not Verdict.SAFE:
        from .fix.rescue import rescue  # the fix planner: only for a file torch.load refuses, or an unsafe one

        found = rescue(ckpt, ["--map-location", "cpu"] if loads.missing_devices else [], source=source,
                       policy=policy)
        if found is not None:  # (torch.load loads an unsafe file whose findings are in pickles it never reads:
            return [("torch.load" if refused else "rescue", found)]  # the rescue is a copy without them)
    return []


# Buffers torch's own modules register under these names (norm layers' statistics, rotary frequencies): a
# state_dict keeps no mark of which entries are parameters, so without a model these names (and every integer or
# bool tensor, which a parameter cannot be) are counted as buffers.
BUFFER_NAMES = frozenset({"running_mean", "running_var", "num_batches_tracked", "inv_freq"})


def parameter_counts(ckpt: Checkpoint, model: Any = None) -> tuple[int, int]:
    """(parameters, buffer elements) of the state_dict, as `model.parameters()` and `model.buffers()` count them (one
    tensor under two names once): told apart by the model when one is given, by the pickle when it says (a whole
    pickled model's Parameters), else by BUFFER_NAMES and dtype. Both 0 where the file holds no state_dict (an
    optimizer's state alone, a lone tensor): its tensors are no model's (count_phrase says how many elements)."""
    from math import prod

    if ckpt.state_dict_root is None:
        return 0, 0
    table = TensorTable.of(ckpt.tensors)
    keys = table.keys
    chosen: Any = range(len(keys))  # positions of the state_dict's tensors (all of them when it holds none)
    root = ckpt.state_dict_root
    if root:
        prefix = root + "."
        under = [i for i, k in enumerate(keys) if k.startswith(prefix)]
        if under:
            chosen, cut = under, len(prefix)
            keys = [k[cut:] if k.startswith(prefix) else k for k in keys]
    named = {e.key: e.is_parameter for e in model.entries} if model is not None else None
    marks = table.is_parameter
    marked = marks is not None and (any(marks) if type(chosen) is range else any(marks[i] for i in chosen))
    shapes, dtypes = table.shapes, table.dtypes
    shares = table.shares_storages()  # else every tensor is counted: no two read the same bytes
    if shares:
        idents, offsets, strides = table.storage_idents(), table.offsets, table.strides
    floating: dict[str, bool] = {}
    if not shares and named is None and not marked:  # told by dtype and name alone, each tensor once: at once
        from itertools import compress
        from operator import gt, itemgetter, methodcaller

        if type(chosen) is list:
            keys, dtypes, shapes = [keys[i] for i in chosen], [dtypes[i] for i in chosen], [shapes[i] for i in chosen]
            ids = list(map(id, shapes))
            distinct = dict(zip(ids, shapes))
        else:
            ids, distinct = table.shape_kinds()
        floating = {dtype: dtype in FLOATING or dtype.startswith("complex") for dtype in set(dtypes)}
        # Each key's last component looked up only when a key may end in a buffer's name: a scan of the keys as one
        # text, each between line breaks (and when one holds a line break)
        joined = "\n" + "\n".join(keys) + "\n"
        if any(f".{name}\n" in joined or f"\n{name}\n" in joined for name in BUFFER_NAMES) or \
                joined.count("\n") != len(keys) + 1:
            last = map(itemgetter(2), map(methodcaller("rpartition", "."), keys))  # key.rsplit(".", 1)[-1]
            is_param = map(gt, map(floating.__getitem__, dtypes), map(BUFFER_NAMES.__contains__, last))
        elif len(floating) == 1:  # told by the one dtype alone: every tensor a parameter, or none
            is_param = None
        else:
            is_param = map(floating.__getitem__, dtypes)
        # a reader hands out one tuple a distinct shape: each multiplied out once
        numels = map({at: prod(shape) for at, shape in distinct.items()}.__getitem__, ids)
        if is_param is None:
            total = sum(numels)
            return (total, 0) if next(iter(floating.values())) else (0, total)
        numels = list(numels)
        params = sum(compress(numels, is_param))
        return params, sum(numels) - params
    seen: set[tuple] = set()
    params = buffers = 0
    for i in chosen:
        key = keys[i]
        if shares:
            ident = (idents[i], offsets[i], shapes[i], strides[i]) if idents[i] is not None else (key,)
            if ident in seen:
                continue
            seen.add(ident)
        if named is not None and key in named:
            is_param = named[key]
        elif marked:
            is_param = marks[i]
        else:
            dtype = dtypes[i]
            float_like = floating.get(dtype)
            if float_like is None:
                float_like = floating[dtype] = dtype in FLOATING or dtype.startswith("complex")
            is_param = float_like and key.rsplit(".", 1)[-1] not in BUFFER_NAMES
        if is_param:
            params += prod(shapes[i])
        else:
            buffers += prod(shapes[i])
    return params, buffers


def count_phrase(report: InspectReport) -> str:
    """`1,262 parameters + 10 in buffers`, or, where the file holds no state_dict, `1,262 elements (no state_dict)`."""
    if report.checkpoint.state_dict_root is None:
        from math import prod

        return f"{sum(prod(t.shape) for t in report.checkpoint.tensors):,} elements (no state_dict)"
    buffers = f" + {report.buffer_count:,} in buffers" if report.buffer_count else ""
    return f"{report.parameter_count:,} parameters{buffers}"


def value_differences(ckpt: Checkpoint, reference: str, *, policy: Policy = DEFAULT_POLICY) -> dict[str, float]:
    """max |a - b| for the tensors of both checkpoints of the same shape, paired by name as `diff` pairs them (the
    renames `--model` infers: a `module.` prefix, a nested state_dict), keyed by this checkpoint's names; read one
    pair at a time."""
    from .diff import compared_root, match_names, pair_stats  # diff, modelspec, tensordata (torch): only here
    from .modelspec import is_checkpoint_spec
    from .tensordata import load_tensor

    if not is_checkpoint_spec(reference):
        raise UsageError("--values needs a reference checkpoint as --model, not a model definition")
    other_ckpt = read_checkpoint(reference, policy=policy)
    mapping, _, root = match_names(ckpt, other_ckpt, reference, policy)
    mine = {t.key: t for t in relative_to_root(ckpt.tensors, root)}
    other = {t.key: t for t in relative_to_root(other_ckpt.tensors, compared_root(other_ckpt))}
    diffs: dict[str, float] = {}
    for key, other_key in mapping.items():
        t, o = mine.get(key), other.get(other_key)
        if t is None or o is None or o.shape != t.shape or t.dtype == "bool" or o.dtype == "bool":
            continue
        diffs[key] = pair_stats(load_tensor(t), load_tensor(o)).max_abs  # the one comparison `diff` makes too
    return diffs


def sibling_hazards(folder: Path, own: tuple[Path, ...], *, policy: Policy = DEFAULT_POLICY) -> list[Hazard]:
    """The other files of a model folder that would run code when loaded (a training_args.bin, an optimizer.pt),
    judged by scan's own per-file check: `inspect DIR` then agrees with `scan DIR` on them."""
    from .scan import scan_file

    mine = {_identity(p) for p in own} - {None}
    found: list[Hazard] = []
    for path in walk_folder(folder).files:
        if _identity(path) in mine:
            continue
        result = scan_file(path, in_folder=True, policy=policy)
        if result is not None and result.verdict is not Verdict.SAFE:
            names = [g.qualname for g in result.findings] + [h.what for h in result.hazards]
            found.append(Hazard(result.verdict, f"{path.relative_to(folder)} in the same folder would run code when "
                                                f"loaded: {', '.join(names[:3])}", beside=True))
    return found


def _identity(path: Path) -> tuple[int, int] | None:
    """Which file `path` is (device and inode, links followed): no path is resolved, so none is too long."""

    try:
        st = os.stat(deep(path))
    except OSError:
        return None
    return st.st_dev, st.st_ino
