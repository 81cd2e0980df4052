"""DCP chunk items exactly as torch's FileSystemWriter writes them, read from their bytes in a few microseconds.

A chunk's item is a `torch.save` archive of one tensor. torch's writer lays it out the same way every time: the
members `archive/data.pkl`, `.format_version` ("1"), `.storage_alignment` ("64"), `byteorder` ("little"),
`data/0`, `version` ("3\\n") and `.data/serialization_id` (40 digits), in that order, stored, each local header
padded (an "FB" extra field of "Z"s) so that its data starts on a 64-byte boundary, each followed by a data
descriptor when it is not empty; then the central directory, a zip64 end record, its locator and the end record.
Given the sizes of data.pkl and data/0, every other byte of the structure is known: the item is matched against
that template (its end by one regex, the bytes between data.pkl and data/0 by another, the directory's variable
fields by one struct and a tuple comparison) instead of being surveyed and read as a general zip.

What the bytes of a data.pkl mean is learnt from the general reading (dcp._Items): the first item with those
bytes is surveyed, walked and read as before, and what came of it (the tensor's dtype, shape, stride, storage
offset and size, the walk's cost and globals) is kept; later items with the same bytes reuse it, checked against
their own sizes and crc. The walk budget is debited by the walk's cost as ItemCache debits it, and an item whose
debit the budget cannot pay is declined. Anything off the template is declined too (None): the caller reads it
the general way, which says what is wrong with it.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import zlib

from .._record import fast_new
from ..records import Piece

ENABLED = True  # False: every item is read the general way (what the differential test compares with)

_NAMES = tuple(b"archive/" + n for n in (b"data.pkl", b".format_version", b".storage_alignment", b"byteorder",
                                         b"data/0", b"version", b".data/serialization_id"))
_PKL, _DATA, _ID = 0, 4, 6
_CONTENT = {1: b"1", 2: b"64", 3: b"little", 5: b"3\n"}  # the fixed records' bytes
_ID_LEN = 40
_ALIGN = 64
_CD_SIZE = sum(46 + len(n) for n in _NAMES)
_TAIL = _CD_SIZE + 56 + 20 + 22  # the directory and the three end records
_HEAD = 64  # data.pkl's local header: its data starts at byte 64
WHOLE = 64 << 10  # an item up to this size is read in one call; a bigger one as its head and its tail
_TAIL_READ = 4096  # what is read of a big item's end (the records after data/0, the directory, the end records)
_MAX_MEANINGS = 16_384  # distinct data.pkl byte strings kept (each a few hundred bytes) ...
_MAX_PICKLE = 64 << 10  # ... of at most this size (ItemCache's bound: a bigger one is walked anew every time)
_MAX_FDS = 128  # shard files held open at once
PICKLE_NAME = _NAMES[_PKL].decode()


def _sizes(pkl: int, data: int) -> list[int]:
    return [pkl, 1, 2, 6, data, 2, _ID_LEN]


def _data_start(header_at: int, name: bytes) -> int:
    """torch's getPadding: past the 30-byte header, the name and the 4 bytes of the "FB" field, to a 64-byte
    boundary (records and offsets under 4 GB: no zip64 extra)."""
    start = header_at + 30 + len(name) + 4
    return start + (-start % _ALIGN)


def _layout(pkl: int, data: int) -> tuple[list[int], list[int], int]:
    """Where each member's local header and data start, and where the directory starts."""
    headers, starts = [], []
    at = 0
    for name, size in zip(_NAMES, _sizes(pkl, data)):
        headers.append(at)
        start = _data_start(at, name)
        starts.append(start)
        at = start + size + (16 if size else 0)  # a data descriptor after a member that is not empty
    return headers, starts, at


def _spans(pkl: int, data: int) -> list[tuple[int, str, bytes | int]]:
    """The item as (position, kind, literal bytes or a length): "lit" bytes every such item has there; "any" bytes
    that vary (crc, sizes and offsets, checked apart; the pickle; the tensor's bytes); "digits" the serialization
    id. A directory field that varies is "any" here and checked by the struct of _Template."""
    headers, starts, cd = _layout(pkl, data)
    out: list[tuple[int, str, bytes | int]] = []
    sizes = _sizes(pkl, data)
    for i, (name, size, at, start) in enumerate(zip(_NAMES, sizes, headers, starts)):
        flags = 0x0808 if size else 0x0800  # bit 3: sizes in a descriptor after the data; bit 11: UTF-8 names
        pad = start - (at + 30 + len(name) + 4)
        out.append((at, "lit", b"PK\x03\x04" + struct.pack("<HHHHHIIIHH", 0, flags, 0, 0, 0, 0, 0, 0, len(name),
                                                            pad + 4) + name + b"FB" + struct.pack("<H", pad)
                    + b"Z" * pad))
        if i in _CONTENT:
            content = _CONTENT[i]
            out.append((start, "lit", content))
            out.append((start + size, "lit", b"PK\x07\x08" + struct.pack("<III", zlib.crc32(content), size, size)))
            continue
        if size:
            out.append((start, "digits" if i == _ID else "any", size))
            out.append((start + size, "lit", b"PK\x07\x08"))  # its crc and sizes: the directory's are read
            out.append((start + size + 4, "any", 12))
    p = cd
    for i, (name, at) in enumerate(zip(_NAMES, headers)):
        out.append((p, "lit", b"PK\x01\x02" + b"\0" * 4))
        out.append((p + 8, "any", 2))  # flags (0x0800 for an empty data/0): the struct's
        out.append((p + 10, "lit", b"\0" * 6))  # stored; no time, no date
        out.append((p + 16, "any", 12))  # crc, sizes: the struct's
        out.append((p + 28, "lit", struct.pack("<HHHHHI", len(name), 0, 0, 0, 0, 0)))
        out.append((p + 42, "any", 4))  # the local header's offset
        out.append((p + 46, "lit", name))
        p += 46 + len(name)
    count = len(_NAMES)
    out.append((p, "lit", b"PK\x06\x06" + struct.pack("<QHHIIQQQ", 44, 0x031E, 45, 0, 0, count, count, _CD_SIZE)))
    out.append((p + 48, "any", 8))
    out.append((p + 56, "lit", b"PK\x06\x07" + struct.pack("<I", 0)))
    out.append((p + 64, "any", 8))
    out.append((p + 72, "lit", struct.pack("<I", 1) + b"PK\x05\x06" + struct.pack("<HHHHI", 0, 0, count, count,
                                                                                  _CD_SIZE)))
    out.append((p + 92, "any", 4))
    out.append((p + 96, "lit", b"\0\0"))
    return out


def _regex(spans: list[tuple[int, str, bytes | int]], lo: int, hi: int, tail: str = "") -> re.Pattern:
    """A pattern of the item's bytes [lo, hi) (span boundaries), `tail` appended."""
    parts = []
    for at, kind, value in spans:
        if lo <= at < hi:
            if kind == "lit":
                parts.append(re.escape(value))
            else:
                parts.append((b"[0-9]" if kind == "digits" else b".") + b"{%d}" % value)
    return re.compile(b"".join(parts) + tail.encode(), re.DOTALL)


# The directory's fields that vary, read with one struct from its start: (offset in the directory, format).
def _fields() -> tuple[struct.Struct, struct.Struct, list[tuple[int, str]]]:
    varying, crcs = [], []
    p = 0
    for i, name in enumerate(_NAMES):
        varying += [(p + 8, "H")]  # flags (0x0800 for an empty data/0)
        (crcs if i in (_PKL, _DATA) else varying if i in _CONTENT else []).append((p + 16, "I"))
        varying += [(p + 20, "I"), (p + 24, "I"), (p + 42, "I")]  # compressed size, size, local header offset
        p += 46 + len(name)
    varying += [(p + 48, "Q"), (p + 64, "Q"), (p + 92, "I")]  # the zip64 record's and the end record's directory
    # offset, and where the zip64 record is

    def make(fields: list[tuple[int, str]]) -> struct.Struct:
        fmt, at = "<", 0
        for where, kind in sorted(fields):
            fmt += f"{where - at}x{kind}" if where > at else kind
            at = where + struct.calcsize("<" + kind)
        return struct.Struct(fmt)

    return make(varying), make(crcs), sorted(varying)


_VARYING, _CRCS, _VARYING_AT = _fields()
# where data.pkl's and data/0's sizes are in _VARYING's tuple
_PKL_SIZE = _VARYING_AT.index((24, "I"))
_DATA_SIZE = _VARYING_AT.index((sum(46 + len(n) for n in _NAMES[:_DATA]) + 24, "I"))


def _expected(pkl: int, data: int) -> tuple[int, ...]:
    """_VARYING's tuple for an item of torch's writer with these sizes."""
    headers, _starts, cd = _layout(pkl, data)
    out = []
    for i, (size, at) in enumerate(zip(_sizes(pkl, data), headers)):
        out.append(0x0808 if size else 0x0800)
        if i in _CONTENT:
            out.append(zlib.crc32(_CONTENT[i]))
        out += [size, size, at]
    return tuple(out + [cd, cd + _CD_SIZE, cd])


class _Template:
    """What one pair of sizes (data.pkl's, data/0's) gives: the expected directory fields, where data/0 starts and
    ends, the item's length."""

    __slots__ = ("expected", "data_start", "data_end", "length", "mid", "end")

    def __init__(self, pkl: int, data: int, mid: re.Pattern, end: re.Pattern) -> None:
        self.expected = _expected(pkl, data)
        _headers, starts, cd = _layout(pkl, data)
        self.data_start = starts[_DATA]
        self.data_end = starts[_DATA] + data
        self.length = cd + _TAIL
        self.mid, self.end = mid, end


_MID: dict[tuple[int, bool], re.Pattern] = {}  # data.pkl's end to data/0's start, by data.pkl's size mod 64
_END: dict[tuple[int, bool], re.Pattern] = {}  # data/0's end to the item's end, by data/0's size mod 64
_HEADER = b"".join(v for at, kind, v in _spans(1, 1) if at < _HEAD and kind == "lit")  # data.pkl's local header


def _template(pkl: int, data: int) -> _Template:
    mid_key, end_key = (pkl % _ALIGN, data == 0), (data % _ALIGN, data == 0)
    mid, end = _MID.get(mid_key), _END.get(end_key)
    if mid is None or end is None:
        spans = _spans(pkl, data)
        _h, starts, _cd = _layout(pkl, data)
        # data/0 must not start with NumPy's magic (np.load, and the survey, would read it as an array)
        mid = _MID.setdefault(mid_key, _regex(spans, _HEAD + pkl, starts[_DATA], r"(?!\x93NUMPY)"))
        end = _END.setdefault(end_key, _regex(spans, starts[_DATA] + data, 1 << 62, r"\Z"))
    return _Template(pkl, data, mid, end)


assert len(_HEADER) == _HEAD


class Meaning:
    """What the general reading made of an item with these data.pkl bytes: its crc32, the walk's cost, the tensor
    (dtype, shape, stride, byte offset in its storage, the storage's bytes), and whether the chunk is its whole
    storage read contiguously (its piece then carries data/0's crc when data/0 is exactly that storage)."""

    __slots__ = ("crc", "cost", "dtype", "shape", "stride", "skip", "nbytes", "whole", "length")

    def __init__(self, crc: int, cost: tuple[int, ...], dtype: str, shape: tuple, stride: tuple, skip: int,
                 nbytes: int, whole: bool, length: int) -> None:
        self.crc, self.cost, self.dtype, self.shape, self.stride = crc, cost, dtype, shape, stride
        self.skip, self.nbytes, self.whole, self.length = skip, nbytes, whole, length


class Pending:
    """An item on the template whose data.pkl is not known yet: read the general way, then learnt (ChunkItems.learn)."""

    __slots__ = ("pkl", "pkl_crc", "data", "data_crc", "data_start")

    def __init__(self, pkl: bytes, pkl_crc: int, data: int, data_crc: int, data_start: int) -> None:
        self.pkl, self.pkl_crc, self.data, self.data_crc, self.data_start = pkl, pkl_crc, data, data_crc, data_start


class ChunkItems:
    """The shard files, each opened once; the items read on the template; what each data.pkl's bytes mean."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        self.meanings: dict[bytes, Meaning] = {}
        self.templates: dict[tuple[int, int], _Template] = {}
        self.used = 0  # items read here (the rest: the general way)

    def close(self) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            os.close(fd)

    def _fd(self, rel: str, path) -> int | None:
        fd = self.fds.get(rel)
        if fd is not None:
            return fd
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            return None  # (the general reading says why)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                return None
        except OSError:
            os.close(fd)
            return None
        if len(self.fds) >= _MAX_FDS:
            os.close(self.fds.pop(next(iter(self.fds))))
        self.fds[rel] = fd
        return fd

    def parse(self, fd: int, at: int, length: int) -> Pending | None:
        """The item's variable fields when its bytes are torch's writer's, byte for byte; None otherwise."""
        if length < _HEAD + _TAIL:
            return None
        try:
            if length <= WHOLE:
                head = tail = os.pread(fd, length, at)
                if len(head) != length:
                    return None
                base = 0
            else:
                base = length - _TAIL_READ
                tail = os.pread(fd, _TAIL_READ, at + base)
                head = b""
                if len(tail) != _TAIL_READ:
                    return None
        except OSError:
            return None
        p = length - _TAIL - base
        fields = _VARYING.unpack_from(tail, p)
        pkl, data = fields[_PKL_SIZE], fields[_DATA_SIZE]
        key = (pkl, data)
        t = self.templates.get(key)
        if t is None:
            if pkl > _MAX_PICKLE or data >= 0xFFFFFFFF - (1 << 20):  # (zip64 extras past 4 GB: not the template)
                return None
            t = _template(pkl, data)
            if len(self.templates) < 4096:
                self.templates[key] = t
        if fields != t.expected or t.length != length or t.data_end < base:
            return None
        if t.end.match(tail, t.data_end - base) is None:
            return None
        if base:
            try:
                head = os.pread(fd, t.data_start + 6, at)
            except OSError:
                return None
            if len(head) != t.data_start + 6:
                return None
        if not head.startswith(_HEADER) or t.mid.match(head, _HEAD + pkl) is None:
            return None
        pkl_crc, data_crc = _CRCS.unpack_from(tail, p)
        return Pending(head[_HEAD:_HEAD + pkl], pkl_crc, data, data_crc, t.data_start)

    def piece(self, items, rel: str, path, at: int, fqn: str, offsets: tuple, sizes: tuple,
              dtype: str, length: int) -> Piece | Pending | None:
        """The chunk's piece read on the template; a Pending when its data.pkl is not known yet; None when the item
        is off the template, or anything about it is not what the general reading accepted before."""
        fd = self._fd(rel, path)
        if fd is None:
            return None
        item = self.parse(fd, at, length)
        if item is None:
            return None
        m = self.meanings.get(item.pkl)
        if m is None:
            return item
        if m.crc != item.pkl_crc or m.shape != sizes or m.dtype != dtype or item.data < m.nbytes:
            return None
        budget = items.budget
        c0, c1, c2 = m.cost
        if budget[0] < c0 or budget[1] < c1 or budget[2] < c2:
            return None  # what ItemCache.walk would not pay: a walk of its own meets the limit
        budget[0] -= c0
        budget[1] -= c1
        budget[2] -= c2
        items.walked_bytes += m.length
        self.used += 1
        return _piece(m, item, path, rel, at, offsets, sizes)

    def learn(self, item: Pending, walk_and_cost, rec, chunk, piece: Piece, path, rel: str, at: int) -> None:
        """Keep what the general reading made of `item`'s data.pkl (`rec`: its tensor; `walk_and_cost`: what
        ItemCache holds for its bytes), when the item is one the template's reading would give the same piece of."""
        if walk_and_cost is None or len(self.meanings) >= _MAX_MEANINGS or len(item.pkl) > _MAX_PICKLE \
                or item.pkl[:2] != b"\x80\x02" or zlib.crc32(item.pkl) != item.pkl_crc:
            return
        walk, cost = walk_and_cost
        storage = rec.storage
        if walk.refused or walk.anomalies or walk.effects or chunk.big_endian or storage.deflated \
                or storage.entry != _NAMES[_DATA].decode() or storage.nbytes > item.data or len(cost) != 3:
            return
        whole = rec.storage_offset == 0 and rec.nbytes == storage.nbytes and rec.is_contiguous
        m = Meaning(item.pkl_crc, tuple(cost), rec.dtype, tuple(rec.shape), tuple(rec.stride),
                    rec.file_offset - storage.offset, storage.nbytes, whole, len(item.pkl))
        if storage.offset != at + item.data_start or _piece(m, item, path, rel, at, piece.offsets,
                                                            piece.sizes) != piece:
            return
        self.meanings[item.pkl] = m


def _piece(m: Meaning, item: Pending, path, rel: str, at: int, offsets: tuple, sizes: tuple) -> Piece:
    return fast_new(Piece, file=path, offset=at + item.data_start + m.skip, offsets=offsets, sizes=sizes,
                    stride=m.stride, label=f"{rel} item at byte {at}",
                    crc=item.data_crc if m.whole and item.data == m.nbytes else None)
