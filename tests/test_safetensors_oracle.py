"""The safetensors library is the authority on safetensors files: ckpt-doctor's own header reader (kept because the
library does not say where each tensor's bytes lie) must read what the library reads, with the same names, dtypes,
shapes and metadata, and refuse what the library refuses."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors import safe_open
from safetensors.torch import save

from ckpt_doctor.errors import ReadError
from ckpt_doctor.readers import read_checkpoint

BASE = save({"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.float16)},
            metadata={"k": "v"})
HEADER = json.loads(BASE[8:8 + struct.unpack("<Q", BASE[:8])[0]])
DATA = BASE[8 + struct.unpack("<Q", BASE[:8])[0]:]


def blob(header: object = None, data: bytes = DATA, *, raw: bytes | None = None, pad: bool = True) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    if pad and raw is None:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def edited(edit) -> dict:
    header = json.loads(json.dumps(HEADER))
    edit(header)
    return header


CASES = {
    "valid": blob(HEADER),
    "unpadded header": blob(HEADER, pad=False),
    "header after spaces": blob(raw=b"  " + json.dumps(HEADER).encode()),
    "no tensors": blob({}, b""),
    "metadata only": blob({"__metadata__": {"x": "y"}}, b""),
    "a key twice": blob(raw=(json.dumps(HEADER)[:-1] + ', "a": ' + json.dumps(HEADER["a"]) + "}").encode()),
    "an empty tensor": blob({"z": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}}, b""),
    "a field it ignores": blob(edited(lambda h: h["a"].__setitem__("extra", 1))),
    "bool": blob({"m": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}}, b"\1\0\1"),
    "float8": blob({"m": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, b"\1\0"),
    "overlapping tensors": blob(edited(lambda h: h["b"].__setitem__("data_offsets", [8, 20]))),
    "a gap": blob(edited(lambda h: h["b"].__setitem__("data_offsets", [20, 32])), DATA + b"\0" * 4),
    "past the end": blob(edited(lambda h: h["b"].__setitem__("data_offsets", [16, 40]))),
    "shape against span": blob(edited(lambda h: h["b"].__setitem__("shape", [2, 2]))),
    "unknown dtype": blob(edited(lambda h: h["a"].__setitem__("dtype", "F128"))),
    "negative dim": blob(edited(lambda h: h["a"].__setitem__("shape", [-4]))),
    "float offsets": blob(edited(lambda h: h["a"].__setitem__("data_offsets", [0.0, 16.0]))),
    "float dims": blob(edited(lambda h: h["a"].__setitem__("shape", [4.0]))),
    "a field missing": blob(edited(lambda h: h["a"].pop("shape"))),
    "dims that overflow": blob(edited(lambda h: h["a"].__setitem__("shape", [2**62, 2**62]))),
    "data not from 0": blob(edited(lambda h: (h["a"].__setitem__("data_offsets", [4, 20]),
                                             h["b"].__setitem__("data_offsets", [20, 32]))), b"\0" * 4 + DATA),
    "bytes after the data": blob(HEADER, DATA + b"\0" * 8),
    "metadata value not text": blob(edited(lambda h: h["__metadata__"].__setitem__("k", 3))),
    "metadata not an object": blob(edited(lambda h: h.__setitem__("__metadata__", "x"))),
    "header length past the end": struct.pack("<Q", 1 << 40) + BASE[8:],
    "header length 0": struct.pack("<Q", 0) + DATA,
    "header not JSON": blob(raw=b"{not json}      "),
    "header a JSON list": blob(raw=b"[1, 2, 3]       "),
    "header not UTF-8": blob(raw=json.dumps(HEADER).encode()[:-1] + b',"\xff":1}'),
    # where the library's JSON reader (serde_json) and Python's differ: nesting, numbers, a key twice
    "metadata null": blob(edited(lambda h: h.__setitem__("__metadata__", None))),
    "a nest 127 deep": blob(edited(lambda h: h["a"].__setitem__("x", nested(125)))),
    "a nest 128 deep": blob(edited(lambda h: h["a"].__setitem__("x", nested(126)))),
    "dims to 2**64-1, then 0": blob({"z": {"dtype": "U8", "shape": [2**64 - 1, 0], "data_offsets": [0, 0]}}, b""),
    "dims past 2**64-1, then 0": blob({"z": {"dtype": "U8", "shape": [2**64 - 1, 2, 0], "data_offsets": [0, 0]}},
                                      b""),
    "a dim past 2**64-1 after a 0": blob({"z": {"dtype": "U8", "shape": [0, 2**64], "data_offsets": [0, 0]}}, b""),
    "a key twice, the first's span wrong": blob(raw=json.dumps(HEADER).replace(
        '"a": {', '"a": {"dtype": "F32", "shape": [5], "data_offsets": [0, 99]}, "a": {', 1).encode()),
    "a key twice, the first's offset past 64 bits": blob(raw=json.dumps(HEADER).replace(
        '"a": {', '"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, %d]}, "a": {' % 2**64, 1).encode()),
    "an entry's field twice": blob(raw=json.dumps(HEADER).replace('"dtype": "F32"', '"dtype": "F32", "dtype": "F32"',
                                                                  1).encode()),
    "an ignored field twice": blob(raw=json.dumps(HEADER).replace('"dtype": "F32"', '"x": 1, "x": 2, "dtype": "F32"',
                                                                  1).encode()),
    "a metadata key twice": blob(raw=json.dumps(HEADER).replace('"k": "v"', '"k": "w", "k": "v"', 1).encode()),
    "-Infinity": blob(raw=json.dumps(HEADER).replace('"dtype": "F32"', '"x": -Infinity, "dtype": "F32"').encode()),
    "a number below the smallest double": blob(raw=json.dumps(HEADER).replace('"dtype": "F32"',
                                                                              '"x": 1e-400, "dtype": "F32"').encode()),
    "an integer past 64 bits in an ignored field": blob(edited(lambda h: h["a"].__setitem__("x", 10**30))),
}


def library_view(path) -> dict | None:
    """What the library reads: {name: (dtype, shape)} and the metadata, or None where it refuses the file."""
    try:
        with safe_open(str(path), framework="np") as f:
            tensors = {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}
            return {"tensors": tensors, "metadata": f.metadata() or {}}
    except Exception:  # SafetensorError and friends: refused
        return None


def our_view(path) -> dict | None:
    try:
        ckpt = read_checkpoint(path)
    except ReadError:
        return None
    from ckpt_doctor.dtypes import TORCH_TO_SAFETENSORS

    return {"tensors": {t.key: (TORCH_TO_SAFETENSORS[t.dtype], list(t.shape)) for t in ckpt.tensors},
            "metadata": ckpt.metadata or {}}


def compact(data: bytes) -> bytes:
    """The file with its header spelled as the library writes one, without blanks (`{"a":{"dtype":"F32",...`): the
    spelling the reader takes in one pass. The headers above hold no blank inside a string."""
    n = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else 0
    if n > len(data):
        return data
    header = data[8:8 + n].rstrip(b" ").replace(b", ", b",").replace(b": ", b":")
    return blob(raw=header + b" " * (-len(header) % 8), data=data[8 + n:])


@pytest.mark.parametrize("spelling", ["as dumped", "compact"])
@pytest.mark.parametrize("name", list(CASES))
def test_read_and_refused_as_the_library_reads_and_refuses(name, spelling, tmp_path):
    path = tmp_path / "case.safetensors"
    path.write_bytes(CASES[name] if spelling == "as dumped" else compact(CASES[name]))
    theirs, ours = library_view(path), our_view(path)
    assert (ours is None) == (theirs is None), (name, theirs, ours)
    if theirs is not None:
        assert ours == theirs


def test_the_library_s_own_spelling_is_what_the_compact_cases_hold(tmp_path):
    """The compact cases are spelled as the library writes: its own file of the same tensors is the valid case."""
    assert compact(CASES["valid"]) == BASE


def test_the_cases_include_files_the_library_reads_and_files_it_refuses(tmp_path):
    verdicts = []
    for data in CASES.values():
        path = tmp_path / "case.safetensors"
        path.write_bytes(data)
        verdicts.append(library_view(path) is not None)
    assert sum(verdicts) >= 8 and verdicts.count(False) >= 15


DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "BOOL": 1, "F64": 8}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 4), max_size=3),
                                  st.integers(-3, 3), st.integers(-3, 3)), max_size=4),
       extra=st.integers(-2, 2), order=st.permutations(range(4)), spelled_compact=st.booleans())
def test_random_headers_get_the_library_s_verdict(tmp_path, entries, extra, order, spelled_compact):
    """Headers built from random entries, each offset nudged by a few bytes and the data a few bytes short or long:
    whatever the library decides, this reader decides."""
    header, at = {}, 0
    for i, (dtype, shape, nudge_start, nudge_end) in enumerate(entries):
        nbytes = DTYPES[dtype]
        for dim in shape:
            nbytes *= dim
        start = max(at + nudge_start, 0)
        header[f"t{order[i]}"] = {"dtype": dtype, "shape": shape, "data_offsets": [start, max(start + nbytes +
                                                                                               nudge_end, 0)]}
        at += nbytes
    path = tmp_path / "random.safetensors"
    data = blob(header, b"\0" * max(at + extra, 0))
    path.write_bytes(compact(data) if spelled_compact else data)
    theirs, ours = library_view(path), our_view(path)
    assert (ours is None) == (theirs is None), (header, at + extra, theirs)
    if theirs is not None:
        assert ours == theirs
