"""DCP chunk items exactly as torch's FileSystemWriter writes them, read from their bytes in a few microseconds.

A chunk's item is a `torch.save` archive of one tensor. torch's writer lays it out the same way every time: the
members `archive/data.pkl`, `.format_version` ("1"), `.storage_alignment` ("64"), `byteorder` ("little"),
`data/0`, `version` ("3\\n") and `.data/serialization_id` (40 digits), in that order, stored, each local header
padded (an "FB" extra field of "Z"s) so that its data starts on a 64-byte boundary, each followed by a data
descriptor when it is not empty; then the central directory, a zip64 end record, its locator and the end record.
Given the sizes of data.pkl and data/0 (read from the directory), every other byte the general reading looks at
is known: the item's bytes are compared with that template's literal runs (a few `startswith` calls) instead of
being surveyed and read as a general zip. Only bytes no reader looks at may differ from it: the data descriptors
after data.pkl, data/0 and the id (miniz, and zipindex, read sizes and crcs from the directory), the id's digits
and its crc in the directory (read by nobody). data.pkl's bytes and crc, and data/0's crc, are the item's own.
Small items are read a block of them at a time, from each shard file opened once.

What the bytes of a data.pkl mean is learnt from the general reading (dcp._Items): the first item with those
bytes is surveyed, walked and read as before, and what came of it (the tensor's dtype, shape, stride, storage
offset and size, the walk's cost and globals) is kept; later items with the same bytes reuse it, checked against
their own sizes and crc. The walk budget is debited by the walk's cost as ItemCache debits it, and an item whose
debit the budget cannot pay is declined. Anything off the template is declined too (None): the caller reads it
the general way, which says what is wrong with it.
"""

from __future__ import annotations

import os
import stat
import struct
import zlib
from bisect import bisect_left
from operator import attrgetter, getitem, itemgetter

from .._record import fast_new
from ..errors import CkptDoctorError
from ..records import Piece
from .held import Holder
from .source import RemotePath
from .zipindex import torch_data_at

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from pathlib import Path

ENABLED = True  # False: every item is read the general way (what the differential test compares with)
BULK_MIN = 4096  # a folder whose metadata names this many entries has its shard files' items parsed in bulk (NumPy)

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
_MAX_FDS = 128  # shard files held open at once ...
_BLOCK = 128 << 10  # ... and the block of each last read (small items are read a block of them at a time)
PICKLE_NAME = _NAMES[_PKL].decode()


def _sizes(pkl: int, data: int) -> list[int]:
    return [pkl, 1, 2, 6, data, 2, _ID_LEN]


def _layout(pkl: int, data: int) -> tuple[list[int], list[int], int]:
    """Where each member's local header and data start, and where the directory starts."""
    headers, starts = [], []
    at = 0
    for name, size in zip(_NAMES, _sizes(pkl, data)):
        headers.append(at)
        start = torch_data_at(at, len(name), size, _ALIGN)  # (records and offsets under 4 GB: no zip64 extra)
        starts.append(start)
        at = start + size + (16 if size else 0)  # a data descriptor after a member that is not empty
    return headers, starts, at


def _spans(pkl: int, data: int) -> list[tuple[int, str, bytes | int]]:
    """The item as (position, kind, literal bytes or a length): "lit" bytes every such item of these sizes has
    there; "any" bytes that vary and that no reader of it looks at (the data descriptors after data.pkl, data/0 and
    the serialization id, which torch's reader and the general one skip; the id's crc) or that are checked apart
    (data.pkl's bytes and crc; data/0's bytes, which must not start with NumPy's magic); "digits" the id."""
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
            out.append((start + size, "lit", b"PK\x07\x08"))
            out.append((start + size + 4, "any", 12))
    p = cd
    for i, (name, size, at) in enumerate(zip(_NAMES, sizes, headers)):
        flags = 0x0808 if size else 0x0800
        out.append((p, "lit", b"PK\x01\x02" + struct.pack("<HHHHHH", 0, 0, flags, 0, 0, 0)))
        if i in _CONTENT:
            out.append((p + 16, "lit", struct.pack("<I", zlib.crc32(_CONTENT[i]))))
        else:
            out.append((p + 16, "any", 4))  # data.pkl's and data/0's: read apart; the id's: read by nobody
        out.append((p + 20, "lit", struct.pack("<IIHHHHHII", size, size, len(name), 0, 0, 0, 0, 0, at) + name))
        p += 46 + len(name)
    count = len(_NAMES)
    out.append((p, "lit", b"PK\x06\x06" + struct.pack("<QHHIIQQQQ", 44, 0x031E, 45, 0, 0, count, count, _CD_SIZE, cd)
                + b"PK\x06\x07" + struct.pack("<IQI", 0, cd + _CD_SIZE, 1)
                + b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, count, count, _CD_SIZE, cd, 0)))
    return out


def _segments(spans: list[tuple[int, str, bytes | int]], lo: int, hi: int) -> tuple[tuple[bytes, ...], tuple[int, ...]]:
    """The literal bytes of [lo, hi), neighbours joined: (bytes, position) pairs as two tuples."""
    segs: list[bytes] = []
    where: list[int] = []
    for at, kind, value in spans:
        if kind != "lit" or not lo <= at < hi:
            continue
        if where and where[-1] + len(segs[-1]) == at:
            segs[-1] += value
        else:
            segs.append(value)
            where.append(at)
    return tuple(segs), tuple(where)


_SIZES = struct.Struct(f"<24xI{sum(46 + len(n) for n in _NAMES[:_DATA]) - 4}xI")  # data.pkl's and data/0's
_CRCS = struct.Struct(f"<16xI{sum(46 + len(n) for n in _NAMES[:_DATA]) - 4}xI")  # sizes and crcs, in the directory


class _Template:
    """An item of torch's writer with these sizes of data.pkl and data/0: the literal bytes of its head (up to
    data/0's bytes) and of its end (from their end), where data/0 starts and ends, where the id is, its length."""

    __slots__ = ("data_end", "data_start", "end", "end_at", "head", "head_at", "id_at", "length", "sizes")

    def __init__(self, pkl: int, data: int) -> None:
        self.sizes = (pkl, data)
        spans = _spans(pkl, data)
        _headers, starts, cd = _layout(pkl, data)
        self.data_start = starts[_DATA]
        self.data_end = starts[_DATA] + data
        self.id_at = starts[_ID]
        self.length = cd + _TAIL
        self.head, self.head_at = _segments(spans, 0, self.data_start)
        self.end, self.end_at = _segments(spans, self.data_end, self.length)


class Meaning:
    """What the general reading made of an item with these data.pkl bytes: its crc32, the walk's cost, the tensor
    (dtype, shape, stride, byte offset in its storage, the storage's bytes), and whether the chunk is its whole
    storage read contiguously (its piece then carries data/0's crc when data/0 is exactly that storage)."""

    __slots__ = ("cost", "crc", "dtype", "length", "nbytes", "shape", "skip", "stride", "whole")

    def __init__(self, crc: int, cost: tuple[int, ...], dtype: str, shape: tuple, stride: tuple, skip: int,
                 nbytes: int, whole: bool, length: int) -> None:
        self.crc, self.cost, self.dtype, self.shape, self.stride = crc, cost, dtype, shape, stride
        self.skip, self.nbytes, self.whole, self.length = skip, nbytes, whole, length

    def piece(self, file: Path, data_pos: int, offsets: tuple, sizes: tuple, label: str, data: int,
              data_crc: int) -> Piece:
        """The piece of a chunk whose item, on the template, holds its data/0 (`data` bytes, crc `data_crc`) at
        `data_pos` in `file`: what this data.pkl makes of those bytes."""
        return fast_new(Piece, file=file, offset=data_pos + self.skip, offsets=offsets, sizes=sizes,
                        stride=self.stride, label=label, crc=data_crc if self.whole and data == self.nbytes else None)


def item_label(rel: str, at: int) -> str:
    """How a chunk's item is named in a piece's label and in errors: `__1_0.distcp item at byte 1261`."""
    return f"{rel} item at byte {at}"


# where, from the directory's start, _SIZES and _CRCS read: data.pkl's size and crc, data/0's size and crc
_PKL_SIZE_AT, _DATA_SIZE_AT, _PKL_CRC_AT, _DATA_CRC_AT = 24, _SIZES.size - 4, 16, _CRCS.size - 4
_CHECK_BYTES = 1 << 18  # items back to back are checked this many bytes of them at a time (what a core's cache holds)


class _Rows:
    """A shard file's items that are on their template, parsed in bulk (ChunkItems.prepare): sorted by where they
    start, each with parse's result: data.pkl's bytes, its crc, data/0's size and crc, and where data/0 starts
    (absolute, in the file)."""

    __slots__ = ("at", "data", "data_crc", "data_pos", "index", "length", "pkl", "pkl_crc")

    def __init__(self) -> None:
        from array import array

        self.at, self.length, self.data_pos = array("q"), array("q"), array("q")
        self.data, self.pkl_crc, self.data_crc = array("q"), array("q"), array("q")
        self.pkl: list[bytes] = []
        self.index: dict[int, int] = {}

    def first(self) -> None:
        """index: {where an item starts: its row} (the first row of that start, as bisect_left finds it)."""
        n = len(self.at)
        self.index = dict(zip(reversed(self.at), range(n - 1, -1, -1)))

    def find(self, at: int, length: int) -> int | None:
        k = bisect_left(self.at, at)
        if k < len(self.at) and self.at[k] == at and self.length[k] == length:
            return k
        return None


_LENGTH, _PKL, _PKL_CRC = attrgetter("length"), attrgetter("pkl"), attrgetter("pkl_crc")
_DATA_OF, _DATA_CRC, _DATA_POS = attrgetter("data"), attrgetter("data_crc"), attrgetter("data_pos")
_INDEX = attrgetter("index")


class ChunkItems:
    """The shard files, each opened once; the items read on the template; what each data.pkl's bytes mean."""

    def __init__(self) -> None:
        self.rows: dict[str, _Rows] = {}  # files whose items were parsed in bulk (prepare)
        self.files: dict[str, list] = {}  # rel -> [path, size, descriptor], opened once (_file)
        self.other: set[str] = set()  # files that are not (URLs, torch's safetensors format)
        self.blocks: dict[int, tuple[int, bytes]] = {}  # fd -> (where its last block starts, its bytes)
        self.meanings: dict[bytes, Meaning] = {}
        self.templates: dict[tuple[int, int], _Template] = {}
        self.used = 0  # items read here (the rest: the general way)
        self.interned: dict[bytes, bytes] = {}  # data.pkl's bytes, one object each (prepare)
        self.tiles: tuple | None = None  # the last _tiled's

    def close(self) -> None:
        files, self.files = self.files, {}
        self.blocks = {}
        for _path, _size, fd in files.values():
            os.close(fd)

    def _file(self, items, rel: str, fqn: str) -> list | None:
        """[path, size, descriptor] of a shard file of torch.save items; None for one that is not (a URL, a shard in
        torch's safetensors format). Raises what the general reading raises for it (missing, not a file)."""
        if rel in self.other:
            return None
        if items.blob(rel, fqn) is not None:  # (which opens it as the general reading does, and says what is wrong)
            self.other.add(rel)
            return None
        path, size = items.open(rel, fqn)
        if isinstance(path, RemotePath):
            self.other.add(rel)
            return None
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
        if len(self.files) >= _MAX_FDS:
            old = self.files.pop(next(iter(self.files)))
            self.blocks.pop(old[2], None)
            os.close(old[2])
        items.walk_budget()
        self.files[rel] = f = [path, size, fd]
        return f

    def parse(self, fd: int, at: int, length: int) -> tuple | None:
        """The item's variable parts when its bytes are torch's writer's: (data.pkl's bytes, its crc in the
        directory, data/0's size, its crc, where its data starts); None otherwise."""
        try:
            if length <= WHOLE:
                block = self.blocks.get(fd)
                if block is not None and block[0] <= at and at + length <= block[0] + len(block[1]):
                    head = tail = block[1][at - block[0]:at - block[0] + length]
                else:
                    # items of a file are read in the order they lie: a block of them at a time
                    data = os.pread(fd, max(length, _BLOCK), at)
                    self.blocks[fd] = (at, data)
                    head = tail = data[:length]
                base = 0
            else:
                base = length - _TAIL_READ
                tail = os.pread(fd, _TAIL_READ, at + base)
                head = b""
        except OSError:
            return None
        if len(tail) != length - base or length < _HEAD + _TAIL:
            return None
        p = length - _TAIL - base
        key = _SIZES.unpack_from(tail, p)
        t = self.templates.get(key)
        if t is None:
            pkl, data = key
            if pkl > _MAX_PICKLE or data >= 0xFFFFFFFF - (1 << 20):  # (zip64 extras past 4 GB: not the template)
                return None
            t = _Template(pkl, data)
            if len(self.templates) < 4096:
                self.templates[key] = t
        if t.length != length or t.data_end < base:
            return None
        if base:
            if not all(map(tail.startswith, t.end, [a - base for a in t.end_at])):
                return None
            try:
                head = os.pread(fd, t.data_start + 6, at)
            except OSError:
                return None
            if len(head) != t.data_start + 6:
                return None
        elif not all(map(tail.startswith, t.end, t.end_at)):
            return None
        if not all(map(head.startswith, t.head, t.head_at)) or head.startswith(b"\x93NUMPY", t.data_start) \
                or not tail[t.id_at - base:t.id_at - base + _ID_LEN].isdigit():
            return None  # (data/0 starting with NumPy's magic: np.load, and the survey, read it as an array)
        pkl_crc, data_crc = _CRCS.unpack_from(tail, p)
        return head[_HEAD:_HEAD + key[0]], pkl_crc, key[1], data_crc, t.data_start

    def piece(self, items, fqn: str, offsets: tuple, sizes: tuple, dtype: str, where: tuple) -> Piece | tuple | None:
        """The chunk's piece read on the template; parse's tuple when its data.pkl is not known yet (the caller
        reads it the general way, then calls learn); None when the item is off the template (or in a file it is
        not for), or anything about it is not what the general reading accepted before."""
        rel, at, length, transforms = where
        f = self.files.get(rel)
        if f is None:
            f = self._file(items, rel, fqn)
            if f is None:
                return None
        if transforms or at + length > f[1]:
            return None
        rows = self.rows.get(rel)
        if rows is not None:  # (parsed in bulk: parse's result for each item on the template; None for the others)
            k = rows.find(at, length)
            if k is None:
                return None
            item = (rows.pkl[k], rows.pkl_crc[k], rows.data[k], rows.data_crc[k], rows.data_pos[k] - at)
        else:
            item = self.parse(f[2], at, length)
            if item is None:
                return None
        pkl, pkl_crc, data, data_crc, data_start = item
        m = self.meanings.get(pkl)
        if m is None:
            return item
        if m.crc != pkl_crc or m.shape != sizes or m.dtype != dtype or data < m.nbytes:
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
        return m.piece(f[0], at + data_start, offsets, sizes, item_label(rel, at), data, data_crc)

    def prepare(self, items, entries, by_file: dict | None = None) -> None:
        """Parse, in bulk, every item of the shard files `entries` name ((rel, at, length, transforms) each) that
        holds a chunk: for each file (a local one of torch.save items, opened and checked as _file does), the items
        parse would take, with parse's result, in `rows`; piece and tensor then read them there. A file that does not
        open is left to the reading item by item (which says what is wrong with it). `by_file`: those items already
        grouped by file, {rel: (where each starts, its length)} (ints; entries is then empty)."""
        import numpy as np

        by_file = {rel: group for rel, group in by_file.items() if len(group[0])} if by_file is not None else {}
        for rel, at, length, transforms in entries:
            if not transforms and type(at) is int and type(length) is int:
                ats, lengths = by_file.get(rel) or by_file.setdefault(rel, ([], []))
                ats.append(at)
                lengths.append(length)
        for rel, (ats, lengths) in by_file.items():
            f = self.files.get(rel)
            try:
                f = f or self._file(items, rel, rel)
            except (OSError, CkptDoctorError):  # (missing, not a file: the reading item by item says so)
                f = None
            if f is None:
                continue
            try:
                with Holder() as holder:  # (a file's lease let go when it is done: a folder may hold thousands)
                    self.rows[rel] = self._bulk(np, holder, str(f[0]), f[2], f[1], ats, lengths)
            except (OSError, ValueError, OverflowError):
                continue

    def _bulk(self, np, holder: Holder, path: str, fd: int, size: int, ats: list, lengths: list) -> _Rows:
        """parse, of every item at `ats` with `lengths` in the file `fd` of `size` bytes, at once: the items it
        takes, with its result for each. The file is mapped only while `holder` holds it still (a file truncated
        under a map ends the process with SIGBUS); one it cannot hold is left to parse, item by item."""
        import mmap

        from numpy.lib.stride_tricks import sliding_window_view

        rows = _Rows()
        if type(ats) is list:  # (Python ints from the metadata: any size; what cannot lie in the file is left out)
            pairs = [(a, n) for a, n in zip(ats, lengths) if 0 <= a and 0 <= n and a + n <= size]
            ats, lengths = [p[0] for p in pairs], [p[1] for p in pairs]
        at = np.array(ats, dtype=np.int64)
        length = np.array(lengths, dtype=np.int64)
        # (no sum that can pass int64: an entry's offset and length are any int64 the recognizer read)
        keep = (at >= 0) & (length >= _HEAD + _TAIL) & (at <= size) & (length <= size - at)
        at, length = at[keep], length[keep]
        if not len(at) or size < _HEAD + _TAIL or not holder.hold(path):
            return rows  # (a file that cannot be held still is read item by item, by pread: never mapped)
        m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        try:
            buf = np.frombuffer(m, dtype=np.uint8)
            quads = sliding_window_view(buf, 4)
            cd = at + length - _TAIL  # the directory's start, were the item torch's writer's
            pkl = quads[cd + _PKL_SIZE_AT].copy().view("<u4")[:, 0].astype(np.int64)
            data = quads[cd + _DATA_SIZE_AT].copy().view("<u4")[:, 0].astype(np.int64)
            key = (pkl << 32) | data
            order = np.lexsort((at, key))
            key, at, length, pkl, data, cd = key[order], at[order], length[order], pkl[order], data[order], cd[order]
            cuts = np.flatnonzero(np.diff(key)) + 1
            found = []
            for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(key)]):
                p_size, d_size = int(pkl[lo]), int(data[lo])
                if p_size > _MAX_PICKLE or d_size >= 0xFFFFFFFF - (1 << 20):
                    continue
                t = self.templates.get((p_size, d_size))
                if t is None:
                    t = _Template(p_size, d_size)
                    if len(self.templates) < 4096:
                        self.templates[(p_size, d_size)] = t
                a = at[lo:hi][length[lo:hi] == t.length]
                if not len(a):
                    continue
                if t.length > WHOLE and t.data_end < t.length - _TAIL_READ:
                    continue  # (what parse reads of a big item's end would not reach data/0's end)
                got = self._group(np, buf, t, a)
                if got is not None:
                    found.append((*got, t))
        finally:
            del buf, quads
            try:
                m.close()
            except BufferError:  # (a view still held by an exception's traceback: closed when it is collected)
                pass
        if not found:
            return rows
        ats_all = np.concatenate([f[0] for f in found])
        order = np.argsort(ats_all, kind="stable")
        pkls: list[bytes] = []
        for f in found:
            pkls += f[1]
        rows.at.frombytes(ats_all[order].astype(np.int64).tobytes())
        rows.length.frombytes(np.concatenate([np.full(len(f[0]), f[4].length, np.int64) for f in found])[order]
                              .tobytes())
        rows.data_pos.frombytes((ats_all + np.concatenate([np.full(len(f[0]), f[4].data_start, np.int64)
                                                           for f in found]))[order].tobytes())
        rows.data.frombytes(np.concatenate([np.full(len(f[0]), f[4].data_end - f[4].data_start, np.int64)
                                            for f in found])[order].tobytes())
        rows.pkl_crc.frombytes(np.concatenate([f[2] for f in found]).astype(np.int64)[order].tobytes())
        rows.data_crc.frombytes(np.concatenate([f[3] for f in found]).astype(np.int64)[order].tobytes())
        rows.pkl = list(map(pkls.__getitem__, order.tolist()))
        rows.first()
        return rows

    def _group(self, np, buf, t: _Template, a) -> tuple | None:
        """_bulk's work for the items at `a` (sorted) that have the template `t`'s sizes and length: (where those on
        it start, their data.pkl bytes, its crc and data/0's crc in the directory), copies of the bytes; None for
        none."""
        from numpy.lib.stride_tricks import sliding_window_view

        if len(a) > 1 and t.length <= WHOLE and (np.diff(a) == t.length).all():  # small items back to back
            # (bigger items are compared by their heads and tails alone, below: a pass over whole items would read
            # every tensor's bytes, a shard's gigabytes, where parse reads 68 KB an item)
            # one pass over them: each byte against the template's where it has a literal one
            whole = buf[a[0]:a[-1] + t.length]
            n, length = len(a), t.length
            block = max(1, _CHECK_BYTES // length)  # items compared at once: their bytes stay in the cache
            expected, mask = self._tiled(np, t, min(block, n))
            scratch = np.empty(min(block, n) * length, np.uint8)
            ok = np.ones(n, bool)
            for lo in range(0, n, block):
                hi = min(n, lo + block)
                part = whole[lo * length:hi * length]
                diff, w = scratch[:len(part)], len(part) // 8 * 8  # (8 bytes at a time first: all alike is common)
                d = diff[:w].view(np.uint64)
                np.bitwise_xor(part[:w].view(np.uint64), expected[:w].view(np.uint64), out=d)
                np.bitwise_and(d, mask[:w].view(np.uint64), out=d)
                if not d.any() and not ((part[w:] ^ expected[w:len(part)]) & mask[w:len(part)]).any():
                    continue
                np.bitwise_xor(part, expected[:len(part)], out=diff)
                np.bitwise_and(diff, mask[:len(part)], out=diff)
                ok[lo:hi] = ~diff.reshape(hi - lo, length).any(1)
            items2d = whole.reshape(len(a), t.length)
            head, tail = items2d[:, :t.data_start + 6], items2d[:, t.data_end:]
        else:
            head = sliding_window_view(buf, t.data_start + 6)[a]
            tail = sliding_window_view(buf, t.length - t.data_end)[a + t.data_end]
            ok = np.ones(len(a), bool)
            for seg, pos in zip(t.head, t.head_at):
                ok &= (head[:, pos:pos + len(seg)] == np.frombuffer(seg, np.uint8)).all(1)
            for seg, pos in zip(t.end, t.end_at):
                pos -= t.data_end
                ok &= (tail[:, pos:pos + len(seg)] == np.frombuffer(seg, np.uint8)).all(1)
        ok &= ~(head[:, t.data_start:] == np.frombuffer(b"\x93NUMPY", np.uint8)).all(1)
        digits = tail[:, t.id_at - t.data_end:t.id_at - t.data_end + _ID_LEN]
        ok &= ((digits >= 0x30) & (digits <= 0x39)).all(1)
        if not ok.any():
            return None
        if not ok.all():
            head, tail, a = head[ok], tail[ok], a[ok]
        d = t.length - _TAIL - t.data_end
        pkl_crc = tail[:, d + _PKL_CRC_AT:d + _PKL_CRC_AT + 4].copy().view("<u4")[:, 0]
        data_crc = tail[:, d + _DATA_CRC_AT:d + _DATA_CRC_AT + 4].copy().view("<u4")[:, 0]
        p_size = t.sizes[0]
        pkl_bytes = head[:, _HEAD:_HEAD + p_size]
        if (pkl_bytes == pkl_bytes[0]).all():  # one data.pkl for all of them (a tensor's chunks alike)
            raw = pkl_bytes[0].tobytes()
            pkls = [self.interned.setdefault(raw, raw)] * len(a)
        else:
            raw = pkl_bytes.tobytes()
            parts = [raw[i:i + p_size] for i in range(0, len(raw), p_size)] if p_size else [b""] * len(a)
            pkls = list(map(self.interned.setdefault, parts, parts))  # (one object for each data.pkl)
        return a, pkls, pkl_crc, data_crc

    def _tiled(self, np, t: _Template, n: int) -> tuple:
        """The template's literal bytes, and a mask of where they are, repeated for `n` items back to back."""
        key = (t.sizes, n)
        if self.tiles is not None and self.tiles[0] == key:
            return self.tiles[1]
        one, mask = np.zeros(t.length, np.uint8), np.zeros(t.length, np.uint8)
        for segs, ats in ((t.head, t.head_at), (t.end, t.end_at)):
            for seg, pos in zip(segs, ats):
                one[pos:pos + len(seg)] = np.frombuffer(seg, np.uint8)
                mask[pos:pos + len(seg)] = 0xFF
        tiles = (np.tile(one, n), np.tile(mask, n))
        self.tiles = (key, tiles)
        return tiles

    def tensor(self, items, wheres: list, chunks: list, dtype: str) -> tuple | None:
        """A tensor's chunks read on their template together, from the rows parsed in bulk: what piece does for each
        of them (the same checks, the same debits), as (meaning, rows, row index) for the pieces of _cut_pieces;
        None, nothing debited, when any of them is not read so (the caller then reads them one by one)."""
        n = len(wheres)
        rows = list(map(self.rows.get, map(itemgetter(0), wheres)))
        if not n or None in rows or any(map(itemgetter(3), wheres)):
            return None
        ats = list(map(itemgetter(1), wheres))
        ks = list(map(dict.get, map(_INDEX, rows), ats))  # (the row bisect_left finds, where its start is at)
        if None in ks:
            return None
        if list(map(getitem, map(_LENGTH, rows), ks)) != list(map(itemgetter(2), wheres)):
            return None
        pkls = list(map(getitem, map(_PKL, rows), ks))
        m = self.meanings.get(pkls[0])
        if m is None or pkls.count(pkls[0]) != n or m.dtype != dtype \
                or list(map(itemgetter(1), chunks)).count(m.shape) != n \
                or list(map(getitem, map(_PKL_CRC, rows), ks)).count(m.crc) != n \
                or min(map(getitem, map(_DATA_OF, rows), ks)) < m.nbytes:
            return None
        budget = items.budget
        c0, c1, c2 = m.cost
        if budget[0] < c0 * n or budget[1] < c1 * n or budget[2] < c2 * n:
            return None  # (one by one, the item the budget cannot pay is found and declined)
        budget[0] -= c0 * n
        budget[1] -= c1 * n
        budget[2] -= c2 * n
        items.walked_bytes += m.length * n
        self.used += n
        return m, rows, ks

    def learn(self, item: tuple, walk_and_cost, rec, chunk, piece: Piece, at: int) -> None:
        """Keep what the general reading made of `item`'s data.pkl (`rec`: its tensor; `walk_and_cost`: what
        ItemCache holds for its bytes), when the item is one the template's reading gives the same piece of."""
        pkl, pkl_crc, data, data_crc, data_start = item
        if walk_and_cost is None or len(self.meanings) >= _MAX_MEANINGS or len(pkl) > _MAX_PICKLE \
                or pkl[:2] != b"\x80\x02" or zlib.crc32(pkl) != pkl_crc:
            return
        walk, cost = walk_and_cost
        storage = rec.storage
        if walk.refused or walk.anomalies or walk.effects or chunk.big_endian or storage.deflated \
                or storage.entry != _NAMES[_DATA].decode() or storage.nbytes > data or len(cost) != 3 \
                or storage.offset != at + data_start:
            return
        whole = rec.storage_offset == 0 and rec.nbytes == storage.nbytes and rec.is_contiguous
        m = Meaning(pkl_crc, tuple(cost), rec.dtype, tuple(rec.shape), tuple(rec.stride),
                    rec.file_offset - storage.offset, storage.nbytes, whole, len(pkl))
        mine = m.piece(piece.file, at + data_start, piece.offsets, piece.sizes, piece.label, data, data_crc)
        if mine == piece:  # (the same piece, field by field, as the general reading's)
            self.meanings[pkl] = m


def cut_pieces(paths: dict, wheres: list, chunks: list, m: Meaning, rows: list, ks: list) -> tuple[Piece, ...]:
    """The pieces `tensor` read, as piece makes them, one by one."""
    return tuple(m.piece(paths[rel], r.data_pos[k], offsets, sizes, item_label(rel, at), r.data[k], r.data_crc[k])
                 for (rel, at, _length, _t), (offsets, sizes), r, k in zip(wheres, chunks, rows, ks))
