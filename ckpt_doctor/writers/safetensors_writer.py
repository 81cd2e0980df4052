"""Writes safetensors: a JSON header padded to 8 bytes, then each tensor's bytes, streamed from the source.

Why not `safetensors.torch.save_file`: it takes every tensor in memory at once, and fix keeps its peak memory flat
whatever the file's size (1 GB in about 40 MB here) by copying each tensor's bytes from the source file. What it
writes is held to the library by the tests: tests/test_fix.py loads every output with `safetensors.torch.load_file`.
"""

from __future__ import annotations

import json
import os
import struct
from .._record import record
from typing import Callable

from ..dtypes import TORCH_TO_SAFETENSORS
from ..errors import WriteError
from .stream import Progress, WrittenRanges, copy_range, preallocate, write_bytes


@record(frozen=False)
class TensorBytes:
    """One safetensors entry: dtype, shape and where its contiguous bytes come from."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    source_fd: int = -1
    source_offset: int = 0
    known_crc: int | None = None
    produce: Callable[[int, int, Progress | None], int] | None = None
    crc: int | None = None


def header_bytes(tensors: list[TensorBytes], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for t in tensors:
        code = TORCH_TO_SAFETENSORS.get(t.dtype)
        if code is None:
            raise WriteError(f"{t.key}: dtype {t.dtype} has no safetensors code; write a .pt file instead")
        header[t.key] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * ((-len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(fd: int, tensors: list[TensorBytes], metadata: dict[str, str],
                      progress: Progress | None = None, written: WrittenRanges | None = None) -> int:
    """Write the file; returns where the data starts (for verification)."""
    head = header_bytes(tensors, metadata)
    preallocate(fd, len(head) + sum(t.nbytes for t in tensors))
    write_bytes(fd, 0, head)
    pos = len(head)
    for t in tensors:
        if t.produce is not None:
            t.crc = t.produce(fd, pos, progress)
        else:
            t.crc = copy_range(t.source_fd, t.source_offset, t.nbytes, fd, pos, progress, t.known_crc, written)
        if written is not None:
            written.done(pos, t.nbytes, t.crc, t.key)
        pos += t.nbytes
    os.ftruncate(fd, pos)
    return len(head)
