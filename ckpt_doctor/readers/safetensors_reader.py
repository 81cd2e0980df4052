"""Reads a safetensors header and checks it by the reference parser's rules, without reading tensor data."""

from __future__ import annotations

import struct
from pathlib import Path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

from ..dtypes import SAFETENSORS_TO_TORCH, element_size
from ..errors import ReadError
from ..records import Checkpoint, Format, StorageRecord, TensorRecord
from ..safepickle import limits
from .source import pread
from .jsonfile import parse_json


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def read_safetensors(path: Path, fd: Any, size: int, base: int = 0) -> Checkpoint:
    """The safetensors blob at `base` (a DCP shard in torch's safetensors format holds one after its value items),
    running to the end of the file."""
    if size - base < 8:
        raise ReadError(f"{path}: safetensors file shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", pread(fd, 8, base))
    if n > limits.MAX_SAFETENSORS_HEADER:
        raise ReadError(f"{path}: safetensors header length {n} is over the 100 MB limit (corrupt file)")
    if 8 + n > size - base:
        raise ReadError(f"{path}: safetensors header length {n} runs past the end of the file (truncated)")

    raw = pread(fd, n, base + 8)
    if raw.count(b'"data_offsets"') > limits.MAX_TENSORS:  # before parsing: 1.7 million entries took 2 GB
        raise ReadError(f"{path}: safetensors header lists more than {limits.MAX_TENSORS:,} tensors; refusing to "
                        "read it")
    header = parse_json(raw, path, "safetensors header")
    del raw
    if not isinstance(header, dict):
        raise ReadError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ReadError(f"{path}: safetensors __metadata__ must map strings to strings")
    data_start = base + 8 + n
    data_len = size - data_start
    spans = []
    tensors = []
    for key, info in header.items():
        tensors.append(_record(path, key, info, data_start, data_len))
        spans.append((tensors[-1].storage.offset - data_start, tensors[-1].nbytes, key))
    spans.sort()
    cursor = 0
    for begin, nbytes, key in spans:
        if begin < cursor:
            raise ReadError(f"{path}: safetensors tensor {key} overlaps the tensor before it (corrupt header)")
        if begin > cursor:
            raise ReadError(f"{path}: safetensors data has a gap before tensor {key} (corrupt header)")
        cursor = begin + nbytes
    if cursor != data_len:
        raise ReadError(f"{path}: safetensors data is {data_len} bytes but the tensors cover {cursor} "
                        "(trailing or missing bytes)")
    tensors.sort(key=lambda t: (t.storage.offset, t.key))
    return Checkpoint(path=path, format=Format.SAFETENSORS, tensors=tuple(tensors), metadata=dict(metadata),
                      globals=(), state_dict_root="" if tensors else None, files=(path,))


def _record(path: Path, key: str, info: object, data_start: int, data_len: int) -> TensorRecord:
    if len(key) > limits.MAX_KEY_LENGTH:
        raise ReadError(f"{path}: safetensors entry {key[:60]}… has a name of {len(key):,} characters")
    if not isinstance(info, dict):
        raise ReadError(f"{path}: safetensors entry {key} is not an object")
    code = info.get("dtype")
    dtype = SAFETENSORS_TO_TORCH.get(code) if isinstance(code, str) else None
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if dtype is None:
        raise ReadError(f"{path}: safetensors entry {key} has unknown dtype {_short(code)}")
    if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
        raise ReadError(f"{path}: safetensors entry {key} has a bad shape {_short(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise ReadError(f"{path}: safetensors entry {key} has bad data_offsets {_short(offsets)}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise ReadError(f"{path}: safetensors entry {key} has offsets {_short(offsets)} outside the data "
                        f"({data_len} bytes)")
    numel = 1
    for s in shape:
        numel *= s
    if numel * element_size(dtype) != end - begin:
        raise ReadError(f"{path}: safetensors entry {key}: {dtype}{_short(shape)} needs "
                        f"{_short(numel * element_size(dtype))} bytes, its offsets give {end - begin}")
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    storage = StorageRecord(key, dtype, end - begin, "cpu", path, data_start + begin)
    return TensorRecord(key=key, dtype=dtype, shape=tuple(shape), stride=tuple(reversed(stride)),
                        storage_offset=0, storage=storage, device="cpu")
