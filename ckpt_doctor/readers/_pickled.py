"""What the pickle-based readers share: running the safe unpickler and turning its tree into a Checkpoint."""

from __future__ import annotations

import _pickle  # pickle.UnpicklingError is this class; pickle.py itself is not needed
import struct
from collections import deque
from itertools import repeat
from operator import attrgetter, itemgetter
from .._record import replace
from pathlib import Path

from ..dtypes import ELEMENT_SIZE, element_size
from ..errors import CkptDoctorError, ReadError, one_line
from ..records import (Checkpoint, Format, GlobalRef, StorageColumns, StorageRecord, TensorRecord, TensorTable,
                       fast_new, span_elements)
from ..assemble import contiguous_strides
from ..tree import Flat, TorchScriptMembers, find_state_dict_root, flatten
from ..safepickle import limits
from ..safepickle.unpickler import RawTensor, Refused, SafeUnpickler, StorageRef

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any

# What a corrupt or hostile pickle can raise from inside the C unpickler; each becomes one ReadError.
PICKLE_ERRORS = (_pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
                 OverflowError, UnicodeDecodeError, RecursionError, MemoryError, struct.error, ImportError, Refused)


def run_unpickler(unpickler: SafeUnpickler, path: Path) -> Any:
    try:
        return unpickler.load()
    except CkptDoctorError:
        raise
    except Refused as exc:
        raise ReadError(f"{path}: refused to read it: {unpickler.source}: {exc}") from None
    except MemoryError:  # memory_guard's cap, met by what the walk could not foresee
        raise ReadError(f"{path}: refused to read it: {unpickler.source} needs more than "
                        f"{limits.UNPICKLE_HEADROOM >> 20} MB to unpickle, the most ckpt-doctor gives one pickle") \
            from None
    except PICKLE_ERRORS as exc:
        raise ReadError(f"{path}: {unpickler.source} is not a valid pickle "
                        f"({type(exc).__name__}: {one_line(exc, 160)})") from exc


_RESOLVED = StorageRef.resolved  # the slot StorageRef keeps its StorageRecord in


class ColumnRef(StorageRef):
    """A StorageRef whose StorageRecord is one of a StorageColumns, made when `resolved` is first read: until then
    its slot holds (the columns, its position). A reader makes its refs ColumnRefs with `resolve_columns`; pickled
    or copied, one is the StorageRef it stands for."""

    __slots__ = ()

    def _resolved(self) -> StorageRecord | None:
        value = _RESOLVED.__get__(self)
        if type(value) is tuple:
            value = value[0].record(value[1])
            _RESOLVED.__set__(self, value)
        return value

    resolved = property(_resolved, _RESOLVED.__set__)

    def __reduce__(self) -> tuple:
        return StorageRef, (self.key, self.dtype, self.numel, self.location, self.resolved, self.view_of,
                            self.view_offset)


def resolve_columns(refs: list[StorageRef], columns: StorageColumns) -> None:
    """Resolve `refs` (no views) to the storages of `columns`, position by position, making no StorageRecord: each
    is made when its ref's `resolved` is read, and tensor_table reads the columns."""
    deque(map(_RESOLVED.__set__, refs, zip(repeat(columns), range(len(refs)))), maxlen=0)
    deque(map(setattr, refs, repeat("__class__"), repeat(ColumnRef)), maxlen=0)


def _view_record(ref: StorageRef) -> StorageRecord | None:
    base = ref.view_of.resolved if ref.view_of is not None else None
    if base is None:
        return None
    return replace(base, offset=base.offset + ref.view_offset, nbytes=ref.numel * element_size(ref.dtype))


def tensor_record(path: Path, key: str, raw: RawTensor) -> TensorRecord:
    """The record of one tensor, its reach checked against its storage. Runs once per tensor: kept lean."""
    ref = raw.storage
    storage = None if ref is None else ref.resolved if ref.view_of is None else _view_record(ref)
    if ref is not None and storage is None:
        raise ReadError(f"{path}: tensor {key} names storage {ref.key}, which the file does not hold")
    record = fast_new(
        TensorRecord, key=key, dtype=raw.dtype, shape=raw.shape, stride=raw.stride, storage_offset=raw.offset,
        storage=storage, device=raw.device or (ref.location if ref is not None else "cpu"),
        requires_grad=raw.requires_grad, is_parameter=raw.is_parameter)
    if storage is not None:
        span = span_elements(raw.shape, raw.stride)  # None: shape and stride are malformed; 0: no elements
        if span is None or span and (raw.offset + span) * ELEMENT_SIZE[raw.dtype] > storage.nbytes:
            raise ReadError(f"{path}: tensor {key or '(the root object)'} ({list(raw.shape)}, {raw.dtype}) reads past "
                            f"the end of its storage {storage.key} ({storage.nbytes} bytes): the file is corrupt")
    return record


def _span(shape: tuple, stride: tuple, spans: dict[tuple[int, int], int | None]) -> int | None:
    """span_elements of a shape and stride, kept in `spans` by their ids: the one-pass reader hands out one tuple
    for each distinct shape (a checkpoint repeats a few). By id, not value: a file chooses the hashes of its tuples
    of ints. (The ids stay theirs: every tuple is held by its tensor while the table is made.)"""
    layout = (id(shape), id(stride))
    span = spans.get(layout, -1)
    if span == -1:
        span = span_elements(shape, stride)
        if len(spans) < 4096:
            spans[layout] = span
    return span


def _column_table(raws: list[tuple[str, RawTensor]]) -> TensorTable | None:
    """tensor_table of tensors whose storages are all of one StorageColumns (resolve_columns): their positions in
    it taken, no StorageRecord made. None when one is not so, or may read past its storage (tensor_table's loop then
    says which). One loop: a column at a time costs more here (eight attributes a tensor, each a pass of its own)."""
    keys, dtypes, shapes, strides, offsets, at, grads, params = ([] for _ in range(8))
    sizes, slot, column_ref = ELEMENT_SIZE, _RESOLVED.__get__, ColumnRef
    columns: StorageColumns | None = None
    nbytes: list[int] = []
    spans: dict[tuple[int, int], int | None] = {}  # (_span)
    last: tuple = (None, None, None)
    for key, raw in raws:
        ref = raw.storage
        if ref.__class__ is not column_ref or raw.device is not None:
            return None
        held = slot(ref)
        if held.__class__ is not tuple:  # its StorageRecord made already
            return None
        owner, i = held
        if owner is not columns:
            if columns is not None:
                return None
            columns, nbytes = owner, owner.nbytes
        shape, stride = raw.shape, raw.stride
        if shape is last[0] and stride is last[1]:
            span = last[2]
        else:
            if len(shape) == 1 and len(stride) == 1 and shape[0] > 0 and stride[0] >= 0:
                span = (shape[0] - 1) * stride[0] + 1
            else:
                span = _span(shape, stride, spans)
            last = (shape, stride, span)
        if span is None or span and (raw.offset + span) * sizes[raw.dtype] > nbytes[i]:
            return None
        keys.append(key)
        dtypes.append(raw.dtype)
        shapes.append(shape)
        strides.append(stride)
        offsets.append(raw.offset)
        at.append(i)
        grads.append(raw.requires_grad)
        params.append(raw.is_parameter)
    if columns is None:
        return None
    devices = list(map(columns.devices.__getitem__, at))
    if len(at) == len(columns) and at == list(range(len(at))):
        at = None  # tensor i reads storage i
    return TensorTable(keys, dtypes, shapes, strides, offsets, devices, columns, grads, params,
                       storage_at=at).check_types()


def tensor_table(path: Path, raws: list[tuple[str, RawTensor]]) -> TensorTable:
    """The tensors as columns (tensor_record's checks, without a record per tensor)."""
    table = _column_table(raws)
    if table is not None:
        return table
    keys, dtypes, shapes, strides, offsets, storages, devices, grads, params = ([] for _ in range(9))
    sizes = ELEMENT_SIZE
    spans: dict[tuple[int, int], int | None] = {}  # (_span)
    last: tuple = (None, None, None)  # the last shape and stride looked up, and their span (neighbours share them)
    for key, raw in raws:
        ref = raw.storage
        if ref is None:
            storage = None
            device = raw.device or "cpu"
        else:
            storage = ref.resolved if ref.view_of is None else _view_record(ref)
            if storage is None:
                raise ReadError(f"{path}: tensor {key} names storage {ref.key}, which the file does not hold")
            device = raw.device or ref.location
            shape, stride = raw.shape, raw.stride
            if len(shape) == 1 and len(stride) == 1 and shape[0] > 0 and stride[0] >= 0:  # the common case, inline
                span = (shape[0] - 1) * stride[0] + 1
            elif shape is last[0] and stride is last[1]:
                span = last[2]
            else:
                span = _span(shape, stride, spans)  # None: shape and stride are malformed; 0: no elements
                last = (shape, stride, span)
            if span is None or span and (raw.offset + span) * sizes[raw.dtype] > storage.nbytes:
                raise ReadError(f"{path}: tensor {key or '(the root object)'} ({list(raw.shape)}, {raw.dtype}) reads "
                                f"past the end of its storage {storage.key} ({storage.nbytes} bytes): the file is "
                                "corrupt")
        keys.append(key)
        dtypes.append(raw.dtype)
        shapes.append(raw.shape)
        strides.append(raw.stride)
        offsets.append(raw.offset)
        storages.append(storage)
        devices.append(device)
        grads.append(raw.requires_grad)
        params.append(raw.is_parameter)
    return TensorTable(keys, dtypes, shapes, strides, offsets, devices, storages, grads, params).check_types()


def assembled_tensor(key: str, dtype: str, shape: tuple[int, ...], assembly: Any, source: Path,
                     record_key: str | None = None) -> RawTensor:
    """A contiguous tensor of `dtype` whose bytes are an Assembly of pieces (DCP chunks, ZeRO partitions), as the
    pickle readers' tensors are: a RawTensor on a resolved storage (named `record_key`, default `key`)."""
    from math import prod

    numel = prod(shape)
    ref = StorageRef(key, dtype, numel, "cpu")
    ref.resolved = StorageRecord(key=record_key or key, dtype=dtype, nbytes=numel * element_size(dtype), device="cpu",
                                 file=source, offset=0, assembly=assembly)
    return RawTensor(ref, dtype, 0, shape, contiguous_strides(shape))


def build_checkpoint(path: Path, fmt: Format, root: Any, unpicklers: list[SafeUnpickler],
                     ts_members: TorchScriptMembers | None = None, notes: tuple[str, ...] = (),
                     extra_globals: tuple[GlobalRef, ...] = (), extra_bytes: int = 0) -> Checkpoint:
    budget = limits.max_tree_nodes(sum(u.length for u in unpicklers) + extra_bytes)
    try:
        flat: Flat = flatten(root, ts_members, budget)
    except RecursionError as exc:
        raise ReadError(f"{path}: the pickle nests too deeply to be a checkpoint") from exc
    except ReadError as exc:
        raise ReadError(f"{path}: {exc}") from None
    tensors = tensor_table(path, flat.tensors)
    sd_root, others = find_state_dict_root(flat)
    model_class = flat.module_classes.get(sd_root) if sd_root is not None else None
    all_notes = list(notes)
    raws = list(map(itemgetter(1), flat.tensors))
    noted = any(map(attrgetter("note"), raws))
    tensor_notes = [f"{key}: {raw.note}" for key, raw in flat.tensors if raw.note] if noted else []
    value_bits = {key: raw.bits for key, raw in flat.tensors if raw.bits} if noted else {}
    attributes = {key: raw.attrs for key, raw in flat.tensors if raw.attrs} if noted else {}
    for up in unpicklers:
        all_notes.extend(up.notes)
        all_notes.extend(tensor_notes)
    if flat.metadata_truncated:
        all_notes.append(f"{flat.metadata_truncated} more metadata entries not listed")
    if sd_root is None and flat.optimizers:
        where = ", ".join(o or "the file's root" for o in flat.optimizers[:3])
        all_notes.append(f"an optimizer's state_dict (state, param_groups) at {where}: optimizer state, not model "
                         "weights; write it with fix --select PATH")
    loaded = [g for up in unpicklers for g in up.globals]
    return Checkpoint(path=path, format=fmt, tensors=tensors, metadata=dict(flat.metadata),
                      globals=_dedupe(loaded + list(extra_globals)), state_dict_root=sd_root, other_state_dicts=others,
                      root=root, model_class=model_class, notes=tuple(dict.fromkeys(all_notes)), files=(path,),
                      non_persistent=tuple(flat.non_persistent), loaded_globals=_dedupe(loaded),
                      value_bits=value_bits, tensor_attrs=attributes)


def _dedupe(refs: list[GlobalRef]) -> tuple[GlobalRef, ...]:
    seen: dict[tuple[str, str], GlobalRef] = {}
    for ref in refs:
        seen.setdefault((ref.module, ref.name), ref)
    return tuple(seen.values())
