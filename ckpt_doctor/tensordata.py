"""Reads one tensor's bytes from disk into torch, lazily: the only reader-side code that imports torch."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .dtypes import element_size
from .errors import ReadError
from .records import TensorRecord

if TYPE_CHECKING:
    import torch


def read_bytes(record: TensorRecord) -> bytes:
    """The bytes a tensor can touch, from its first element to its last (views included)."""
    assert record.storage is not None
    if record.storage.assembly is not None:  # pieces of several files (DCP, ZeRO): assembled in memory
        from .assemble import assembled_bytes

        data = assembled_bytes(record.storage.assembly, record.key)
        if record.storage.assembly.dtype != record.dtype:  # a 16-bit buffer read as float32, as zero_to_fp32 does
            import torch

            src = torch.frombuffer(bytearray(data), dtype=getattr(torch, record.storage.assembly.dtype))
            data = tensor_bytes(src.to(getattr(torch, record.dtype)))
        return data
    start = record.file_offset
    assert start is not None
    size = record.span_bytes
    with open(record.storage.file, "rb") as f:
        data = os.pread(f.fileno(), size, start)
    if len(data) != size:
        raise ReadError(f"{record.storage.file}: {record.key} is cut short ({len(data)} of {size} bytes)")
    return data


def load_tensor(record: TensorRecord) -> "torch.Tensor":
    """A CPU tensor with the record's dtype, shape and stride, read from the file (never unpickled)."""
    import torch

    dtype = getattr(torch, record.dtype)
    if record.storage is None or record.numel == 0:
        return torch.empty(record.shape, dtype=dtype)
    buf = bytearray(read_bytes(record))
    flat = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
    return flat.as_strided(record.shape, record.stride)


def tensor_bytes(tensor: "torch.Tensor") -> bytes:
    """A tensor's elements in row-major order as bytes, without numpy (not a dependency)."""
    import torch

    buf = bytearray(tensor.numel() * tensor.element_size())
    if buf:
        torch.frombuffer(buf, dtype=tensor.dtype).copy_(tensor.reshape(-1))
    return bytes(buf)


def storage_nbytes(record: TensorRecord) -> int:
    return record.numel * element_size(record.dtype)
