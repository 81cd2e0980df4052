"""The one static pickle walker: every global a run of pickles would make CPython's unpickler look up, found
without unpickling anything.

It models CPython's pickle machine opcode by opcode — the stack and its MARKs, the memo by index (PUT, BINPUT,
LONG_BINPUT, MEMOIZE), STACK_GLOBAL's operands taken from the stack, EXT codes resolved through copyreg's
registry — for protocols 0 to 5. Where CPython's own checks stop a pickle before it looks anything up (a stack
underflow, a missing memo entry, a global's name that is not UTF-8) the walker stops too; where the outcome depends
on what a call returns, it assumes the worst (a call may return the str a later STACK_GLOBAL uses). So the globals
it reports include every global CPython would ask `find_class` for (tests/test_walker.py checks this against
CPython's Unpickler on generated pickles), and every global seen before a pickle breaks off is kept — but for one
that CPython's `find_class` fails on whatever the machine holds (unresolvable(): text read as a pickle), which is
no finding; the walk goes on past it.

Pickles concatenated after STOP and pickles inside byte strings are walked too. A memo index no honest pickle of
that length could use is refused before anything unpickles it (limits.max_memo_index).
"""

from __future__ import annotations

import copyreg
import struct
from .._record import field, record

from . import limits
from .policy import DEFAULT_POLICY, GlobalRef, Policy, Verdict, call_kind, is_mutable

# What the walker knows of a stack value: a str it can read back (kept as (start, end, codec) into the data, so a
# big string is never copied), definitely not a str, or unknown (the result of a call: it might be a str). A tuple
# is an int: how many tuples below it hashing it visits (shared parts counted each time they are reached: 3**40 for
# a 40-level tuple of three references to the level below) << _NODES, | its nesting depth (hashing recurses in C
# once per level: see limits.MAX_TUPLE_DEPTH); a tuple of no tuples is its depth, 1. Only tuples nested in tuples
# count: a tuple a call hands back (an identity such as build_intlist returns its argument) starts again from 0 here;
# the unpickler measures what such calls hand back (unpickler._handed_back).
_NODES = 14
_DEPTH = (1 << _NODES) - 1  # past MAX_TUPLE_DEPTH: a deeper tuple is refused, and its depth saturates here
_NOT_STR = object()
_UNKNOWN = object()


class _Global:
    """A global on the walker's stack: a function, class or module of the process (or a torch dtype), or, off the
    allow-list, anything (a str too). BUILD or setattr on it changes it for the whole process."""

    __slots__ = ("kind", "mutable", "ref", "safe")

    def __init__(self, ref: GlobalRef) -> None:
        self.ref = ref
        self.safe = ref.verdict is Verdict.SAFE
        self.kind = call_kind(ref.module, ref.name) if self.safe else "new"  # what calling it returns
        self.mutable = is_mutable(ref.module, ref.name)


class _Held:
    """What the walk knows of a value beyond the plain kinds: a tuple holding globals or values whose hash a file can
    choose, a number whose hash it can choose, or what a call or a persistent id hands back.

    `code`: the hash cost and depth of a tuple, as for a plain tuple (None: no tuple); `objects`: the process-wide
    objects (_Global, or a description) the value may itself be, which BUILD would change (_ANY: any at all);
    `items`: a short tuple's items, as the walk knows them; `maybe_str`: it may be a str (a call's result);
    `digest`, `value`: its hash, for a value whose hash a file can choose (ints past 2**61, -1, floats, tuples of
    them), and what tells equal values apart."""

    __slots__ = ("code", "digest", "items", "maybe_str", "objects", "value")

    def __init__(self, code: int | None = None, objects: tuple = (), items: tuple | None = None,
                 maybe_str: bool = False, digest: int | None = None, value: object = None) -> None:
        self.code, self.objects, self.items, self.maybe_str = code, objects, items, maybe_str
        self.digest, self.value = digest, value


_ANY = "anything at all"  # in _Held.objects: what a call hands back when the walk does not know its argument
_SHORT = 6  # a tuple of at most this many items keeps them (a legacy storage record has six)
_HASH_M = (1 << 61) - 1  # CPython hashes ints modulo this: k * (2**61 - 1) all hash to 0
_MINUS_ONE = _Held(digest=-2, value=-1)  # hash(-1) == hash(-2) == -2
_MINUS_TWO = _Held(digest=-2, value=-2)


def _number(value: float) -> object:
    """The walk's value for a number a pickle spells out: plain unless its hash can be made to collide with others'
    (ints past 2**61 or -1/-2; floats, ~16 to a hash)."""
    if value.__class__ is float:
        return value
    if -_HASH_M < value < _HASH_M and value not in (-1, -2):
        return _NOT_STR
    return _Held(digest=hash(value), value=value)
_UTF8, _RAW_UNICODE, _QUOTED, _BYTES_STR = 0, 1, 2, 3

_VALID = frozenset(b"(.012FIJKLMNPQRSTUVXabcdeghijlopqrstu}])G\x80\x81\x82\x83\x84\x85\x86\x87\x88\x89\x8a\x8b"
                   b"BC\x8c\x8d\x8e\x8f\x90\x91\x92\x93\x94\x95\x96\x97\x98")
_LE4 = struct.Struct("<I")
_LE4S = struct.Struct("<i")
_LE8 = struct.Struct("<Q")
_BE8D = struct.Struct(">d")


def _may_be_str(value: object) -> bool:
    """Whether a stack value may be a str, as STACK_GLOBAL needs: a str the walk read, or what it cannot know."""
    kind = value.__class__
    if kind is tuple or value is _UNKNOWN:
        return True
    if kind is _Global:
        return not value.safe  # type: ignore[attr-defined]  # an allowed global is a function, class or dtype
    return kind is _Held and value.maybe_str  # type: ignore[attr-defined]


def _text_number(raw: bytes, op: int) -> object:
    """The walk's value of an INT, LONG or FLOAT line (what CPython cannot parse stops it there: any value will do)."""
    try:
        if op == 0x46:
            return float(raw)
        if op == 0x49 and raw in (b"00", b"01"):
            return _NOT_STR  # False, True
        return _number(int(raw[:-1] if op == 0x4C and raw.endswith(b"L") else raw))
    except (ValueError, OverflowError):
        return _NOT_STR


def _shed(code: int) -> int | None:
    """The code of what a call hands back from arguments of tuple code `code` (one of them: the tuples below): as
    many tuples to hash at most, its depth counted again from 0 (the unpickler measures it); None: no tuple."""
    below = code >> _NODES
    return (below - 1) << _NODES if below else None


def _objects(value: object) -> tuple:
    """The process-wide objects a stack value may be (what BUILD on it would change)."""
    if value.__class__ is _Global:
        return (value,)
    if value.__class__ is _Held:
        return value.objects  # type: ignore[attr-defined]
    return ()


def _merge(values: list) -> object:
    """One stack value for what may be any of `values` (a call that returns one thing or another)."""
    if len(values) == 1:
        return values[0]
    objects: tuple = ()
    codes = [v if v.__class__ is int else v.code for v in values if v.__class__ is int or v.__class__ is _Held
             and v.code is not None]
    for value in values:
        objects += tuple(o for o in _objects(value) if o not in objects)
    return _Held(code=max(codes) if codes else None, objects=objects,
                 maybe_str=any(_may_be_str(v) for v in values))


class _Break(Exception):
    """The pickle cannot go on from here (CPython's unpickler would raise too)."""


class _Truncated(_Break):
    """The data ends before the pickle does."""


class _Refuse(Exception):
    """The pickle asks for resources no honest pickle of its size needs: it must not be unpickled."""


class _OutOfTime(_Refuse):
    """The walk met its opcode budget: what follows is not known."""


@record(frozen=False)
class Walk:
    """What walking a run of pickles found."""

    globals: list[GlobalRef] = field(default_factory=list)
    pickles: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each pickle that reached STOP
    end: int = 0  # where walking stopped
    broken: str | None = None  # why the last pickle broke off before its STOP
    truncated: bool = False  # ... because the data ended
    refused: str | None = None  # a resource limit the pickle exceeds: it must not be unpickled
    notes: list[str] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)  # frames built to be read two ways: a finding
    # What torch's own load path would do to the process or the file system (policy.SIDE_EFFECTS): findings.
    effects: list[str] = field(default_factory=list)
    effect_kinds: set = field(default_factory=set, repr=False)  # each side effect listed once
    # The first GLOBAL/INST CPython cannot look up (unresolvable()): its unpickler stops there. (byte, why)
    unresolved: tuple[int, str] | None = None
    seen: dict = field(default_factory=dict, repr=False)  # (module, name) -> _Global, for globals already listed

    @property
    def findings(self) -> list[GlobalRef]:
        return [g for g in self.globals if g.verdict is not Verdict.SAFE]


def new_budget(opcodes: int | None = None) -> list:
    """What one file may cost the walker, shared by every walk of it: [nested bytes left, opcodes left, tuples
    left to hash, the dict keys and set members of chosen hashes seen (a HashBuckets, made when the first is),
    the opcodes it was allowed (for the message when they run out)]. `opcodes`: more than MAX_PICKLE_OPCODES for
    a folder whose metadata names many items (limits.folder_opcodes)."""
    opcodes = limits.MAX_PICKLE_OPCODES if opcodes is None else opcodes
    return [limits.MAX_NESTED_BYTES, opcodes, limits.MAX_HASHED_TUPLES, None, opcodes]


class HashBuckets:
    """Dict keys and set members whose hash a file can choose (ints past 2**61, floats, tuples of them), counted by
    hash: CPython inserts keys of one hash in quadratic time (30,000 ints k * (2**61 - 1) took 23 s), so more than
    limits.MAX_KEYS_OF_ONE_HASH distinct ones are refused. A bucket is counted by occurrences up to COUNTED, then by
    distinct values (a value repeated in many dicts is one key in each), kept as their repr: hashing the values
    themselves would be the quadratic work."""

    __slots__ = ("counts", "distinct", "stored")
    BITS = 20
    COUNTED = 64  # keys a bucket takes before its values are told apart

    def __init__(self) -> None:
        self.counts = [0] * (1 << self.BITS)
        self.distinct: dict[int, set[str]] = {}
        self.stored = 0

    def add(self, digest: int, value: object) -> str | None:
        """Count one key; why it is one too many, or None."""
        bucket = digest & ((1 << self.BITS) - 1)
        count = self.counts[bucket] + 1
        self.counts[bucket] = count
        if count <= self.COUNTED:
            return None
        seen = self.distinct.setdefault(bucket, set())
        text = repr(value)
        if text in seen:
            return None
        seen.add(text)
        self.stored += 1
        if len(seen) + self.COUNTED > limits.MAX_KEYS_OF_ONE_HASH:  # the first COUNTED may all have been distinct
            return (f"more than {limits.MAX_KEYS_OF_ONE_HASH:,} distinct dict keys or set members of one hash "
                    "(numbers whose hashes a file can choose): CPython takes quadratic time to insert them")
        if self.stored > limits.MAX_CROWDED_KEYS:
            return (f"more than {limits.MAX_CROWDED_KEYS:,} dict keys or set members in crowded hash buckets "
                    "(numbers whose hashes a file can choose)")
        return None


def unresolvable(module: str, name: str) -> bool:
    """Whether CPython's unpickler fails to look up a global named by text lines (GLOBAL, INST) on any machine, so
    that it stops there having run nothing the file chose. Text read as a pickle names such "globals": a wheel's
    RECORD, a CSV, a Python source that starts with `class`.

    CPython checks no name: `__import__` takes a module or folder of any name sys.path holds (the standard library's
    `lib-dynload` imports as a namespace package, and through its `__loader__` a pickle reaches eval), and `os\\0x`
    imports os (C code reads the name up to the NUL). So a module that is no dotted identifier proves nothing alone.
    But when its first part is none, what imports under it is a folder (its only attributes are dunders) or a file of
    the machine's own, never a module of the file's choosing nor a Python-named parent; and looking up an attribute
    whose first part is no identifier fails on those (objects that answer any name, such as torch.ops, are reached
    through Python names only). Both must hold; a name with NUL in it is never taken (it may stand for another)."""
    if "\0" in module or "\0" in name:
        return False
    return not module.split(".", 1)[0].isidentifier() and not name.split(".", 1)[0].isidentifier()


def starts_pickle(data: bytes, at: int = 0) -> bool:
    """Whether CPython's unpickler would begin reading a pickle at `at` (its first byte is an opcode)."""
    return at < len(data) and data[at] in _VALID


def text_pickle(data: bytes | memoryview, start: int, end: int) -> bytes | None:
    """The pickle a UTF-8 str at data[start:end] carries, which the walk walks as a nested pickle: a latin-1 decoded
    pickle (how protocols 0-2 write bytes), UTF-8 of "\\x80" first; None for any other str."""
    if end - start < 3 or data[start] != 0xC2 or data[start + 1] != 0x80:
        return None
    try:
        return bytes(data[start:end]).decode("utf-8", "surrogatepass").encode("latin-1")
    except UnicodeError:
        return None


def walk(data: bytes | memoryview, source: str, start: int = 0, *, max_pickles: int | None = None,
         depth: int = 0, budget: list | None = None, following: bool = False, policy: Policy = DEFAULT_POLICY) -> Walk:
    """Walk pickles from `start`: the first, then each that follows its STOP, until one breaks off, the data ends,
    or `max_pickles` have been walked. Never raises for malformed data: it says where and why it stopped.

    A pickle whose FRAME reaches past its STOP leaves a stream positioned at the frame's end when CPython reads it
    through `read` (a BytesIO, a frame of 8 KB or more): the pickles from there on are walked too.
    `following`: this walk goes on where an earlier one stopped, so its first pickle is named by its byte too.
    `policy`: the allow-list each global is judged by.
    """
    result = Walk(end=start)
    budget = budget or new_budget()
    side = _chain(data, start, source, result, depth, budget, max_pickles, policy, main=True, following=following)
    seen = {start}
    while side:
        at = side.pop()
        if at not in seen and len(seen) < 64:
            seen.add(at)
            side += _chain(data, at, source, result, depth, budget, max_pickles, policy, main=False)
    return result


def _chain(data, at: int, source: str, result: Walk, depth: int, budget: list, max_pickles: int | None,
           policy: Policy, main: bool, following: bool = False) -> list[int]:
    """Walk one run of concatenated pickles from `at`; the start of every other run a frame makes possible."""
    side: list[int] = []
    index = 0
    first = at
    n = len(data)
    while at < n and (max_pickles is None or index < max_pickles):
        if index and not starts_pickle(data, at):
            break
        label = source if index == 0 and at == first and main and not following else f"{source} (pickle at byte {at})"
        machine = _Machine(data, at, label, result, depth, budget, policy)
        try:
            end = machine.run()
        except _Break as exc:
            if main:
                result.broken = f"{label}: the pickle breaks off at byte {machine.pos} ({exc})"
                result.truncated = isinstance(exc, _Truncated)
                result.end = machine.pos
            if at < machine.frame_end < n:
                side.append(machine.frame_end)
            return side
        except _Refuse as exc:
            result.refused = result.refused or f"{label}: {exc}"
            if main:
                result.end = machine.pos
            return side
        if end < machine.frame_end < n:
            side.append(machine.frame_end)
        if main:
            result.pickles.append((at, end))
            result.end = end
        at = end
        index += 1
    return side


class _Machine:
    """One pickle's worth of CPython's unpickling machine, run on what the walker knows of each value."""

    def __init__(self, data, pos: int, source: str, result: Walk, depth: int, budget: list, policy: Policy) -> None:
        self.data, self.pos, self.source, self.result = data, pos, source, result
        self.depth, self.budget, self.policy = depth, budget, policy
        self.start = pos
        self.frame_end = 0  # the furthest end of a FRAME seen
        self.current_frame_end = 0  # set by a FRAME opcode, taken over by the loop
        self.memo_limit = limits.max_memo_index(len(data) - pos)
        self.memo_cap = limits.max_memo_entries(len(data) - pos)

    # -- reading arguments ------------------------------------------------------------------------------------
    def _take(self, size: int) -> int:
        start = self.pos
        if start + size > len(self.data):
            raise _Truncated("the data ends inside an opcode's argument")
        self.pos = start + size
        return start

    def _line(self) -> tuple[int, int]:
        """A protocol-0 argument line: (start, end) without its newline. A line the data ends inside (no newline
        yet) stops CPython's unpickler ("pickle data was truncated") before it uses the line: a GLOBAL cut inside
        its name looks nothing up. (Lib/pickle.py's pure-Python unpickler would drop the last byte instead; torch
        and pickle.load use the C one.)"""
        data, start = self.data, self.pos
        if isinstance(data, memoryview):  # no find(): look in 64 KB pieces (a hostile line can be megabytes)
            nl, at = -1, start
            while at < len(data):
                found = bytes(data[at:at + 65536]).find(b"\n")
                if found >= 0:
                    nl = at + found
                    break
                at += 65536
        else:
            nl = data.find(b"\n", start)
        if nl < 0:
            raise _Truncated("the data ends inside an opcode's argument (a line without its newline)")
        self.pos = nl + 1
        return start, nl

    def _text(self, start: int, end: int) -> str:
        return bytes(self.data[start:end]).decode("utf-8")  # CPython decodes global names strictly

    def _value_text(self, value: tuple) -> str:
        start, end, codec = value
        raw = bytes(self.data[start:end])
        if codec == _UTF8:
            return raw.decode("utf-8", "surrogatepass")
        if codec == _RAW_UNICODE:
            return raw.decode("raw-unicode-escape")
        if codec == _QUOTED:
            import codecs

            return codecs.escape_decode(raw[1:-1])[0].decode("utf-8", "surrogateescape")
        return raw.decode("utf-8", "surrogateescape")

    # -- findings -----------------------------------------------------------------------------------------------
    def _global(self, module: str, name: str, at: int, by_line: bool = False) -> object:
        """The stack value a global leaves, after listing it. `by_line`: named by GLOBAL or INST, whose text lines
        CPython cannot look up when unresolvable(): that one is no finding, and the walk goes on past it as if it
        were found (a loader that did find it would read on)."""
        if by_line and unresolvable(module, name) and self.policy.classify(module, name)[0] is not Verdict.DANGEROUS:
            if self.result.unresolved is None:
                self.result.unresolved = (at, f"{self.source} at byte {at}: {module[:60]!r} and {name[:60]!r} are "
                                              "no Python names, which CPython's unpickler stops at")
            return _UNKNOWN
        seen = self.result.seen
        value = seen.get((module, name))
        if value is None:  # each distinct global once, where it first appears: a pickle can repeat one 2M times
            if len(seen) >= limits.MAX_DISTINCT_GLOBALS:
                raise _OutOfTime(f"more than {limits.MAX_DISTINCT_GLOBALS:,} distinct globals: no checkpoint "
                                 "names that many")
            verdict, reason = self.policy.classify(module, name)
            ref = GlobalRef(module, name, verdict, reason, f"{self.source} at byte {at}")
            value = seen[(module, name)] = _Global(ref)
            self.result.globals.append(ref)
        return value

    def _frame_anomaly(self, what: str) -> None:
        """A frame that does not end on an opcode boundary: CPython reads such a pickle one way from a file with
        peek() and another from a stream without (torch's tar members, a BytesIO), so a walk cannot know which
        bytes a loader sees. No pickler writes one."""
        self.result.anomalies.append(f"{self.source}: {what}")

    def _finding(self, module: str, name: str, verdict: Verdict, reason: str, at: int) -> None:
        self.result.globals.append(GlobalRef(module, name, verdict, reason, f"{self.source} at byte {at}"))

    def _nested(self, start: int, end: int, at: int, is_text: bool) -> None:
        """Walk a byte string that is itself a pickle (a payload for pickle.loads or torch.load)."""
        if self.depth >= limits.MAX_NESTED_DEPTH or end - start < 3 or self.budget[0] <= 0:
            return
        data = self.data
        first = data[start]
        if is_text:
            raw = text_pickle(data, start, end)
            if raw is None:
                return
        else:
            if not (first == 0x80 and data[start + 1] <= 5
                    or first in b"c(" and b"\n" in bytes(data[start:start + 256])):
                return
            raw = bytes(data[start:end])
        self.budget[0] -= len(raw)
        inner = walk(raw, f"{self.source} → nested pickle at byte {at}", depth=self.depth + 1, budget=self.budget,
                     policy=self.policy)
        self.result.globals.extend(inner.globals)
        self.result.notes.extend(inner.notes)
        self.result.anomalies.extend(inner.anomalies)
        if inner.globals:
            self.result.notes.append(f"{self.source}: a byte string at byte {at} is itself a pickle")

    @staticmethod
    def _pop_mark(metastack: list) -> list:
        if not metastack:
            raise _Break("no MARK to pop")
        return metastack.pop()

    def _put(self, stack: list, memo: dict, index: int) -> None:
        if not stack:
            raise _Break("memo PUT with an empty stack")
        if index < 0:
            raise _Break("negative memo index")
        if len(memo) >= self.memo_cap and index not in memo:
            raise _OutOfTime(f"more than {self.memo_cap:,} memo entries; the rest was not walked")
        if index > self.memo_limit:  # the walk goes on (its memo is a dict); the unpickler must not
            self._refuse(f"memo index {index:,} in a pickle of {len(self.data) - self.start:,} bytes: a memory bomb "
                         "(an honest pickle numbers its memo from 0)")
        memo[index] = stack[-1]

    def _hashing(self, values: list, at: int) -> None:
        """Values that are, or may be, hashed: dict keys and set members, and what lists and calls are given (set(),
        frozenset(), OrderedDict() and Counter() hash the items of their argument). What hashing their tuples visits
        is taken from the file's budget. Depth bounds one hash's recursion, not its work: a 40-level tuple of three
        references to the level below (120 bytes) is 3**40 tuples to hash, and a 9,999-deep key set two million
        times is 2 * 10**10. (A dict or list handed to such a call again and again is not counted again.)"""
        nodes = 0
        for value in values:
            if value.__class__ is int:
                nodes += (value >> _NODES) + 1
            elif value.__class__ is _Held and value.code is not None:
                nodes += (value.code >> _NODES) + 1
        self.budget[2] -= nodes
        if self.budget[2] < 0:
            self._flooded(at)

    def _keys(self, values: list, at: int) -> None:
        """Dict keys and set members, hashed into one container: counted as _hashing counts them, and those whose
        hash a file can choose counted by hash (HashBuckets)."""
        self._hashing(values, at)
        for value in values:
            if value.__class__ is float:
                self._chosen(hash(value), value, at)
            elif value.__class__ is _Held and value.digest is not None:
                self._chosen(value.digest, value.value, at)

    def _chosen(self, digest: int, value: object, at: int) -> None:
        buckets = self.budget[3]
        if buckets is None:
            buckets = self.budget[3] = HashBuckets()
        elif buckets is False:  # refused already: nothing more to count
            return
        why = buckets.add(digest, value)
        if why is not None:  # the walk goes on (it is linear); the unpickler must not run
            self.budget[3] = False
            self._refuse(f"{why}, at byte {at}")

    def _flooded(self, at: int) -> None:
        """The file's budget of tuples to hash is spent (run() takes from it inline for REDUCE's arguments)."""
        self._refuse(f"dict keys, set members and call arguments add up to more than {limits.MAX_HASHED_TUPLES:,} "
                     f"tuples to hash, at byte {at} (a hash flood; no checkpoint needs one)")

    # -- what torch's own load path does with what the pickle builds (policy.SIDE_EFFECTS) ------------------------
    def _effect(self, what: str, why: str, at: int) -> None:
        """A side effect torch.load(weights_only=False) would have: a finding (each kind listed once)."""
        kinds = self.result.effect_kinds
        if what in kinds or len(kinds) >= 64:
            return
        kinds.add(what)
        self.result.effects.append(f"{what} ({self.source} at byte {at}): {why}")

    def _build(self, target: object, at: int) -> None:
        """BUILD on a global, or on what may be one: it changes a process-wide object."""
        for obj in _objects(target):
            if obj.__class__ is _Global:
                if obj.mutable:  # type: ignore[attr-defined]
                    name = obj.ref.qualname  # type: ignore[attr-defined]
                    self._effect(f"BUILD on {name}", f"sets attributes of {name} (a function, class or module) for "
                                 "the whole process; torch's legacy and tar loaders read dump_patches and __name__ "
                                 "set so, and write a .patch file there", at)
            elif obj is _ANY:
                self._effect("BUILD on what a call hands back", "the call may hand back a function, class or "
                             "module (torch.jit's build_*list and a module record return their argument): BUILD "
                             "then sets its attributes for the whole process", at)
            else:
                self._effect(f"BUILD on {obj}", "one object for the whole process: BUILD sets its attributes for "
                             "every user of it", at)

    @staticmethod
    def _instance(made_by: object) -> object:
        """What NEWOBJ, OBJ or INST with the class `made_by` makes: a new object, but for an Enum class its member."""
        made: list = []
        for obj in _objects(made_by):
            if obj.__class__ is _Global and obj.safe and obj.kind == "member":  # type: ignore[attr-defined]
                made.append(f"a member of the Enum {obj.ref.qualname}")  # type: ignore[attr-defined]
            elif obj is _ANY:
                made.append(_ANY)
        return _Held(objects=tuple(made)) if made else _UNKNOWN

    def _handed(self, args: object, index: int) -> object:
        """Item `index` of a call's arguments, which the call hands back (REDUCE's args must be a tuple)."""
        if args.__class__ is _Held:
            if args.items is not None:  # type: ignore[attr-defined]
                items = args.items  # type: ignore[attr-defined]
                return items[index] if index < len(items) else _UNKNOWN
            if args.code is None:  # type: ignore[attr-defined]  # no tuple: CPython raises, unless a call made it
                return _Held(objects=(_ANY,), maybe_str=True) if _ANY in args.objects else _UNKNOWN  # type: ignore
            # A long tuple holding globals, or a tuple a call handed back: which item, the walk does not know. A
            # handed-back tuple of plain values holds no global.
            inside = () if args.maybe_str and not args.objects else (_ANY,)  # type: ignore[attr-defined]
            return _Held(code=_shed(args.code), objects=inside, maybe_str=True)  # type: ignore[attr-defined]
        if args.__class__ is int:  # a tuple of plain values: the item may be a tuple (its cost goes on) or a str
            code = _shed(args)  # type: ignore[arg-type]
            return _UNKNOWN if code is None else _Held(code=code, maybe_str=True)
        if args is _UNKNOWN:  # a tuple a call made: anything at all
            return _Held(objects=(_ANY,), maybe_str=True)
        return _UNKNOWN  # not a tuple: CPython raises

    def _call(self, func: object, args: object, at: int) -> object:
        """What REDUCE leaves: a new object, unless `func` hands back (part of) its arguments, returns an Enum's
        member, or is _rebuild_from_type_v2."""
        if func.__class__ is _Global:
            if not func.safe:  # type: ignore[attr-defined]  # off the allow-list: a finding already
                return _UNKNOWN
            candidates = [func]
        elif func.__class__ is _Held and func.objects:  # type: ignore[attr-defined]  # a handed-back callable
            if _ANY in func.objects:  # type: ignore[attr-defined]
                self._effect("a call of what a call hands back", "it may be any allowed function, "
                             "_rebuild_from_type_v2 (which sets attributes on what it builds) among them", at)
                return _Held(objects=(_ANY,), maybe_str=True)
            candidates = [g for g in func.objects if g.__class__ is _Global and g.safe]  # type: ignore[attr-defined]
        else:
            return _UNKNOWN
        results = []
        for g in candidates:
            kind = g.kind
            if kind == "argument":
                results.append(self._handed(args, 0))
            elif kind == "member":
                results.append(_Held(objects=(f"a member of the Enum {g.ref.qualname}",)))
            elif kind == "reconstructor":  # base.__new__(cls, state): an Enum's member when base is an Enum
                base = self._handed(args, 1)
                if base.__class__ is _Global and base.safe and base.kind == "member":
                    results.append(_Held(objects=(f"a member of the Enum {base.ref.qualname}",)))
                elif _objects(base) and base.__class__ is not _Global:
                    results.append(_Held(objects=(_ANY,)))
                else:
                    results.append(_UNKNOWN)
            elif kind == "from type":
                results.append(self._from_type(args, at))
            else:
                results.append(_UNKNOWN)
        return _merge(results) if results else _UNKNOWN

    def _from_type(self, args: object, at: int) -> object:
        """torch._tensor._rebuild_from_type_v2(func, type, args, state): func(*args), then state set on the result
        with setattr. Safe when func is a torch._utils tensor rebuilder (all torch.save writes)."""
        func = self._handed(args, 0)
        if func.__class__ is _Global:
            if not func.safe or func.kind == "new":  # type: ignore[attr-defined]
                return _UNKNOWN  # a new object (a tensor, all torch.save writes); or code, a finding already
        elif not _objects(func):
            return _UNKNOWN  # no global: func(*args) fails, or makes a new object
        result = self._call(func, self._handed(args, 2), at)
        if _objects(result):
            what = func.ref.qualname if func.__class__ is _Global else "what a call hands back"  # type: ignore
            self._effect(f"_rebuild_from_type_v2 of {what}", f"torch._tensor._rebuild_from_type_v2 calls {what} "
                         "and sets attributes on what it returns, here an Enum's member or a global handed back: "
                         "changed for the whole process (torch.save writes tensor rebuilders there only)", at)
        return result

    def _truthy(self, value: object) -> bool:
        """Whether a value may be true (torch checks a module record's source only when both fields are)."""
        if value.__class__ is tuple and value[1] - value[0] <= 16:  # type: ignore[index]
            try:
                return self._value_text(value) != ""  # type: ignore[arg-type]
            except (UnicodeError, ValueError):
                return True
        return True

    def _record(self, container: object, kind: str, at: int) -> None:
        """A module record torch checks the source of: a .patch file written when the container's dump_patches is
        set (a BUILD can set it, and __name__, the file's path)."""
        for obj in _objects(container):
            if obj.__class__ is _Global and obj.safe and obj.mutable or obj is _ANY:  # type: ignore[attr-defined]
                name = obj.ref.qualname if obj is not _ANY else "what a call hands back"  # type: ignore
                self._effect(f"a {kind} of {name}", f"torch.load compares the source of {name} with the file's "
                             "and, when its dump_patches is set, appends the file's text to `<its __name__>.patch`"
                             " (torch.save writes module records for nn.Module classes only)", at)

    def _persistent(self, pid: object, at: int) -> object:
        """What torch's persistent_load makes of `pid`: storages are new objects; a module record (legacy:
        ("module", container, source file, source); tar: (container, source file, source)) hands back its
        container after checking its source."""
        if pid.__class__ is int:  # a tuple of plain values: what it hands back may be one of its tuples
            code = _shed(pid)  # type: ignore[arg-type]
            return _UNKNOWN if code is None else _Held(code=code, maybe_str=True)
        if pid.__class__ is _Held and pid.items is None and not pid.objects:  # type: ignore[attr-defined]
            code = _shed(pid.code) if pid.code else None  # type: ignore[attr-defined]
            return _UNKNOWN if code is None else _Held(code=code, maybe_str=True)
        if pid.__class__ is not _Held or pid.items is None:  # type: ignore[attr-defined]
            if pid.__class__ is _Global or pid.__class__ is float:
                return _UNKNOWN  # torch fails on it
            self._effect("a persistent id computed while loading", "the walk cannot tell whether torch's legacy "
                         "loader takes it for a module record (which checks a source and may write a .patch file)",
                         at)
            return _Held(objects=(_ANY,), maybe_str=True)
        items = pid.items  # type: ignore[attr-defined]
        if not items:
            return _UNKNOWN
        first = items[0]
        text = None
        if first.__class__ is tuple and first[1] - first[0] <= 16:
            try:
                text = self._value_text(first)
            except (UnicodeError, ValueError):
                text = None
        if text == "storage":
            return _UNKNOWN
        results = []
        if len(items) >= 2 and (text == "module" or text is None and (first is _NOT_STR or _may_be_str(first))):
            if len(items) == 4 and self._truthy(items[2]) and self._truthy(items[3]):
                self._record(items[1], "legacy module record", at)
            results.append(items[1])
        if len(items) == 3 and self._truthy(items[1]) and self._truthy(items[2]):
            self._record(first, "tar module record", at)
        results.append(first if text is None else _UNKNOWN)
        return _merge(results)

    def _tuple(self, items: list, at: int) -> object:
        """A tuple holding a global, a float, a number of chosen hash or another _Held: its _Held."""
        below = depth = 0
        chosen = False
        for value in items:
            kind = value.__class__
            if kind is int:
                code = value
            elif kind is _Held:
                code = value.code
                if value.digest is not None:
                    chosen = True
                if code is None:
                    continue
            else:
                if kind is float:
                    chosen = True
                continue
            below += (code >> _NODES) + 1
            depth = max(depth, code & _DEPTH)
        digest = value = None
        if chosen:  # its hash is the file's choice: what tells it apart (most tuples, a storage's among them, not)
            digests: list = []
            values: list = []
            data = self.data
            for item in items:
                kind = item.__class__
                if kind is float:
                    digests.append(hash(item))
                    values.append(item)
                elif kind is _Held and item.digest is not None:
                    digests.append(item.digest)
                    values.append(item.value)
                elif kind is tuple:  # a str: equal strs hash alike
                    raw = bytes(data[item[0]:item[1]]) if item[1] - item[0] <= 4096 else \
                        (item[1] - item[0], bytes(data[item[0]:item[0] + 2048]), bytes(data[item[1] - 2048:item[1]]))
                    digests.append(hash(raw))
                    values.append(raw)
                elif kind is _Global:
                    digests.append(hash(item.ref.qualname))
                    values.append(item.ref.qualname)
                else:
                    digests.append(0)
                    values.append(None)
            digest, value = hash(tuple(digests)), tuple(values)
        depth += 1
        if depth > limits.MAX_TUPLE_DEPTH:
            self._refuse(f"tuples nested {depth:,} deep at byte {at}: hashing one overflows CPython's stack (no "
                         "pickler writes one)")
            depth = _DEPTH
        code = min(below, limits.MAX_HASHED_TUPLES) << _NODES | depth
        return _Held(code=code, items=tuple(items) if len(items) <= _SHORT else None, digest=digest, value=value)

    @staticmethod
    def _frozenset(items: list) -> object:
        """FROZENSET's value: plain, or of chosen hash when its members are."""
        digests = [hash(v) if v.__class__ is float else v.digest for v in items
                   if v.__class__ is float or v.__class__ is _Held and v.digest is not None]
        if not digests:
            return _NOT_STR
        values = sorted(repr(v if v.__class__ is float else v.value) for v in items
                        if v.__class__ is float or v.__class__ is _Held and v.digest is not None)
        return _Held(digest=hash(frozenset(digests)), value=tuple(values))

    def _refuse(self, why: str) -> None:
        """A bound no honest pickle reaches: the file must not be unpickled, but walking on still names what it
        would run."""
        if self.result.refused is None:
            self.result.refused = f"{self.source}: {why}"

    @staticmethod
    def _get(stack: list, memo: dict, index: int) -> None:
        value = memo.get(index, memo)
        if value is memo:
            raise _Break(f"memo index {index} was never stored")
        stack.append(value)

    # -- the machine -------------------------------------------------------------------------------------------
    def run(self) -> int:  # noqa: C901 - one opcode per branch, in CPython's order of frequency in checkpoints
        data = self.data
        n = len(data)
        stack: list = []
        metastack: list[list] = []
        memo: dict[int, object] = {}
        take = self._take
        NOT, UNK = _NOT_STR, _UNKNOWN

        unpack4 = _LE4.unpack_from
        memo_limit = self.memo_limit
        memo_cap = self.memo_cap
        max_depth = limits.MAX_TUPLE_DEPTH
        max_marks = limits.MAX_OPEN_MARKS
        hash_cap = limits.MAX_HASHED_TUPLES  # a count of tuples saturates there (3**40 is no int to add up)
        nodes_at, depth_mask = _NODES, _DEPTH
        budget = self.budget
        # The hottest opcodes of torch's data.pkl (about 30 per tensor) are handled first, inline, on a local
        # cursor: this loop runs 600,000 times for a 20,000-tensor checkpoint.
        cur = self.pos
        fe = 0  # where the current FRAME ends (0: outside frames)
        left = self.budget[1]
        try:
            while True:
                left -= 1
                if left < 0:
                    self.pos = cur
                    raise _OutOfTime(f"more than {self.budget[4]:,} opcodes; the rest was not walked")
                if fe and cur >= fe:
                    if cur > fe:
                        self._frame_anomaly(f"an opcode runs across the end of a frame at byte {fe}")
                    fe = 0
                try:
                    op = data[cur]  # (a try costs nothing in 3.11 until it catches; a compare per opcode does)
                except IndexError:
                    self.pos = cur
                    raise _Truncated("the data ends before STOP") from None
                if op == 0x72:  # r LONG_BINPUT (the memo past 255: most PUTs of a big state_dict)
                    if cur + 5 > n:
                        self.pos = cur + 1
                        raise _Truncated("the data ends inside an opcode's argument")
                    index = unpack4(data, cur + 1)[0]
                    if not stack or index > memo_limit or len(memo) >= memo_cap:
                        self.pos = cur + 5
                        self._put(stack, memo, index)  # raises or refuses, as it must
                    else:
                        memo[index] = stack[-1]
                    cur += 5
                    continue
                if op == 0x71 or op == 0x68:  # q BINPUT, h BINGET
                    if cur + 2 > n:
                        self.pos = cur + 1
                        raise _Truncated("the data ends inside an opcode's argument")
                    index = data[cur + 1]
                    if op == 0x71:
                        if not stack:
                            self.pos = cur + 2
                            raise _Break("memo PUT with an empty stack")
                        memo[index] = stack[-1]
                    else:
                        value = memo.get(index, memo)
                        if value is memo:
                            self.pos = cur + 2
                            raise _Break(f"memo index {index} was never stored")
                        stack.append(value)
                    cur += 2
                    continue
                if op == 0x4B or op == 0x4D or op == 0x4A:  # K BININT1, M BININT2, J BININT: 1, 2 or 4 bytes
                    cur += 2 if op == 0x4B else 3 if op == 0x4D else 5
                    if cur > n:
                        self.pos = cur - (1 if op == 0x4B else 2 if op == 0x4D else 4)
                        raise _Truncated("the data ends inside an opcode's argument")
                    if op == 0x4A and data[cur - 1] == 0xFF and data[cur - 2] == 0xFF and data[cur - 3] == 0xFF:
                        stack.append(_MINUS_ONE if data[cur - 4] == 0xFF else _MINUS_TWO if data[cur - 4] == 0xFE
                                     else NOT)  # -1 and -2 hash alike
                    else:
                        stack.append(NOT)
                    continue
                if op == 0x28:  # ( MARK
                    if len(metastack) >= max_marks:
                        self.pos = cur
                        raise _OutOfTime(f"more than {max_marks:,} MARKs open at byte {cur} (no pickler nests "
                                         "containers that deep); the rest was not walked")
                    metastack.append(stack)
                    stack = []
                    cur += 1
                    continue
                if op == 0x58:  # X BINUNICODE
                    if cur + 5 > n:
                        self.pos = cur + 1
                        raise _Truncated("the data ends inside an opcode's argument")
                    start = cur + 5
                    end = start + unpack4(data, cur + 1)[0]
                    if end > n:
                        self.pos = start
                        raise _Truncated("the data ends inside a string")
                    if end - start > limits.MAX_PICKLE_VALUE:
                        self._refuse(f"a string of {end - start:,} bytes at byte {cur}, over the "
                                     f"{limits.MAX_PICKLE_VALUE >> 20} MB ckpt-doctor unpickles")
                    stack.append((start, end, _UTF8))
                    if end - start > 2 and data[start] == 0xC2:
                        self.pos = end
                        self._nested(start, end, cur, True)
                    cur = end
                    continue
                if op == 0x74 or 0x85 <= op <= 0x87:  # t TUPLE (of the items since the MARK), TUPLE1-3
                    if op == 0x74:
                        if not metastack:
                            self.pos = cur + 1
                            raise _Break("no MARK to pop")
                        items, stack = stack, metastack.pop()
                    else:
                        count = op - 0x84
                        if len(stack) < count:
                            self.pos = cur + 1
                            raise _Break("stack underflow")
                        items = stack[-count:]
                        del stack[-count:]
                    depth = 0
                    below = 0
                    special = False
                    for value in items:
                        if value.__class__ is int:
                            below += (value >> nodes_at) + 1
                            value &= depth_mask
                            if value > depth:
                                depth = value
                        elif value is not NOT and value is not UNK and value.__class__ is not tuple:
                            special = True  # a global, a float, a _Held: the slow way
                    if special:
                        stack.append(self._tuple(items, cur))
                        cur += 1
                        continue
                    depth += 1
                    if depth > max_depth:
                        self._refuse(f"tuples nested {depth:,} deep at byte {cur}: hashing one overflows CPython's "
                                     "stack (no pickler writes one)")
                        depth = depth_mask
                    stack.append((below if below < hash_cap else hash_cap) << nodes_at | depth if below else depth)
                    cur += 1
                    continue
                if op == 0x52:  # R REDUCE: callable(*args) may return anything
                    if len(stack) < 2:
                        self.pos = cur + 1
                        raise _Break("stack underflow")
                    args = stack.pop()
                    func = stack[-1]
                    kind = func.kind if func.__class__ is _Global else "unknown"
                    if kind == "new" and args.__class__ is not _Held:
                        stack[-1] = UNK  # a new object: most calls of a checkpoint (a tensor)
                        cur += 1
                        continue
                    if kind == "hashing" or kind == "from type" or kind == "unknown":  # set(), OrderedDict(), or
                        # a callable the walk does not know, hash the items of what they are given
                        if args.__class__ is int:
                            if args > depth_mask:
                                budget[2] -= (args >> nodes_at) + 1  # _hashing((args,)), inline
                                if budget[2] < 0:
                                    self._flooded(cur)
                        elif args.__class__ is _Held:
                            self._hashing((args,), cur)
                    stack[-1] = self._call(func, args, cur)
                    cur += 1
                    continue
                if op == 0x94:  # MEMOIZE (protocol 4: every memo entry of a DCP .metadata, 1.6 million per 100,000
                    # chunks), inline as LONG_BINPUT above; _put raises or refuses where it must
                    if not stack or len(memo) >= memo_cap:
                        self.pos = cur + 1
                        self._put(stack, memo, len(memo))
                    else:
                        memo[len(memo)] = stack[-1]  # (len(memo) < the bytes walked <= memo_limit: a PUT is a byte at least)
                    cur += 1
                    continue
                if op == 0x6A:  # j LONG_BINGET (protocol 4's reads of the memo past 255)
                    if cur + 5 > n:
                        self.pos = cur + 1
                        raise _Truncated("the data ends inside an opcode's argument")
                    value = memo.get(unpack4(data, cur + 1)[0], memo)
                    if value is memo:
                        self.pos = cur + 5
                        raise _Break(f"memo index {unpack4(data, cur + 1)[0]} was never stored")
                    stack.append(value)
                    cur += 5
                    continue
                if op == 0x89 or op == 0x29 or op == 0x88 or op == 0x4E or op == 0x7D or op == 0x5D or op == 0x8F:
                    stack.append(NOT)  # bools, None, empty tuple/dict/list/set
                    cur += 1
                    continue
                if op == 0x51:  # Q BINPERSID: torch's persistent_load returns a storage (legacy: maybe more)
                    if not stack:
                        self.pos = cur + 1
                        raise _Break("stack underflow")
                    pid = stack[-1]
                    stack[-1] = UNK if pid is NOT or pid.__class__ is tuple else self._persistent(pid, cur)
                    cur += 1
                    continue
                pos = cur
                self.pos = cur + 1
                if op == 0x75:  # u SETITEMS
                    items, stack = stack, self._pop_mark(metastack)
                    if len(items) % 2 or not stack:
                        raise _Break("SETITEMS without a dict or with an odd number of items")
                    self._keys(items[0::2], pos)
                elif op == 0x6A:  # j LONG_BINGET
                    (index,) = _LE4.unpack_from(data, take(4))
                    self._get(stack, memo, index)
                elif op == 0x94:  # MEMOIZE
                    self._put(stack, memo, len(memo))
                elif op == 0x8C:  # SHORT_BINUNICODE
                    size = data[take(1)]
                    start = take(size)
                    stack.append((start, start + size, _UTF8))
                    if size > 2 and data[start] == 0xC2:
                        self._nested(start, start + size, pos, True)
                elif op == 0x63:  # c GLOBAL
                    mod_start, mod_end = self._line()
                    name_start, name_end = self._line()
                    if mod_end - mod_start < 1 or name_end - name_start < 1:
                        raise _Break("GLOBAL without a module and a name")
                    try:
                        module, name = self._text(mod_start, mod_end), self._text(name_start, name_end)
                    except UnicodeDecodeError:
                        raise _Break("a global's name is not UTF-8") from None
                    stack.append(self._global(module, name, pos, by_line=True))
                elif op == 0x93:  # STACK_GLOBAL
                    if len(stack) < 2:
                        raise _Break("stack underflow")
                    name_v, module_v = stack.pop(), stack.pop()
                    if not (_may_be_str(name_v) and _may_be_str(module_v)):
                        raise _Break("STACK_GLOBAL needs two str")
                    if type(name_v) is tuple and type(module_v) is tuple:
                        try:
                            module, name = self._value_text(module_v), self._value_text(name_v)
                        except (UnicodeError, ValueError):  # CPython failed on that string's own opcode
                            raise _Break("a string that does not decode") from None
                        stack.append(self._global(module, name, pos))
                    else:
                        self._finding("?", "?", Verdict.DANGEROUS, "STACK_GLOBAL whose name is computed while loading "
                                      "(the result of a call)", pos)
                        stack.append(UNK)
                elif op == 0x2E:  # . STOP
                    if not stack:
                        raise _Break("STOP with an empty stack")
                    if fe > self.pos:
                        self._frame_anomaly(f"a frame runs {fe - self.pos} bytes past the pickle's STOP")
                    return self.pos
                elif op == 0x80:  # PROTO
                    if data[take(1)] > 5:
                        raise _Break(f"unsupported pickle protocol {data[self.pos - 1]}")
                elif op == 0x95:  # FRAME: CPython reads the whole frame before going on
                    (size,) = _LE8.unpack_from(data, take(8))
                    if self.pos + size > n:
                        raise _Truncated("a frame runs past the end of the data")
                    self.frame_end = max(self.frame_end, self.pos + size)
                    if fe and fe != pos:
                        self._frame_anomaly(f"a frame starts at byte {pos}, inside the frame that ends at byte {fe}")
                    self.current_frame_end = self.pos + size
                elif op in (0x42, 0x43, 0x8E, 0x96, 0x54, 0x55):  # BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8,
                    # BINSTRING, SHORT_BINSTRING (the last two become str when torch loads them)
                    if op == 0x43 or op == 0x55:
                        size = data[take(1)]
                    # CPython reads BINSTRING's count unsigned (pickle.py reads it signed)
                    elif op == 0x42 or op == 0x54:
                        (size,) = _LE4.unpack_from(data, take(4))
                    else:
                        (size,) = _LE8.unpack_from(data, take(8))
                    start = take(size)
                    if size > limits.MAX_PICKLE_VALUE:
                        self._refuse(f"a byte string of {size:,} bytes at byte {pos}, over the "
                                     f"{limits.MAX_PICKLE_VALUE >> 20} MB ckpt-doctor unpickles")
                    self._nested(start, start + size, pos, False)
                    stack.append((start, start + size, _BYTES_STR) if op in (0x54, 0x55) else NOT)
                elif op == 0x8D:  # BINUNICODE8
                    (size,) = _LE8.unpack_from(data, take(8))
                    start = take(size)
                    if size > limits.MAX_PICKLE_VALUE:
                        self._refuse(f"a string of {size:,} bytes at byte {pos}, over the "
                                     f"{limits.MAX_PICKLE_VALUE >> 20} MB ckpt-doctor unpickles")
                    stack.append((start, start + size, _UTF8))
                    if size > 2 and data[start] == 0xC2:
                        self._nested(start, start + size, pos, True)
                elif op == 0x53:  # S STRING: a quoted repr
                    start, end = self._line()
                    if end - start < 2 or data[start] != data[end - 1] or data[start] not in b"\"'":
                        raise _Break("the STRING opcode argument must be quoted")
                    value = (start, end, _QUOTED)
                    try:
                        self._value_text(value)
                    except (UnicodeError, ValueError):
                        raise _Break("the STRING opcode's escapes do not decode") from None
                    stack.append(value)
                elif op == 0x56:  # V UNICODE
                    start, end = self._line()
                    value = (start, end, _RAW_UNICODE)
                    try:
                        self._value_text(value)
                    except (UnicodeError, ValueError):
                        raise _Break("the UNICODE opcode's escapes do not decode") from None
                    stack.append(value)
                elif op in (0x49, 0x4C, 0x46):  # I INT, L LONG, F FLOAT (text)
                    start, end = self._line()
                    stack.append(_text_number(bytes(data[start:end]), op))
                elif op == 0x47:  # G BINFLOAT
                    stack.append(_BE8D.unpack_from(data, take(8))[0])
                elif op == 0x8A:  # LONG1
                    size = data[take(1)]
                    start = take(size)
                    stack.append(_number(int.from_bytes(data[start:start + size], "little", signed=True)))
                elif op == 0x8B:  # LONG4
                    (size,) = _LE4S.unpack_from(data, take(4))
                    if size < 0:
                        raise _Break("LONG pickle has negative byte count")
                    if size > limits.MAX_INT_BYTES:
                        self._refuse(f"an integer of {size * 8:,} bits at byte {pos}: no checkpoint holds one")
                        take(size)
                        stack.append(NOT)
                    else:
                        start = take(size)
                        stack.append(_number(int.from_bytes(data[start:start + size], "little", signed=True)))
                elif op == 0x70:  # p PUT
                    start, end = self._line()
                    try:
                        index = int(bytes(data[start:end]).split(b"\0", 1)[0])  # C reads the line up to a NUL
                    except ValueError:
                        raise _Break("PUT's index is not a number") from None
                    self._put(stack, memo, index)
                elif op == 0x67:  # g GET
                    start, end = self._line()
                    try:
                        index = int(bytes(data[start:end]).split(b"\0", 1)[0])  # C reads the line up to a NUL
                    except ValueError:
                        raise _Break("GET's index is not a number") from None
                    self._get(stack, memo, index)
                elif op == 0x30:  # 0 POP (of an item, or of an empty MARK)
                    if stack:
                        stack.pop()
                    else:
                        stack = self._pop_mark(metastack)
                elif op == 0x31:  # 1 POP_MARK
                    stack = self._pop_mark(metastack)
                elif op == 0x32:  # 2 DUP
                    if not stack:
                        raise _Break("stack underflow")
                    stack.append(stack[-1])
                elif op == 0x61:  # a APPEND (a list's items may be handed to set() or OrderedDict(): counted too)
                    if len(stack) < 2:
                        raise _Break("stack underflow")
                    self._hashing((stack.pop(),), pos)
                elif op in (0x65, 0x90):  # e APPENDS, ADDITEMS
                    items, stack = stack, self._pop_mark(metastack)
                    if not stack:
                        raise _Break("no list or set below the MARK")
                    if op == 0x90:
                        self._keys(items, pos)
                    else:
                        self._hashing(items, pos)
                elif op == 0x73:  # s SETITEM
                    if len(stack) < 3:
                        raise _Break("stack underflow")
                    self._keys(stack[-2:-1], pos)
                    del stack[-2:]
                elif op == 0x62:  # b BUILD: __setstate__ may run; the instance stays on the stack
                    if len(stack) < 2:
                        raise _Break("stack underflow")
                    stack.pop()
                    target = stack[-1]
                    if target.__class__ is _Global or target.__class__ is _Held and target.objects:
                        self._build(target, pos)
                elif op in (0x6C, 0x64, 0x91):  # l LIST, d DICT, FROZENSET
                    items, stack = stack, self._pop_mark(metastack)
                    if op == 0x64 and len(items) % 2:
                        raise _Break("odd number of items for DICT")
                    if op == 0x6C:
                        self._hashing(items, pos)
                        stack.append(NOT)
                    else:
                        self._keys(items[0::2] if op == 0x64 else items, pos)
                        stack.append(self._frozenset(items) if op == 0x91 else NOT)
                elif op == 0x81:  # NEWOBJ: cls.__new__(cls, *args)
                    if len(stack) < 2:
                        raise _Break("stack underflow")
                    self._hashing((stack.pop(),), pos)
                    stack[-1] = self._instance(stack[-1])
                elif op == 0x92:  # NEWOBJ_EX
                    if len(stack) < 3:
                        raise _Break("stack underflow")
                    self._hashing(stack[-2:], pos)
                    del stack[-2:]
                    stack[-1] = self._instance(stack[-1])
                elif op == 0x6F:  # o OBJ: MARK cls args... → cls(*args)
                    items, stack = stack, self._pop_mark(metastack)
                    if not items:
                        raise _Break("OBJ without a class")
                    self._hashing(items, pos)
                    stack.append(self._instance(items[0]))
                elif op == 0x69:  # i INST: MARK args... INST module name → module.name(*args)
                    if not metastack:
                        raise _Break("INST without a MARK")
                    mod_start, mod_end = self._line()
                    name_start, name_end = self._line()
                    if mod_end - mod_start < 1 or name_end - name_start < 1:
                        raise _Break("INST without a module and a name")
                    try:
                        module, name = self._text(mod_start, mod_end), self._text(name_start, name_end)
                    except UnicodeDecodeError:
                        raise _Break("a global's name is not UTF-8") from None
                    cls = self._global(module, name, pos, by_line=True)
                    stack = self._pop_mark(metastack)
                    stack.append(self._instance(cls))
                elif op in (0x82, 0x83, 0x84):  # EXT1, EXT2, EXT4: a global by number, from copyreg's registry
                    size = {0x82: 1, 0x83: 2, 0x84: 4}[op]
                    code = int.from_bytes(data[take(size):self.pos], "little")
                    if code <= 0:
                        raise _Break("EXT specifies code <= 0")
                    key = copyreg._inverted_registry.get(code)  # type: ignore[attr-defined]
                    if isinstance(key, tuple) and len(key) == 2:
                        stack.append(self._global(str(key[0]), str(key[1]), pos))
                    else:  # CPython raises here; only a process that registered the code would go on
                        raise _Break(f"extension code {code} is registered nowhere (copyreg.add_extension)")
                elif op == 0x50:  # P PERSID: a text persistent id (torch's loaders refuse it, other loaders may not)
                    self._line()
                    stack.append(UNK)
                elif op == 0x97:  # NEXT_BUFFER: out-of-band data (torch.load passes none; another loader may)
                    stack.append(UNK)
                elif op == 0x98:  # READONLY_BUFFER
                    if not stack:
                        raise _Break("stack underflow")
                else:
                    self.pos = pos
                    raise _Break(f"byte 0x{op:02x} is not a pickle opcode")
                cur = self.pos
                if self.current_frame_end:
                    fe, self.current_frame_end = self.current_frame_end, 0
        finally:
            self.budget[1] = left
