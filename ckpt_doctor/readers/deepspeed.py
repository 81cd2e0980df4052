"""DeepSpeed ZeRO checkpoint folders, consolidated as DeepSpeed's own `zero_to_fp32.py` does — without deepspeed.

A save folder holds `latest` (the tag) and `<tag>/`: `mp_rank_00_model_states.pt` (ZeRO-1/2) or one
`zero_pp_rank_R_mp_rank_00_model_states.pt` per rank (ZeRO-3), and one `*_optim_states.pt` per rank. Every file is
read by this tool's own readers (nothing deepspeed pickled is imported; its enum and loss-scaler records are inert):
every pickle walked for what it would import; unpickled, the optimizer states and rank 0's model states (ZeRO-3's
other ranks' list the same parameters again: they are unpickled, in forked processes, only for their fragments of
frozen parameters).

The fp32 master weights are rebuilt as zero_to_fp32 does, each parameter an Assembly of slices of the ranks' flat
partitions (streamed by `fix`, never concatenated in memory):
- ZeRO-1/2: per param group, the ranks' `single_partition_of_fp32_groups[g]` laid end to end; the group's
  `param_shapes` taken in order, `numel` each (plus `param_alignment_paddings` when saved); the total must match to
  within the 2 × world-size alignment, as zero_to_fp32 checks.
- ZeRO-3: each parameter is `ceil(numel / ws)` elements of every rank's `fp32_flat_groups` (concatenated over
  sub-groups), at the same offset on every rank; the ranks' slices laid end to end and cut to `numel`.
Then buffers (from rank 0's `module`, floating ones as float32 as zero_to_fp32 does), frozen parameters, and
`shared_params` aliases as the same tensor (tied in a torch output).
"""

from __future__ import annotations

import functools
import os
import re
import stat
from collections import OrderedDict
from itertools import islice
from ..advice import Promise, Suggestion, consolidate, shell_path
from .._record import replace
from math import prod
from pathlib import Path
from typing import Any

from ..dtypes import element_size
from ..errors import CkptDoctorError, ReadError
from ..pool import map_paths
from ..records import (
    Assembly,
    Checkpoint,
    DeepSpeedFolder,
    DistributedShard,
    Format,
    LazyAssembly,
    Piece,
    fast_new,
)
from ..safepickle.policy import DEFAULT_POLICY, Policy
from ..safepickle.unpickler import Opaque, RawTensor
from ._pickled import assembled_tensor, build_checkpoint
from .files import read_file
from .source import (RemoteError, RemotePath, close_source, exists, list_folder, open_source, pread, real_url,
                     remote_path)
from .survey import survey_file

MODEL_STATES = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
OPTIM_STATES = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
FP32 = "fp32_weights"


def find_tag_folder(folder: Path, names: list[str]) -> Path | None:
    """The folder holding a DeepSpeed checkpoint's rank files: `folder` itself, or the one `latest` names."""
    if any(MODEL_STATES.fullmatch(n) for n in names):
        return folder
    if "latest" in names and (folder / "latest").is_file():
        tag = read_tag(folder / "latest")
        if tag is None:
            return None
        if (folder / tag).is_dir():
            return folder / tag
        raise ReadError(f"{folder}/latest names the tag {tag!r}, but there is no folder {folder / tag}: the "
                        "checkpoint is incomplete")
    return None


def read_tag(latest: Path) -> str | None:
    """The tag a `latest` file names (a local file or a URL's object: its first 257 bytes, no more); None when its
    bytes are no text (not DeepSpeed's `latest`)."""
    src = open_source(latest)
    try:
        raw = pread(src, 257, 0)  # a tag is a short name; nothing longer is read
    finally:
        close_source(src)
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    if not tag or len(raw) > 256 or not tag.isprintable() or "/" in tag or "\\" in tag or tag in (".", ".."):
        raise ReadError(f"{latest.parent}/latest names {tag[:60]!r}, not a tag folder beside it")
    return tag


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _get(tree: Any, *path: Any, what: str, where: Path) -> Any:
    for key in path:
        if not isinstance(tree, (dict, list)) or (key not in tree if isinstance(tree, dict)
                                                  else type(key) is not int or key >= len(tree)):
            raise ReadError(f"{where}: not a DeepSpeed ZeRO file: no {what}")
        tree = tree[key]
    return tree


def _stage(value: Any) -> int | None:
    if isinstance(value, Opaque) and value.ckd.args and type(value.ckd.args[0]) is int:
        return value.ckd.args[0]  # ZeroStageEnum(2), never called
    return value if type(value) is int else None


def _flat(raw: Any, what: str, where: Path) -> tuple[Path, int, int, str]:
    """(file, byte offset of element 0, numel, dtype) of a 1-D contiguous partition tensor."""
    if not isinstance(raw, RawTensor) or raw.storage is None or raw.storage.resolved is None:
        raise ReadError(f"{where}: {what} is not a tensor saved in the file")
    if len(raw.shape) != 1 or raw.shape[0] and raw.stride != (1,):
        raise ReadError(f"{where}: {what} is not a flat (1-D, contiguous) partition")
    st = raw.storage.resolved
    _stored(st, what, where)
    return st.file, st.offset + raw.offset * element_size(raw.dtype), raw.shape[0], raw.dtype


def _stored(st: Any, what: str, where: Path) -> None:
    """Pieces are read in place: a storage deflated in a re-zipped file (which DeepSpeed never writes) is refused."""
    if st.deflated:
        raise ReadError(f"{where}: {what} is a compressed (deflated) zip member, which DeepSpeed never writes and "
                        "ckpt-doctor does not assemble from; load the file with torch.load and torch.save it again")


def _one_dtype(dtypes: list[str], what: str) -> str:
    """The partitions' dtype: one for all (a tensor's pieces are read at one element size)."""
    if len(set(dtypes)) > 1:
        raise ReadError(f"{what}: partitions in {', '.join(sorted(set(dtypes)))} where all should share one dtype "
                        "(the checkpoint is corrupt or was tampered with)")
    return dtypes[0] if dtypes else "float32"


class _Partitions:
    """One rank's flat vectors (a group's partition, or ZeRO-3's sub-groups end to end) as one virtual vector."""

    def __init__(self, parts: list[tuple[Path, int, int, str]], label: str) -> None:
        self.parts, self.label = parts, label
        self.length = sum(p[2] for p in parts)
        self.dtype = _one_dtype([p[3] for p in parts], label)
        self.size = element_size(self.dtype)

    def pieces(self, start: int, count: int, at: int) -> list[Piece]:
        """Pieces covering [start, start + count) of the vector, placed from `at` in the output's flat grid. (Made
        without binding arguments, fast_new: a ZeRO-3 folder of R ranks makes R pieces per parameter, per weight
        and per optimizer state.)"""
        out = []
        base, end, size, label = 0, start + count, self.size, self.label
        for file, offset, numel, _ in self.parts:
            top = base + numel
            if base >= end:
                break
            lo, hi = max(start, base), min(end, top)
            if lo < hi:
                out.append(fast_new(Piece, file=file, offset=offset + (lo - base) * size, offsets=(at + lo - start,),
                                    sizes=(hi - lo,), stride=_UNIT, label=f"{label} elements {lo:,}-{hi:,}",
                                    crc=None))
            base = top
        return out


_UNIT = (1,)


def _tensor(key: str, shape: tuple[int, ...], dtype: str, pieces: list[Piece] | tuple, source: Path) -> RawTensor:
    """A parameter of `shape` assembled from flat pieces of `dtype` (the partitions' own); `pieces` a list, or the
    (ranks, offset, numel, world) of a ZeRO-3 parameter, its pieces cut when first asked for (LazyAssembly)."""
    if isinstance(pieces, tuple):
        assembly = fast_new(LazyAssembly, grid=(prod(shape),), dtype=dtype, cut=(_zero3_pieces, pieces))
    else:
        assembly = fast_new(Assembly, grid=(prod(shape),), pieces=tuple(pieces), dtype=dtype)
    return assembled_tensor(key, dtype, shape, assembly, source)


def _as_float32(key: str, raw: RawTensor, source: Path) -> RawTensor:
    """A floating buffer saved in 16 bits, read as float32 (zero_to_fp32 calls .float() on it)."""
    if raw.dtype not in ("float16", "bfloat16") or raw.storage is None or raw.storage.resolved is None:
        return raw
    st = raw.storage.resolved
    _stored(st, key, st.file)
    piece = Piece(st.file, st.offset + raw.offset * element_size(raw.dtype), (0,) * len(raw.shape), raw.shape,
                  raw.stride, f"{key} in {st.file.name}")
    return assembled_tensor(key, "float32", raw.shape, Assembly(raw.shape, (piece,), raw.dtype), source,
                            record_key=f"{key} (float32)")


def _shape(value: Any, name: str, where: Path) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise ReadError(f"{where}: the shape of {name} is not a list of sizes")
    return tuple(value)


def read_deepspeed(folder: Path, tag_dir: Path, names: list[str] | None = None, shown: Path | None = None, *,
                   policy: Policy = DEFAULT_POLICY) -> Checkpoint:
    """The DeepSpeed checkpoint in `tag_dir` (`folder`: the save folder as named, or the tag folder itself). `names`:
    the tag folder's files (listed here when None); behind a URL, the objects of its s3:// prefix, or the names
    derived from rank 0's model states (remote_names). `shown`: how commands name it, when not by `folder` (an
    https:// folder by the URL of its `latest` or rank 0's model states: HTTP lists no folder)."""
    remote = isinstance(tag_dir, RemotePath)
    names = sorted(os.listdir(tag_dir) if names is None else names, key=_natural)
    model_files = [tag_dir / n for n in names if MODEL_STATES.fullmatch(n)]
    optim_files = [tag_dir / n for n in names if OPTIM_STATES.fullmatch(n)]
    if not model_files:
        raise ReadError(f"{tag_dir}: no *_model_states.pt: not a DeepSpeed checkpoint folder, or an incomplete one")
    for p in [*model_files, *optim_files] if not remote else ():  # a pipe would block the open
        try:
            mode = os.stat(p).st_mode
        except OSError as exc:
            raise ReadError(f"{p}: cannot be read ({exc.strerror})") from None
        if not stat.S_ISREG(mode):
            raise ReadError(f"{p}: not a regular file (a device, a pipe or a folder)")
    first = model_files[0]
    read0 = _read_rank_file(first, tag_dir, policy)
    m0 = read0.root
    if not isinstance(m0, dict) or "buffer_names" not in m0:
        raise ReadError(f"{first}: not a DeepSpeed model-states file (no buffer_names)")
    # Only rank 0's model states are unpickled unless frozen parameters are saved (ZeRO-3 keeps a fragment of each
    # in every rank's file): the others (ZeRO-3 writes one per rank, each listing every parameter) are walked, or
    # read for their fragments, in forked processes (pool.py) when the files are local; one whose walk or read finds
    # anything is read again here, as every file was, and fails or is reported as it was.
    whole = bool(m0.get("frozen_param_shapes"))
    frozen = m0.get("frozen_param_shapes") or {}
    rest = model_files[1:]
    work = functools.partial(_walk_rank_file, policy=policy,
                             frozen=(tuple(frozen) if isinstance(frozen, dict) else ()) if whole else None)
    walked = [work(p) for p in rest] if remote else map_paths(work, rest)
    ckpts: dict[Path, Checkpoint | _Walked] = {first: read0}
    for p, w in zip(rest, walked):
        ckpts[p] = w if w is not None else _read_rank_file(p, tag_dir, policy)
    for p in optim_files:
        ckpts[p] = _read_rank_file(p, tag_dir, policy)
    module = _get(m0, "module", what="module", where=first)
    buffer_names = _get(m0, "buffer_names", what="buffer_names", where=first)
    param_shapes = _get(m0, "param_shapes", what="param_shapes", where=first)
    if isinstance(param_shapes, dict):
        param_shapes = [param_shapes]
    if not isinstance(param_shapes, list) or not all(isinstance(shapes, dict) for shapes in param_shapes):
        raise ReadError(f"{first}: param_shapes is not a list of {{name: shape}} per param group")
    stage = None
    world = 1
    optims = [ckpts[p].root for p in optim_files]
    if optims:
        osd = _get(optims[0], "optimizer_state_dict", what="optimizer_state_dict", where=optim_files[0])
        stage = _stage(osd.get("zero_stage")) if isinstance(osd, dict) else None
        count = osd.get("partition_count") if isinstance(osd, dict) else None
        if not (isinstance(count, list) and all(type(c) is int for c in count) or count is None or type(count) is int):
            raise ReadError(f"{optim_files[0]}: partition_count is {str(count)[:60]}, not a number of ranks")
        world = max(count) if isinstance(count, list) and count else count if type(count) is int else len(optims)
        if stage is None:
            raise ReadError(f"{optim_files[0]}: no zero_stage in its optimizer_state_dict: not a ZeRO checkpoint")
        ranks = {int(m.group(1)) for n in names if (m := OPTIM_STATES.fullmatch(n))}
        missing = list(islice((r for r in range(world) if r not in ranks), 4))  # (a count of 10**12: not a list)
        if missing or len(optims) != world:
            shown = ", ".join(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in missing) or \
                f"{len(optims)} files for {world} ranks"
            raise ReadError(f"{tag_dir}: the optimizer states of {world} ranks are needed, missing: {shown}: the "
                            "checkpoint is incomplete")
    if stage == 3 and len(model_files) != world:
        raise ReadError(f"{tag_dir}: ZeRO-3 needs a model-states file per rank ({world}), found {len(model_files)}")

    state: OrderedDict[str, Any] = OrderedDict()
    layouts: dict[str, str] = {}
    for name in buffer_names if isinstance(buffer_names, list) else []:
        raw = module.get(name) if isinstance(module, dict) and isinstance(name, str) else None
        if isinstance(raw, RawTensor):
            state[name] = _as_float32(name, raw, first)
    # each rank's frozen_param_fragments, or the fragments a worker read of it (_Walked.fragments)
    fragments = [c.fragments if isinstance(c, _Walked) else c.root.get("frozen_param_fragments") or {}
                 for c in (ckpts[p] for p in model_files)] if whole else [m0.get("frozen_param_fragments") or {}]
    for name, shape in frozen.items() if isinstance(frozen, dict) else []:
        shape = _shape(shape, name, first)
        if stage == 3:
            parts = [_Partitions([f[name] if isinstance(f, _Fragments) else
                                  _flat(_get(f, name, what=f"frozen fragment {name}", where=p), name, p)], p.name)
                     for f, p in zip(fragments, model_files)]
            numel, chunk = prod(shape), -(-prod(shape) // world)
            pieces = _zero3_pieces(parts, 0, numel, world)
            state[name] = _tensor(f"{FP32}.{name}", shape, _one_dtype([p.dtype for p in parts], name), pieces, first)
            layouts[f"{FP32}.{name}"] = f"ZeRO-3 frozen, {world} ranks × {chunk:,}"
        else:
            state[name] = _get(fragments[0], name, what=f"frozen fragment {name}", where=first)
    slots: list[tuple[int, str, tuple[int, ...], int, int]] = []  # (group, name, shape, offset, numel)
    if stage in (1, 2):
        key = "single_partition_of_fp32_groups"
        per_rank = [_get(o, "optimizer_state_dict", key, what=key, where=p) for o, p in zip(optims, optim_files)]
        paddings = optims[0]["optimizer_state_dict"].get("param_alignment_paddings")
        for g, shapes in enumerate(param_shapes):
            parts = [(_flat(_get(pr, g, what=f"{key}[{g}]", where=p), f"{key}[{g}]", p), p)
                     for pr, p in zip(per_rank, optim_files)]
            ranks = [_Partitions([part], f"{p.name} {key}[{g}]") for part, p in parts]
            group = _Concat(ranks)
            dtype = _one_dtype([r.dtype for r in ranks], f"{tag_dir}: {key}[{g}]")
            offset = 0
            pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
            if paddings is not None and not (isinstance(pads, list) and len(pads) == len(shapes)
                                             and all(type(x) is int and x >= 0 for x in pads)):
                raise ReadError(f"{optim_files[0]}: param_alignment_paddings of group {g} should be {len(shapes)} "
                                "sizes, one per parameter (as zero_to_fp32 requires)")
            for j, (name, shape) in enumerate(shapes.items()):
                shape = _shape(shape, name, first)
                numel = prod(shape)
                state[name] = _tensor(f"{FP32}.{name}", shape, dtype, group.pieces(offset, numel), first)
                layouts[f"{FP32}.{name}"] = f"ZeRO-{stage} flat partitions of group {g}, {world} ranks"
                slots.append((g, name, shape, offset, numel))
                offset += numel + (pads[j] if pads is not None else 0)
            align = 2 * world
            if -(-offset // align) != -(-group.length // align):
                raise ReadError(f"{tag_dir}: param group {g} takes {offset:,} elements of the {group.length:,} its "
                                "partitions hold: the checkpoint does not match its param_shapes")
    elif stage == 3:
        key = "fp32_flat_groups"
        ranks = []
        for o, p in zip(optims, optim_files):
            groups = _get(o, "optimizer_state_dict", key, what=key, where=p)
            if not isinstance(groups, list):
                raise ReadError(f"{p}: {key} is not a list of flat partitions")
            ranks.append(_Partitions([_flat(t, f"{key}[{i}]", p) for i, t in enumerate(groups)], f"{p.name} {key}"))
        dtype = _one_dtype([r.dtype for r in ranks], f"{tag_dir}: {key}")
        offset = 0
        merged = OrderedDict((n, s) for shapes in param_shapes for n, s in shapes.items())
        for name, shape in merged.items():
            shape = _shape(shape, name, first)
            numel = prod(shape)
            chunk = -(-numel // world)
            state[name] = _tensor(f"{FP32}.{name}", shape, dtype, (ranks, offset, numel, world), first)
            slots.append((0, name, shape, offset, numel))
            pad = chunk * world - numel
            layouts[f"{FP32}.{name}"] = f"ZeRO-3 partitions, {world} ranks × {chunk:,}" + (f" ({pad} padding)"
                                                                                         if pad else "")
            offset += chunk
        if offset != ranks[0].length:
            raise ReadError(f"{tag_dir}: the parameters take {offset:,} elements of each rank's {ranks[0].length:,}: "
                            "the checkpoint does not match its param_shapes")
    shared = m0.get("shared_params") or {}
    for alias, owner in shared.items() if isinstance(shared, dict) else []:
        if isinstance(owner, str) and owner in state:
            state[alias] = state[owner]
    recovered = []
    if stage in (1, 2) and isinstance(module, dict):
        # Parameters no optimizer partition holds and no frozen_param_shapes lists (ZeRO-1 saves none of its frozen
        # parameters): zero_to_fp32 leaves them out, and a strict load then fails. `module` holds them whole.
        for name, raw in module.items():
            if name not in state and isinstance(raw, RawTensor) and name not in shared:
                state[name] = raw
                recovered.append(name)
    root: OrderedDict[str, Any] = OrderedDict()
    offered = []
    optimizer = _optimizer_state(stage, world, optims, optim_files, slots, param_shapes, first) if optims else None
    if stage is not None:
        root[FP32] = state
        offered.append(f"{FP32}: the fp32 master weights rebuilt from the optimizer partitions (what zero_to_fp32 "
                       "writes; the default)")
    if optimizer is not None:
        root["optimizer"] = optimizer
        offered.append("optimizer: the optimizer's state per parameter, keyed by name (exp_avg, exp_avg_sq, step), "
                       "rebuilt from the partitions like the weights: --select optimizer")
    if stage != 3 and isinstance(module, dict):
        root["module"] = module
        offered.append("module: the weights the engine held, as saved (16-bit in fp16/bf16 training): --select "
                       "module")
    for k, v in m0.items():
        if k not in ("module", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
                     "shared_params", "buffer_names") and not isinstance(v, RawTensor):
            root.setdefault(k, v)
    if stage is not None:
        root["zero_stage"] = stage
    what = f"ZeRO-{stage}" if stage is not None else "without ZeRO optimizer states"
    notes = (f"DeepSpeed checkpoint {what} (tag {tag_dir.name}, {world} ranks, {len(ckpts)} files); "
             + "; ".join(offered),)
    if recovered:
        notes += (f"{len(recovered)} parameters no optimizer partition holds ({', '.join(recovered[:4])}"
                  f"{', …' if len(recovered) > 4 else ''}: frozen ones) are taken from module as saved; "
                  "zero_to_fp32 leaves them out and a strict load of its output fails",)
    ckpt = build_checkpoint(folder, Format.DEEPSPEED, root, [], notes=notes,
                            extra_bytes=sum(c.length if isinstance(c, _Walked) else len(c.tensors) * 64
                                            for c in ckpts.values()) + (1 << 16))
    globals_ = tuple({(g.module, g.name): g for c in ckpts.values() for g in c.globals}.values())
    return replace(ckpt, path=shown or ckpt.path, globals=globals_,
                   hazards=tuple(h for c in ckpts.values() for h in c.hazards),
                   state_dict_root=FP32 if stage is not None else ckpt.state_dict_root,
                   other_state_dicts=tuple(o for o in (*ckpt.other_state_dicts, ckpt.state_dict_root)
                                           if o and (stage is None or o != FP32)),
                   files=tuple(ckpts), layouts=layouts,
                   distributed=DeepSpeedFolder(stage, world, tag_dir.name, len(ckpts),
                                               tuple(o.split(":")[0] for o in offered), tuple(notes[1:])))


def _read_rank_file(path: Path, tag_dir: Path, policy: Policy) -> Checkpoint:
    """One rank's file, read by the file readers; one the server does not have is the folder's missing file."""
    try:
        return read_file(path, policy=policy)
    except RemoteError as exc:
        if "not found (404)" not in str(exc):
            raise
        raise ReadError(f"{tag_dir}: {path.name} is missing (not found (404)): the checkpoint is incomplete") from None


class _Fragments(dict):
    """A rank's frozen fragments as a worker read them: name -> _flat's (file, offset, numel, dtype)."""


class _Walked:
    """A rank's model states as a worker read them (_walk_rank_file): what the folder takes of the file."""

    __slots__ = ("fragments", "globals", "hazards", "length")

    def __init__(self, globals_: tuple, hazards: tuple, length: int, fragments: _Fragments | None = None) -> None:
        self.globals, self.hazards, self.length, self.fragments = globals_, hazards, length, fragments


def _walk_rank_file(path: Path, *, policy: Policy, frozen: tuple[str, ...] | None) -> _Walked | None:
    """A rank's model states beside rank 0's, which say all the folder needs but its frozen parameters (`frozen`:
    their names, when any are saved). Without: its pickles walked as any file's are (their globals the folder's),
    not unpickled. With: the file read whole and each frozen parameter's fragment taken as a flat partition. None
    — the file is then read again by the caller, as every file was, and fails or is reported as it was — when the
    walk finds anything (a global off the allow-list, a hazard, a note, a pickle that breaks off or is refused, an
    archive torch cannot read), a fragment is not a flat partition, or the file cannot be read."""
    if frozen is not None:
        try:
            ckpt = read_file(path, policy=policy)
            fragments = ckpt.root.get("frozen_param_fragments") or {}
            flats = _Fragments((name, _flat(_get(fragments, name, what=f"frozen fragment {name}", where=path),
                                            name, path)) for name in frozen)
        except (CkptDoctorError, AttributeError):  # (a root that is no dict: read again, it fails as it did)
            return None
        return _Walked(ckpt.globals, ckpt.hazards, len(ckpt.tensors) * 64, flats)
    try:
        survey = survey_file(path, policy=policy)
    except CkptDoctorError:
        return None
    index = survey.zip
    if survey.findings or survey.hazards or survey.notes or survey.refused or survey.broken or survey.items \
            or survey.zip_error is not None or index is None or index.torch_problem or survey.main_pickle is None:
        return None
    # every global it names is allowed; each named as a read names it (by its pickle: read_surveyed)
    return _Walked(tuple(replace(g, source=g.source.rsplit(" at byte ", 1)[0]) for g in survey.globals), (),
                   len(survey.main_pickle))


def _subgroup_at(offset: int, per_key: dict[str, Any], groups: list[int]) -> int:
    """ZeRO-3: the sub-group whose flat partition holds a parameter's first element (its `step` is that group's)."""
    if not per_key or not groups:
        return groups[0] if groups else 0
    base = 0
    for g, part in zip(groups, next(iter(per_key.values()))[0].parts):
        if offset < base + part[2]:
            return g
        base += part[2]
    return groups[-1]


def _optimizer_state(stage: int | None, world: int, optims: list, files: list[Path], slots: list,
                     param_shapes: list, source: Path) -> dict | None:
    """The optimizer's state as torch's name-keyed optimizer state_dicts hold it (FSDP's get_optimizer_state_dict
    does the same): every per-element state (exp_avg, exp_avg_sq) cut from the ranks' partitions exactly as the
    fp32 weights are, each 0-d state (step) shared by the parameters of its group."""
    if stage in (1, 2):
        where = ("optimizer_state_dict", "base_optimizer_state")
    elif stage == 3:
        where = ("optimizer_state_dict", "optimizer_state_dict")
    else:
        return None
    bases = [_get(o, *where, what="the optimizer's state_dict", where=p) for o, p in zip(optims, files)]
    states = [_get(b, "state", what="optimizer state", where=p) for b, p in zip(bases, files)]
    groups = sorted(k for k in states[0] if type(k) is int) if isinstance(states[0], dict) else []
    per_key: dict[str, Any] = {}  # key -> _Concat (ZeRO-1/2: by group) or per-rank _Partitions (ZeRO-3)
    scalars: dict[tuple[int, str], Any] = {}
    state0 = _get(states[0], groups[0], what=f"state[{groups[0]}]", where=files[0]) if groups else {}
    if not isinstance(state0, dict):
        raise ReadError(f"{files[0]}: the optimizer's state[{groups[0]}] is not a dict of its states")
    for key, value in state0.items():
        if isinstance(value, RawTensor) and value.shape == ():
            for g in groups:
                scalars[(g, key)] = _get(states[0], g, key, what=f"state[{g}].{key}", where=files[0])
            continue
        if not isinstance(value, RawTensor):
            continue
        ranks = [_Partitions([_flat(_get(st, g, key, what=f"state[{g}].{key}", where=p), f"state[{g}].{key}", p)
                              for g in groups], f"{p.name} state.{key}") for st, p in zip(states, files)]
        per_key[key] = ranks
    out: OrderedDict[str, Any] = OrderedDict()
    dtypes = {key: _one_dtype([r.dtype for r in ranks], f"{files[0].parent}: optimizer state {key}")
              for key, ranks in per_key.items()} if slots else {}
    concats: dict[tuple[str, int], _Concat] = {}  # ZeRO-1/2: (key, group) -> the ranks' partitions end to end
    for g, name, shape, offset, numel in slots:
        entry: OrderedDict[str, Any] = OrderedDict()
        for key, ranks in per_key.items():
            if stage == 3:
                pieces = (ranks, offset, numel, world)
            else:
                group = concats.get((key, g))
                if group is None:
                    group = concats[(key, g)] = _Concat([_Partitions([part.parts[g]], part.label) for part in ranks])
                pieces = group.pieces(offset, numel)
            entry[key] = _tensor(f"optimizer.state.{name}.{key}", shape, dtypes[key], pieces, source)
        own = g if stage != 3 else _subgroup_at(offset, per_key, groups)
        for (sg, key), value in scalars.items():
            if sg == own:
                entry.setdefault(key, value)
        out[name] = entry
    names_by_group = [list(shapes) for shapes in param_shapes]
    param_groups = []
    listed = _get(bases[0], "param_groups", what="param_groups", where=files[0])
    for i, group in enumerate(listed if isinstance(listed, list) else []):
        if isinstance(group, dict):
            copy = {k: v for k, v in group.items() if k != "params"}
            copy["params"] = names_by_group[i] if i < len(names_by_group) else []
            param_groups.append(copy)
    return {"state": out, "param_groups": param_groups}


def _zero3_pieces(ranks: list[_Partitions], offset: int, numel: int, world: int) -> list[Piece]:
    """A ZeRO-3 parameter of `numel` elements from `offset` of every rank's partitions: rank r holds its elements
    r × chunk to (r + 1) × chunk, chunk = ceil(numel / world), the last ones padding."""
    chunk = -(-numel // world)  # (in ints: a float quotient overflows, or rounds, past 2**53)
    return [pc for r, part in enumerate(ranks)
            for pc in part.pieces(offset, max(0, min(chunk, numel - r * chunk)), r * chunk)]


class _Concat:
    """The ranks' partitions of one ZeRO-1/2 param group, end to end: rank 0's, then rank 1's, …"""

    def __init__(self, ranks: list[_Partitions]) -> None:
        self.ranks = ranks
        self.length = sum(r.length for r in ranks)

    def pieces(self, start: int, count: int) -> list[Piece]:
        out, base = [], 0
        for rank in self.ranks:
            lo, hi = max(start, base), min(start + count, base + rank.length)
            if lo < hi:
                out += rank.pieces(lo - base, hi - lo, lo - start)
            base += rank.length
        if start + count > self.length:
            raise ReadError(f"{self.ranks[0].label}: the parameters need elements up to {start + count:,}, the ranks' "
                            f"partitions hold {self.length:,}: the checkpoint does not match its param_shapes")
        return out


MAX_RANKS = 1 << 16  # files named from a model-states file's dp_world_size over HTTP: no more than this many


def names_folder(url: str) -> bool:
    """Whether a URL names a DeepSpeed folder by one of its files (HTTP lists no folder): its save folder's
    `latest`, or its tag folder's rank-0 model states (`mp_rank_00_model_states.pt`, ZeRO-3's
    `zero_pp_rank_0_mp_rank_00_model_states.pt`)."""
    name = url.split("#", 1)[0].split("?", 1)[0].rsplit("/", 1)[-1]
    found = MODEL_STATES.fullmatch(name)
    return name == "latest" or bool(found) and found.group(1) in (None, "0") and found.group(2) == "00"


def read_remote_deepspeed(url: str, names: list[str] | None = None, *, policy: Policy = DEFAULT_POLICY
                          ) -> Checkpoint:
    """A DeepSpeed folder behind URLs, read as a local one is (the same reader, walker and limits), by range
    requests: each rank file's pickles, never its tensor data. `names`: the objects of an s3:// prefix, listed once
    (the save folder: its tag's prefix listed too). None for the URL of the save folder's `latest` or of the tag
    folder's rank-0 model states (names_folder): its folder listed on S3, the other files' names derived from it
    over HTTP (remote_names); that URL is the checkpoint's path, so that the commands printed for it run as
    printed."""
    if names is not None:
        folder = remote_path(url.split("#", 1)[0].split("?", 1)[0].rstrip("/"))
        tag_dir, names = _listed_tag(folder, names)
        return read_deepspeed(folder, tag_dir, names, policy=policy)
    shown, tag_dir, names = _named_files(url, policy)
    return read_deepspeed(tag_dir, tag_dir, names, shown, policy=policy)


def remote_deepspeed_members(url: str, *, policy: Policy = DEFAULT_POLICY) -> list[Path]:
    """What `scan` of the URL of a DeepSpeed folder's `latest` or rank-0 model states reads: that object and every
    file of its tag folder. Files that cannot be named give the URL alone: it is scanned."""
    shown = remote_path(url)
    try:
        _, tag_dir, names = _named_files(url, policy)
    except ReadError:
        return [shown]
    return [shown, *sorted((tag_dir / n for n in names if str(tag_dir / n) != str(shown)), key=str)]


def _named_files(url: str, policy: Policy) -> tuple[Path, Path, list[str]]:
    """(the URL as the checkpoint's path, its tag folder, the tag folder's files) for the URL of a `latest` or of
    rank 0's model states: on S3 its folder listed (and the tag's, for a `latest`); over HTTP, which lists no
    folder, the names derived from rank 0's model states (remote_names)."""
    if url.startswith("s3://"):
        shown = remote_path(url)  # (its query kept: a presigned URL of that object)
        folder = remote_path(url.split("#", 1)[0].split("?", 1)[0].rsplit("/", 1)[0])
        listed = list_folder(real_url(folder) + "/")
        if shown.name not in listed:
            raise ReadError(f"{shown}: not found (404): not a DeepSpeed folder, or an incomplete one")
        return (shown, *_listed_tag(folder, listed))
    shown, tag_dir, first = _named_by(url)
    return shown, tag_dir, remote_names(tag_dir, first, policy)


def _listed_tag(folder: Path, names: list[str]) -> tuple[Path, list[str]]:
    """The tag folder of an s3:// folder listed as `names`, and its objects: the folder itself when it holds model
    states, else the tag its `latest` names (whose prefix is listed: S3 lists one level)."""
    if any(MODEL_STATES.fullmatch(n) for n in names):
        return folder, names
    tag_dir = _remote_tag(folder, folder / "latest")
    return tag_dir, _tag_names(folder, tag_dir)


def remote_tag_names(folder: Path, names: list[str]) -> list[str]:
    """The objects of an s3:// save folder's tag (`latest` names it; S3 lists one level), as `tag/name`; [] where
    the folder is none, or its `latest` names no tag that holds objects."""
    if "latest" not in names or any(MODEL_STATES.fullmatch(n) for n in names):
        return []
    try:
        tag_dir, tag_names = _listed_tag(folder, names)
    except ReadError:
        return []
    return [f"{tag_dir.name}/{n}" for n in tag_names]


def _named_by(url: str) -> tuple[Path, Path, str]:
    """(the URL as the checkpoint's path, its tag folder, the name of rank 0's model states there) for the URL of a
    `latest` or of rank 0's model states; a `latest` costs a request, and a ZeRO-3 folder's a 404 too (which of two
    names rank 0's model states have)."""
    shown = remote_path(url)  # (its query kept: a presigned URL of that object)
    parent = remote_path(url.split("#", 1)[0].split("?", 1)[0].rsplit("/", 1)[0])
    if shown.name != "latest":
        return shown, parent, shown.name
    tag_dir = _remote_tag(parent, shown)
    for first in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if exists(tag_dir / first):
            return shown, tag_dir, first
    raise ReadError(f"{shown} names the tag {tag_dir.name!r}, but {tag_dir} holds neither mp_rank_00_model_states.pt "
                    "nor zero_pp_rank_0_mp_rank_00_model_states.pt (not found (404)): the checkpoint is incomplete")


def _remote_tag(folder: Path, latest: Path) -> Path:
    try:
        tag = read_tag(latest)
    except RemoteError as exc:
        if "not found (404)" not in str(exc):
            raise
        raise ReadError(f"{latest}: not found (404): not a DeepSpeed folder, or an incomplete one") from None
    if tag is None:
        raise ReadError(f"{latest}: its bytes are no tag name: not DeepSpeed's `latest`")
    return folder / tag


def _tag_names(folder: Path, tag_dir: Path) -> list[str]:
    """The objects of an s3:// tag folder, listed once."""
    names = list_folder(real_url(tag_dir) + "/")
    if not names:
        raise ReadError(f"{folder}/latest names the tag {tag_dir.name!r}, but there is no folder {tag_dir}: the "
                        "checkpoint is incomplete")
    return names


def remote_names(tag_dir: Path, first: str, policy: Policy = DEFAULT_POLICY) -> list[str]:
    """The files of a DeepSpeed tag folder behind a URL that lists no folder (https://), named as DeepSpeed names
    them from what rank 0's model states `first` say: `dp_world_size` ranks; ZeRO-3 (a `zero_pp_rank_0_…` name) has
    a model-states file per rank; each rank's optimizer states are `bf16_zero_pp_rank_R_…` when `ds_config` enables
    bf16, else `zero_pp_rank_R_…` (the other name is asked for when the first is not found: a config may say
    neither). Rank 0's model states are read here (the reader finds their blocks kept). A folder whose
    config says ZeRO but holds no rank-0 optimizer states is incomplete; otherwise it holds none (no ZeRO)."""
    mp = MODEL_STATES.fullmatch(first).group(2)
    m0 = _read_rank_file(tag_dir / first, tag_dir, policy).root
    if not isinstance(m0, dict) or "buffer_names" not in m0:
        raise ReadError(f"{tag_dir / first}: not a DeepSpeed model-states file (no buffer_names)")
    world = m0.get("dp_world_size")
    if type(world) is not int or not 1 <= world <= MAX_RANKS:
        raise ReadError(f"{tag_dir / first}: no dp_world_size from 1 to {MAX_RANKS:,}, so the ranks' files cannot be "
                        "named (a URL lists no folder): download the folder and inspect the copy")
    config = m0.get("ds_config") if isinstance(m0.get("ds_config"), dict) else {}
    bf16 = isinstance(config.get("bf16"), dict) and config["bf16"].get("enabled") is True
    zero = config.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    zero3 = MODEL_STATES.fullmatch(first).group(1) is not None
    models = [f"zero_pp_rank_{r}_mp_rank_{mp}_model_states.pt" for r in range(world)] if zero3 else [first]
    optim = f"zero_pp_rank_0_mp_rank_{mp}_optim_states.pt"
    prefix = next((p for p in (("bf16_", "") if bf16 else ("", "bf16_")) if exists(tag_dir / (p + optim))), None)
    if prefix is None:
        if zero3 or type(stage) is int and stage > 0:
            raise ReadError(f"{tag_dir}: {optim} is missing (not found (404)): the checkpoint is incomplete")
        return models
    return models + [f"{prefix}zero_pp_rank_{r}_mp_rank_{mp}_optim_states.pt" for r in range(world)]


def rank_file_note(ckpt: Checkpoint) -> Checkpoint:
    """One file of a DeepSpeed folder opened alone: say what it is, and refuse to `fix` the ones that hold only one
    rank's part (ZeRO-3 model states, any optimizer states)."""
    name = ckpt.path.name
    root = ckpt.root if isinstance(ckpt.root, dict) else {}
    optim = OPTIM_STATES.fullmatch(name) and isinstance(root.get("optimizer_state_dict"), dict)
    model = MODEL_STATES.fullmatch(name) and "buffer_names" in root
    if not (optim or model):
        return ckpt
    folder = ckpt.path.parent
    save_dir = where = folder.parent if (folder.parent / "latest").is_file() else folder
    if isinstance(folder, RemotePath):  # a URL: the tag folder as an s3:// prefix, over HTTP by rank 0's model states
        where = folder
        save_dir = folder if str(folder).startswith("s3://") else folder / _rank0_model_states(name, root)
    if model and not MODEL_STATES.fullmatch(name).group(1):
        listing = Suggestion(("inspect", shell_path(save_dir)), Promise.SHOWS, "lists the folder's whole tensors")
        note = (f"DeepSpeed model states (ZeRO-1/2 or none): `module` holds the weights the engine held; the fp32 "
                f"master weights are in the optimizer partitions: `{listing.command}`")
        return replace(ckpt, notes=(*ckpt.notes, note), advice=(*ckpt.advice, ("folder", listing)))
    whole = consolidate(save_dir)
    note = (f"one rank's part of the DeepSpeed checkpoint in {where}: its tensors are partitions, not whole "
            f"weights; consolidate the folder: `{whole.command}`")
    return replace(ckpt, notes=(*ckpt.notes, note), advice=(*ckpt.advice, ("folder", whole)),
                   distributed=DistributedShard("deepspeed", str(save_dir)))


def _rank0_model_states(name: str, root: dict) -> str:
    """The name of rank 0's model states beside a rank's file: ZeRO-3's `zero_pp_rank_0_…` (a model-states file of
    a rank, or optimizer states whose zero_stage is 3), else `mp_rank_NN_model_states.pt`."""
    found = MODEL_STATES.fullmatch(name) or OPTIM_STATES.fullmatch(name)
    osd = root.get("optimizer_state_dict")
    zero3 = found.group(1) is not None if MODEL_STATES.fullmatch(name) else \
        isinstance(osd, dict) and _stage(osd.get("zero_stage")) == 3
    return f"{'zero_pp_rank_0_' if zero3 else ''}mp_rank_{found.group(2)}_model_states.pt"
