"""Reads one tensor's bytes from disk into torch, lazily: the only reader-side code that imports torch."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Iterator

from .assemble import assembled_bytes
from .dtypes import QUANTIZED, element_size, tensor_bytes  # noqa: F401  (tensor_bytes: re-exported)
from .errors import ReadError
from .readers.source import close_source, is_url, open_source, same_bytes
from .readers.zipindex import inflated_range
from .records import StorageRecord, TensorRecord

if TYPE_CHECKING:
    import torch


def read_bytes(record: TensorRecord) -> bytes | bytearray:
    """The bytes a tensor can touch, from its first element to its last (views included)."""
    assert record.storage is not None
    if record.storage.assembly is not None:  # pieces of several files (DCP, ZeRO): assembled in memory
        data = assembled_bytes(record.storage.assembly, record.key)
        if record.storage.assembly.dtype != record.dtype:  # a 16-bit buffer read as float32, as zero_to_fp32 does
            import torch

            src = torch.frombuffer(bytearray(data), dtype=getattr(torch, record.storage.assembly.dtype))
            data = tensor_bytes(src.to(getattr(torch, record.dtype)))
        return data
    size = record.span_bytes
    if record.storage.deflated:  # a deflated zip member: inflated up to the tensor's last byte, no further
        return inflated_bytes(record.storage, record.storage_offset * element_size(record.dtype), size, record.key)
    start = record.file_offset
    assert start is not None
    if is_url(record.storage.file):  # an https:// or s3:// object: its data windows (readers/source.py)
        return remote_bytes(open_source(record.storage.file), start, size, f"{record.storage.file}: {record.key}")
    data = bytearray(size)  # read into the buffer load_tensor hands torch: no second copy
    done = 0
    with open(record.storage.file, "rb") as f, memoryview(data) as view:
        while done < size:
            n = os.preadv(f.fileno(), [view[done:]], start + done) if hasattr(os, "preadv") else \
                _pread_into(f.fileno(), view[done:], start + done)
            if n == 0:
                raise ReadError(f"{record.storage.file}: {record.key} is cut short ({done} of {size} bytes)")
            done += n
    return data


def same_values(a: TensorRecord, b: TensorRecord) -> bool:
    """Whether two tensors hold the same elements: one dtype, shape and layout, and the same bytes, compared a
    megabyte at a time where both are stored as they are (memory stays flat whatever their size)."""
    if (a.dtype, a.shape, a.stride) != (b.dtype, b.shape, b.stride) or a.storage is None or b.storage is None:
        return False
    if any(r.storage.assembly is not None or r.storage.deflated for r in (a, b)):
        return read_bytes(a) == read_bytes(b)
    return same_bytes(a.storage.file, a.file_offset, b.storage.file, b.file_offset, a.span_bytes,
                      cut_short=f"{a.storage.file}: {a.key} or {b.key}")


def remote_bytes(src: Any, start: int, size: int, what: str) -> bytearray:
    data = src.read_data(size, start)
    if len(data) < size:
        raise ReadError(f"{what} is cut short ({len(data)} of {size} bytes)")
    return data if isinstance(data, bytearray) else bytearray(data)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    got = os.pread(fd, len(view), offset)
    view[:len(got)] = got
    return len(got)


def inflated_bytes(storage: StorageRecord, skip: int, nbytes: int, what: str) -> bytearray:
    """`nbytes` of a deflated storage from byte `skip`, the whole storage checked against its recorded crc32 (a
    corrupt member is an error, whichever part of it is asked for)."""

    whole = (storage.nbytes, storage.crc) if storage.crc is not None else None
    out = bytearray(nbytes)  # filled in place: one buffer of the tensor's size, whatever the member's
    at = 0
    with _source(storage.file) as src, memoryview(out) as view:
        for block in inflated_range(src, storage.offset, storage.deflated, skip, nbytes,
                                    f"{storage.file}: {what} (storage {storage.entry or storage.key})", whole):
            view[at:at + len(block)] = block
            at += len(block)
    return out


@contextlib.contextmanager
def _source(path: Any) -> Iterator[Any]:
    """A descriptor of a local file (closed after), or the remote object's source (kept for the process)."""
    src = open_source(path)
    try:
        yield src
    finally:
        close_source(src)


def load_tensor(record: TensorRecord) -> "torch.Tensor":
    """A CPU tensor with the record's dtype, shape and stride, read from the file (never unpickled)."""
    import torch

    if record.dtype in QUANTIZED:
        raise ReadError(f"{record.key} is a quantized tensor ({record.dtype}): its scale and zero point are not read, "
                        "so ckpt-doctor neither compares nor rewrites its values; torch.load reads them")
    dtype = getattr(torch, record.dtype)
    if record.storage is None or record.numel == 0:
        return torch.empty(record.shape, dtype=dtype)
    data = read_bytes(record)
    buf = data if isinstance(data, bytearray) else bytearray(data)
    flat = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
    return flat.as_strided(record.shape, record.stride)


def with_bits(tensor: "torch.Tensor", bits: str) -> "torch.Tensor":
    """A tensor read from its bytes, given the conjugate and negative bits torch.load sets (Checkpoint.value_bits):
    its values, as torch.load gives them."""
    import torch

    if "conj" in bits:
        tensor = tensor.conj().resolve_conj()
    if "neg" in bits:
        if tensor.dtype == torch.bool:
            raise ReadError("a bool tensor saved with its negative bit: torch.load reads it, and fails wherever its "
                            "values are read (no bool can be negated)")
        tensor = -tensor
    return tensor


def storage_nbytes(record: TensorRecord) -> int:
    return record.numel * element_size(record.dtype)
