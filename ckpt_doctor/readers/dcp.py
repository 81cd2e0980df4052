"""torch.distributed.checkpoint (DCP) folders: `.metadata` and `__R_N.distcp` files, read as torch's DCP reader does.

`.metadata` (one, or `__R.metadata` per rank when saved without collectives: their union) is unpickled by the
safe unpickler, where DCP's dataclasses are inert records. It gives each tensor's global shape and dtype and its
chunks; `storage_data` says which file holds each chunk and where: an item `[offset, offset + length)` that is a
complete `torch.save` archive of its own. Each item is walked and read like any torch zip (nothing from it runs),
and a tensor becomes an Assembly of its chunks (assemble.py) that `fix` streams into one output tensor. Non-tensor
values are items too; they are put back along `planner_data`'s paths as torch's `set_element` does (an int in a
path makes a list: optimizer `param_groups` stay lists, integer state keys stay integers). Never split on dots.
"""

from __future__ import annotations

import functools
import io
import os
import re
import stat
import sys
import weakref
from itertools import repeat
from math import prod
from operator import add, contains, is_, itemgetter, not_
from pathlib import Path
from typing import Any

from .._record import fast_new, replace
from ..advice import consolidate
from ..assemble import chunks_total, count_problem, coverage_problem, overlap_problem
from ..dtypes import element_size
from ..errors import CkptDoctorError, ReadError
from ..records import (
    Assembly,
    Checkpoint,
    DcpFolder,
    DistributedShard,
    Format,
    GlobalRef,
    LazyAssembly,
    Piece,
    integer_keys_note,
)
from ..safepickle import limits
from ..safepickle.policy import DEFAULT_POLICY, Policy
from ..safepickle.unpickler import Opaque, RawTensor, SafeUnpickler, SizeValue, StorageRef
from ..safepickle.walker import new_budget
from ..sniff import Container
from . import dcp_items, source
from ._pickled import assembled_tensor, build_checkpoint, run_unpickler
from .dcp_items import ChunkItems
from .dcp_meta_fast import Storage, recognize
from .files import read_file
from .jsonfile import parse_json
from .mapping import read_all
from .safetensors_reader import read_safetensors
from .source import RemoteError, RemotePath, close_source, open_source, pread, read_data, remote_path
from .survey import ZIP_END_SEARCH, ItemCache, ends_like_a_zip, survey_file, survey_item
from .table import sniff_head
from .torch_zip import read_torch_zip

METADATA = ".metadata"
SHARD = re.compile(r"__(\d+)_(\d+)\.distcp")
RANK_METADATA = re.compile(r"__(\d+)\.metadata")
MAX_PATH_DEPTH = 256  # planner_data paths nest a few levels; thousands is no state_dict


def is_dcp_folder(names: list[str]) -> bool:
    return METADATA in names or any(RANK_METADATA.fullmatch(n) or n.endswith(".distcp") for n in names)


def metadata_files(folder: Path, names: list[str]) -> list[Path]:
    if METADATA in names:
        return [folder / METADATA]
    return [folder / n for n in sorted((n for n in names if RANK_METADATA.fullmatch(n)),
                                       key=lambda n: int(RANK_METADATA.fullmatch(n).group(1)))]


def _open(path: Path) -> tuple[Any, int]:
    """A source for one file of the folder, and its size: a descriptor (a local file that is not a regular one is
    refused: a pipe would block), or the remote object of a URL (readers/source.py), read by range requests."""
    if isinstance(path, RemotePath):
        src = open_source(path)
        return src, src.size
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a named pipe put in its place never blocks
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ReadError(f"{path}: not a regular file (a device, a pipe or a folder)")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


class _Meta:
    """The parts of DCP's Metadata this reader uses, merged over the metadata files."""

    def __init__(self) -> None:
        self.tensors: dict[str, tuple[tuple[int, ...], str, list[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
        self.values: dict[str, None] = {}  # fqns of BytesStorageMetadata items, in order (a set: ranks repeat them)
        self.paths: dict[str, tuple] = {}
        self.storage: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int, tuple[str, ...]]] = {}
        self.version = ""
        self.chunk_sets: dict[str, set] = {}  # a tensor's chunks as a set, made when a second file lists it
        # Saved without collectives, every rank stores what it holds whole (values, replicated tensors): the first
        # metadata file's place is in `storage`, other ranks' places for the same item in `copies`, by rank.
        self.holder: dict[tuple[str, tuple[int, ...] | None], int | None] = {}
        self.copies: dict[tuple[str, tuple[int, ...] | None], list[tuple[int | None, tuple]]] = {}
        # the recognizer's columns of the storage entries while `storage` is made of them alone (one metadata file
        # read by it): by_file reads them, grouped by file, at C speed, instead of a pass over a million entries
        self.columns: Storage | None = None
        self.grouped: dict | None = None

    def by_file(self) -> dict | None:
        """The storage entries grouped by file, column-wise (NumPy arrays): {rel: (where each starts, its length,
        whether it is a value's (no chunk offsets), whether it has no transforms)}, each file's in the order of
        `entries`; made once, from the recognizer's columns. None where `storage` is not made of them alone (several
        metadata files, copies) or NumPy is missing: the caller then goes over `entries`."""
        cols, self.columns = self.columns, None
        if cols is None or self.copies or len(cols) != len(self.storage):
            return self.grouped
        try:
            import numpy as np
        except ImportError:
            return None
        n = len(cols)
        names = {rel: i for i, rel in enumerate(dict.fromkeys(cols.rel))}
        codes = np.fromiter(map(names.__getitem__, cols.rel), np.int64, n)
        order = np.argsort(codes, kind="stable")
        cuts = np.searchsorted(codes[order], np.arange(len(names) + 1))
        try:
            at = np.fromiter(cols.at, np.int64, n)[order]
            length = np.fromiter(cols.length, np.int64, n)[order]
        except OverflowError:  # (an offset or length past int64: the reading entry by entry says what is wrong)
            return None
        value = np.fromiter(map(is_, cols.offset, repeat(None)), bool, n)[order]
        plain = np.ones(n, bool) if cols.transforms.count(()) == n \
            else np.fromiter(map(not_, cols.transforms), bool, n)[order]
        self.grouped = {rel: (at[lo:hi], length[lo:hi], value[lo:hi], plain[lo:hi])
                        for rel, lo, hi in zip(names, cuts[:-1].tolist(), cuts[1:].tolist())}
        return self.grouped

    def entries(self):
        """Every place an item is stored: (key, entry), the first metadata file's and then every copy."""
        yield from self.storage.items()
        for key, copies in self.copies.items():
            for _rank, entry in copies:
                yield key, entry


def _state(obj: Any, cls: str, where: Path) -> Any:
    ref = obj.ckd.ref if isinstance(obj, Opaque) else None
    if ref is None or ref.name != cls or not ref.module.startswith("torch.distributed."):
        found = ref.qualname if ref is not None else type(obj).__name__
        raise ReadError(f"{where}: not torch.distributed.checkpoint metadata (expected a {cls}, found {found})")
    return obj.ckd.state


def _field(state: Any, name: str, where: Path) -> Any:
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] or {}), **state[1]}  # (dict, slots) from a class with __slots__
    if not isinstance(state, dict) or name not in state:
        raise ReadError(f"{where}: DCP metadata without its {name!r} field")
    return state[name]


def _ints(value: Any, what: str, where: Path) -> tuple[int, ...]:
    if type(value) is SizeValue and (not value or min(value) >= 0):  # a torch.Size: its items are ints already
        return tuple(value)
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise ReadError(f"{where}: {what} is not a list of sizes ({str(value)[:60]})")
    return tuple(value)


class _Read:
    """What build_checkpoint reads of a metadata file the recognizer read."""

    __slots__ = ("globals", "length", "notes")

    def __init__(self, length: int, notes: Any, globals_: Any) -> None:
        self.length, self.notes, self.globals = length, notes, globals_


def _read_metadata(path: Path, meta: _Meta, unpicklers: list, strict: bool = True,
                   policy: Policy = DEFAULT_POLICY, parsed: Any = None) -> None:
    """Merge one metadata file into `meta`. `parsed`: the file as dcp_meta_fast.recognize read it (the same values
    its unpickled tree gives); None: it is unpickled here by the safe unpickler."""
    rank_file = RANK_METADATA.fullmatch(path.name)
    rank = int(rank_file.group(1)) if rank_file else None
    if meta.storage or meta.copies:  # (a second file: `storage` is no longer the first one's columns alone)
        meta.columns = None
    if parsed is not None:
        # (its globals are the survey's; build_checkpoint reads .length, .notes, .globals: what is kept of it, not its
        # columns of a million storage entries, ~48 MB, which `meta` holds as its own from here on)
        unpicklers.append(_Read(parsed.length, parsed.notes, parsed.globals))
        meta.version = parsed.version
        sdm: Any = parsed.sdm
        planner: Any = parsed.planner
        storage: Any = parsed.storage
    else:
        src, size = _open(path)
        try:
            if size > limits.MAX_UNPICKLE_BYTES:
                raise ReadError(f"{path}: {size:,} bytes of DCP metadata, over the {limits.MAX_UNPICKLE_BYTES >> 20} "
                                "MB ckpt-doctor unpickles")
            raw = read_all(src, size)
        finally:
            close_source(src)
        up = SafeUnpickler(io.BytesIO(raw), path.name, None, policy=policy)
        unpicklers.append(up)
        state = _state(run_unpickler(up, path), "Metadata", path)
        meta.version = str(_field(state, "version", path)) if isinstance(state, dict) and "version" in state else ""
        sdm = _field(state, "state_dict_metadata", path)
        planner = _field(state, "planner_data", path) if isinstance(state, dict) and "planner_data" in state else {}
        storage = _field(state, "storage_data", path)
        if not isinstance(sdm, dict) or not isinstance(storage, dict):
            raise ReadError(f"{path}: DCP metadata whose state_dict_metadata or storage_data is not a dict")
        sdm = _tensor_entries(sdm, path)
        storage = _storage_entries(storage, path)
    own: dict[str, set[tuple[int, ...]]] = {}  # the chunk offsets of each tensor this file describes
    for entry in sdm:
        fqn = entry[0]
        if entry[1] is None:
            meta.values[fqn] = None
            continue
        _fqn, size, name, chunks = entry
        own[fqn] = set(map(itemgetter(0), chunks))
        known = meta.tensors.get(fqn)
        if known is not None:
            if known[:2] != (size, name):
                raise ReadError(f"{path}: {fqn} is {name}{list(size)} here but {known[1]}{list(known[0])} in another "
                                "rank's metadata")
            seen = meta.chunk_sets.get(fqn)
            if seen is None:
                seen = meta.chunk_sets[fqn] = set(known[2])
            for c in chunks:
                if c not in seen:
                    seen.add(c)
                    known[2].append(c)
        else:
            meta.tensors[fqn] = (size, name, chunks)
    if isinstance(planner, dict):
        for fqn, p in planner.items():
            if not (isinstance(fqn, str) and isinstance(p, tuple) and 0 < len(p) <= MAX_PATH_DEPTH
                    and all(type(k) is str or type(k) is int and k >= 0 for k in p)):
                if not strict:  # scan only wants the items: a bad path does not hide them
                    continue
                raise ReadError(f"{path}: planner_data gives {str(fqn)[:60]} a path that is no list of keys "
                                f"(of at most {MAX_PATH_DEPTH} names or indices)")
            if meta.paths.setdefault(fqn, p) != p:
                raise ReadError(f"{path}: planner_data puts {fqn} at {list(p)[:6]}, another rank's metadata at "
                                f"{list(meta.paths[fqn])[:6]}: the metadata files disagree")
    if type(storage) is Storage and _merged(storage, meta, own, rank, strict):
        return
    good_files: set[str] = set()
    for fqn, offset, rel, at, length, transforms in storage:
        if not (type(at) is int and type(length) is int and at >= 0 and length >= 0):
            raise ReadError(f"{path}: the storage entry of {str(fqn)[:80]} is malformed")
        if not isinstance(rel, str) or rel not in good_files:
            if not isinstance(rel, str):
                raise ReadError(f"{path}: the storage entry of {str(fqn)[:80]} is malformed")
            if "/" in rel or "\\" in rel or "\0" in rel or rel in ("", ".", ".."):  # (a NUL: os.stat raises ValueError)
                raise ReadError(f"{path}: the storage entry of {str(fqn)[:80]} names {rel[:80]!r}, not a file in "
                                "the folder")
            good_files.add(rel)
        key = (fqn, offset)
        entry = (rel, at, length, transforms)
        if strict and offset is not None and fqn in own and offset not in own[fqn]:
            raise ReadError(f"{path}: stores a chunk of {fqn} at {list(offset)} ({rel} at byte {at}) that its own "
                            "state_dict_metadata does not list: the metadata is inconsistent")
        first = meta.storage.setdefault(key, entry)
        if first == entry:
            meta.holder.setdefault(key, rank)
        elif rank is not None and meta.holder.get(key) != rank or not strict:  # another rank's copy (compared
            meta.copies.setdefault(key, []).append((rank, entry))  # when read; scan walks every place)
        else:
            raise ReadError(f"{path}: {fqn} at {list(offset or [])} is stored in {rel} at byte {at} and in "
                            f"{first[0]} at byte {first[1]}: the metadata names two places for one item")


class _Anything:
    """Holds every chunk offset: the chunks of an item this file's state_dict_metadata does not list."""

    def __contains__(self, _item: object) -> bool:
        return True


_ANYTHING = _Anything()


def _merged(storage: Storage, meta: _Meta, own: dict[str, set], rank: int | None, strict: bool) -> bool:
    """The recognizer's storage entries merged into `meta` column by column, at C speed, when every check of the
    entry-by-entry loop in _read_metadata passes and no entry meets another (within the file or in `meta`): the same
    `meta` that loop makes. False, `meta` untouched: that loop then reads them, and says what is wrong."""
    if not (set(map(type, storage.at)) <= {int} and set(map(type, storage.length)) <= {int}):
        return False
    if min(storage.at, default=0) < 0 or min(storage.length, default=0) < 0:
        return False
    for rel in set(storage.rel):
        if not isinstance(rel, str) or "/" in rel or "\\" in rel or "\0" in rel or rel in ("", ".", ".."):
            return False
    # A chunk's entry must be one its own state_dict_metadata lists (an item it does not list: any offset does)
    if strict and not all(map(contains, map(own.get, storage.fqn, repeat(_ANYTHING)), storage.offset)):
        return False  # (a value's entry, offset None, of a tensor's fqn: the loop lets it by)
    entries = dict(zip(zip(storage.fqn, storage.offset),
                       zip(storage.rel, storage.at, storage.length, storage.transforms)))
    if len(entries) != len(storage) or not meta.storage.keys().isdisjoint(entries):
        return False
    if meta.storage:
        meta.storage.update(entries)
    else:
        meta.storage = entries  # (the first file's: no copy of a million entries)
        meta.columns = storage
    if rank is not None:  # (holder.get of a key absent is None: the rank of `.metadata`, which need not be kept)
        meta.holder.update(dict.fromkeys(entries, rank))
    return True


def _tensor_entries(sdm: dict, path: Path) -> Any:
    """state_dict_metadata's entries, unpickled: (fqn, None) for a value, (fqn, size, dtype name, chunks) for a
    tensor."""
    for fqn, md in sdm.items():
        if not isinstance(fqn, str):
            raise ReadError(f"{path}: DCP metadata names an item by a {type(fqn).__name__}, not a string")
        ref = md.ckd.ref.qualname if isinstance(md, Opaque) and md.ckd.ref is not None else ""
        if ref.endswith("BytesStorageMetadata"):
            yield (fqn, None)
            continue
        tsm = _state(md, "TensorStorageMetadata", path)
        size = _ints(_field(tsm, "size", path), f"the size of {fqn}", path)
        props = _state(_field(tsm, "properties", path), "TensorProperties", path)
        dtype = props[0] if isinstance(props, tuple) and props else _field(props, "dtype", path)
        name = getattr(dtype, "name", None)
        if not isinstance(name, str):
            raise ReadError(f"{path}: {fqn} has no torch dtype in its metadata")
        chunks = []
        listed = _field(tsm, "chunks", path) or []
        if not isinstance(listed, list):
            raise ReadError(f"{path}: the chunks of {fqn} are not a list")
        for chunk in listed:
            cs = _state(chunk, "ChunkStorageMetadata", path)
            chunks.append((_ints(_field(cs, "offsets", path), f"a chunk offset of {fqn}", path),
                           _ints(_field(cs, "sizes", path), f"a chunk size of {fqn}", path)))
        yield (fqn, size, name, chunks)


def _storage_entries(storage: dict, path: Path):
    """storage_data's entries, unpickled: (fqn, chunk offsets or None, relative_path, offset, length, transforms).
    One entry per chunk: a million in a large run's metadata. Each class is checked once (every entry of a class is
    an instance of the same stand-in class), and a plain dict state is read directly."""
    index_classes: set[type] = set()
    info_classes: set[type] = set()
    for index, info in storage.items():
        if type(index) in index_classes:
            mi = index._ckd.state
        else:
            mi = _state(index, "MetadataIndex", path)
            index_classes.add(type(index))
        if type(info) in info_classes:
            si = info._ckd.state
        else:
            si = _state(info, "_StorageInfo", path)
            info_classes.add(type(info))
        fqn = mi["fqn"] if type(mi) is dict and "fqn" in mi else _field(mi, "fqn", path)
        if not isinstance(fqn, str):
            raise ReadError(f"{path}: a storage entry names its item by a {type(fqn).__name__}, not a string")
        offset = mi.get("offset") if isinstance(mi, dict) else None  # absent for a non-tensor value
        if type(si) is dict and "relative_path" in si and "offset" in si and "length" in si:
            rel, at, length = si["relative_path"], si["offset"], si["length"]
            transforms = si.get("transform_descriptors")
        else:
            rel, at, length = _field(si, "relative_path", path), _field(si, "offset", path), _field(si, "length", path)
            transforms = si.get("transform_descriptors") if isinstance(si, dict) else None
        if transforms is not None and not (isinstance(transforms, (list, tuple))
                                           and all(isinstance(t, str) for t in transforms)):
            raise ReadError(f"{path}: the storage entry of {fqn[:80]} has malformed transform descriptors")
        yield (fqn, None if offset is None else _ints(offset, f"a storage offset of {fqn}", path), rel, at, length,
               tuple(transforms or ()))


def _recognized(path: Path, policy: Policy) -> Any:
    """A local metadata file read by dcp_meta_fast's recognizer (what torch's pickler writes, and nothing else), or
    None: the file is then surveyed (every pickle walked, with the walk's bounds) and unpickled as any other. The
    file must be what survey_file would take for a bare pickle alone: no tar header first, no zip end record in its
    last 64 KB (each a second reading a loader could make of it)."""
    if isinstance(path, RemotePath):
        return None
    src, size = _open(path)
    try:
        if size > limits.MAX_UNPICKLE_BYTES or size < 64:
            return None
        raw = read_all(src, size)
    finally:
        close_source(src)
    if len(raw) != size or sniff_head(raw[:512], size) is not Container.PICKLE \
            or ends_like_a_zip(raw[-ZIP_END_SEARCH:]):
        return None
    return recognize(raw, policy)


def _layout(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str:
    """How the chunks split the tensor, in words: `whole`, `Shard(0) 2 ways [4, 3]`, `2-D split 4 ways`. Column by
    column (a tensor of a 1,000,000-chunk folder has hundreds). Chunks not of the tensor's rank are only counted
    here: the coverage check names them, and the read fails."""
    n = len(chunks)
    if n <= 1:
        return "whole (one chunk)"
    rank = len(size)
    offsets, sizes = list(map(itemgetter(0), chunks)), list(map(itemgetter(1), chunks))
    if set(map(len, offsets)) != {rank} or set(map(len, sizes)) != {rank}:
        return f"{n} chunks, not all of the tensor's rank"
    columns = list(zip(*offsets))
    dims = [d for d, column in enumerate(columns) if column.count(column[0]) != n]
    # chunks with a dimension of 0 (counted where a dimension has one)
    empty = n - sum(map(all, sizes)) if any(0 in extents for extents in zip(*sizes)) else 0
    tail = f", {empty} empty" if empty else ""
    if len(dims) == 1:
        d = dims[0]
        parts, column = list(map(itemgetter(d), sizes)), list(columns[d])
        if sorted(column) != column:  # by offset (stable: chunks at one offset as listed)
            parts = [parts[i] for i in sorted(range(n), key=column.__getitem__)]
        uneven = " uneven" if len(set(parts) - {0}) > 1 or empty else ""
        return f"Shard({d}) {n} ways{uneven} {parts}{tail}"
    if not dims:
        return f"{n} chunks{tail}"
    return f"{len(dims)}-D split on dims {dims}, {n} chunks{tail}"


def set_element(root: dict, path: tuple, value: Any, limit: int) -> None:
    """torch.distributed.checkpoint._traverse.set_element: an int key makes (and extends) a list. Stricter than
    torch's: a path through a value, a string key into a list, or a second value for one place is an error (torch
    would silently keep the last), and a list index is below `limit`, the number of entries (each slot of a real
    list holds one)."""
    where = list(path)[:6]
    cur: Any = root
    for prev, key in zip(path, path[1:]):
        default: Any = {} if type(key) is str else []
        if isinstance(cur, dict):
            cur = cur.setdefault(prev, default)
        elif type(prev) is int and prev < limit:
            while len(cur) <= prev:
                cur.append(None)
            if cur[prev] is None:
                cur[prev] = default
            cur = cur[prev]
        else:
            raise ReadError(f"planner_data path {where} indexes a list by {str(prev)[:40]!r}")
        if not isinstance(cur, (dict, list)):
            raise ReadError(f"two items of the checkpoint claim the path {where} (one is a value, one goes through it)")
    key = path[-1]
    if isinstance(cur, dict):
        if key in cur:
            raise ReadError(f"two items of the checkpoint claim the path {where}")
        cur[key] = value
        return
    if type(key) is not int or key >= limit:
        raise ReadError(f"planner_data path {where} indexes a list by {str(key)[:40]!r}")
    while len(cur) <= key:
        cur.append(None)
    if cur[key] is not None:
        raise ReadError(f"two items of the checkpoint claim the path {where}")
    cur[key] = value


def _lightning_meta(folder: Path, names: list[str], root: dict, policy: Policy) -> Checkpoint | None:
    """Lightning's ModelParallelStrategy saves the non-distributed part of its state (step, epoch, loops) in
    `meta.pt` beside the DCP files: read like any file, its values join the tree where no item is."""
    if "meta.pt" not in names:
        return None
    meta = read_file(folder / "meta.pt", policy=policy)
    if isinstance(meta.root, dict) and not meta.tensors:
        for key, value in meta.root.items():
            root.setdefault(key, value)
    return meta


def _place(folder: Path, root: dict, path: tuple, value: Any, limit: int) -> None:
    try:
        set_element(root, path, value, limit)
    except ReadError as exc:
        raise ReadError(f"{folder}: {exc}") from None


def _whole_file_views(folder: Path, files: set[str], items: dict[str, tuple[list[int], list[int]]],
                      policy: Policy) -> tuple[list, list]:
    """What torch.load and Python's zipfile would read of each shard taken whole (a payload after the items is
    seen there): globals and hazards. Their disagreement is what a shard is when its items tile it exactly."""
    globals_, hazards = [], []
    lexsort = sys.modules["numpy"].lexsort if "numpy" in sys.modules else None
    for rel in sorted(files):
        _within_budget(folder)  # (a remote folder: within what its items cost)
        survey = survey_file(folder / rel, thorough=False, policy=policy)
        globals_ += survey.globals
        tiled = False
        if rel in items and len(items[rel][0]):
            starts, lengths = items[rel]
            if type(starts) is list:
                starts, lengths = zip(*sorted(zip(starts, lengths)))  # each item's start and length, in the file's order
                ends = list(map(add, starts, lengths))
                tiled = starts[0] == 0 and ends[:-1] == list(starts[1:]) and ends[-1] == survey.size
            else:  # (NumPy arrays: the same, column-wise)
                order = lexsort((lengths, starts))
                starts, ends = starts[order], (starts + lengths)[order]
                tiled = bool(starts[0] == 0 and (ends[:-1] == starts[1:]).all() and ends[-1] == survey.size)
        hazards += [h for h in survey.hazards if not (tiled and h.what.startswith("zip readers disagree"))]
    return globals_, hazards


class _Items:
    """Each item's file opened and checked once; each item walked and read as the torch.save archive it is, or, a
    chunk's item exactly as torch's writer writes it, read on its template (dcp_items.py) with the same result."""

    def __init__(self, folder: Path, meta: _Meta | None = None, policy: Policy = DEFAULT_POLICY) -> None:
        self.folder = folder
        self.meta = meta
        self.policy = policy  # what every item's globals are judged by
        self.blobs: dict[str, dict[str, tuple[Any, tuple[int, ...]]] | None] = {}
        self.blob_base: dict[str, int] = {}  # where each shard's safetensors blob starts
        self.sizes: dict[str, int] = {}
        self.paths: dict[str, Path] = {}  # each file's path, made once
        self.globals: list[GlobalRef] = []
        self.hazards: list = []
        self.walked_bytes = 0
        self.budget: list[int] | None = None
        self.cache = ItemCache()  # items alike (a chunk's archive, by its data.pkl's bytes) are walked and read once
        self.big_endian = False  # a chunk item saved on a big-endian machine (its bytes are not swapped here)
        self.value_ends: dict[str, int] | None = None
        self.past_end: list[str] = []  # items the metadata says run past the end of their file (read to its end)
        # chunk items exactly as torch's writer writes them, read from their bytes (dcp_items.py); each shard file
        # opened once for them, and closed with this reading
        self.chunks = ChunkItems()
        weakref.finalize(self, self.chunks.close)

    def open(self, rel: str, fqn: str) -> tuple[Path, int]:
        if rel in self.paths:
            return self.paths[rel], self.sizes[rel]
        path = self.folder / rel
        if rel not in self.sizes and isinstance(path, RemotePath):  # a URL: its size from its first request
            _within_budget(self.folder)
            try:
                self.sizes[rel] = open_source(path).size
            except RemoteError as exc:
                if "not found (404)" not in str(exc):
                    raise
                raise ReadError(f"{self.folder}: {rel[:80]} is missing (not found (404); it holds {fqn[:80]}, among "
                                "others): the checkpoint is incomplete") from None
        if rel not in self.sizes:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise ReadError(f"{self.folder}: {rel[:80]} is missing (it holds {fqn[:80]}, among others): the "
                                "checkpoint is incomplete") from None
            except OSError as exc:  # (a name the metadata gives: shown cut, as its other messages show it)
                raise ReadError(f"{self.folder}: {rel[:80]} cannot be read ({exc.strerror})") from None
            if not stat.S_ISREG(st.st_mode):
                raise ReadError(f"{self.folder}: {rel[:80]} is not a regular file (a device, a pipe or a folder)")
            self.sizes[rel] = st.st_size
        self.paths[rel] = path
        return path, self.sizes[rel]

    def blob(self, rel: str, fqn: str) -> dict[str, tuple[Any, tuple[int, ...]]] | None:
        """torch's safetensors serialization format: a shard's tensors are one safetensors blob after its value
        items (their storage entries give offsets into the blob's data, not the file). {fqn: (record, the chunk's
        offsets from DCP_SHARDING_INFO)}, or None for a shard of torch.save archives."""
        if rel in self.blobs:
            return self.blobs[rel]
        path, size = self.open(rel, fqn)
        if self.value_ends is None:  # where each file's value items end: one pass over the entries, not one a file
            self.value_ends = {}
            grouped = self.meta.by_file() if self.meta is not None else None
            if grouped is not None:
                for r, (at, n, value, _plain) in grouped.items():
                    if value.any():  # (Python ints: an offset and a length of int64 may pass it together)
                        self.value_ends[r] = max(map(add, at[value].tolist(), n[value].tolist()))
            else:
                for (_f, off), (r, at, n, _t) in self.meta.entries() if self.meta is not None else ():
                    if off is None:
                        self.value_ends[r] = max(self.value_ends.get(r, 0), at + n)
        base = self.value_ends.get(rel, 0)
        found = None
        fd = open_source(path)
        try:
            if size - base > 8 and pread(fd, 1, base + 8) == b"{":
                blob = read_safetensors(path, fd, size, base)
                info = blob.metadata.get("DCP_SHARDING_INFO")
                if info is not None:
                    sharding = parse_json(info.encode(), path, "DCP_SHARDING_INFO")
                    if not isinstance(sharding, dict):
                        raise ReadError(f"{path}: DCP_SHARDING_INFO is not a JSON object")
                    found = {}
                    for rec in blob.tensors:
                        saved = sharding.get(rec.key, {}).get("saved_offsets") \
                            if isinstance(sharding.get(rec.key), dict) else None
                        found[rec.key] = (rec, _ints(saved, f"the saved offsets of {rec.key}", path)
                                          if saved is not None else (0,) * len(rec.shape))
        finally:
            close_source(fd)
        self.blobs[rel] = found
        if found is not None:
            self.blob_base[rel] = base
        return found

    def read(self, rel: str, at: int, length: int, transforms: tuple[str, ...], fqn: str,
             expect: int | None = None) -> Checkpoint:
        """The item's archive, read; `expect`: the bytes its tensor holds (bounds a compressed item's inflation)."""
        path, size = self.open(rel, fqn)
        label = dcp_items.item_label(rel, at)
        if at + length > size:
            # torch's reader reads a value (and a compressed item) up to the end of the file, a slice shorter than
            # the metadata says, and torch.load takes it: those bytes are the item. A tensor's item it hands
            # torch.load as a view that claims the length: its end records are not there, and torch fails.
            cut = (f"{self.folder}: {rel} ends at byte {size:,}, but {fqn} is stored at bytes {at:,} to "
                   f"{at + length:,}: the file is truncated")
            if at >= size or (expect is not None and not transforms):
                raise ReadError(cut)
            try:
                ckpt = self._read(path, at, size - at, transforms, fqn, label, expect)
            except ReadError as exc:  # what torch would read fails there too: the file is cut short
                if getattr(exc, "findings", ()):
                    raise
                raise ReadError(f"{cut} ({str(exc).removeprefix(f'{self.folder}: ')})") from None
            self.past_end.append(f"{fqn}: the metadata says its item runs to byte {at + length:,}, past the end of "
                                 f"{rel} ({size:,} bytes); torch's DCP reader reads it to the end of the file, as "
                                 "this reading does")
            return ckpt
        return self._read(path, at, length, transforms, fqn, label, expect)

    def _read(self, path: Path, at: int, length: int, transforms: tuple[str, ...], fqn: str, label: str,
              expect: int | None) -> Checkpoint:
        if transforms:
            if transforms != ("stream.zstd/1",) and not (len(transforms) == 1 and
                                                         transforms[0].startswith("stream.zstd/1.")):
                shown = ", ".join(t[:40] for t in transforms[:3]) + (f", … {len(transforms) - 3} more"
                                                                    if len(transforms) > 3 else "")
                raise ReadError(f"{self.folder}: {fqn} is stored through {shown} ({label}), a transform ckpt-doctor "
                                "does not know")
            cap = (expect if expect is not None else limits.MAX_UNPICKLE_BYTES) + (1 << 20)
            path, at, length = inflate_zstd(path, at, length, cap, f"{self.folder}: {fqn} ({label})")
            if expect is None:  # a value: unpickled now, its inflated copy not needed after
                try:
                    return self._read_archive(path, at, length, fqn, label)
                finally:
                    os.unlink(path)
        return self._read_archive(path, at, length, fqn, label)

    def walk_budget(self) -> list:
        """The walk's budget, shared by every item of the folder: it grows with the items the metadata names."""
        if self.budget is None:
            named = len(self.meta.storage) + len(self.meta.copies) if self.meta is not None else 0
            self.budget = new_budget(limits.folder_opcodes(named))
        return self.budget

    def _read_archive(self, path: Path, at: int, length: int, fqn: str, label: str) -> Checkpoint:
        self.walk_budget()
        fd = open_source(path)
        try:
            if pread(fd, 4, at) != b"PK\x03\x04":
                raise ReadError(f"{self.folder}: {fqn} ({label}) is no torch.save archive (nor a tensor of a "
                                "safetensors blob the metadata leads to)")
            item = survey_item(path, fd, at, length, self.budget, self.cache, policy=self.policy)
        finally:
            close_source(fd)
        self.globals.extend(item.globals)
        self.hazards.extend(item.hazards)
        if item.refused:
            raise ReadError(f"{path}: refused to read {label}: {item.refused}")
        try:
            ckpt = read_torch_zip(path, item)
        except ReadError as exc:
            raise ReadError(f"{self.folder}: {fqn} ({label}): {str(exc).removeprefix(f'{path}: ')}") from None
        self.walked_bytes += len(item.main_pickle or b"")
        return ckpt


_NAMED: dict[str, dict[str, int]] = {}  # a remote folder -> the bytes its metadata names in each file


def _name_bytes(folder: Path, meta: _Meta) -> None:
    """Keep what a remote folder's metadata names in each file: the measure fetch_overrun holds its reads to."""
    if isinstance(folder, RemotePath):
        named: dict[str, int] = {}
        for _key, (rel, _at, length, _t) in meta.entries():
            named[rel] = named.get(rel, 0) + length
        _NAMED[str(folder)] = named


def fetch_overrun(folder: Path) -> str | None:
    """Why reading a remote DCP folder stops, when its files have cost more than the items its metadata names in them
    (each counted up to the file's size) plus limits.MAX_DCP_UNNAMED_FETCH: one object under many names, or files
    that hold far more than their items. None while within (and for a folder not read by its metadata)."""
    named = _NAMED.get(str(folder))
    if not named:
        return None
    fetched = allowed = 0
    for rel, n in named.items():
        src = source._OPEN.get(str(folder / rel))  # (opened ones only: none is fetched here)
        if src is not None:
            fetched += src.bytes
            allowed += min(n, src.size)
    if fetched <= allowed + limits.MAX_DCP_UNNAMED_FETCH:
        return None
    return (f"{folder}: reading its files fetched {source.human(fetched)}, past the {source.human(allowed)} of items "
            f"its metadata names in them (and {limits.MAX_DCP_UNNAMED_FETCH >> 20} MB more): its {len(named):,} files "
            "hold far more than their items (one object under many names?); stopped")


def _within_budget(folder: Path) -> None:
    why = fetch_overrun(folder)
    if why is not None:
        raise ReadError(why)


_INFLATED: list[str] = []  # temporary folders of inflated zstd items, removed when the process ends


def inflate_zstd(path: Path, at: int, length: int, cap: int, what: str) -> tuple[Path, int, int]:
    """A zstd-compressed item (DCP's `stream.zstd` transform) inflated into a private temporary file, at most `cap`
    bytes (a tensor item inflates to its bytes plus a small archive around them): (file, 0, its length). The item
    is then read like any other, and `fix` streams its tensor from that file."""
    try:
        import zstandard
    except ImportError:
        raise ReadError(f"{what}: zstd-compressed; reading it needs the zstandard package "
                        "(pip install zstandard)") from None
    import shutil
    import tempfile

    if not _INFLATED:
        _INFLATED.append(tempfile.mkdtemp(prefix="ckpt-doctor-zstd-"))
        _remove_on_exit(_INFLATED[0])
    room = shutil.disk_usage(_INFLATED[0]).free - (1 << 30)  # a gigabyte is left to the rest of the machine
    fd = open_source(path)
    out_fd, out_name = tempfile.mkstemp(dir=_INFLATED[0], suffix=".zip")

    class _Slice:
        def __init__(self) -> None:
            self.pos = 0

        def read(self, n: int = -1) -> bytes:
            n = length - self.pos if n < 0 else min(n, length - self.pos)
            data = read_data(fd, n, at + self.pos) if n > 0 else b""
            self.pos += len(data)
            return data

    total = 0
    done = False
    try:
        # One frame, as torch's reader (zstandard's stream_reader) takes it; what follows the frame is ignored.
        reader = zstandard.ZstdDecompressor().stream_reader(_Slice(), read_across_frames=False)
        while True:
            block = reader.read(8 << 20)
            if not block:
                break
            if not total and block[:4] != b"PK\x03\x04":  # an item is a torch.save archive: nothing else is written
                raise ReadError(f"{what}: inflates to something other than a torch.save archive")
            total += len(block)
            if total > cap:
                raise ReadError(f"{what}: inflates past the {cap:,} bytes it can hold (a zstd bomb?)")
            if total > room:
                raise ReadError(f"{what}: inflating it needs more temporary disk than is free in "
                                f"{_INFLATED[0]} (set TMPDIR to a roomier folder)")
            os.write(out_fd, block)
        done = True
    except zstandard.ZstdError as exc:
        raise ReadError(f"{what}: is not a valid zstd stream ({exc})") from None
    finally:
        close_source(fd)
        os.close(out_fd)
        if not done:
            os.unlink(out_name)
    return Path(out_name), 0, total


def _remove_on_exit(folder: str) -> None:
    """Remove the temporary folder when the process ends, also on SIGTERM/SIGHUP (atexit alone misses those)."""
    import atexit
    import shutil
    import signal
    import threading

    atexit.register(shutil.rmtree, folder, True)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))


def read_remote_dcp(url: str, names: list[str] | None = None, *, policy: Policy = DEFAULT_POLICY) -> Checkpoint:
    """A DCP folder behind URLs, read as a local one is (the same checks and limits), by range requests: its
    metadata and pickled items, never its tensor data. `names`: the objects of an s3:// prefix, listed once; None
    for the URL of the folder's `.metadata` (https:// lists no folder: the item files are the ones its storage_data
    names), which is then the checkpoint's path, so that the commands printed for it run as printed."""
    plain = url.split("#", 1)[0].split("?", 1)[0]
    if names is None:
        shown = remote_path(url)  # (its query kept: a presigned URL of the metadata object)
        return read_dcp(remote_path(plain.rsplit("/", 1)[0]), [METADATA], shown, policy=policy)
    return read_dcp(remote_path(plain.rstrip("/")), names, policy=policy)


def remote_dcp_members(url: str, *, policy: Policy = DEFAULT_POLICY) -> list[Path]:
    """What `scan` of the URL of a DCP folder's `.metadata` reads: the metadata, and every file its storage_data
    names (https:// lists no folder). A metadata that does not read gives itself alone: it is scanned, and the scan
    says its items were not walked."""
    shown = remote_path(url)
    folder = remote_path(url.split("#", 1)[0].split("?", 1)[0].rsplit("/", 1)[0])
    try:
        files = metadata_items(folder, [METADATA], policy=policy)
    except ReadError:
        return [shown]
    _NAMED[str(folder)] = {p.name: sum(n for _at, n, _t in spans) for p, spans in files.items()}
    return [shown, *sorted(files, key=str)]


def read_dcp(folder: Path, names: list[str], shown: Path | None = None, *,
             policy: Policy = DEFAULT_POLICY) -> Checkpoint:
    try:
        return _read_dcp(folder, names, shown, policy=policy)
    except ReadError as exc:
        if not isinstance(folder, RemotePath) or exc.findings:
            raise
        # What the folder's files would run is said even when the folder does not read (exit 1), as `inspect` of a
        # local folder says it of the files beside (report.sibling_hazards): each file torch's loader would open.
        found = _remote_findings(folder, names, policy)
        if found:
            raise ReadError(f"{exc} — and files in it would run code: {'; '.join(found[:3])}", tuple(found)) from None
        raise


def _remote_findings(folder: RemotePath, names: list[str], policy: Policy) -> list[str]:
    """What each file of a remote DCP folder would run when loaded, walked as `scan` walks it (the objects listed,
    or the files the metadata names, read as leniently as scan reads it); [] when none can be known."""
    try:
        if names != [METADATA]:  # an s3:// prefix: its objects
            files = [folder / n for n in names if n != METADATA and not RANK_METADATA.fullmatch(n)]
        else:  # https://: the item files the metadata names, when it names them
            files = sorted(metadata_items(folder, names, policy=policy), key=str)
    except CkptDoctorError:
        return []
    found = []
    for path in files:
        if fetch_overrun(folder) is not None:
            break  # (what was found is said; the error already says the folder did not read)
        try:
            survey = survey_file(path, policy=policy)
        except CkptDoctorError:
            continue  # (missing, or the server failed: nothing more to say of it than the error already says)
        runs = [n.rsplit(" (", 1)[0] for n in survey.finding_names()]
        if runs:
            found.append(f"{path.name} would run code when loaded: {', '.join(runs[:3])}")
    return found


def _read_dcp(folder: Path, names: list[str], shown: Path | None = None, *,
              policy: Policy = DEFAULT_POLICY) -> Checkpoint:
    metas = metadata_files(folder, names)
    if not metas:
        shards = [n for n in names if n.endswith(".distcp")]
        raise ReadError(f"{folder}: {len(shards)} .distcp files but no .metadata: the folder is incomplete, or was "
                        "written by a storage writer without one (Hugging Face's), which ckpt-doctor does not read yet")
    meta = _Meta()
    unpicklers: list = []
    survey_globals: list[GlobalRef] = []
    hazards: list = []
    for path in metas:
        if not isinstance(path, RemotePath):  # (a URL: its first request says what it is)
            try:
                mode = os.stat(path).st_mode
            except OSError as exc:
                raise ReadError(f"{path}: cannot be read ({exc.strerror})") from None
            if not stat.S_ISREG(mode):  # a pipe would block the open below
                raise ReadError(f"{path}: not a regular file (a device, a pipe or a folder)")
        parsed = _recognized(path, policy)
        if parsed is not None:  # torch's own metadata, byte for byte: its globals are known, nothing to walk
            survey_globals.extend(parsed.globals)
            _read_metadata(path, meta, unpicklers, policy=policy, parsed=parsed)
            parsed = None  # (its columns: `meta` holds the entries now)
            continue
        survey = survey_file(path, policy=policy)
        survey_globals.extend(survey.globals)
        hazards.extend(survey.hazards)
        if survey.refused:
            raise ReadError(f"{path}: refused to read it: {survey.refused}")
        try:
            _read_metadata(path, meta, unpicklers, policy=policy)
        except ReadError as exc:
            findings = survey.finding_names()
            if findings:
                raise ReadError(f"{exc} — and it would run code: {', '.join(findings[:4])}", findings) from None
            raise
    _name_bytes(folder, meta)
    items = _Items(folder, meta, policy)
    root: dict = {}
    layouts: dict[str, str] = {}
    files: set[str] = set()
    problems: list[str] = []
    order = list(meta.paths) + [f for f in [*meta.tensors, *meta.values] if f not in meta.paths]
    shared: dict[tuple, list] = {}  # the chunks of a tensor -> (its pieces, its tensor): names of the same chunks
    differ: list[tuple[str, dict]] = []  # items ranks saved with different bytes: (note, JSON record)
    stored, copies = meta.storage.get, meta.copies
    # a folder of many chunks: every shard file's items parsed at once (dcp_items.ChunkItems.prepare), and the
    # chunks of a tensor read on their template together, its pieces made when a command asks for them
    bulk = dcp_items.ENABLED and not copies and len(meta.storage) >= dcp_items.BULK_MIN \
        and not isinstance(folder, RemotePath) and _prepare(items, meta)
    for fqn in order:
        path = meta.paths.get(fqn, (fqn,))
        if fqn in meta.tensors:
            size, dtype, chunks = meta.tensors[fqn]
            cut = None
            if bulk:
                wheres = list(map(stored, zip(repeat(fqn), map(itemgetter(0), chunks))))
                cut = items.chunks.tensor(items, wheres, chunks, dtype) if None not in wheres else None
            if cut is not None:
                pieces = ()
                assembly = fast_new(LazyAssembly, grid=size, dtype=dtype,
                                    cut=(dcp_items.cut_pieces, (items.paths, wheres, chunks, *cut)))
            else:
                pieces, wheres = _pieces(items, fqn, chunks, dtype, meta, problems, differ, files)
                assembly = Assembly(size, tuple(pieces), dtype)
            files.update(map(itemgetter(0), wheres))
            # Names are one tensor only when every chunk is the same storage entry read the same way (a writer that
            # records a tie names the same entries twice); shared bytes read through other strides are not a tie.
            # (keyed by the storage entries, tuples the metadata holds anyway; each piece's reading is compared on
            # a hit only: a 6-tuple per piece in the key cost ~95 MB for a million pieces)
            tie_key = (size, dtype, tuple(wheres))
            alike = shared.setdefault(tie_key, [])  # (one lookup of a key of a hundred entries: appended to below)
            tied = next((t for a, t in alike if _read_alike(a.pieces, assembly.pieces)), None) \
                if wheres and (cut is not None or pieces) else None
            if tied is not None:  # a second name of the same chunks (a tie a writer recorded): one tensor
                _place(folder, root, path, RawTensor(tied.storage, dtype, 0, size, tied.stride), len(order))
                layouts[".".join(str(p) for p in path)] = _layout(size, chunks) + " (tied)"
                continue
            if cut is not None:
                problem = _chunk_coverage(assembly, chunks, cut[0].stride)
            else:
                problem = coverage_problem(assembly) if len(pieces) == len(chunks) else None
            if problem:
                problems.append(f"{fqn}: {problem}")
            tensor = assembled_tensor(fqn, dtype, size, assembly, metas[0])
            alike.append((assembly, tensor))
            _place(folder, root, path, tensor, len(order))
            layouts[".".join(str(p) for p in path)] = _layout(size, chunks)
        else:
            where = meta.storage.get((fqn, None))
            if where is None:
                problems.append(f"{fqn}: no file holds this value")
                continue
            rel, at, length, transforms = where
            files.add(rel)
            value = items.read(rel, at, length, transforms, fqn).root
            others = []
            for rank, copy in meta.copies.get((fqn, None), ()):  # stored by every rank: one item when the same
                files.add(copy[0])
                if not _same_range(folder, where, copy):  # walked and read: what that rank's dcp.load unpickles
                    others.append((rank, copy, items.read(*copy, fqn).root))
            if others:
                differ.append(_differs(meta, (fqn, None), where, others, False, value))
            _place(folder, root, path, value, len(order))
    lightning = _lightning_meta(folder, names, root, policy)
    if lightning is not None:
        survey_globals.extend(lightning.globals)
        hazards.extend(lightning.hazards)
    restored = _integer_state_keys(root)
    # each file's items as (where they start, their lengths): two columns, not a tuple an item (~50 MB for a million)
    spans: dict[str, tuple[Any, Any]] = {}
    grouped = meta.by_file()
    if grouped is not None:  # (the same, column-wise)
        for rel, (at, length, value, _plain) in grouped.items():
            if items.blobs.get(rel) is not None:
                at, length = at[value], length[value]
            if len(at):
                end = items.sizes.get(rel)
                spans[rel] = (at, length if end is None else (end - at).clip(0).clip(None, length))
    else:
        for (_fqn, offsets), (rel, at, length, _t) in meta.entries():
            if offsets is None or items.blobs.get(rel) is None:  # a blob's tensors: their offsets are no positions
                end = items.sizes.get(rel)  # an item read to the end of its file: what it spans (torch reads that)
                starts, lengths = spans.get(rel) or spans.setdefault(rel, ([], []))
                starts.append(at)
                lengths.append(length if end is None else max(0, min(length, end - at)))
    for rel, base in items.blob_base.items():
        starts, lengths = spans.get(rel) or spans.setdefault(rel, ([], []))
        spans[rel] = ([*starts, base], [*lengths, items.sizes[rel] - base])  # the blob runs to the end of the file
    view_globals, view_hazards = _whole_file_views(folder, files, spans, policy)
    if problems:
        shown = "; ".join(problems[:3]) + (f"; … {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ReadError(f"{folder}: the checkpoint is incomplete: {shown}")
    ranks = sorted({int(m.group(1)) for n in files if (m := SHARD.fullmatch(n))})
    variant = ["per-rank metadata (saved without collectives)"] if metas[0].name != METADATA else []
    if meta.copies:
        variant[0:1] = [f"per-rank metadata (saved without collectives): {_count(len(meta.copies), 'item')} stored by "
                        f"several ranks, read as one" + (f"; {len(differ)} of them with different bytes" if differ
                                                         else " (the same bytes)")]
    per_rank = [int(m.group(2)) for n in files if (m := SHARD.fullmatch(n))]
    if per_rank and max(per_rank) > 0:
        variant.append("one file per item (single_file_per_rank=False)")
    if lightning is not None:
        variant.append("Lightning ModelParallelStrategy (meta.pt beside it)")
    sharded = sum(1 for v in layouts.values() if not v.startswith("whole"))
    distributed = DcpFolder(len(files), len(ranks), tuple(variant or ["one .metadata"]), len(meta.tensors), sharded,
                            len(meta.values), version=meta.version)
    notes = (f"torch.distributed.checkpoint folder: {_count(len(meta.tensors), 'tensor')} ({sharded} sharded) and "
             f"{_count(len(meta.values), 'other value')} in {_count(len(files), 'file')} from "
             f"{_count(len(ranks), 'rank')}; shapes are the global (unsharded) ones",)
    notes += tuple(items.past_end[:3])
    if items.big_endian:  # what refuse_values reads: fix and diff would take big-endian bytes as little-endian ones
        notes += ("saved on a big-endian machine: tensor bytes are big-endian (in some chunk items)",)
    restored_note = integer_keys_note(restored) if restored else None
    if restored_note:
        notes += (restored_note,)
    if differ:
        notes += tuple(note for note, _ in differ[:3])
        if len(differ) > 3:
            notes += (f"… and {len(differ) - 3} more items the ranks saved differently (all in the JSON's "
                      "distributed.rank_differences)",)
        distributed = replace(distributed, rank_differences=tuple(record for _, record in differ))
    ckpt = build_checkpoint(folder, Format.DCP, root, unpicklers, notes=notes,
                            extra_globals=tuple(survey_globals + items.globals + view_globals),
                            extra_bytes=items.walked_bytes)
    if not all(isinstance(v, RawTensor) for v in root.values()):  # a flat state_dict needs no contents line
        distributed = replace(distributed, contents=tuple(_contents(root, ckpt.state_dict_root)))
    # fix says which optimizer states have integer keys again only where it writes them (not the model alone)
    distributed = replace(distributed, fix_notes=tuple(note for note in notes[1:] if note is not restored_note),
                          integer_state_keys=tuple(restored))

    extra_files = (folder / "meta.pt",) if lightning is not None else ()
    return replace(ckpt, path=shown or ckpt.path, files=(*metas, *(folder / f for f in sorted(files)), *extra_files),
                   hazards=tuple(hazards + items.hazards + view_hazards),
                   layouts=layouts, distributed=distributed)


def _pieces(items: _Items, fqn: str, chunks: list, dtype: str, meta: _Meta, problems: list, differ: list,
            files: set) -> tuple[list[Piece], list[tuple]]:
    """A tensor's chunks read one by one: its pieces, and the storage entry of each."""
    folder, stored, copies = items.folder, meta.storage.get, meta.copies
    pieces, wheres = [], []
    for offsets, sizes in chunks:
        key = (fqn, offsets)
        where = stored(key)
        if where is None:
            problems.append(f"{fqn}: no file holds its chunk at {list(offsets)} of size {list(sizes)}")
            continue
        piece = _chunk_piece(items, fqn, offsets, sizes, dtype, where)
        pieces.append(piece)
        wheres.append(where)
        if not copies:
            continue
        others = []
        for rank, copy in copies.get(key, ()):  # other ranks' copies
            files.add(copy[0])
            if items.blob(where[0], fqn) is None and items.blob(copy[0], fqn) is None \
                    and _same_range(folder, where, copy):
                continue  # the same archive, byte for byte: what was walked and read above
            if not _same_piece(piece, _chunk_piece(items, fqn, offsets, sizes, dtype, copy), dtype):
                others.append((rank, copy, None))  # (its archive walked and read, as rank 1 would)
        if others:
            differ.append(_differs(meta, key, where, others, len(chunks) > 1))
    return pieces, wheres


def _prepare(items: _Items, meta: _Meta) -> bool:
    """Parse every chunk item of the folder's shard files in bulk (dcp_items.ChunkItems.prepare); False where NumPy
    is not there to do it."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    grouped = meta.by_file()
    if grouped is not None:  # (a chunk's entry, not a transformed one: what prepare takes of the entries below)
        items.chunks.prepare(items, (), {rel: (at[~value & plain], length[~value & plain])
                                         for rel, (at, length, value, plain) in grouped.items()})
        return True
    items.chunks.prepare(items, (where for (_fqn, offsets), where in meta.storage.items() if offsets is not None))
    return True


def _chunk_coverage(assembly: Assembly, chunks: list, stride: tuple[int, ...]) -> str | None:
    """coverage_problem of a LazyAssembly of chunks read together, from its chunks (every piece's stride is
    `stride`) without making its pieces; where a chunk does not pass the column-wise check, coverage_problem itself
    names it."""
    offsets, sizes = list(map(itemgetter(0), chunks)), list(map(itemgetter(1), chunks))
    total = chunks_total(assembly.grid, offsets, sizes, {len(stride)})
    if total is None:
        return coverage_problem(assembly)
    return count_problem(total, assembly.grid) or overlap_problem(assembly.grid, offsets, sizes)


def _read_alike(a: tuple[Piece, ...], b: list[Piece]) -> bool:
    """Whether two tensors' pieces (of the same storage entries) are read the same way: the same bytes, laid alike."""
    return all(p.file == q.file and p.offset == q.offset and p.stride == q.stride and p.offsets == q.offsets
               and p.sizes == q.sizes for p, q in zip(a, b))


def _chunk_piece(items: _Items, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: str,
                 where: tuple) -> Piece:
    """The saved chunk of `fqn` at `offsets`, as a piece of its tensor: from the shard's safetensors blob (torch's
    safetensors format) or from the torch.save archive of its item (walked, and checked against the metadata)."""
    fast = items.chunks.piece(items, fqn, offsets, sizes, dtype, where) if dcp_items.ENABLED else None
    if fast is not None and type(fast) is not tuple:  # (a tuple: on the template, its data.pkl learnt below)
        return fast
    folder = items.folder
    rel, at, length, transforms = where
    blob = items.blob(rel, fqn)
    if blob is not None:  # torch's safetensors format: the tensor is named in the shard's blob
        rec, saved = blob.get(fqn, (None, None))
        if rec is None or saved != offsets:
            raise ReadError(f"{folder}: {fqn}: {rel} holds no chunk of it at {list(offsets)}")
        if rec.shape != sizes or rec.dtype != dtype:
            raise ReadError(f"{folder}: {fqn}: {rel} holds {rec.dtype}{list(rec.shape)}, the metadata says "
                            f"{dtype}{list(sizes)}")
        return Piece(rec.storage.file, rec.storage.offset, offsets, sizes, rec.stride, f"{rel} safetensors entry {fqn}")
    hazards, globals_ = len(items.hazards), len(items.globals)
    chunk = items.read(rel, at, length, transforms, fqn, prod(sizes) * element_size(dtype))
    rec = chunk.tensors[0] if len(chunk.tensors) == 1 and chunk.tensors[0].key == "" else None
    if rec is None or rec.storage is None:
        raise ReadError(f"{folder}: {fqn}: {rel} item at byte {at} holds no single tensor")
    items.big_endian = items.big_endian or chunk.big_endian
    if rec.shape != sizes or rec.dtype != dtype:
        raise ReadError(f"{folder}: {fqn}: {rel} item at byte {at} holds {rec.dtype}{list(rec.shape)}, the metadata "
                        f"says {dtype}{list(sizes)}")
    if rec.storage.deflated:
        raise ReadError(f"{folder}: {fqn}: {rel} item at byte {at} holds its chunk as a compressed (deflated) zip "
                        "member, which torch's DCP writer never writes; ckpt-doctor assembles chunks from stored bytes "
                        "only")
    whole = rec.storage_offset == 0 and rec.nbytes == rec.storage.nbytes and rec.is_contiguous
    piece = Piece(rec.storage.file, rec.file_offset or 0, offsets, sizes, rec.stride, dcp_items.item_label(rel, at),
                  rec.storage.crc if whole else None)
    if fast is not None and len(items.hazards) == hazards:  # on the template: what its data.pkl means, kept
        walked = items.cache.walks.get((items.policy, dcp_items.PICKLE_NAME, fast[0]))
        if walked is not None and items.globals[globals_:] == walked[0].globals:
            items.chunks.learn(fast, walked, rec, chunk, piece, at)
    return piece


def _same_range(folder: Path, a: tuple, b: tuple) -> bool:
    """Whether two items' stored bytes are the same (rel, at, length, transforms): read a megabyte at a time."""
    if a == b:
        return True
    if a[2] != b[2] or a[3] != b[3]:
        return False
    return source.same_bytes(folder / a[0], a[1], folder / b[0], b[1], a[2])


def _same_piece(a: Piece, b: Piece, dtype: str) -> bool:
    """Whether two ranks' copies of one chunk hold the same elements, byte for byte (read: the crc32 an archive
    records is its writer's claim, and torch.load does not check it)."""
    from ..assemble import is_contiguous, read_piece

    nbytes = prod(a.sizes) * element_size(dtype)
    if is_contiguous(a) and is_contiguous(b):
        return (a.file, a.offset) == (b.file, b.offset) or source.same_bytes(a.file, a.offset, b.file, b.offset, nbytes)
    fds = [open_source(p.file) for p in (a, b)]
    try:
        return read_piece(a, dtype, fds[0]) == read_piece(b, dtype, fds[1])
    finally:
        for fd in fds:
            close_source(fd)


def _differs(meta: _Meta, key: tuple, mine: tuple, others: list[tuple[int | None, tuple, Any]], chunked: bool,
             value: Any = None) -> tuple[str, dict]:
    """An item other ranks saved with other bytes than the first, in words (naming the ranks, where each copy is,
    and small values) and as its JSON record. The reading keeps the first rank's, as torch's dcp_to_torch_save
    does."""
    fqn, offsets = key
    first = meta.holder.get(key)
    what = f"{fqn} (its chunk at {list(offsets)})" if chunked and offsets is not None else fqn

    def one(rank: int | None, where: tuple, held: Any) -> str:
        shown = f", holding {_short(held)}" if offsets is None and _short(held) is not None else ""
        return f"rank {rank} ({where[0]} at byte {where[1]:,}{shown})"

    theirs = [one(rank, where, held) for rank, where, held in others[:3]]
    more = f" and {len(others) - 3} more ranks" if len(others) > 3 else ""
    note = (f"{what} was saved with different bytes by {one(first, mine, value)} and {', '.join(theirs)}{more}; "
            f"torch's dcp.load gives each rank its own, and this reading holds rank {first}'s (as torch's "
            "dcp_to_torch_save does)")
    record = {"key": fqn, "chunk": list(offsets) if offsets is not None else None,
              "ranks": [first, *(rank for rank, _w, _h in others)],
              "files": [f"{mine[0]}@{mine[1]}", *(f"{w[0]}@{w[1]}" for _r, w, _h in others)], "kept": first}
    return note, record


def _short(value: Any) -> str | None:
    """A value small enough to show in a line (a number, a short string); None for anything else."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str) and len(value) <= 40:
        return repr(value)
    return None


def _integer_state_keys(tree: Any, path: str = "") -> list[str]:
    """Give an optimizer state_dict ({"state", "param_groups"}) its integer state keys back where DCP turned them
    into strings ("0", "1", …) and its param_groups still list those integers as params; returns where it did."""
    done: list[str] = []
    if isinstance(tree, dict):
        state, groups = tree.get("state"), tree.get("param_groups")
        if isinstance(state, dict) and isinstance(groups, list) and state:
            ids = {p for g in groups if isinstance(g, dict) for p in (g.get("params") or []) if type(p) is int}
            keys = list(state)
            if all(isinstance(k, str) and k.isdigit() and int(k) in ids for k in keys):
                tree["state"] = {int(k): state[k] for k in keys}
                done.append(f"{path}.state" if path else "state")
        for key, value in tree.items():
            done += _integer_state_keys(value, f"{path}.{key}" if path else str(key))
    return done


def _contents(root: dict, model_root: str | None) -> list[str]:
    """What each top-level item is: the model's weights, an optimizer's state, other tensors, a value."""
    out = []
    for name, value in root.items():
        tensors = _count_tensors(value)
        if isinstance(value, dict) and "state" in value and "param_groups" in value:
            what = f"{_n(tensors)} (optimizer state)"
        elif str(name) == model_root:
            what = f"{_n(tensors)} (model weights)"
        elif tensors:
            what = _n(tensors)
        else:
            what = "a value" if not isinstance(value, (dict, list)) else f"{len(value)} values"
        out.append(f"{name}: {what}")
    return out


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _n(count: int) -> str:
    return f"{count} tensor" + ("" if count == 1 else "s")


def _count_tensors(value: Any) -> int:
    if isinstance(value, RawTensor):
        return 1
    if isinstance(value, dict):
        return sum(_count_tensors(v) for v in value.values())
    if isinstance(value, list):
        return sum(_count_tensors(v) for v in value)
    return 0


def hf_shard_files(folder: Path, names: list[str]) -> list[Path]:
    """Safetensors files written by DCP's Hugging Face storage writer (no .metadata; each header's __metadata__ holds
    DCP_SHARDING_INFO): one per rank and file index. [] for an ordinary folder of safetensors files."""
    files = sorted(folder / n for n in names if n.endswith(".safetensors"))
    found = []
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a named pipe never blocks
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                continue
            with os.fdopen(fd, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    continue
                n = int.from_bytes(head, "little")
                if n > limits.MAX_SAFETENSORS_HEADER:
                    continue
                if b'"DCP_SHARDING_INFO"' in f.read(min(n, 1 << 20)):
                    found.append(path)
        except OSError:
            continue
    return found


def read_hf_shards(folder: Path, shards: list[Path]) -> Checkpoint:
    """A folder DCP's HuggingFaceStorageWriter wrote with save_distributed: every rank's chunks in safetensors files,
    each placed by its saved_offsets; a tensor's global shape is the largest offset + size over its chunks (the
    writer records no global shape), and its chunks must tile it."""
    chunks: dict[str, list[tuple[tuple[int, ...], Any]]] = {}
    for path in shards:
        fd = os.open(path, os.O_RDONLY)
        try:
            blob = read_safetensors(path, fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        sharding = parse_json(str(blob.metadata.get("DCP_SHARDING_INFO", "{}")).encode(), path, "DCP_SHARDING_INFO")
        if not isinstance(sharding, dict):
            raise ReadError(f"{path}: DCP_SHARDING_INFO is not a JSON object")
        for rec in blob.tensors:
            info = sharding.get(rec.key)
            saved = info.get("saved_offsets") if isinstance(info, dict) else None
            offsets = _ints(saved, f"the saved offsets of {rec.key}", path) if saved is not None \
                else (0,) * len(rec.shape)
            if len(offsets) != len(rec.shape):
                raise ReadError(f"{path}: {rec.key} has {len(offsets)} saved offsets for {len(rec.shape)} dims")
            chunks.setdefault(rec.key, []).append((offsets, rec))
    root: dict = {}
    layouts: dict[str, str] = {}
    problems = []
    for fqn, parts in chunks.items():
        if len({len(o) for o, _ in parts}) > 1:
            raise ReadError(f"{folder}: the chunks of {fqn} disagree on its number of dimensions "
                            f"({', '.join(str(len(o)) for o, _ in parts)})")
        dtypes = {rec.dtype for _, rec in parts}
        if len(dtypes) > 1:
            raise ReadError(f"{folder}: the chunks of {fqn} disagree on its dtype ({', '.join(sorted(dtypes))})")
        dtype = dtypes.pop()
        rank = len(parts[0][0])
        size = tuple(max(o[d] + r.shape[d] for o, r in parts) for d in range(rank))
        pieces = tuple(Piece(r.storage.file, r.storage.offset, o, r.shape, r.stride, f"{r.storage.file.name} "
                             f"entry {fqn}") for o, r in parts)
        assembly = Assembly(size, pieces, dtype)
        problem = coverage_problem(assembly)
        if problem:
            problems.append(f"{fqn}: {problem}")
        root[fqn] = assembled_tensor(fqn, dtype, size, assembly, shards[0])
        layouts[fqn] = _layout(size, [(o, r.shape) for o, r in parts])
    if problems:
        raise ReadError(f"{folder}: the checkpoint is incomplete (the writer records no global shapes: a missing "
                        f"shard file shows as a gap): {'; '.join(problems[:3])}")
    sharded = sum(1 for v in layouts.values() if not v.startswith("whole"))
    notes = (f"torch.distributed.checkpoint folder written by its Hugging Face storage writer: {len(root)} tensors "
             f"({sharded} sharded) in {len(shards)} safetensors files; shapes are the largest offset + size over each "
             "tensor's chunks (the writer records no global shape)",)
    ckpt = build_checkpoint(folder, Format.DCP, root, [], notes=notes)
    return replace(ckpt, files=tuple(shards), layouts=layouts,
                   distributed=DcpFolder(len(shards), len({p.name.split("-model-")[0] for p in shards}),
                                         ("Hugging Face storage writer (safetensors shards, no .metadata)",),
                                         len(root), sharded, 0, hf_writer=True))


def metadata_items(folder: Path, names: list[str] | None = None, *,
                   policy: Policy = DEFAULT_POLICY) -> dict[Path, list[tuple[int, int, tuple[str, ...]]]]:
    """Each byte range the folder's metadata names, by file: what torch's DCP reader hands torch.load (for `scan`,
    which walks them beside each file's own views). Raises ReadError when the metadata cannot be read: the items
    DCP's loader would unpickle are then unknown, and scan must not call the folder clean. `names`: the folder's
    files, when it is not listed here (a URL's folder: the objects scanned)."""
    meta = _Meta()
    try:
        for path in metadata_files(folder, os.listdir(folder) if names is None else names):
            _read_metadata(path, meta, [], strict=False, policy=policy)
    except OSError as exc:
        raise ReadError(f"{folder}: its metadata cannot be read ({exc.strerror})") from None
    ranges: dict[Path, list[tuple[int, int, tuple[str, ...]]]] = {}
    for _key, (rel, at, length, transforms) in meta.entries():
        ranges.setdefault(folder / rel, []).append((at, length, transforms))
    return ranges


def _blob_tensors(path: Path, base: int, size: int, meta: _Meta) -> dict[str, RawTensor]:
    """The tensors of a shard's safetensors blob, each named by its fqn (and its chunk's offsets when the folder's
    metadata splits that tensor), as chunks: their own shapes."""
    fd = open_source(path)
    try:
        blob = read_safetensors(path, fd, size, base)
    finally:
        close_source(fd)
    sharding = parse_json(str(blob.metadata.get("DCP_SHARDING_INFO", "{}")).encode(), path, "DCP_SHARDING_INFO")
    out = {}
    for rec in blob.tensors:
        info = sharding.get(rec.key) if isinstance(sharding, dict) else None
        saved = info.get("saved_offsets") if isinstance(info, dict) else None
        split = rec.key in meta.tensors and len(meta.tensors[rec.key][2]) > 1
        name = f"{rec.key}@{list(saved)}" if split and isinstance(saved, list) else rec.key
        ref = StorageRef(name, rec.dtype, rec.numel, "cpu")
        ref.resolved = rec.storage
        out[name] = RawTensor(ref, rec.dtype, 0, rec.shape, rec.stride)
    return out


def _named(folder: Path, metas: list[Path]) -> Path:
    """How a command names the folder: an https:// folder by the URL of its `.metadata` (HTTP lists no folder)."""
    return metas[0] if isinstance(folder, RemotePath) and not str(folder).startswith("s3://") and metas else folder


def _stamp(path: Path) -> tuple:
    """What tells a local metadata file's versions apart (a URL's is read once per process)."""
    if isinstance(path, RemotePath):
        return ()
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return st.st_ino, st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _shard_names(metas: tuple[Path, ...], stamps: tuple, policy: Policy) -> tuple[_Meta, dict[str, dict[int, str]]]:
    """A folder's metadata read once for all its shards (scan reads every shard of a folder; each re-reading the
    folder's metadata and going over all its entries made a folder of many ranks quadratic): each file's items by
    where they start, named by fqn (and the chunk's offsets where the tensor has several). Empty when the metadata
    does not read: the items are then unnamed."""
    meta = _Meta()
    by_file: dict[str, dict[int, str]] = {}
    for m in metas:
        try:
            _read_metadata(m, meta, [], policy=policy)
        except (ReadError, OSError):
            return meta, {}
    for (fqn, offsets), (rel, at, _length, _t) in meta.entries():
        whole = offsets is None or fqn not in meta.tensors or len(meta.tensors[fqn][2]) == 1
        by_file.setdefault(rel, {})[at] = fqn if whole else f"{fqn}@{list(offsets)}"
    return meta, by_file


def read_dcp_shard(path: Path, survey: Any) -> Checkpoint:
    """One `__R_N.distcp` file on its own: its items, named by the folder's metadata when it is beside it. Shapes are
    the chunks' (local); the folder is what holds whole tensors, and `fix` refuses a lone shard."""
    from .torch_zip import read_torch_zip

    folder = path.parent
    metas = metadata_files(folder, [METADATA] if isinstance(folder, RemotePath) else os.listdir(folder))
    meta, by_file = _shard_names(tuple(metas), tuple(_stamp(m) for m in metas), survey.policy)
    names = by_file.get(path.name, {})
    root: dict = {}
    for item in survey.items:
        if item.refused:
            raise ReadError(f"{path}: refused to read the item at byte {item.base}: {item.refused}")
        ckpt = read_torch_zip(path, item)
        root[names.get(item.base, f"item@{item.base}")] = ckpt.root
    end = survey.items[-1].base + survey.items[-1].size if survey.items else 0
    if end < survey.size:  # torch's safetensors format: the rank's tensors, in a blob after its values
        root.update(_blob_tensors(path, end, survey.size, meta))
    shard = SHARD.fullmatch(path.name)
    whose = f"rank {shard.group(1)}'s" if shard else "one"
    advice = ()
    if names:
        fqns = {n.split("@")[0] for n in names.values()}
        whole = consolidate(_named(folder, metas))
        advice = (("folder", whole),)
        note = (f"{whose} shard of the torch.distributed.checkpoint folder {folder}: {len(survey.items)} items, parts "
                f"of {len(fqns)} of its {len(meta.tensors) + len(meta.values)} entries; shapes here are the chunks' "
                f"own. Inspect or fix the folder for whole tensors: `{whole.command}`")
    else:
        note = (f"{whose} shard of a torch.distributed.checkpoint folder ({len(survey.items)} items); without its "
                ".metadata beside it the items' names are unknown and shapes are the chunks' own")
    ckpt = build_checkpoint(path, Format.TORCH_ZIP, root, [], notes=(note,),
                            extra_bytes=sum(len(i.main_pickle or b"") for i in survey.items))
    return replace(ckpt, distributed=DistributedShard("torch.distributed.checkpoint", str(folder)), advice=advice)

