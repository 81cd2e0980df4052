"""Builds the inspect report — everything `inspect` says about a checkpoint — as one frozen result object."""

from __future__ import annotations

from ._record import field, record, replace
from pathlib import Path

from .analyze import PrefixFinding, find_prefixes, parameter_count, shared_groups
from .errors import ReadError, SeveralCheckpoints, UsageError
from .readers import read_checkpoint
from .records import Checkpoint, Hazard, SharedGroup, TensorRecord, Verdict
from .devices import missing_devices

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any


@record
class InspectReport:
    checkpoint: Checkpoint
    tensors: tuple[TensorRecord, ...]  # after --filter
    prefixes: tuple[PrefixFinding, ...]
    shared: tuple[SharedGroup, ...]
    parameter_count: int
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

    @property
    def has_problems(self) -> bool:
        bad_values = bool(self.stats) and any(s is not None and (s.nan or s.inf) for s in self.stats.values())
        mismatch = self.comparison is not None and not self.comparison.ok
        unsafe = self.checkpoint.verdict is not Verdict.SAFE
        return unsafe or bad_values or bool(self.batchnorm_at_init) or mismatch


def inspect_checkpoint(path: str | Path, *, stats: bool = False, filter: str | None = None,
                       checkpoint: Checkpoint | None = None, model: str | None = None,
                       model_args: dict[str, Any] | None = None, allow_missing: str | None = None,
                       allow_unexpected: str | None = None, min_loaded: float | None = None,
                       values: bool = False, select: str | None = None) -> InspectReport:
    """What `inspect` reports; with `model`, also the comparison with that model (or reference checkpoint)."""
    folder = checkpoint is None and Path(path).is_dir()
    try:
        ckpt = checkpoint or read_checkpoint(path)
    except SeveralCheckpoints:
        raise  # `inspect` lists them; for anything else, the message says which to name
    except ReadError as exc:
        if not folder or exc.findings:
            raise
        # Which checkpoint to open is unclear, but what the folder's files would run is not: say it (exit 1).
        found = sibling_hazards(Path(path), ())
        if found:
            raise ReadError(f"{exc} — and files in it would run code: "
                            + "; ".join(h.what for h in found[:3]), tuple(h.what for h in found)) from None
        raise
    if folder:
        ckpt = replace(ckpt, hazards=ckpt.hazards + tuple(sibling_hazards(Path(path), ckpt.files)))
    comparison = None
    model_shapes: dict[str, tuple] = {}
    diffs = None
    if model is not None:
        from .compare import compare_checkpoint
        from .modelspec import keys_from_spec

        from .transforms import compile_regex

        for flag, pattern in (("--allow-missing", allow_missing), ("--allow-unexpected", allow_unexpected)):
            if pattern:
                compile_regex(pattern, flag)
        keys = keys_from_spec(model, model_args)
        model_shapes = {e.key: e.shape for e in keys.entries}
        if select is not None and not any(t.key.startswith(select + ".") for t in ckpt.tensors):
            raise UsageError(f"--select {select!r} holds no tensors in {ckpt.path}")
        comparison = compare_checkpoint(ckpt, keys, select=select, allow_missing=allow_missing,
                                        allow_unexpected=allow_unexpected, min_loaded=min_loaded)
        if values:
            diffs = value_differences(ckpt, model)
    elif values:
        raise UsageError("--values compares with a reference checkpoint: give one with --model OTHER_CKPT")
    tensors = ckpt.tensors
    if filter:
        from .transforms import compile_regex

        pattern = compile_regex(filter, "--filter")
        tensors = tuple(t for t in tensors if pattern.search(t.key))
    root_keys = [t.key for t in ckpt.state_dict_tensors()]
    table_stats = None
    bn: list[str] = []
    if stats:
        from .stats import batchnorm_at_init, tensor_stats

        table_stats = {t.key: tensor_stats(t) for t in tensors}
        bn = batchnorm_at_init(list(tensors), table_stats)
    storages = {t.storage.ident: t.storage.nbytes for t in ckpt.tensors if t.storage is not None}
    return InspectReport(
        checkpoint=ckpt, tensors=tensors, prefixes=tuple(find_prefixes(root_keys, list(model_shapes) or None)),
        shared=tuple(shared_groups(ckpt.tensors)), parameter_count=parameter_count(ckpt),
        total_bytes=sum(storages.values()), storage_count=len(storages),
        stats=table_stats, batchnorm_at_init=tuple(bn), filter=filter, comparison=comparison,
        model_shapes=model_shapes, value_diffs=diffs, missing_devices=tuple(missing_devices(ckpt.devices)))


def value_differences(ckpt: Checkpoint, reference: str) -> dict[str, float]:
    """max |a - b| for tensors present in both checkpoints with the same shape (read one pair at a time)."""
    from .diff import pair_stats
    from .modelspec import is_checkpoint_spec
    from .tensordata import load_tensor

    if not is_checkpoint_spec(reference):
        raise UsageError("--values needs a reference checkpoint as --model, not a model definition")
    other = {t.key: t for t in read_checkpoint(reference).state_dict_tensors()}
    diffs: dict[str, float] = {}
    for t in ckpt.state_dict_tensors():
        o = other.get(t.key)
        if o is None or o.shape != t.shape or t.dtype == "bool" or o.dtype == "bool":
            continue
        diffs[t.key] = pair_stats(load_tensor(t), load_tensor(o)).max_abs  # the one comparison `diff` makes too
    return diffs


def sibling_hazards(folder: Path, own: tuple[Path, ...]) -> list[Hazard]:
    """The other files of a model folder that would run code when loaded (a training_args.bin, an optimizer.pt),
    judged by scan's own per-file check: `inspect DIR` then agrees with `scan DIR` on them."""
    from .scan import scan_file
    from .sniff import folder_files

    mine = {p.resolve() for p in own}
    found: list[Hazard] = []
    for path in folder_files(folder)[0]:
        if path.resolve() in mine:
            continue
        result = scan_file(path, in_folder=True)
        if result is not None and result.verdict is not Verdict.SAFE:
            names = [g.qualname for g in result.findings] + [h.what for h in result.hazards]
            found.append(Hazard(result.verdict, f"{path.relative_to(folder)} in the same folder would run code when "
                                                f"loaded: {', '.join(names[:3])}"))
    return found
