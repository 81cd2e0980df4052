"""A strict recognizer of the `.metadata` pickle torch.distributed.checkpoint writes: read in one pass, at C speed
over its repeated parts, or not at all (None: the safety walk and the safe unpickler then read it, with their
bounds, as before).

Why: a `.metadata` of 1,000,000 chunk entries is ~68 million opcodes, past what the opcode-by-opcode walk
(safepickle/walker.py) is allowed to visit; yet its bytes are a handful of templates torch's pickler repeats.

What is admitted (anything else returns None):
- framing: PROTO 4 or 5 first; FRAMEs exactly back to back (each where the previous one ends, no opcode across a
  frame's end, the last one ending at the last byte). So Python's framed reader and the C unpickler (which ignores
  frame ends) read the same opcodes; no frame can be "read two ways" (the walk's anomaly).
- opcodes: the ones torch's pickler writes for the Metadata dataclass tree: MEMOIZE (never PUT: a memo index is
  always the next one; never right after another MEMOIZE, as no pickler memoizes one object twice; and no more
  entries than limits.max_memo_entries, the walk's own bound), BINGET/LONG_BINGET only of an index this
  recognizer recorded itself, SHORT_BINUNICODE/BINUNICODE, STACK_GLOBAL, EMPTY_TUPLE/TUPLE1-3/TUPLE,
  EMPTY_DICT/SETITEM(S), EMPTY_LIST/APPEND(S), MARK, NEWOBJ, BUILD, REDUCE, BININT1/2/BININT/LONG1 (8 bytes at
  most), NONE/NEWTRUE/NEWFALSE, STOP at the last byte with one value on the stack and no MARK open.
- globals: only DCP's metadata dataclasses, torch.Size, torch's dtypes, torch.serialization._get_layout,
  _MEM_FORMAT_ENCODING and pathlib's path classes, each only where torch puts it (NEWOBJ of a dataclass with no
  arguments; REDUCE of torch.Size on a tuple of non-negative ints, of _get_layout / _MEM_FORMAT_ENCODING / a path on
  a tuple of strs or ints); and each judged SAFE by the policy in force (else the walk reports it).
- strings: none the walk would walk as a nested pickle (walker.text_pickle: a latin-1 decoded pickle).
- values: tuples nested 2 deep at most (a Size's argument; the walk refuses tuples past limits.MAX_TUPLE_DEPTH,
  and a key this recognizer does not read could hold one); a dtype is a torch dtype; BUILD only on a dataclass
  made here, once, with a dict (a tuple for TensorProperties); dict keys are strs
  or objects made here (hashed by identity: no hash a file can choose, no tuple to recurse into); SETITEMS on
  dicts, APPENDS on lists only; the tree is then read by its schema (fixed depth), never walked generically.

Why no bomb passes: every opcode admitted costs O(1) work and memory except those that pop a MARK's items (each
item popped once) and string reads (bounded by the bytes they consume), so time and memory are linear in the
file's length, itself at most limits.MAX_UNPICKLE_BYTES. Nothing is looked up or called: globals are inert markers
compared by name, REDUCE/NEWOBJ build markers. The fast templates (compiled `re` patterns over one chunk entry or
one storage entry, with the memo indices of their class, keys and torch.Size spelled in as literal bytes) only
shortcut what the opcode loop would do with the same bytes: a template's variable parts are bounded (a string of
at most 255 bytes, whose length byte is checked; ints of fixed widths), so one match costs O(1), and a unit that
does not fit a template is read by the opcode loop instead.

Runs: back-to-back units that fit a template (no byte between one and the next, at most _BLOCK at once) are found
by one re.split of a window of their frame, which gives each match's groups and the bytes between matches, and read
column by column: each column's ints,
tuples, memo indices and strings decoded by C loops (map, join, struct, dict lookups; equal tuples and strings once).
The run stands on the stack as one item (_Chunks, _Entries) that only the op popping exactly its units may take
(APPENDS/SETITEMS with it at a pair boundary, APPEND/SETITEM of a run of one); anything else declines. A memo index a
run fetches must be below its entry's place (only a string memoized before it, or its own new one, can be there).
"""

from __future__ import annotations

import re
import struct
from bisect import bisect_right
from itertools import accumulate, compress, islice, repeat
from operator import add, le, mul

from ..safepickle import limits
from ..safepickle.policy import DEFAULT_POLICY, TORCH_DTYPES, GlobalRef, Policy, Verdict
from ..safepickle.statedict import binints
from ..safepickle.walker import text_pickle

_DC = "torch.distributed.checkpoint.metadata"
_CLASSES = frozenset({(_DC, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                         "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta")}
                     | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")})
_PATHS = frozenset((m, n) for m in ("pathlib", "pathlib._local")
                   for n in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"))
_CALLS = frozenset({("torch", "Size"), ("torch.serialization", "_get_layout"), (_DC, "_MEM_FORMAT_ENCODING")}) | _PATHS
_LE4 = struct.Struct("<I")
_LE8 = struct.Struct("<Q")
_GROUPS = type(re.match(b"", b"")).groups
_BLOCK = 4096  # entries read at once, at most
_WINDOW = 1 << 18  # bytes of a frame searched for them at once, at most
_EMPTY = {None: b""}  # (a group of a branch not taken: b"", as the templates' columns have it)


class NoFit(Exception):
    """The bytes leave the grammar: the ordinary path reads the file."""


class _G:
    """An allow-listed global: a marker, never the object it names."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


class _Obj:
    """An instance of a DCP dataclass (NEWOBJ), its state set once by BUILD."""

    __slots__ = ("cls", "state")

    def __init__(self, cls: str) -> None:
        self.cls, self.state = cls, None


class _Size(tuple):
    __slots__ = ()


class _Nest(tuple):  # a tuple holding a tuple; one holding a _Nest (tuples nested 3 deep: torch writes 2) is declined
    __slots__ = ()


def _tuple(items) -> tuple:
    nested = False
    for v in items:
        t = type(v)
        if t is tuple:
            nested = True
        elif t is _Nest or t in _RUNS:
            raise NoFit
    return _Nest(items) if nested else tuple(items)


class _Chunk(tuple):  # (offsets, sizes) of a ChunkStorageMetadata read by the chunk template
    __slots__ = ()


class _Info(tuple):  # (relative_path, offset, length) of a _StorageInfo read by the storage template
    __slots__ = ()


class _Key:
    """A MetadataIndex read by the storage template (hashed by identity, as every key object here)."""

    __slots__ = ("fqn", "offset")

    def __init__(self, fqn: str, offset: tuple) -> None:
        self.fqn, self.offset = fqn, offset


class _Chunks:
    """A run of chunk entries the chunk template read at once, column-wise: what the opcode loop would push as that
    many _Chunk items. On the stack it is one item that only APPENDS may pop (as its items, in order)."""

    __slots__ = ("offsets", "sizes")

    def __init__(self, offsets: list, sizes: list) -> None:
        self.offsets, self.sizes = offsets, sizes


class _Entries:
    """A run of storage entries the storage template read at once, column-wise: what the opcode loop would push as
    that many (_Key, _Info) pairs. Only SETITEMS may pop it; it then stands in its dict as one key (hashed by
    identity, as every _Key, so it stands for the same distinct keys, in the same order)."""

    __slots__ = ("at", "fqn", "length", "offset", "rel")

    def __init__(self, fqn: list, offset: list, rel: list, at: list, length: list) -> None:
        self.fqn, self.offset, self.rel, self.at, self.length = fqn, offset, rel, at, length


_RUNS = (_Chunks, _Entries)


class _Token:  # what _get_layout, _MEM_FORMAT_ENCODING and a path constructor give back: inert, unread
    __slots__ = ()


_TOKEN = _Token()
_MARK = object()


def _get(idx: int) -> bytes:
    return b"h" + bytes([idx]) if idx < 256 else b"j" + _LE4.pack(idx)


_INT = rb"(?:K.|M..|J...[\x00-\x7f])"
_TUP = rb"(\)|" + _INT + rb"\x85\x94|" + _INT + rb"{2}\x86\x94|" + _INT + rb"{3}\x87\x94|\(" + _INT + rb"{4,64}t\x94)"
_BIG = rb"(K.|M..|J...[\x00-\x7f]|\x8a(?:\x05.{4}|\x06.{5}|\x07.{6}|\x08.{7})[\x00-\x7f])"
_BIG_UNREAD = b"(?:" + _BIG[1:]  # (the same, not captured)
_STR = rb"(?:\x8c(.)(.{0,255}?)\x94|h(.)|j(....))"


def _ints(g: bytes) -> tuple:
    """The ints of a _TUP group (the regex has checked its shape)."""
    if g == b")":
        return ()
    return binints(g[1:-2] if g[0] == 0x28 else g[:-2])


def _big(g: bytes) -> int:
    """The int of a _BIG group: a LONG1's bytes, or one BININT's (the regex has kept both non-negative)."""
    return int.from_bytes(g[2:], "little") if g[0] == 0x8A else binints(g)[0]


def _shifted(bases, shift: int):
    """bases[i] + shift for every i: a range stays a range."""
    if type(bases) is range:
        return range(bases.start + shift, bases.stop + shift, bases.step)
    return list(map(add, bases, repeat(shift)))


class _Machine:
    def __init__(self, data: bytes, policy: Policy) -> None:
        self.data = data
        self.policy = policy
        self.memo: dict[int, object] = {}
        # a run's new strings, each memoized at a step from the last: (first index, past the last, step, the
        # strings), by first index; not in `memo` (a million relative paths), found there by fetch
        self.held: list[tuple[int, int, int, list]] = []
        self.held_at: list[int] = []
        self.count = 0  # the next memo index
        self.globals: list[GlobalRef] = []
        self.seen: dict[tuple[str, str], _G] = {}
        self.roles: dict[object, int] = {}  # (kind, name) -> the memo index holding it, for the templates
        self.chunk_re = self.storage_re = None
        self.window: tuple | None = None  # the runs of the window _run searched last
        self.optional: dict[object, frozenset] = {}  # a template's groups of a branch (a _STR's): None when not taken
        self.decoded: dict[bytes, str] = {}  # a template string's bytes, decoded (and checked) once
        self.strings: dict[str, str] = {}  # equal strings kept once (a million relative paths are a few files)
        self.sizes: dict[tuple, tuple] = {}
        self.tuples: dict[bytes, tuple] = {}  # a _TUP group's bytes -> its ints (a million chunks have few distinct)

    # --- the templates ---------------------------------------------------------------------------------------
    def _role(self, idx: int, value: object) -> None:
        if type(value) is _G:
            role = ("g", value.name)
        elif type(value) is str and value in ("offsets", "sizes", "fqn", "index", "offset", "relative_path",
                                              "length"):
            role = ("s", value)
        else:
            return
        if role in self.roles:
            return
        self.roles[role] = idx
        r = self.roles
        if self.chunk_re is None and all(k in r for k in (("g", "ChunkStorageMetadata"), ("s", "offsets"),
                                                          ("s", "sizes"), ("g", "Size"))):
            size = re.escape(_get(r["g", "Size"]))
            self.chunk_head = _get(r["g", "ChunkStorageMetadata"])
            one = (re.escape(self.chunk_head) + rb"\)\x81\x94\}\x94\(" + re.escape(_get(r["s", "offsets"])) + size
                   + _TUP + rb"\x85\x94R\x94" + re.escape(_get(r["s", "sizes"])) + size + _TUP + rb"\x85\x94R\x94ub")
            self.chunk_re = re.compile(one, re.DOTALL).match
            self.chunk_split = re.compile(b"(" + one + b")", re.DOTALL)
        if self.storage_re is None and all(k in r for k in (
                ("g", "MetadataIndex"), ("g", "_StorageInfo"), ("g", "Size"), ("s", "fqn"), ("s", "index"),
                ("s", "offset"), ("s", "relative_path"), ("s", "length"))):
            e = lambda role: re.escape(_get(r[role]))  # noqa: E731
            self.storage_head = _get(r["g", "MetadataIndex"])
            one = (re.escape(self.storage_head) + rb"\)\x81\x94\}\x94\(" + e(("s", "fqn")) + _STR + e(("s", "index"))
                   + _BIG_UNREAD + e(("s", "offset")) + e(("g", "Size")) + _TUP + rb"\x85\x94R\x94ub"
                   + e(("g", "_StorageInfo")) + rb"\)\x81\x94\}\x94\(" + e(("s", "relative_path")) + _STR
                   + e(("s", "offset")) + _BIG + e(("s", "length")) + _BIG + rb"ub")
            self.storage_re = re.compile(one, re.DOTALL).match
            self.storage_split = re.compile(b"(" + one + b")", re.DOTALL)
            self.optional[self.storage_split] = frozenset({0, 1, 2, 3, 5, 6, 7, 8})  # (the groups of the two _STRs)

    def _str_of(self, m, i: int, at: int) -> tuple[str, int]:
        """A template's string: (value, memo entries it adds)."""
        raw = m.group(i + 1)
        if raw is not None:
            if len(raw) != m.group(i)[0]:
                raise _Retry
            if text_pickle(raw, 0, len(raw)) is not None:
                raise NoFit
            value = raw.decode("utf-8", "surrogatepass")
            value = self.strings.setdefault(value, value)
            self.memo[at] = value
            return value, 1
        idx = m.group(i + 2)[0] if m.group(i + 2) is not None else _LE4.unpack(m.group(i + 3))[0]
        value = self.fetch(idx)
        if type(value) is not str:
            raise NoFit
        return value, 0

    def fetch(self, idx: int) -> object:
        """What memo index `idx` holds (None: nothing)."""
        value = self.memo.get(idx)
        if value is None and self.held:
            k = bisect_right(self.held_at, idx) - 1
            if k >= 0:
                start, stop, step, values = self.held[k]
                if idx < stop and not (idx - start) % step:
                    return values[(idx - start) // step]
        return value

    def _run(self, split, pos: int, end: int) -> tuple[int, list]:
        """The entries of the run of back-to-back template matches at `pos` within the frame (to `end`): (where it
        stops, the template's groups column by column, b"" for a branch not taken). The run is the matches that
        follow each other with no byte between them (each where the previous one ended: what a match anchored there
        finds), from `pos` on; it stops at the first place the template does not fit, or after _BLOCK entries.

        The matches are found a window at a time (_WINDOW bytes of the frame, at most: a frame can be the whole
        file): split gives each match's groups and the bytes between matches, in C; the runs of the window are kept,
        and a later run of it is taken from there. A match cut by the window's end is not one: the run stops before
        it, and the next run starts a new window there."""
        c = self.window
        if c is None or c[0] is not split or c[1] != end or pos not in c[2]:
            c = self.window = self._window(split, pos, end)
            if pos not in c[2]:
                return pos, []
        lo, hi, stop = c[2][pos]
        return stop, [col[lo:hi] for col in c[3]]

    def _window(self, split, pos: int, end: int) -> tuple:
        """(split, the frame's end, {where a run starts: (first match, past its last, where it stops)}, the columns
        of the window's matches) for the window of the frame from `pos`."""
        stop = min(end, pos + _WINDOW)
        parts = split.split(self.data[pos:stop])
        k = split.groups + 1  # a gap, the whole match, the template's groups
        gaps, wholes = parts[0::k], parts[1::k]
        cols = []
        for g in range(2, k):
            col = parts[g::k]
            if col and col[0] is not None and g - 2 not in self.optional.get(split, ()):
                cols.append(col)  # (a group every match has)
                continue
            none = col.count(None)
            cols.append(col if not none else [b""] * len(col) if none == len(col) else list(map(_EMPTY.get, col, col)))
        runs = {}
        n = len(wholes)
        breaks = [0, *compress(range(1, n), islice(gaps, 1, n)), n]  # runs start at the first match and after gaps
        at = pos
        for i, j in zip(breaks, breaks[1:]):
            at += len(gaps[i])
            while i < j:
                hi = min(j, i + _BLOCK)
                length = sum(map(len, wholes[i:hi]))
                runs[at] = (i, hi, at + length)
                at += length
                i = hi
        return split, end, runs, cols

    def _ints_of(self, col: tuple) -> list:
        """The ints of each _TUP group of a column, each distinct group decoded once."""
        known = self.tuples
        values = list(map(known.get, col))
        if None in values:
            for g in set(col).difference(known):
                known[g] = _ints(g)
            values = list(map(known.__getitem__, col))
        return values

    def _chunk_run(self, pos: int, end: int, stack: list) -> int:
        """A run of chunk entries, read column-wise (one _Chunks item on the stack)."""
        stop, cols = self._run(self.chunk_split, pos, end)
        if not cols:
            return pos
        a, b = cols
        stack.append(_Chunks(self._ints_of(a), self._ints_of(b)))
        self.count += 8 * len(a) - a.count(b")") - b.count(b")")
        return stop

    def _strs(self, lens: tuple, raws: tuple, short: tuple, long: tuple, bases, shift: int) -> list:
        """A template string of each entry of a run. Its place: memo index bases[i] + shift, what a new one (`lens`
        non-empty, its length byte checked already) is memoized at; a fetched one must be a str memoized before it
        (at the place itself only the entry's own new string can stand, and only a new one is there)."""
        memo = self.memo
        n = len(lens)
        new = len(b"".join(lens))
        at = None
        if new:
            at = _shifted(bases, shift)
            raw = list(compress(raws, lens))
            decoded = self.decoded
            distinct = set(raw).difference(decoded)  # (a million relative paths are a few files' names)
            if any(map(bytes.startswith, distinct, repeat(b"\xc2\x80"))):  # text_pickle's first test, at C speed
                for r in distinct:
                    if text_pickle(r, 0, len(r)) is not None:
                        raise NoFit
            keep = self.strings.setdefault
            decoded.update({r: keep(v, v) for r, v in zip(distinct, map(bytes.decode, distinct, repeat("utf-8"),
                                                                         repeat("surrogatepass")))})
            if new == n and type(at) is range and n > 1:  # all new, a step apart: held as one
                values = list(map(decoded.__getitem__, raw))
                self.held.append((at.start, at[-1] + 1, at.step, values))
                self.held_at.append(at.start)
                return values
            memo.update(zip(compress(at, lens), map(decoded.__getitem__, raw)))
        if new == n:  # all new: each at its place
            index: object = at
        else:
            if not new and long.count(b"") == n:  # BINGETs only: their indices are their bytes
                index = b"".join(short)
            elif not new and short.count(b"") == n:  # LONG_BINGETs only
                index = struct.unpack(f"<{n}I", b"".join(long))
            else:
                got = struct.unpack(f"<{n}I", b"".join(map(bytes.ljust, map(add, short, long), repeat(4),
                                                           repeat(b"\0"))))
                index = list(map(add, got, map(mul, map(len, lens), at))) if new else got
            if max(index) >= bases[0] + shift:  # (all below the first place: memoized before the run)
                if at is None:
                    at = _shifted(bases, shift)
                if not all(map(le, index, at)):
                    raise NoFit
        values = list(map(memo.get, index))
        if None in values and self.held:
            values = list(map(self.fetch, index))
        if set(map(type, values)) != {str}:
            raise NoFit
        return values

    def _entry_run(self, pos: int, end: int, stack: list) -> int:
        """A run of storage entries, read column-wise (one _Entries item on the stack); a string whose length byte
        does not fit sends the run to the entry-by-entry template."""
        stop, cols = self._run(self.storage_split, pos, end)
        if not cols:
            return pos
        f_len, f_raw, f_short, f_long, offs, r_len, r_raw, r_short, r_long, at, length = cols
        n = len(offs)
        for lens, raws in ((f_len, f_raw), (r_len, r_raw)):  # (checked before any is memoized)
            if len(b"".join(lens)) and bytes(map(len, compress(raws, lens))) != b"".join(lens):
                return self._storage(pos, end, stack)
        # memo entries of an entry: MetadataIndex, its dict, [fqn], offsets (not when empty), args, Size,
        # _StorageInfo, its dict, [relative_path]
        start = self.count
        empty, old_f, old_r = offs.count(b")"), f_len.count(b""), r_len.count(b"")
        if {empty, old_f, old_r} <= {0, n}:  # every entry alike: as many memo entries each
            step = 7 - (empty == n) + (old_f == 0) + (old_r == 0)
            bases: object = range(start, start + step * n + 1, step)
        else:
            incs = map(add, map(add, map(len, f_len), map(len, r_len)), map(int.__sub__, repeat(7),
                                                                               map(bytes.__eq__, offs, repeat(b")"))))
            bases = list(accumulate(incs, initial=start))
        fqns = self._strs(f_len, f_raw, f_short, f_long, bases[:n], 2)  # after the MetadataIndex and its dict
        rels = self._strs(r_len, r_raw, r_short, r_long, bases[1:], -1)  # the entry's last
        if max(map(len, at)) > 5 or max(map(len, length)) > 5:  # a LONG1
            ats, lengths = list(map(_big, at)), list(map(_big, length))
        else:  # BININT1/2/BININT, non-negative (the regex checked their last byte): the opcode is the low byte
            ats = list(map(int.__rshift__, map(int.from_bytes, at, repeat("little")), repeat(8)))
            lengths = list(map(int.__rshift__, map(int.from_bytes, length, repeat("little")), repeat(8)))
        stack.append(_Entries(fqns, self._ints_of(offs), rels, ats, lengths))
        self.count = bases[-1]
        return stop

    def _chunks(self, pos: int, end: int, stack: list) -> int:
        match = self.chunk_re
        sizes = self.sizes
        while True:
            m = match(self.data, pos)
            if m is None or m.end() > end:
                return pos
            a, b = m.group(1), m.group(2)
            offsets, size = _ints(a), _ints(b)
            size = sizes.setdefault(size, size)
            stack.append(_Chunk((offsets, size)))
            self.count += 8 - (a == b")") - (b == b")")
            pos = m.end()

    def _storage(self, pos: int, end: int, stack: list) -> int:
        match = self.storage_re
        while True:
            m = match(self.data, pos)
            if m is None or m.end() > end:
                return pos
            try:
                base = self.count + 2
                fqn, new = self._str_of(m, 1, base)
                base += new
                offs = m.group(5)
                offset = _ints(offs)
                base += 5 - (offs == b")")
                rel, new = self._str_of(m, 6, base)
            except _Retry:
                return pos
            stack.append(_Key(fqn, offset))
            stack.append(_Info((rel, _big(m.group(10)), _big(m.group(11)))))
            self.count = base + new
            pos = m.end()

    # --- the opcode loop -------------------------------------------------------------------------------------
    def run(self) -> object:
        data = self.data
        n = len(data)
        if n < 12 or data[0] != 0x80 or data[1] not in (4, 5) or data[2] != 0x95:
            raise NoFit
        pos = 2
        frame_end = 2  # the end of the frame being read; a FRAME opcode must stand exactly there
        stack: list = []
        marks: list[int] = []
        memo = self.memo
        memo_cap = limits.max_memo_entries(n)  # the walk refuses past it
        after_memo = -1  # where the last MEMOIZE ended: no pickler memoizes one object twice
        while True:
            if pos >= frame_end:
                if pos != frame_end or pos >= n or data[pos] != 0x95 or pos + 9 > n:
                    raise NoFit
                length = _LE8.unpack_from(data, pos + 1)[0]
                if after_memo == pos:
                    after_memo = pos + 9
                pos += 9
                frame_end = pos + length
                if length == 0 or frame_end > n:
                    raise NoFit
                continue
            op = data[pos]
            if op == 0x94:  # MEMOIZE
                if not stack or stack[-1] is _MARK or type(stack[-1]) in _RUNS or pos == after_memo \
                        or self.count >= memo_cap:
                    raise NoFit
                memo[self.count] = stack[-1]
                self._role(self.count, stack[-1])
                self.count += 1
                pos += 1
                after_memo = pos
            elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                if self.chunk_re is not None and data.startswith(self.chunk_head, pos):
                    new = self._chunk_run(pos, frame_end, stack)
                    if new != pos:
                        pos = new
                        continue
                if self.storage_re is not None and data.startswith(self.storage_head, pos):
                    new = self._entry_run(pos, frame_end, stack)
                    if new != pos:
                        pos = new
                        continue
                if op == 0x68:
                    idx, pos = data[pos + 1], pos + 2
                else:
                    idx, pos = _LE4.unpack_from(data, pos + 1)[0], pos + 5
                value = memo.get(idx) if idx in memo else self.fetch(idx)
                if value is None and idx not in memo:
                    raise NoFit
                stack.append(value)
            elif op == 0x8C or op == 0x58:  # SHORT_BINUNICODE, BINUNICODE
                if op == 0x8C:
                    length, pos = data[pos + 1], pos + 2
                else:
                    length, pos = _LE4.unpack_from(data, pos + 1)[0], pos + 5
                if pos + length > frame_end:
                    raise NoFit
                try:
                    value = data[pos:pos + length].decode("utf-8", "surrogatepass")
                except UnicodeDecodeError:
                    raise NoFit from None
                if text_pickle(data, pos, pos + length) is not None:  # the walk walks it as a nested pickle
                    raise NoFit
                stack.append(self.strings.setdefault(value, value))
                pos += length
            elif op == 0x4B:
                stack.append(data[pos + 1])
                pos += 2
            elif op == 0x4D:
                stack.append(data[pos + 1] | data[pos + 2] << 8)
                pos += 3
            elif op == 0x4A:
                stack.append(int.from_bytes(data[pos + 1:pos + 5], "little", signed=True))
                pos += 5
            elif op == 0x8A:  # LONG1
                length = data[pos + 1]
                if length > 8:
                    raise NoFit
                stack.append(int.from_bytes(data[pos + 2:pos + 2 + length], "little", signed=True))
                pos += 2 + length
            elif op == 0x28:  # MARK
                marks.append(len(stack))
                stack.append(_MARK)
                pos += 1
            elif op in (0x75, 0x65, 0x74):  # SETITEMS, APPENDS, TUPLE
                if not marks:
                    raise NoFit
                at = marks.pop()
                items = stack[at + 1:]
                del stack[at:]
                if op == 0x74:
                    stack.append(_tuple(items))
                else:
                    if not stack:
                        raise NoFit
                    self._add(stack[-1], items, op == 0x75)
                pos += 1
            elif op == 0x73 or op == 0x61:  # SETITEM, APPEND
                k = 2 if op == 0x73 else 1
                if stack and type(stack[-1]) in _RUNS:  # a run of one entry: the item or the pair the op pops
                    run = stack[-1]
                    if len(stack) < 2 or (len(run.offsets) if type(run) is _Chunks else len(run.fqn) * 2) != k:
                        raise NoFit
                    k = 1
                elif len(stack) < k + 1 or _MARK in stack[-k - 1:] or not {type(v) for v in stack[-k - 1:]}.isdisjoint(
                        _RUNS):
                    raise NoFit
                items = stack[-k:]
                del stack[-k:]
                self._add(stack[-1], items, op == 0x73)
                pos += 1
            elif op == 0x29:
                stack.append(())
                pos += 1
            elif op in (0x85, 0x86, 0x87):  # TUPLE1-3
                k = op - 0x84
                if len(stack) < k or _MARK in stack[-k:]:
                    raise NoFit
                value = _tuple(stack[-k:])
                del stack[-k:]
                stack.append(value)
                pos += 1
            elif op == 0x7D:
                stack.append({})
                pos += 1
            elif op == 0x5D:
                stack.append([])
                pos += 1
            elif op == 0x93:  # STACK_GLOBAL
                if len(stack) < 2 or type(stack[-1]) is not str or type(stack[-2]) is not str:
                    raise NoFit
                key = (stack[-2], stack[-1])
                del stack[-2:]
                stack.append(self._global(key, pos))
                pos += 1
            elif op == 0x81:  # NEWOBJ
                if len(stack) < 2 or type(stack[-1]) is not tuple or stack[-1] != () or type(stack[-2]) is not _G \
                        or (stack[-2].module, stack[-2].name) not in _CLASSES:
                    raise NoFit
                cls = stack[-2].name
                del stack[-2:]
                stack.append(_Obj(cls))
                pos += 1
            elif op == 0x62:  # BUILD
                if len(stack) < 2:
                    raise NoFit
                state, obj = stack[-1], stack[-2]
                if type(obj) is not _Obj or obj.state is not None or not (
                        type(state) is dict or type(state) is tuple and obj.cls == "TensorProperties"):
                    raise NoFit
                obj.state = dict(state) if type(state) is dict else state
                del stack[-1]
                pos += 1
            elif op == 0x52:  # REDUCE
                if len(stack) < 2:
                    raise NoFit
                args, fn = stack[-1], stack[-2]
                if type(fn) is not _G or type(args) is not tuple and type(args) is not _Nest:
                    raise NoFit
                if fn.name == "Size" and fn.module == "torch":
                    if len(args) != 1 or type(args[0]) is not tuple or not all(
                            type(v) is int and v >= 0 for v in args[0]):
                        raise NoFit
                    value = _Size(args[0])
                elif (fn.module, fn.name) in _CALLS and all(type(a) in (str, int) for a in args):
                    value = _TOKEN
                else:
                    raise NoFit
                del stack[-2:]
                stack.append(value)
                pos += 1
            elif op == 0x4E:
                stack.append(None)
                pos += 1
            elif op == 0x88 or op == 0x89:
                stack.append(op == 0x88)
                pos += 1
            elif op == 0x2E:  # STOP
                pos += 1
                if pos != n or frame_end != n or len(stack) != 1 or marks or self.count > memo_cap:
                    raise NoFit
                return stack[0]
            else:
                raise NoFit
            if pos > frame_end:  # an opcode ran past its frame's end
                raise NoFit

    def _global(self, key: tuple[str, str], at: int) -> _G:
        g = self.seen.get(key)
        if g is not None:
            return g
        module, name = key
        if key not in _CLASSES and key not in _CALLS and not (module == "torch" and name in TORCH_DTYPES):
            raise NoFit
        verdict, reason = self.policy.classify(module, name)
        if verdict is not Verdict.SAFE:
            raise NoFit
        self.globals.append(GlobalRef(module, name, verdict, reason, f"pickle at byte {at}"))
        g = self.seen[key] = _G(module, name)
        return g

    @staticmethod
    def _add(target: object, items: list, pairs: bool) -> None:
        types = set(map(type, items))
        if pairs:
            if type(target) is not dict or _Chunks in types:
                raise NoFit
            if _Entries in types:  # a run stands for its pairs: it must start a pair
                at = 0
                for i, v in enumerate(items):
                    if type(v) is _Entries:
                        if (i - at) % 2:
                            raise NoFit
                        _Machine._add(target, items[at:i], True)
                        target[v] = v
                        at = i + 1
                _Machine._add(target, items[at:], True)
                return
            if len(items) % 2:
                raise NoFit
            keys = items[::2]
            if not {type(k) for k in keys} <= {str, _Obj, _Key}:
                raise NoFit
            target.update(zip(keys, items[1::2]))
        else:
            if type(target) is not list or _Entries in types:
                raise NoFit
            target.extend(items)


class _Retry(Exception):
    pass


class Storage:
    """storage_data's entries, column-wise (a million entries are six lists, not a million tuples): iterated, each
    entry is (fqn, chunk offsets | None, relative_path, offset, length, transforms)."""

    __slots__ = ("at", "fqn", "length", "offset", "rel", "transforms")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self) -> None:
        self.fqn: list[str] = []
        self.offset: list = []
        self.rel: list = []
        self.at: list = []
        self.length: list = []
        self.transforms: list[tuple[str, ...]] = []

    def __len__(self) -> int:
        return len(self.fqn)

    def __iter__(self):
        return zip(self.fqn, self.offset, self.rel, self.at, self.length, self.transforms)

    def __eq__(self, other: object) -> bool:
        return type(other) is Storage and all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    def append(self, fqn: str, offset: tuple | None, rel: str, at: int, length: int, transforms: tuple) -> None:
        self.fqn.append(fqn)
        self.offset.append(offset)
        self.rel.append(rel)
        self.at.append(at)
        self.length.append(length)
        self.transforms.append(transforms)

    def extend(self, run: _Entries) -> None:
        self.fqn += run.fqn
        self.offset += run.offset
        self.rel += run.rel
        self.at += run.at
        self.length += run.length
        self.transforms += repeat((), len(run.fqn))


class Parsed:
    """What the reader takes from a `.metadata`: the same values its unpickled tree gives."""

    __slots__ = ("globals", "has_version", "length", "notes", "planner", "sdm", "storage", "version")

    def __init__(self) -> None:
        self.version, self.has_version = "", False
        self.sdm: list = []  # (fqn, None) for a value; (fqn, size, dtype name, [(offsets, sizes), ...])
        self.planner: dict = {}
        self.storage = Storage()
        self.globals: list[GlobalRef] = []
        self.length = 0
        self.notes: tuple = ()


def recognize(data: bytes, policy: Policy = DEFAULT_POLICY) -> Parsed | None:
    """The metadata in `data`, when every byte fits the grammar torch writes; None otherwise."""
    machine = _Machine(data, policy)
    try:
        root = machine.run()
        out = _read_tree(root)
    except (NoFit, _Retry, IndexError, struct.error, UnicodeDecodeError):
        return None
    out.globals = machine.globals
    out.length = len(data)
    return out


def _state(obj: object, cls: str) -> object:
    if type(obj) is not _Obj or obj.cls != cls:
        raise NoFit
    return obj.state


def _read_tree(root: object) -> Parsed:
    out = Parsed()
    state = _state(root, "Metadata")
    if type(state) is not dict or not {"state_dict_metadata", "storage_data"} <= state.keys():
        raise NoFit
    if "version" in state:
        if type(state["version"]) is not str:
            raise NoFit
        out.version, out.has_version = state["version"], True
    sdm, storage = state["state_dict_metadata"], state["storage_data"]
    planner = state.get("planner_data", {})
    if type(sdm) is not dict or type(storage) is not dict or type(planner) is not dict:
        raise NoFit
    for fqn, md in sdm.items():
        if type(fqn) is not str or type(md) is not _Obj:
            raise NoFit
        if md.cls == "BytesStorageMetadata":
            if md.state not in (None, {}):
                raise NoFit
            out.sdm.append((fqn, None))
            continue
        tsm = _state(md, "TensorStorageMetadata")
        if type(tsm) is not dict or not {"properties", "size", "chunks"} <= tsm.keys():
            raise NoFit
        props = _state(tsm["properties"], "TensorProperties")
        dtype = props[0] if type(props) is tuple and props else None
        size, listed = tsm["size"], tsm["chunks"]
        if type(dtype) is not _G or dtype.module != "torch" or dtype.name not in TORCH_DTYPES or type(size) is not _Size \
                or type(listed) is not list:
            raise NoFit
        chunks = []
        for chunk in listed:
            if type(chunk) is _Chunk:
                chunks.append((chunk[0], chunk[1]))
                continue
            if type(chunk) is _Chunks:
                chunks += zip(chunk.offsets, chunk.sizes)
                continue
            cs = _state(chunk, "ChunkStorageMetadata")
            if type(cs) is not dict or type(cs.get("offsets")) is not _Size or type(cs.get("sizes")) is not _Size:
                raise NoFit
            chunks.append((tuple(cs["offsets"]), tuple(cs["sizes"])))
        out.sdm.append((fqn, tuple(size), dtype.name, chunks))
    for fqn, p in planner.items():
        if type(fqn) is not str or type(p) is not tuple or not all(type(k) is str or type(k) is int for k in p):
            raise NoFit
    out.planner = planner
    for index, info in storage.items():
        if type(index) is _Entries:  # (standing for its entries, as their value too)
            out.storage.extend(index)
            continue
        if type(index) is _Key:
            fqn, offset = index.fqn, index.offset
        else:
            mi = _state(index, "MetadataIndex")
            if type(mi) is not dict or type(mi.get("fqn")) is not str:
                raise NoFit
            fqn, offset = mi["fqn"], mi.get("offset")
            if offset is not None:
                if type(offset) is not _Size:
                    raise NoFit
                offset = tuple(offset)
        if type(info) is _Info:
            rel, at, length = info
            transforms = ()
        else:
            si = _state(info, "_StorageInfo")
            if type(si) is not dict or not {"relative_path", "offset", "length"} <= si.keys():
                raise NoFit
            rel, at, length = si["relative_path"], si["offset"], si["length"]
            transforms = si.get("transform_descriptors")
            if transforms is None:
                transforms = ()
            elif type(transforms) is not list or not all(type(t) is str for t in transforms):
                raise NoFit
            transforms = tuple(transforms)
            if type(rel) is not str or type(at) is not int or type(length) is not int:
                raise NoFit
        out.storage.append(fqn, offset, rel, at, length, transforms)
    return out
