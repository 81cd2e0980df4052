"""The pickle `torch.save` writes for a state_dict or a tensor, read in one pass: walked and unpickled together.

A checkpoint's data.pkl is almost always one shape: protocol 2, a tensor (a DCP item) or a dict (or an
OrderedDict, with the `_metadata` of module versions set on it by BUILD) of str keys to tensors, each
`_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, OrderedDict())` on a persistent id
`("storage", torch.XStorage, key, location, numel)`; a training checkpoint puts such dicts in a dict beside an
optimizer's state_dict (its state keyed by int, its param_groups a list of dicts of floats, None, tuples of floats
and lists of ints), a scheduler's, an epoch, a name.
read_state_dict reads exactly that grammar and nothing else: the opcodes below, the four kinds of global the
grammar names (each judged by the policy and required SAFE), and values of the kinds each opcode's place allows.
Whatever does not fit — another opcode, global, protocol or value, a memo entry that was never stored, bytes after
STOP — returns None, and the caller walks and unpickles the pickle as before (safepickle.walker, then
SafeUnpickler), with all their bounds. So this reader only ever speeds up what those two would have accepted.

Why nothing it accepts needs their bounds: it calls nothing (a global is a marker; the only "calls" are the two
REDUCEs the grammar has, building an OrderedDict() or a RawTensor record); dict keys are str (hashed with Python's
random key) or ints from 0 to below 2**61 − 1 (each its own hash: no two keys share one, which the walk counts and
bounds); a tuple is never hashed and holds no container (tuples are persistent ids and the rebuild's arguments,
consumed where they are made, shapes of ints, and scalars); the memo is numbered 0, 1, 2, … as every pickler
numbers it (no index sized to bomb an array, no entry overwritten), one entry per PUT; MARKs nest at most
_MAX_MARKS and dicts and lists at most _MAX_HEIGHT; every opcode is O(1) but the ones that pop a MARK's items, each
item popped once. A dict or list is never fetched from the memo, so containers are filled bottom up, hold no cycle,
and their nesting is known where it is made. Time and memory are linear in the pickle's bytes. And the walk's own
bounds hold as if it had walked: opcodes are counted as it counts them, against the file's budget (debited alike),
memo entries against its bound, strings against its length bound; a str that starts as a pickle would (latin-1 text
of one, which the walker walks as a nested pickle) makes the reader decline.

What it returns is what the two passes would have: the Walk (the globals named, where first named; the one pickle
and its end) and, as SafeUnpickler would have made it, the root with a RawTensor per tensor on StorageRefs, one per
storage key, in the order the unpickler's persistent_load would have met them (tests/test_statedict.py checks both
against the walker and the unpickler on generated checkpoints, and that a mutation is declined or read alike).
"""

from __future__ import annotations

import functools
import gc
import re
import struct
from collections import OrderedDict
from itertools import chain, repeat

from ..dtypes import STORAGE_CLASS_DTYPE
from . import limits
from .policy import GlobalRef, Policy, Verdict
from .unpickler import RawTensor, StorageRef, rebuilt_tensor
from .walker import Walk, new_budget, text_pickle

_INT64 = 1 << 63
# Dicts and lists in dicts and lists (BUILD's state counted as a dict under its target): a state_dict with its
# _metadata is 4 high (root, the state, _metadata, {"version": 1}); a training checkpoint holds it a level or two down,
# an optimizer's state 4 high (root, the optimizer, its state, a parameter's).
_MAX_HEIGHT = 8
# A SETITEMS or APPENDS batch open for each level of containers, then the rebuild's arguments and a persistent id.
_MAX_MARKS = _MAX_HEIGHT + 3
# Opcodes read one at a time (not by the template): a state_dict's first tensors, its _metadata (~8 a module) and
# tensors of 4 or more dimensions (~30 each). Past this the pickle is left to the walker, which reads opcodes
# faster than this reader does one at a time: a file of nothing but odd opcodes costs this reader ~1 s at most.
_MAX_BY_OPCODE = 2_000_000


class _Marker:
    """A global of the grammar on the stack: what a GLOBAL opcode names (never the object itself)."""

    __slots__ = ("dtype", "what")

    def __init__(self, what: str, dtype: str = "") -> None:
        self.what, self.dtype = what, dtype


_REBUILD = _Marker("rebuild")
_ORDERED = _Marker("OrderedDict")
_GLOBALS: dict[bytes, _Marker] = {b"torch._utils\n_rebuild_tensor_v2\n": _REBUILD,
                                  b"collections\nOrderedDict\n": _ORDERED}
_GLOBALS.update({f"torch\n{name}\n".encode(): _Marker("storage", dtype) for name, dtype in STORAGE_CLASS_DTYPE.items()})
_GLOBAL_TEXT = re.compile(rb"([\w.]{1,64})\n(\w{1,64})\n")
# The types of a dict's keys (an optimizer's state is keyed by parameter index: an int from 0 to below _HASH_M,
# each its own hash); of the values that hold nothing (a tensor's record, scalars); and of a tuple's items (an
# optimizer's betas): a tuple never holds a container.
_KEYS, _PLAIN = {str, int}, {RawTensor, int, bool, str, float, type(None)}
_HASH_M = (1 << 61) - 1  # CPython hashes an int modulo this: past it, or below 0, keys can share a hash
_SCALARS = {int, bool, str, float, type(None)}
_DOUBLE = struct.Struct(">d")
_GONE = object()  # a memo entry no state_dict pickle fetches again (a persistent id, the rebuild's arguments)

# One tensor of the dict once its globals and strings are in the memo, as torch.save writes every tensor after the
# first 31 (every PUT a LONG_BINPUT, indices from 256 on; those before go opcode by opcode). After the key: PUT; GET
# rebuild; MARK MARK GET "storage" GET storage class; the storage key (BINUNICODE of 1 to 9 digits: its length is
# checked against theirs); PUT; GET location; numel; TUPLE PUT BINPERSID; offset; shape; stride; requires_grad; GET
# OrderedDict, EMPTY_TUPLE REDUCE PUT (the hooks); TUPLE PUT REDUCE PUT. A shape or stride: (), or 1 to 3 ints,
# TUPLEn and PUT (more dimensions go opcode by opcode). The PUTs' indices are captured and checked in bulk
# (_numbered, for the items _Reader._run reads at once; _Reader.check_puts, for the rest). Repeats are possessive
# (no backtracking into them, whose states the regex would save for every group captured before): what follows one
# never starts as another of its items does, so nothing it matches changes.
_GET, _NUM, _PUT = rb"(?:h.|j....)", rb"(K.|M..|J....)", rb"r(....)"
_INTS = rb"(\)|(?:K.|M..|J....){1,3}+[\x85-\x87])(?:r(....))?+"
_ITEM = re.compile(_PUT + b"(" + _GET + rb"\(\(" + _GET + _GET + rb")X(.)\x00\x00\x00([0-9]{1,9}+)" + _PUT + b"("
                   + _GET + b")" + _NUM + rb"t" + _PUT + rb"Q" + _NUM + _INTS + _INTS + rb"([\x88\x89])(" + _GET
                   + rb")\)R" + _PUT + rb"t" + _PUT + rb"R" + _PUT, re.DOTALL)
# A tensor of the template without a key of its own before it (from its GET of the rebuild on): an optimizer's state
# under a key fetched from the memo ("exp_avg"), an item of a list. _Reader._tensor reads one at a time.
_TENSOR = re.compile(_ITEM.pattern[len(_PUT):], re.DOTALL)
_PUT_RUNS = {n: struct.Struct(f"<{n}I") for n in (5, 6, 7)}  # the index bytes of a tensor's 5 to 7 PUTs in turn
# An item with its key before it (BINUNICODE), for keys of 1 to 255 bytes of printable ASCII, as a state_dict's names
# are, the whole item a group too: _Reader._keyed_run cuts a stretch of the pickle into these with one re.split.
_KEYED = re.compile(rb"(X(.)\x00\x00\x00([\x20-\x7e]{1,255})" + _ITEM.pattern + b")", re.DOTALL)
_STRIDE = _KEYED.groups + 1  # re.split's parts a match: the bytes before it, then its groups
_WINDOW = 512  # bytes _keyed_run splits at first, and after a run that was not one (about four items)
_ITEM_BYTES = 512  # more than a keyed item can span (a 255-byte key and the template's ~150): a stretch's last bytes
# fewer than this may be an item the stretch cut short
_UINT32 = "I" if struct.calcsize("I") == 4 else None  # a 4-byte int's code, for _numbered's memoryview
_MAX_RUN = 4096  # the most items _Reader._run reads at once
_FEW = 4  # runs of fewer items are left to _Reader._items' loop (a dict whose tensors alternate with other values)


class StateDictRead:
    """What reading a state_dict pickle in one pass gives: the walk's result, and what the unpickler would have
    made (its root, the storages its persistent ids named, the globals it looked up); `notes` and `length` as the
    unpickler keeps them, for build_checkpoint."""

    __slots__ = ("globals", "length", "notes", "root", "source", "storages", "walk")

    def __init__(self, walk: Walk, root: object, storages: dict[str, StorageRef], globals_: list[GlobalRef],
                 length: int, source: str) -> None:
        self.walk, self.root, self.storages, self.globals = walk, root, storages, globals_
        self.notes: list[str] = []
        self.length, self.source = length, source


class _Misfit(Exception):
    """The pickle is not of the grammar: the caller walks and unpickles it as before."""


def read_state_dict(data: bytes, source: str, policy: Policy, budget: list | None = None) -> StateDictRead | None:
    """The one-pass reading of `data` (a whole data.pkl), or None when it is not torch.save's state_dict grammar.
    `budget`: the file's walk budget (walker.new_budget), debited by the opcodes read as the walk debits it; a pickle
    of more opcodes than it has left, or more memo entries than the walk tracks, is left to the walk to refuse."""
    if data[:2] != b"\x80\x02":
        return None
    budget = budget or new_budget()
    reader = _Reader(data, source, policy, budget[1])
    collecting = gc.isenabled()
    gc.disable()  # what it builds holds no cycle (no dict is fetched again): the collector would only walk it
    try:
        read = reader.run()
    except (_Misfit, IndexError, KeyError, UnicodeDecodeError, struct.error):  # the bytes end mid-opcode: IndexError,
        return None  # struct.error (a float's)
    finally:
        if collecting:
            gc.enable()
    budget[1] -= reader.ops
    return read


class _Reader:
    def __init__(self, data: bytes, source: str, policy: Policy, max_ops: int) -> None:
        self.data, self.source, self.policy = data, source, policy
        self.ops, self.max_ops = 1, max_ops  # opcodes read (PROTO first), as the walk counts them against its budget
        self.max_memo = limits.max_memo_entries(len(data))
        self.walk = Walk()
        self.globals: list[GlobalRef] = []
        self.named: dict[bytes, _Marker] = {}
        self.storages: dict[str, StorageRef] = {}
        self.heights: dict[int, tuple[object, int]] = {}  # id(dict) -> (the dict, its height), for dicts in dicts
        self.gets: dict[tuple[bytes, ...], tuple | None] = {}  # _template_gets, by the GETs' bytes
        self.runs: list[tuple[int, list[bytes]]] = []  # the PUTs _items took: (first index, their index bytes)
        self.run_end = -1
        self.slow_until = 0  # _run read items up to here and found one the loop must read: it leaves them to it
        self.window = _WINDOW  # the bytes _keyed_run splits next
        self.streak = (0, 0)  # where the runs _keyed_run read end to end start and end
        self.tuples: dict[bytes, tuple[int, ...]] = {}  # shapes and strides, by their bytes (few distinct)
        self.scalar_tuples: dict[int, tuple] = {}  # id(tuple) -> the tuple, for tuples _value found of scalars

    def _global(self, at: int) -> tuple[_Marker, int]:
        match = _GLOBAL_TEXT.match(self.data, at + 1)
        if match is None:
            raise _Misfit
        text = match.group(0)
        marker = _GLOBALS.get(text)
        if marker is None:
            raise _Misfit
        if text not in self.named:
            module, name = match.group(1).decode(), match.group(2).decode()
            verdict, reason = _classify(self.policy, module, name)
            if verdict is not Verdict.SAFE:
                raise _Misfit
            self.named[text] = marker
            self.walk.globals.append(GlobalRef(module, name, verdict, reason, f"{self.source} at byte {at}"))
            self.globals.append(GlobalRef(module, name, verdict, reason, self.source))
        return marker, match.end()

    def _storage(self, pid: object) -> StorageRef:
        """persistent_load of torch's storage id, as SafeUnpickler does it (one StorageRef per key)."""
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise _Misfit
        _, kind, key, location, numel = pid
        if kind.__class__ is not _Marker or kind.what != "storage" or type(key) is not str \
                or type(location) is not str or type(numel) is not int or not 0 <= numel < _INT64:
            raise _Misfit
        ref = self.storages.get(key)
        if ref is None:
            ref = self.storages[key] = StorageRef(key, kind.dtype, numel, location)
        return ref

    def _height(self, value: object) -> int:
        known = self.heights.get(id(value))
        return known[1] if known is not None and known[0] is value else 1

    def _under(self, target: object, value: object) -> None:
        """`value`, a dict, is put under `target` (as an item, or as BUILD's state): the target's height grows."""
        height = self._height(value) + 1
        if height > _MAX_HEIGHT:
            raise _Misfit
        if height > self._height(target):
            self.heights[id(target)] = (target, height)

    def _value(self, target: object, value: object) -> None:
        """Raises _Misfit unless `value` may be put in `target` (a dict or a list): a tensor, a scalar, a tuple of
        scalars, or a dict or list below the height bound."""
        kind = value.__class__
        if kind is dict or kind is OrderedDict or kind is list:
            self._under(target, value)
        elif kind is tuple:  # a dict's value only: what a list holds the walk counts as what may be hashed
            if target.__class__ is list:
                raise _Misfit
            # Its items are looked at once: a tuple fetched from the memo for every value of a dict would have them
            # looked at each time (a 20,000-item tuple put 20,000 times, 180 KB: 14 s).
            if self.scalar_tuples.get(id(value)) is not value:
                if not set(map(type, value)) <= _SCALARS:  # type: ignore[arg-type]
                    raise _Misfit  # a tuple of containers, tensors or markers: nothing a checkpoint holds so
                self.scalar_tuples[id(value)] = value  # type: ignore[assignment]
        elif kind not in _PLAIN:
            raise _Misfit  # a marker, a storage: nothing torch.save's checkpoint holds as a value

    def _set(self, target: object, key: object, value: object) -> None:
        if target.__class__ not in (dict, OrderedDict) or key.__class__ not in _KEYS \
                or key.__class__ is int and not 0 <= key < _HASH_M:  # type: ignore[operator]
            raise _Misfit
        self._value(target, value)
        target[key] = value  # type: ignore[index]

    def _extend(self, target: object, items: list) -> None:
        """APPEND and APPENDS: `items` put at the end of `target`, a list."""
        if target.__class__ is not list:
            raise _Misfit
        if not set(map(type, items)) <= _PLAIN:
            for item in items:
                self._value(target, item)
        target.extend(items)  # type: ignore[attr-defined]

    def run(self) -> StateDictRead:
        data = self.data
        end = len(data)
        stack: list = []
        marks: list[list] = []
        memo: list = []  # PUTs append: an index is stored at len(memo), or the pickle is not of the grammar
        pos = 2
        by_opcode = 0
        while True:
            op = data[pos]
            self.ops += 1
            by_opcode += 1
            if self.ops > self.max_ops or len(memo) > self.max_memo or by_opcode > _MAX_BY_OPCODE:
                raise _Misfit  # the walk refuses it (limits.MAX_PICKLE_OPCODES, max_memo_entries), or reads it
            if op == 0x71:  # BINPUT: the next index, as every pickler numbers them
                if data[pos + 1] != len(memo):
                    raise _Misfit
                memo.append(stack[-1])
                pos += 2
            elif op == 0x72:  # LONG_BINPUT
                if int.from_bytes(data[pos + 1:pos + 5], "little") != len(memo):
                    raise _Misfit
                memo.append(stack[-1])
                pos += 5
            elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                value = _fetched(memo[data[pos + 1] if op == 0x68 else int.from_bytes(data[pos + 1:pos + 5], "little")])
                if value is _REBUILD and marks:  # a tensor: of the template, at once
                    read = self._tensor(pos, memo)
                    if read is not None:
                        stack.append(read[0])
                        pos = read[1]
                        continue
                stack.append(value)
                pos += 2 if op == 0x68 else 5
            elif op == 0x4B:  # BININT1
                stack.append(data[pos + 1])
                pos += 2
            elif op == 0x4D:  # BININT2
                stack.append(int.from_bytes(data[pos + 1:pos + 3], "little"))
                pos += 3
            elif op == 0x4A:  # BININT
                stack.append(int.from_bytes(data[pos + 1:pos + 5], "little", signed=True))
                pos += 5
            elif op == 0x8A:  # LONG1
                size = data[pos + 1]
                if size > 8 or pos + 2 + size > end:
                    raise _Misfit
                stack.append(int.from_bytes(data[pos + 2:pos + 2 + size], "little", signed=True))
                pos += 2 + size
            elif op == 0x58:  # BINUNICODE
                size = int.from_bytes(data[pos + 1:pos + 5], "little")
                # keys of a SETITEMS batch: at once, while of the template (a str that no tensor follows, an item
                # of a list of names, is asked one match, not _items' few)
                if marks and len(memo) >= 256 and _ITEM.match(data, pos + 5 + size) is not None:
                    at = self._items(pos, memo, stack)
                    if at != pos:
                        pos = at
                        continue
                if pos + 5 + size > end or size > limits.MAX_PICKLE_VALUE \
                        or text_pickle(data, pos + 5, pos + 5 + size) is not None:
                    raise _Misfit  # too long for the walker, or text the walker walks as a pickle inside
                stack.append(data[pos + 5:pos + 5 + size].decode("utf-8", "surrogatepass"))
                pos += 5 + size
            elif op == 0x28:  # MARK
                if len(marks) >= _MAX_MARKS:
                    raise _Misfit
                marks.append(stack)
                stack = []
                pos += 1
            elif op == 0x74:  # TUPLE
                items = tuple(stack)
                stack = marks.pop()
                stack.append(items)
                pos += 1
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
                pos += 1
            elif op == 0x85:  # TUPLE1
                stack[-1] = (stack[-1],)
                pos += 1
            elif op == 0x86:  # TUPLE2
                stack[-2:] = [tuple(stack[-2:])] if len(stack) >= 2 else _misfit()
                pos += 1
            elif op == 0x87:  # TUPLE3
                stack[-3:] = [tuple(stack[-3:])] if len(stack) >= 3 else _misfit()
                pos += 1
            elif op == 0x51:  # BINPERSID
                stack[-1] = self._storage(stack[-1])
                pos += 1
            elif op == 0x88 or op == 0x89:  # NEWTRUE, NEWFALSE
                stack.append(op == 0x88)
                pos += 1
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                stack[-1] = self._reduce(stack[-1], args)
                pos += 1
            elif op == 0x75:  # SETITEMS
                items = stack
                stack = marks.pop()
                if len(items) % 2 or not stack:
                    raise _Misfit
                target = stack[-1]
                keys, values = items[0::2], items[1::2]
                kinds = set(map(type, keys))
                if (target.__class__ is dict or target.__class__ is OrderedDict) and kinds <= _KEYS \
                        and set(map(type, values)) <= _PLAIN and (int not in kinds or _plain_ints(keys)):
                    # what _set would do for each, at once
                    target.update(zip(keys, values))
                else:
                    for key, value in zip(keys, values):
                        self._set(target, key, value)
                pos += 1
            elif op == 0x73:  # SETITEM
                value = stack.pop()
                key = stack.pop()
                self._set(stack[-1], key, value)
                pos += 1
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
                pos += 1
            elif op == 0x47:  # BINFLOAT
                stack.append(_DOUBLE.unpack_from(data, pos + 1)[0])
                pos += 9
            elif op == 0x4E:  # NONE
                stack.append(None)
                pos += 1
            elif op == 0x5D:  # EMPTY_LIST
                stack.append([])
                pos += 1
            elif op == 0x61:  # APPEND
                value = stack.pop()
                self._extend(stack[-1], [value])
                pos += 1
            elif op == 0x65:  # APPENDS
                items = stack
                stack = marks.pop()
                if not stack:
                    raise _Misfit
                self._extend(stack[-1], items)
                pos += 1
            elif op == 0x63:  # GLOBAL
                marker, pos = self._global(pos)
                stack.append(marker)
            elif op == 0x62:  # BUILD: the state torch sets on a state_dict (its _metadata)
                state = stack.pop()
                target = stack[-1]
                if target.__class__ is not OrderedDict or state.__class__ is not dict \
                        or any(k.__class__ is not str or k[:2] == "__" or hasattr(OrderedDict, k) for k in state):
                    raise _Misfit  # (a __setstate__ set so would be what CPython's next BUILD calls; an `items`,
                    # what every `.items()` calls: the unpickler drops those)
                self._under(target, state)
                vars(target).update(state)
                pos += 1
            elif op == 0x2E:  # STOP
                pos += 1
                if marks or len(stack) != 1 or pos != end or not self.check_puts():
                    raise _Misfit  # bytes after STOP, or a stack left over: the walker says what they are
                root = stack[0]
                if root.__class__ is not dict and root.__class__ is not OrderedDict and root.__class__ is not RawTensor:
                    raise _Misfit  # a state_dict, or one tensor saved alone
                self.walk.pickles.append((0, end))
                self.walk.end = end
                return StateDictRead(self.walk, root, self.storages, self.globals, end, self.source)
            else:
                raise _Misfit

    def _checked(self, groups: tuple, memo: list) -> tuple | None:
        """A tensor of the template from its _TENSOR groups (an _ITEM's, less its key's PUT), checked as the opcodes
        one by one would check it: ((dtype, location), numel, offset, shape, stride, the opcodes the walk counts
        from its GET of the rebuild on); None where it is not of the template, or is what SafeUnpickler refuses (a
        negative offset) or notes (a negative numel), which the opcodes one by one then meet."""
        (head_gets, skey_size, skey, _, get_location, numel, _, offset, shape, put_shape, stride, put_stride, _,
         get_ordered, *_) = groups
        head = (head_gets, get_location, get_ordered)
        known = self.gets.get(head, _GONE)
        if known is _GONE:
            known = self.gets[head] = _template_gets(*head, memo)
        tuples = self.tuples
        shape_value = tuples.get(shape) or _tuple(shape, tuples)
        stride_value = tuples.get(stride) or _tuple(stride, tuples)
        offset_value = 0 if offset == b"K\x00" else _int(offset)
        numel_value = numel[1] if len(numel) == 2 else _int(numel)
        if known is None or shape_value is None or stride_value is None or offset_value < 0 or numel_value < 0 \
                or skey_size[0] != len(skey) \
                or (put_shape is None) is not (shape == b")") or (put_stride is None) is not (stride == b")"):
            return None
        # The opcodes the walk counts: 22, and a shape's and a stride's (EMPTY_TUPLE, or ints, TUPLEn, PUT).
        ops = 22 + (1 if put_shape is None else len(shape_value) + 2) \
            + (1 if put_stride is None else len(stride_value) + 2)
        return known, numel_value, offset_value, shape_value, stride_value, ops

    def _made(self, skey: bytes, known: tuple[str, str], numel: int, offset: int, shape: tuple, stride: tuple,
              grad: bytes) -> tuple[str, RawTensor]:
        """The storage key and the tensor of a checked item: persistent_load's StorageRef (one per key, made when
        first named) and the rebuild's RawTensor."""
        key = skey.decode()
        ref = self.storages.get(key)
        if ref is None:
            ref = self.storages[key] = StorageRef(key, known[0], numel, known[1])
        return key, RawTensor(ref, ref.dtype, offset, shape, stride, grad == b"\x88")

    def _tensor(self, pos: int, memo: list) -> tuple[RawTensor, int] | None:
        """The tensor of the template from `pos`, its GET of the rebuild (_TENSOR: an _ITEM without its key), as the
        opcodes one by one would make it: its memo entries stored, their PUTs' indices checked, its opcodes counted
        (the GET already by run()); with where it ends. None, and nothing done, where the bytes are not of it."""
        item = _TENSOR.match(self.data, pos)
        if item is None:
            return None
        groups = item.groups()
        checked = self._checked(groups, memo)
        if checked is None:
            return None
        known, numel, offset, shape, stride, ops = checked
        (_, _, skey, put_skey, _, _, put_pid, _, _, put_shape, _, put_stride, grad, _, put_hooks, put_args,
         put_tensor) = groups
        puts = [put for put in (put_skey, put_pid, put_shape, put_stride, put_hooks, put_args, put_tensor)
                if put is not None]
        first = len(memo)
        if first + len(puts) > self.max_memo or self.ops + ops - 1 > self.max_ops \
                or b"".join(puts) != _PUT_RUNS[len(puts)].pack(*range(first, first + len(puts))):
            return None  # PUTs out of turn, or past the walk's bounds: read opcode by opcode, which says so
        self.ops += ops - 1
        key, tensor = self._made(skey, known, numel, offset, shape, stride, grad)
        memo += key, _GONE
        if put_shape is not None:
            memo.append(shape)
        if put_stride is not None:
            memo.append(stride)
        memo += _GONE, _GONE, tensor
        return tensor, item.end()

    def _items(self, pos: int, memo: list, stack: list) -> int:
        """The keys and tensors from `pos` on, read as the opcodes one by one would read them, while they are of
        the template torch.save repeats for every tensor (_ITEM): each key and tensor pushed, their memo entries
        stored, their PUTs' indices kept for check_puts; where the first that is not of it starts."""
        data = self.data
        item_match = _ITEM.match
        max_ops, max_memo, max_value = self.max_ops, self.max_memo, limits.MAX_PICKLE_VALUE
        ops = self.ops - 1  # the first key's BINUNICODE, which run() counted, is counted with its item
        start = pos
        while True:  # as many items as _run reads at once; then one by one from where it stopped
            done = self._run(pos, memo, stack, ops)
            if done is None:
                break
            pos, ops = done
        puts = None  # (the list of the run the items below continue, once one is read)
        while data[pos] == 0x58:
            size = int.from_bytes(data[pos + 1:pos + 5], "little")
            if size > max_value or data[pos + 5] == 0xC2 and text_pickle(data, pos + 5, pos + 5 + size) is not None:
                break  # what the walker refuses, or walks as a pickle inside the text: run() declines it
            at = pos + 5 + size
            item = item_match(data, at)
            if item is None:
                break
            put_key, *groups = item.groups()
            checked = self._checked(groups, memo)
            if checked is None:
                break  # run() reads it opcode by opcode, and declines it or meets what SafeUnpickler would
            known, numel, offset, shape_value, stride_value, item_ops = checked
            item_ops += 2  # its key's BINUNICODE and PUT
            if ops + item_ops > max_ops or len(memo) + 8 > max_memo:
                break  # past the walk's bounds: run() declines it
            ops += item_ops
            if puts is None:
                if len(memo) != self.run_end:  # PUTs by opcode came between: a new run of indices
                    self.runs.append((len(memo), []))
                puts = self.runs[-1][1]
            (_, _, skey, put_skey, _, _, put_pid, _, _, put_shape, _, put_stride, grad, _, put_hooks, put_args,
             put_tensor) = groups
            skey, tensor = self._made(skey, known, numel, offset, shape_value, stride_value, grad)
            key = data[pos + 5:at].decode("utf-8", "surrogatepass")
            if put_shape is not None and put_stride is not None:  # the common case, in one step
                puts += put_key, put_skey, put_pid, put_shape, put_stride, put_hooks, put_args, put_tensor
                memo += key, skey, _GONE, shape_value, stride_value, _GONE, _GONE, tensor
            else:
                puts += put_key, put_skey, put_pid
                memo += key, skey, _GONE
                if put_shape is not None:
                    puts.append(put_shape)
                    memo.append(shape_value)
                if put_stride is not None:
                    puts.append(put_stride)
                    memo.append(stride_value)
                puts += put_hooks, put_args, put_tensor
                memo += _GONE, _GONE, tensor
            stack += key, tensor
            pos = item.end()
        if puts is not None:  # (items _run read alone set run_end themselves)
            self.run_end = len(memo)
        if pos != start:
            self.ops = ops
        return pos

    def _run(self, pos: int, memo: list, stack: list, ops: int) -> tuple[int, int] | None:
        """What _items' loop would make of the items from `pos` on, made a column at a time: the items of the
        template end to end there (up to _MAX_RUN), when every one passes every check the loop makes (else None, and
        the loop reads them: where one fails, it stops before it as it always has). Returns where they end, and the
        opcodes counted so far."""
        data = self.data
        if pos < self.slow_until:
            return None  # a run read here had an item the loop must read: the loop reads them all
        columns = self._keyed_run(pos)
        if columns is None:  # a key _KEYED does not take (not printable ASCII, 256 bytes or more): each as long as
            item_match = _ITEM.match  # it says, then its item
            keys, found = [], []
            end = pos
            while data[end] == 0x58 and len(found) < _MAX_RUN:  # the items end to end
                at = end + 5 + int.from_bytes(data[end + 1:end + 5], "little")
                item = item_match(data, at)
                if item is None:
                    break
                keys.append(data[end + 5:at])
                found.append(item)
                end = item.end()
            if not found:
                return None
            columns = (end, keys, *zip(*map(_groups, found, repeat(b""))))
        (end, keys, put_key, head_gets, skey_size, skey, put_skey, get_location, numel, put_pid, offset, shape,
         put_shape, stride, put_stride, grad, get_ordered, put_hooks, put_args, put_tensor) = columns
        n = len(keys)
        if n < _FEW:
            return None  # read faster by the loop: what is done here once a run costs more than a few items do
        self.slow_until = end  # unless all is well below: then the loop reads these items (and _run none of them)
        # Keys within the walker's bound, none starting as a pickle's text would (the loop asks the walker about those).
        # Where no key holds a line break, they are asked, and decoded below, as one text a line each.
        joined = b"\n".join(keys)
        lines = joined.count(b"\n") == n - 1
        if max(map(len, keys)) > limits.MAX_PICKLE_VALUE or b"".join(skey_size) != bytes(map(len, skey)) \
                or (joined[:1] == b"\xc2" or b"\n\xc2" in joined if lines
                    else any(map(bytes.startswith, keys, repeat(b"\xc2")))):
            return None
        gets = self.gets
        same = head_gets.count(head_gets[0]) == get_location.count(get_location[0]) \
            == get_ordered.count(get_ordered[0]) == n  # (as torch writes them)
        heads = [(head_gets[0], get_location[0], get_ordered[0])] if same else \
            list(zip(head_gets, get_location, get_ordered))
        for head in set(heads):
            if gets.get(head, _GONE) is _GONE:
                gets[head] = _template_gets(*head, memo)
            if gets[head] is None:
                return None
        tuples = self.tuples
        values = {body: _tuple(body, tuples) for body in {*shape, *stride}}
        if None in values.values():
            return None
        for puts, bodies in ((put_shape, shape), (put_stride, stride)):  # a PUT after each tuple but the empty one
            if (b")" in values or not all(puts)) and any(put is (body == b")")
                                                        for put, body in set(zip(map(bool, puts), bodies))):
                return None
        at_start = offset.count(b"K\x00") == n  # every tensor at its storage's start (torch's views aside)
        ints = {raw: _int(raw) for raw in ({*numel} if at_start else {*offset, *numel})}
        numels = list(map(ints.__getitem__, numel))
        offsets = repeat(0, n) if at_start else list(map(ints.__getitem__, offset))
        if min(numels) < 0 or not at_start and min(offsets) < 0:
            return None  # a negative offset: SafeUnpickler's _tensor refuses it; a negative numel, its note
        shapes, strides = list(map(values.__getitem__, shape)), list(map(values.__getitem__, stride))
        # the opcodes the walk counts, as the loop counts them for each item
        ops += 28 * n + sum(map(len, shapes)) + sum(map(len, strides)) - shapes.count(()) - strides.count(())
        every = all(put_shape) and all(put_stride)  # the common case: every item's eight entries
        puts = (put_key, put_skey, put_pid, put_shape, put_stride, put_hooks, put_args, put_tensor)
        # (a shape's or stride's PUT, which an empty tuple goes without: b"" from the loop's groups, None from a split)
        blob = b"" if every else b"".join(filter(None, chain.from_iterable(zip(*puts))))
        if ops > self.max_ops or len(memo) + (8 * n if every else len(blob) // 4) > self.max_memo - 8:
            return None  # past the walk's bounds somewhere in the run: the loop finds the item
        if every and not _numbered(len(memo), puts):
            return None  # (the loop reads them, and check_puts finds what it took amiss)
        try:  # (a line break is no part of a longer UTF-8 sequence: a key's bytes decode alike either way)
            names = joined.decode("utf-8", "surrogatepass").split("\n") if lines else \
                list(map(bytes.decode, keys, repeat("utf-8"), repeat("surrogatepass")))
        except UnicodeDecodeError:
            return None
        skeys = list(map(bytes.decode, skey))
        storages = self.storages
        known = gets[heads[0]] if same else None  # (dtype, location) of every item, else of each
        if known is not None and len(set(skeys)) == n and storages.keys().isdisjoint(skeys):
            # a storage each, none named before: all of the one dtype and location
            dtypes = [known[0]] * n
            refs = list(map(StorageRef, skeys, dtypes, numels, repeat(known[1])))
            storages.update(zip(skeys, refs))
        else:
            knowns = [known] * n if known is not None else list(map(gets.__getitem__, heads))
            for i, name in enumerate(skeys):
                if name not in storages:
                    storages[name] = StorageRef(name, knowns[i][0], numels[i], knowns[i][1])
            refs = list(map(storages.__getitem__, skeys))
            dtypes = [ref.dtype for ref in refs]
        tensors = list(map(RawTensor, refs, dtypes, offsets, shapes, strides,
                           map(b"\x88".__eq__, grad)))
        if every:  # their PUTs checked above: those of the items read next are a run of their own
            first = len(memo)  # eight entries an item, filled a column at a time (zip made a tuple an item)
            memo += repeat(_GONE, 8 * n)
            memo[first::8], memo[first + 1::8], memo[first + 3::8] = names, skeys, shapes
            memo[first + 4::8], memo[first + 7::8] = strides, tensors
        else:
            if len(memo) != self.run_end:  # PUTs by opcode came between: a new run of indices
                self.runs.append((len(memo), []))
            self.runs[-1][1].append(blob)
            for name, key, put_sh, sh, put_st, st, tensor in zip(names, skeys, put_shape, shapes, put_stride,
                                                                 strides, tensors):
                memo += name, key, _GONE
                if put_sh:
                    memo.append(sh)
                if put_st:
                    memo.append(st)
                memo += _GONE, _GONE, tensor
        first = len(stack)  # a key and its tensor an item
        stack += repeat(None, 2 * n)
        stack[first::2] = names
        stack[first + 1::2] = tensors
        self.run_end = -1 if every else len(memo)
        self.slow_until = 0
        return end, ops

    def _keyed_run(self, pos: int) -> tuple | None:
        """Where the items from `pos` on end, their keys, and their _ITEM groups a column each, for the items _KEYED
        takes, end to end (up to _MAX_RUN); None when the first is not one. A stretch of the pickle is cut into them by
        one re.split (its parts hold no match object an item): the items are those before the first bytes between
        two of them. The stretch is as long as the last run was, a little more (torch's runs are its SETITEMS batches,
        of 1,000 items each), and doubles while runs fill it, so that little is split past a run's end. A key is as
        long as the length before it says: where the bytes after a key happen to spell an item too and the pattern
        took them into it, the keys are not each what its length says, and None leaves them to the loop that reads
        each key by its length."""
        data = self.data
        if data[pos] != 0x58:  # (where a run ends: SETITEMS)
            return None
        if data[pos + 2:pos + 5] != b"\x00\x00\x00" or _ITEM.match(data, pos + 5 + data[pos + 1]) is None:
            self.window = _WINDOW  # no item after a key of its length (a str value, a key of no tensor): no stretch
            return None  # is split to find that out, for every such str (the loop's one match says it)
        window = self.window
        parts = _KEYED.split(data[pos:pos + window])
        count = len(parts) // _STRIDE  # the matches (the last part: the bytes after the last)
        if not count or parts[0]:
            self.window = _WINDOW
            return None
        between = list(map(bool, parts[_STRIDE:count * _STRIDE:_STRIDE]))  # bytes before each match after the first
        n = between.index(True) + 1 if True in between else count
        n = min(n, _MAX_RUN)
        whole, sizes, keys, *columns = (parts[g:(n - 1) * _STRIDE + g + 1:_STRIDE] for g in range(1, _STRIDE))
        end = pos + sum(map(len, whole))
        if b"".join(sizes) != bytes(map(len, keys)):
            self.window = _WINDOW
            return None
        # runs end to end are one streak (a batch that took several stretches)
        self.streak = (self.streak[0] if pos == self.streak[1] else pos, end)
        # twice as long where the run ran to the stretch's end; as long as this run where it stopped at _MAX_RUN (the
        # next run, from its end, is no longer: the streak's length would be split again for every run of a long
        # batch, quadratic); else as long as the streak of runs it ended, and some
        self.window = min(2 * window, 1 << 22) if n == count and len(parts[-1]) < _ITEM_BYTES \
            else max(_WINDOW, (end - (pos if n == _MAX_RUN else self.streak[0])) * 9 // 8 + 64)
        return (end, keys, *columns)

    def check_puts(self) -> bool:
        """Whether the PUTs of the template's items numbered their entries in turn, as _items took them to."""
        for first, puts in self.runs:
            joined = b"".join(puts)  # each a PUT's 4 bytes, or a run's at once
            if joined != _indices(first, first + len(joined) // 4):
                return False
        return True

    def _reduce(self, func: object, args: object) -> object:
        if func is _ORDERED and args == ():
            return OrderedDict()
        if func is not _REBUILD or args.__class__ is not tuple or len(args) != 6:  # type: ignore[arg-type]
            raise _Misfit
        storage, offset, shape, stride, requires_grad, hooks = args  # type: ignore[misc]
        if requires_grad.__class__ is not bool or hooks.__class__ is not OrderedDict or hooks:
            raise _Misfit
        try:  # SafeUnpickler's _rebuild_tensor_v2 (its checks of the storage, the offset, the shape and stride)
            return rebuilt_tensor(storage, offset, shape, stride, requires_grad)
        except TypeError:
            raise _Misfit from None


@functools.lru_cache(maxsize=256)
def _classify(policy: Policy, module: str, name: str) -> tuple[Verdict, str]:
    """policy.classify, once per policy for each of the grammar's few globals (a folder's items name them anew)."""
    return policy.classify(module, name)


def _indices(start: int, stop: int) -> bytes:
    """range(start, stop) as little-endian 4-byte ints (0 <= start <= stop <= 2**32): the indices of a run of PUTs,
    made a byte column at a time (160,000 of them in ~0.3 ms; int by int, struct.pack takes 15 ms)."""
    n = stop - start
    out = bytearray(4 * n)
    low = start & 0xFF  # the low bytes run through 0..255 from it
    out[0::4] = (_BYTES * ((low + n) // 256 + 1))[low:low + n]
    for shift in (8, 16, 24):  # each higher byte holds a value for 256**k ints in turn
        out[shift // 8::4] = b"".join(_BYTES[v & 0xFF:(v & 0xFF) + 1] * (min(stop, (v + 1) << shift)
                                                                         - max(start, v << shift))
                                      for v in range(start >> shift, ((stop - 1) >> shift) + 1)) if n else b""
    return bytes(out)


_BYTES = bytes(range(256))


def _numbered(first: int, columns: tuple[tuple[bytes, ...], ...]) -> bool:
    """Whether the PUTs of items of as many entries each as `columns` has columns (the k-th: each item's k-th PUT's
    4 index bytes) number them in turn from `first`: column k holds first + k, first + k + len(columns), ..."""
    step = len(columns)
    expected = _indices(first, first + step * len(columns[0]))
    if _UINT32 is None:
        return b"".join(chain.from_iterable(zip(*columns))) == expected
    ints = memoryview(expected).cast(_UINT32)
    return all(b"".join(column) == ints[k::step].tobytes() for k, column in enumerate(columns))


def _index(put: bytes) -> int:
    """The memo index of a BINPUT/LONG_BINPUT or BINGET/LONG_BINGET, opcode included."""
    return put[1] if len(put) == 2 else int.from_bytes(put[1:], "little")


def _int(raw: bytes) -> int:
    """The value of a BININT1, BININT2 or BININT, opcode included."""
    return raw[1] if len(raw) == 2 else int.from_bytes(raw[1:], "little", signed=len(raw) == 5)


def _tuple(body: bytes, known: dict[bytes, tuple[int, ...]]) -> tuple[int, ...] | None:
    """The tuple of 1 to 3 ints `body` spells (BININTs, then TUPLEn); `known`: those met, by their bytes."""
    value = known.get(body)
    if value is None:
        if body == b")":
            return ()
        value = binints(body[:-1])
        if len(value) != body[-1] - 0x84:
            return None
        known[body] = value
    return value


def binints(body: bytes) -> tuple[int, ...]:
    """The ints of a run of BININT1, BININT2 and BININT opcodes (a tuple's items as a pickler writes them), which a
    regex has matched as such."""
    if body[::2] == b"K" * ((len(body) + 1) // 2):  # all BININT1: every even byte is the opcode
        return tuple(body[1::2])
    items, at = [], 0
    while at < len(body):
        width = _WIDTH[body[at]]
        items.append(_int(body[at:at + width]))
        at += width
    return tuple(items)


_WIDTH = {0x4B: 2, 0x4D: 3, 0x4A: 5}


def _template_gets(head: bytes, location: bytes, ordered: bytes, memo: list) -> tuple[str, str] | None:
    """(dtype, location) when the template's GETs fetch what it needs — in `head` the rebuild, "storage" and a
    storage class, then a location and OrderedDict — and None otherwise. The memo never changes an entry (PUTs
    number in turn), so the answer holds for the same bytes later."""
    gets, at = [], 0
    while at < len(head):  # GET rebuild, MARK MARK, GET "storage", GET storage class
        if head[at] == 0x28:
            at += 1
            continue
        width = 2 if head[at] == 0x68 else 5
        gets.append(head[at:at + width])
        at += width
    indices = [_index(g) for g in (*gets, location, ordered)]
    if len(indices) != 5 or max(indices) >= len(memo):
        return None
    rebuild, storage, kind, location_value, ordered_value = (memo[i] for i in indices)
    if rebuild is not _REBUILD or storage != "storage" or ordered_value is not _ORDERED \
            or location_value.__class__ is not str or kind.__class__ is not _Marker or kind.what != "storage":
        return None
    return kind.dtype, location_value  # type: ignore[attr-defined,return-value]


_groups = re.Match.groups


def _plain_ints(keys: list) -> bool:
    """Whether the int keys among `keys` are each their own hash (0 <= k < _HASH_M): no two share one."""
    ints = [key for key in keys if key.__class__ is int]
    return 0 <= min(ints) and max(ints) < _HASH_M


def _fetched(value: object) -> object:
    """A memo entry GET puts on the stack: anything but a dict or a list, so that every container is filled while it
    is on the stack and put in its parent once, bottom up (no cycle, no container shared), and its height
    (_Reader.heights) is known when it is put there. (torch.save writes a container twice only where a checkpoint
    holds one object in two places.)"""
    if value.__class__ is dict or value.__class__ is OrderedDict or value.__class__ is list:
        raise _Misfit
    return value


def _misfit() -> list:
    raise _Misfit
