"""Reads a safetensors header and checks it by the reference parser's rules, without reading tensor data.

Why not the safetensors library itself: its `safe_open` gives each tensor's name, dtype and shape but not where its
bytes lie, and every command past `inspect` needs that (fix copies each tensor's byte range with copy_file_range,
diff maps them, a remote file is read by range requests). A header as the reference writer spells it (no blanks,
its fields in its order: every file the library writes) is read into columns by one regex pass (_compact_columns)
with every check of the general reading: no JSON parse of the whole header, no walk of its depth, no object per
entry. Any other spelling, and every fault, goes through the JSON parse and the checks of each entry, which name
what is wrong. The library stays the authority: tests/test_safetensors_oracle.py holds this reader's verdict (read or refused) and its names,
dtypes, shapes and metadata to the library's on valid files and on headers broken in every way its parser names.
"""

from __future__ import annotations

import struct
from itertools import repeat
from operator import add, itemgetter, sub
from pathlib import Path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

from ..dtypes import ELEMENT_SIZE, SAFETENSORS_TO_TORCH, element_size
from ..errors import ReadError
from ..records import Checkpoint, Format, TensorTable
from ..safepickle import limits
from .source import pread
from .jsonfile import has_lone_surrogate, parse_json


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
    data_start = base + 8 + n
    columns = _compact_columns(raw, size - data_start)
    if columns is not None:
        metadata, keys, dtypes, shapes, begins, sizes = columns
        return _checkpoint(path, data_start, metadata, keys, dtypes, shapes, begins, sizes)
    # JSON keeps the last of a key given twice; the library reads every one. Objects with a key twice are kept
    # (by id of the dict JSON made of them) with all their pairs, for the checks below.
    twice: dict[int, list] = {}
    held: list[dict] = []  # those objects themselves: an id stays theirs while they live, dropped ones included

    def pairs_hook(pairs: list) -> dict:
        value = dict(pairs)
        if len(value) != len(pairs):
            twice[id(value)] = pairs
            held.append(value)
        return value

    header = parse_json(raw, path, "safetensors header", strict=True, object_pairs_hook=pairs_hook)
    if not isinstance(header, dict):
        raise ReadError(f"{path}: safetensors header is not a JSON object")
    if twice:
        _check_repeats(path, header, twice, raw)
    del raw
    metadata = header.pop("__metadata__", None)
    if metadata is None:  # absent or null: the library's Option
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ReadError(f"{path}: safetensors __metadata__ must map strings to strings")
    data_len = size - data_start
    # One tight pass over the entries into columns (no object per tensor); an entry the fast checks do not pass
    # is checked again by _entry, which says what is wrong with it.
    begins, sizes, keys, dtypes, shapes = [], [], [], [], []
    max_key = limits.MAX_KEY_LENGTH
    codes = SAFETENSORS_TO_TORCH
    for key, info in header.items():
        try:
            dtype = codes[info["dtype"]]
            shape = info["shape"]
            offsets = info["data_offsets"]
            numel = 1
            for s in shape:
                if type(s) is not int or not 0 <= s <= _U64_MAX:
                    raise TypeError
                numel *= s
                if numel > _U64_MAX:
                    raise TypeError
            begin, end = offsets
            if type(shape) is not list or type(offsets) is not list or type(begin) is not int or \
                    type(end) is not int or not 0 <= begin <= end <= data_len or len(key) > max_key or \
                    numel * ELEMENT_SIZE[dtype] != end - begin:
                raise TypeError
        except Exception:
            dtype, shape, begin, end = _entry(path, key, info, data_len)
        begins.append(begin)
        sizes.append(end - begin)
        keys.append(key)
        dtypes.append(dtype)
        shapes.append(tuple(shape))
    # In order of their bytes (keys are unique: tuples never compare past the key), each span after the last.
    spans = sorted(zip(begins, sizes, keys, dtypes, shapes))
    cursor = 0
    tie = False
    for begin, nbytes, key, _, _ in spans:
        if begin < cursor:
            raise ReadError(f"{path}: safetensors tensor {key} overlaps the tensor before it (corrupt header)")
        if begin > cursor:
            raise ReadError(f"{path}: safetensors data has a gap before tensor {key} (corrupt header)")
        tie = tie or begin == cursor and nbytes == 0
        cursor = begin + nbytes
    if cursor != data_len:
        raise ReadError(f"{path}: safetensors data is {data_len} bytes but the tensors cover {cursor} "
                        "(trailing or missing bytes)")
    if tie:  # empty tensors at the offset of another: listed by offset, then key
        spans.sort(key=lambda span: (span[0], span[2]))
    if spans:
        begins, sizes, keys, dtypes, shapes = (list(column) for column in zip(*spans))
    return _checkpoint(path, data_start, metadata, keys, dtypes, shapes, begins, sizes)


def _checkpoint(path: Path, data_start: int, metadata: dict, keys: list[str], dtypes: list[str], shapes: list,
                begins: list[int], sizes: list[int]) -> Checkpoint:
    """The Checkpoint of a checked header's columns, in order of the tensors' bytes."""
    table = TensorTable(keys, dtypes, shapes, file=path, file_offsets=list(map(add, begins, repeat(data_start))),
                        nbytes=sizes)
    table.checked = True  # keys are JSON strings, shapes JSON integers (checked above)
    return Checkpoint(path=path, format=Format.SAFETENSORS, tensors=table, metadata=dict(metadata),
                      globals=(), state_dict_root="" if keys else None, files=(path,))


# One entry of a header as the reference writer spells it (no blanks, its fields in its order), a comma after it, in
# three parts: the key (a JSON string without escapes), the dtype and shape (`F32","shape":[4,4`: a file has a few
# distinct ones, each then read once) and the two offsets (`0,64`: all of them then read as one JSON array).
_ENTRY = (r'"([^"\\\x00-\x1f]*)":\{"dtype":"([0-9A-Z_a-z]{1,16}","shape":\[[0-9,]*)\],'
          r'"data_offsets":\[([0-9]{1,20},[0-9]{1,20})\]\},')
_ENTRY_TEXT = len('"":{"dtype":"],"data_offsets":[]},')  # an entry's characters besides its three parts
_entries = None  # _ENTRY compiled, on the first header read
_U64_MAX = (1 << 64) - 1  # the library's dims and offsets are usize, their product checked as it is multiplied
_DIGITS_MAX = len(str(_U64_MAX))  # a dim of more digits is past it: refused before int() of it


def _compact_columns(raw: bytes, data_len: int) -> tuple | None:
    """A header as the reference writer spells it, read by one regex pass instead of a JSON parse and a walk of its
    20,000 objects (a fifth of the time): (metadata, keys, dtypes, shapes, begins, sizes), in order of the tensors'
    bytes, when every entry passes every check the general reading makes and the bytes lie in order, one tensor
    after the other from 0 to the end. None for anything else (other spacing or escapes in a key, an empty tensor,
    any fault): the general reading then decides, and names what is wrong.

    The entries are the header's text exactly: the regex's matches never overlap, so when their lengths add up to
    the text's, they tile it, and nothing (a nest, a second value, a stray byte) lies between them. Numbers are
    read by the JSON parser, which refuses what JSON does (a leading zero)."""
    global _entries
    try:
        text = raw.decode("utf-8").rstrip(" ")
    except UnicodeDecodeError:
        return None
    if text[:1] != "{" or text[-1:] != "}":
        return None
    import json

    metadata: dict = {}
    body = text[1:-1]
    if text.startswith('{"__metadata__":{'):  # where the reference writer puts it
        try:
            counts: list[int] = []  # each object's pairs, the metadata's last: a key twice is the general reading's
            decoder = json.JSONDecoder(object_pairs_hook=lambda pairs: counts.append(len(pairs)) or dict(pairs))
            metadata, end = decoder.raw_decode(text, 16)
        except (ValueError, RecursionError):
            return None
        if type(metadata) is not dict or counts[-1] != len(metadata) or \
                not all(type(v) is str for v in metadata.values()) or \
                "\\u" in text[16:end] and has_lone_surrogate(metadata, text[16:end]):
            return None
        if end == len(text) - 1:  # nothing but the metadata: its brace, then the header's
            return (metadata, [], [], [], [], []) if text[end] == "}" and data_len == 0 else None
        if text[end:end + 1] != "," or end + 2 >= len(text):
            return None
        body = text[end + 1:-1]
    if not body:  # "{}"
        return (metadata, [], [], [], [], []) if data_len == 0 else None
    if _entries is None:
        import re

        _entries = re.compile(_ENTRY)
    found = _entries.findall(body + ",")
    if not found:
        return None
    # columns by itemgetter, not zip(*found): that makes an iterator per entry
    keys, kinds, spans = (list(map(itemgetter(i), found)) for i in range(3))
    del found
    n = len(keys)
    if n * _ENTRY_TEXT + sum(map(len, keys)) + sum(map(len, kinds)) + sum(map(len, spans)) != len(body) + 1:
        return None  # text between the entries
    if len(set(keys)) != n or "__metadata__" in keys or max(map(len, keys)) > limits.MAX_KEY_LENGTH:
        return None
    dtype_of: dict[str, str] = {}
    shape_of: dict[str, tuple[int, ...]] = {}
    nbytes_of: dict[str, int] = {}
    try:
        for kind in set(kinds):  # a few distinct: each read once, the tensors of that shape share its tuple
            code, _, dims = kind.partition('","shape":[')
            dtype = dtype_of[kind] = SAFETENSORS_TO_TORCH[code]
            if len(dims) > _DIGITS_MAX and max(map(len, dims.split(","))) > _DIGITS_MAX:
                return None  # a dim past 64 bits, not read
            shape = shape_of[kind] = tuple(json.loads(f"[{dims}]"))  # digits and commas: ints, or a ValueError
            numel = 1
            for dim in shape:  # as the library multiplies: left to right, refused once past 64 bits
                numel *= dim
                if numel > _U64_MAX or dim > _U64_MAX:
                    return None
            nbytes_of[kind] = numel * ELEMENT_SIZE[dtype]
        offsets = json.loads(f"[{','.join(spans)}]")
    except (KeyError, ValueError):
        return None  # an unknown dtype, a number JSON refuses
    begins, ends = offsets[0::2], offsets[1::2]
    sizes = list(map(sub, ends, begins))
    if sizes != list(map(nbytes_of.__getitem__, kinds)) or min(sizes) <= 0:
        return None  # a shape that does not fill its span, or an empty tensor (listed by offset, then key)
    if not (begins[0] == 0 and ends[-1] == data_len and begins[1:] == ends[:-1]):
        order = sorted(range(n), key=begins.__getitem__)
        keys, kinds, begins, ends, sizes = ([column[i] for i in order] for column in (keys, kinds, begins, ends,
                                                                                        sizes))
        if not (begins[0] == 0 and ends[-1] == data_len and begins[1:] == ends[:-1]):
            return None  # a gap, an overlap, bytes past the tensors or a tensor past the data
    return metadata, keys, list(map(dtype_of.__getitem__, kinds)), list(map(shape_of.__getitem__, kinds)), begins, \
        sizes


def _entry(path: Path, key: str, info: object, data_len: int) -> tuple[str, list, int, int]:
    """One header entry checked by the reference parser's rules: (dtype, shape, begin, end), or the ReadError that
    says what is wrong with it."""
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
    if any(s > _U64_MAX for s in shape):
        raise ReadError(f"{path}: safetensors entry {key} has a dim past 2**64-1 in its shape {_short(shape)}")
    numel = 1
    for s in shape:
        numel *= s
        if numel > _U64_MAX:
            raise ReadError(f"{path}: safetensors entry {key}: its shape {_short(shape)} has more than 2**64-1 "
                            "elements (the product overflows 64 bits)")
    if numel * element_size(dtype) > _U64_MAX:
        raise ReadError(f"{path}: safetensors entry {key}: {dtype}{_short(shape)} is more than 2**64-1 bytes")
    if numel * element_size(dtype) != end - begin:
        raise ReadError(f"{path}: safetensors entry {key}: {dtype}{_short(shape)} needs "
                        f"{_short(numel * element_size(dtype))} bytes, its offsets give {end - begin}")
    return dtype, shape, begin, end


def _check_repeats(path: Path, header: dict, twice: dict[int, list], raw: bytes) -> None:
    """A key given twice, which JSON reads as its last: the library refuses __metadata__ or an entry's field twice,
    and reads every value of a metadata key and every entry of a tensor key, refusing one of the wrong type (of an
    entry valid in type, the last is kept)."""
    top = twice.get(id(header), ())
    seen: set[str] = set()
    for key, value in top:
        if key == "__metadata__" and key in seen:
            raise ReadError(f"{path}: safetensors header has __metadata__ twice (duplicate field)")
        seen.add(key)
    metadata = header.get("__metadata__")
    for key, value in twice.get(id(metadata), ()):
        if not isinstance(value, str):
            raise ReadError(f"{path}: safetensors __metadata__ must map strings to strings ({key} is "
                            f"{_short(value)})")
    for key, info in [*top, *header.items()]:
        fields = [field for field, _ in twice.get(id(info), ()) if field in ("dtype", "shape", "data_offsets")
                  and key != "__metadata__"]
        if len(set(fields)) != len(fields):
            field = next(f for f in fields if fields.count(f) > 1)
            raise ReadError(f"{path}: safetensors entry {key} has {field} twice (duplicate field)")
    for key, info in top:
        if key != "__metadata__" and key in header and header[key] is not info:  # an earlier entry of the key
            _entry_types(path, key, info)
    if has_lone_surrogate([list(pairs) for pairs in twice.values()], raw.decode("utf-8")):
        raise ReadError(f"{path}: safetensors header holds a lone UTF-16 surrogate (\\ud800-\\udfff), which JSON "
                        "readers refuse")


def _entry_types(path: Path, key: str, info: object) -> None:
    """An entry given before another of the same key: the library reads it as an entry (its fields of their types,
    numbers within 64 bits), then keeps the last."""
    def u64(value: object) -> bool:
        return type(value) is int and 0 <= value <= _U64_MAX

    if not isinstance(info, dict):
        raise ReadError(f"{path}: safetensors entry {key} (given twice) is not an object")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not (isinstance(code, str) and code in SAFETENSORS_TO_TORCH):
        raise ReadError(f"{path}: safetensors entry {key} (given twice) has unknown dtype {_short(code)}")
    if not (isinstance(shape, list) and all(map(u64, shape))):
        raise ReadError(f"{path}: safetensors entry {key} (given twice) has a bad shape {_short(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(u64, offsets))):
        raise ReadError(f"{path}: safetensors entry {key} (given twice) has bad data_offsets {_short(offsets)}")
