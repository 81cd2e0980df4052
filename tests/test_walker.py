"""The static walker against the authority it imitates: CPython's own pickle.Unpickler.

For generated pickles — random stack shuffles, memo games, every protocol's opcodes, concatenations, nested
pickles, EXT codes, random bytes — every global CPython's Unpickler asks `find_class` for (recorded, and answered
with an inert stand-in) must be among the globals the walker reports, unless the walker reported a name computed
while loading for that pickle.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_doctor.safepickle import limits
from ckpt_doctor.safepickle.policy import Verdict
from ckpt_doctor.safepickle.walker import walk


class _Inert:
    """What the recording unpickler hands out for every global: accepts any use, runs nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __setstate__(self, state):
        pass

    def append(self, item):
        pass

    def extend(self, items):
        pass

    def add(self, item):
        pass

    def __setitem__(self, key, value):
        pass


class _Recording(pickle.Unpickler):
    def __init__(self, file, asked, computed_str):
        super().__init__(file, encoding="utf-8")
        self.asked, self.computed_str = asked, computed_str

    def find_class(self, module, name):
        self.asked.append((module, name))
        if self.computed_str and (module, name) == ("builtins", "str"):
            return str  # lets a call produce the str a later STACK_GLOBAL uses
        return _Inert

    def persistent_load(self, pid):
        return _Inert()


def cpython_globals(data: bytes, computed_str: bool = False) -> list[tuple[str, str]]:
    """Every (module, name) CPython's Unpickler asks for, loading pickle after pickle as torch's legacy loader and a
    concatenation-reading caller would, until one fails."""
    asked: list[tuple[str, str]] = []
    stream = io.BytesIO(data)
    while stream.tell() < len(data):
        start = stream.tell()
        try:
            _Recording(stream, asked, computed_str).load()
        except Exception:
            break
        if stream.tell() == start:
            break
    return asked


def reported(data: bytes) -> tuple[set[tuple[str, str]], bool]:
    result = walk(data, "test")
    names = {(g.module, g.name) for g in result.globals}
    computed = any(g.module == "?" for g in result.globals)
    return names, computed


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _short(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


NAMES = [("os", "system"), ("builtins", "eval"), ("__builtin__", "eval"), ("torch", "Size"),
         ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"), ("torch", "os.system"),
         ("mypkg.nets", "Net"), ("builtins", "str"), ("copy_reg", "_reconstructor"), ("posix", "system"),
         ("subprocess", "Popen"), ("torch.nn.modules.linear", "Linear")]


@st.composite
def pickle_programs(draw) -> bytes:
    """Opcode streams that mostly follow the stack discipline (so they go deep) and sometimes break it."""
    out = bytearray()
    depth = 0  # items above the innermost MARK
    marks: list[int] = []
    memo = 0
    steps = draw(st.integers(1, 40))
    if draw(st.booleans()):
        out += b"\x80" + bytes([draw(st.integers(0, 5))])
    for _ in range(steps):
        kind = draw(st.integers(0, 27))
        module, name = draw(st.sampled_from(NAMES))
        if kind == 0:
            out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"
            depth += 1
        elif kind == 1:
            out += draw(st.sampled_from([_str, _short]))(module) + draw(st.sampled_from([_str, _short]))(name)
            out += draw(st.sampled_from([b"\x93", b"\x940\x93", b"2\x93", b"\x87\x93", b"\x93"]))
            depth += 1
        elif kind == 2:
            text = draw(st.sampled_from([module, name, "x"]))
            out += draw(st.sampled_from([_str(text), _short(text), b"V" + text.encode() + b"\n",
                                         b"S'" + text.encode() + b"'\n", b"U" + bytes([len(text)]) + text.encode(),
                                         b"C" + bytes([len(text)]) + text.encode()]))
            depth += 1
        elif kind == 3:
            out += draw(st.sampled_from([b"K\x05", b"M\x01\x02", b"J\x01\x00\x00\x00", b"N", b"\x88", b"\x89",
                                         b"I12\n", b"L5L\n", b"F1.5\n", b"\x8a\x01\x07", b"G" + b"\0" * 8]))
            depth += 1
        elif kind == 4:
            out += b"("
            marks.append(depth)
            depth = 0
        elif kind == 5 and marks:
            out += draw(st.sampled_from([b"t", b"l", b"d", b"\x91", b"1"]))
            depth = marks.pop() + (0 if out[-1:] == b"1" else 1)
        elif kind == 6 and depth >= 1:
            out += draw(st.sampled_from([b"\x85", b"0", b"2"]))
            depth += {b"\x85": 0, b"0": -1, b"2": 1}[bytes(out[-1:])]
        elif kind == 7 and depth >= 2:
            out += draw(st.sampled_from([b"R", b"\x81", b"b", b"a", b"\x86"]))
            depth -= 1
        elif kind == 8 and depth >= 1:
            op = draw(st.sampled_from(["q", "r", "p", "\x94"]))
            if op == "q":
                out += b"q" + bytes([memo % 256])
            elif op == "r":
                out += b"r" + struct.pack("<I", memo)
            elif op == "p":
                out += b"p" + str(memo).encode() + b"\n"
            else:
                out += b"\x94"
            memo += 1
        elif kind == 9 and memo:
            index = draw(st.integers(0, memo - 1))
            out += draw(st.sampled_from([b"h" + bytes([index % 256]), b"j" + struct.pack("<I", index),
                                         b"g" + str(index).encode() + b"\n"]))
            depth += 1
        elif kind == 10 and marks:
            out += b"i" + module.encode() + b"\n" + name.encode() + b"\n"
            depth = marks.pop() + 1
        elif kind == 11 and marks and depth >= 1:
            out += b"o"
            depth = marks.pop() + 1
        elif kind == 12:
            out += draw(st.sampled_from([b"\x82\x01", b"\x83\x02\x00", b"\x84\x03\x00\x00\x00", b"\x82\xf0"]))
            depth += 1
        elif kind == 13 and depth >= 1:
            out += b"Q"
        elif kind == 14:
            inner = draw(pickle_programs())
            out += draw(st.sampled_from([b"B" + struct.pack("<I", len(inner)),
                                         b"\x8e" + struct.pack("<Q", len(inner))]))
            out += inner
            depth += 1
        elif kind == 15:
            out += bytes([draw(st.integers(0, 255))])  # anything at all
        elif kind == 16 and depth >= 1:
            out += b"."  # a STOP, and maybe a concatenated pickle after it
            depth = 0
            marks = []
            memo = 0
        elif kind == 17 and depth >= 3:
            out += b"s" if draw(st.booleans()) else b"\x92"
            depth -= 2
        elif kind == 18:
            body = draw(pickle_programs())
            out += b"\x95" + struct.pack("<Q", draw(st.sampled_from([0, len(body), len(body) + 5]))) + body
        elif kind == 19:
            out += b"}" if draw(st.booleans()) else b"]"
            depth += 1
        elif kind == 20 and marks and depth % 2 == 0 and depth:
            out += b"u"
            depth = marks.pop()
        elif kind == 21:
            out += b"cbuiltins\nstr\n" + b"(" + _str(module) + b"tR" + _short(name) + b"\x93"  # a computed name
            depth += 1
        elif kind == 22:
            out += b"P" + b"abc" + b"\n"
            depth += 1
        elif kind in (23, 24) and depth >= 1:
            out += b"."
            depth = 0
            marks = []
            memo = 0
        elif kind == 25:
            out += b"\x80" + bytes([draw(st.integers(0, 7))])
        elif kind == 26:
            out += b")"
            depth += 1
        elif kind == 27 and marks:
            out += b"e" if draw(st.booleans()) else b"\x90"
            depth = marks.pop()
    if depth and draw(st.integers(0, 4)):
        out += b"."
    return bytes(out)


@pytest.fixture
def extension_codes():
    copyreg.add_extension("os", "system", 1)
    copyreg.add_extension("mypkg.nets", "Net", 2)
    yield
    copyreg.remove_extension("os", "system", 1)
    copyreg.remove_extension("mypkg.nets", "Net", 2)


@settings(max_examples=700, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=pickle_programs(), computed=st.booleans())
def test_walker_reports_every_global_cpython_asks_for(data, computed):
    asked = cpython_globals(data, computed)
    names, computed_reported = reported(data)
    missed = [g for g in asked if g not in names]
    assert not missed or computed_reported, (data, missed)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=pickle_programs())
def test_extension_codes_resolve_through_copyregs_registry(extension_codes, data):
    asked = cpython_globals(data)
    names, computed = reported(data)
    assert all(g in names for g in asked) or computed


def test_ext_codes_nobody_registered_stop_the_walk_as_they_stop_cpython():
    # A safetensors file whose header length starts with byte 0x82 reads as EXT1 5: not a finding.
    result = walk(b"\x80\x02\x82\x09.", "x")
    assert result.globals == [] and "extension code 9" in result.broken
    with pytest.raises(ValueError, match="unregistered extension code"):
        pickle.loads(b"\x80\x02\x82\x09.")


def test_stack_global_takes_its_operands_from_the_stack_not_the_last_strings_seen():
    # "os" "system" are the last two strings, but a POP drops "system": the operands are "os" and "posix"? No —
    # the stack holds "torch", "os" when STACK_GLOBAL runs; the walker must say torch.os, as CPython asks.
    data = b"\x80\x04" + _short("torch") + _short("os") + _short("system") + b"0\x93."
    assert cpython_globals(data) == [("torch", "os")]
    names, _ = reported(data)
    assert ("torch", "os") in names and ("os", "system") not in names


def test_memo_is_numbered_by_index_not_by_strings_seen():
    # MEMOIZE numbers every memoized value, strings or not; BINGET 1 is the second memoized value: "system".
    data = b"\x80\x04N\x94" + _short("system") + b"\x94" + _short("os") + b"h\x01\x93."
    assert cpython_globals(data) == [("os", "system")]
    names, _ = reported(data)
    assert names == {("os", "system")}


def test_later_pickles_without_proto_are_walked():
    # A protocol-1 pickle after a protocol-2 one (legacy files saved with pickle_protocol=1).
    data = b"\x80\x02}." + b"(cos\nsystem\nS'ls'\ntR."
    assert ("os", "system") in reported(data)[0]


def test_globals_before_a_break_are_kept():
    data = b"\x80\x02cos\nsystem\n(X\x02\x00\x00\x00ls"  # cut inside the argument tuple
    result = walk(data, "x")
    assert result.broken and [g.qualname for g in result.globals] == ["os.system"]


def test_a_memo_bomb_is_refused_before_anything_unpickles_it():
    result = walk(b"\x80\x02Nr\xff\xff\xff\x7f.", "x")
    assert result.refused and "memo index" in result.refused
    assert limits.max_memo_index(9) < 0x7FFFFFFF


def test_dotted_names_are_judged_hop_by_hop():
    data = b"\x80\x04" + _short("torch") + _short("serialization.os.system") + b"\x93."
    (ref,) = walk(data, "x").globals
    assert ref.verdict is Verdict.DANGEROUS
    allowed = b"\x80\x04" + _short("torch") + _short("nn.parameter.Parameter") + b"\x93."
    assert walk(allowed, "x").globals[0].verdict is Verdict.SAFE


def test_a_pickle_inside_bytes_is_walked():
    inner = b"\x80\x02cos\nsystem\n)R."
    data = b"\x80\x03B" + struct.pack("<I", len(inner)) + inner + b"."
    assert ("os", "system") in reported(data)[0]
    latin = inner.decode("latin-1")  # protocol 2 writes bytes as _codecs.encode(str, 'latin1')
    data2 = b"\x80\x02c_codecs\nencode\n" + _str(latin) + _str("latin1") + b"\x86R."
    assert ("os", "system") in reported(data2)[0]
