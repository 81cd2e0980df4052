"""Writes torch-loadable pickles as a hand-made opcode stream: Python's pickler would import torch to check globals."""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Any, Callable, Iterator

from .._record import record
from ..dtypes import element_size
from ..errors import WriteError
from ..records import TensorRecord
from ..safepickle.policy import DEFAULT_POLICY, TORCH_WEIGHTS_ONLY, Policy, resolve
from ..safepickle.unpickler import Device, DType, Opaque, SizeValue

# Legacy typed storage class for each dtype; others are written as UntypedStorage + _rebuild_tensor_v3.
STORAGE_CLASS = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage", "bfloat16": "BFloat16Storage",
    "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage", "int8": "CharStorage",
    "uint8": "ByteStorage", "bool": "BoolStorage", "complex128": "ComplexDoubleStorage",
    "complex64": "ComplexFloatStorage", "qint8": "QInt8Storage", "quint8": "QUInt8Storage", "qint32": "QInt32Storage",
}


@record
class TensorOut:
    """A tensor to write: its source record (for shape, stride, offset and flags), and the storage key, device
    and dtype it will have in the output."""

    record: TensorRecord
    storage_key: str
    device: str
    dtype: str
    storage_numel: int


class Emitter:
    """Protocol-2 opcodes for plain containers, TensorOut and the inert Opaque stand-ins of the reader.

    A global whose name is dotted (a nested class, `mypkg.Outer.Inner`, allowed with --allow-global) is still named
    by GLOBAL, the one opcode torch's weights_only unpickler reads (it matches "module.name" against
    `__module__.__qualname__` of what safe_globals holds), but the pickle then declares protocol 4: CPython's
    unpickler walks a dotted name attribute by attribute only from protocol 4 on, and below it fails on one."""

    def __init__(self, policy: Policy = DEFAULT_POLICY) -> None:
        self.policy = policy  # what the output may name
        self.out: list[bytes] = [b"\x80\x02"]
        self.unknown: list[str] = []
        self.classes: list[str] = []  # NumPy dtype classes the output builds (safe_globals needs them too)
        self._memo: dict[tuple[str, str], int] = {}

    def getvalue(self) -> bytes:
        if any("." in name for _, name in self._memo):
            self.out[0] = b"\x80\x04"  # every opcode written is valid in protocol 4 (no FRAME needed)
        return b"".join(self.out) + b"."

    def global_(self, module: str, name: str) -> None:
        slot = self._memo.get((module, name))
        if slot is not None:
            self.out.append(b"h" + bytes([slot]) if slot < 256 else b"j" + struct.pack("<I", slot))
            return
        self.out.append(b"c" + module.encode() + b"\n" + name.encode() + b"\n")
        slot = len(self._memo)
        self._memo[(module, name)] = slot
        self.out.append(b"q" + bytes([slot]) if slot < 256 else b"r" + struct.pack("<I", slot))

    def emit(self, root: Any) -> None:
        """Write `root` depth first on a stack of generators, one per open container, not a call per level:
        torch.save writes containers nested as deep as Python's recursion limit, and so must a repair."""
        write = self.out.append
        stack: list[tuple[Any, int]] = [(iter((root,)), 0)]
        open_: set[int] = set()  # the containers being written: one met again inside itself is a cycle
        while stack:
            for obj in stack[-1][0]:
                kind = type(obj)  # the common exact types first: a state_dict is thousands of keys and tensors
                if kind is str:
                    write(str_op(obj))
                elif kind is TensorOut:
                    self._tensor(obj)
                elif kind is int:
                    write(int_op(obj))
                else:
                    if id(obj) in open_:
                        raise WriteError(f"the checkpoint holds a {kind.__name__} inside itself (a cycle), which "
                                         "cannot be written back; leave that entry out with --drop")
                    open_.add(id(obj))
                    stack.append((self._emit_any(obj), id(obj)))
                    break
            else:
                open_.discard(stack.pop()[1])

    def _emit_any(self, obj: Any) -> Iterator[Any]:
        """Write `obj`'s opcodes; yield each object inside it, to be written in its place."""
        write: Callable[[bytes], None] = self.out.append
        if obj is None:
            write(b"N")
        elif isinstance(obj, bool):
            write(b"\x88" if obj else b"\x89")
        elif isinstance(obj, int):
            write(int_op(obj))
        elif isinstance(obj, float):
            write(b"G" + struct.pack(">d", obj))
        elif isinstance(obj, str):
            write(str_op(obj))
        elif isinstance(obj, bytearray):
            self.global_("builtins", "bytearray")
            yield bytes(obj)
            write(b"\x85R")
        elif isinstance(obj, bytes):
            self.global_("_codecs", "encode")
            yield (obj.decode("latin1"), "latin1")
            write(b"R")
        elif isinstance(obj, TensorOut):
            self._tensor(obj)
        elif type(obj) is SizeValue:
            self.global_("torch", "Size")
            yield from self._tuple(tuple(obj))
            write(b"\x85R")
        elif isinstance(obj, tuple):
            yield from self._tuple(obj)
        elif isinstance(obj, list):
            write(b"]")
            yield from self._batch(obj, b"e")
        elif isinstance(obj, OrderedDict):
            self.global_("collections", "OrderedDict")
            write(b")R")
            yield from self._dict_items(obj)
            metadata = getattr(obj, "_metadata", None)
            if metadata is not None:  # a state_dict's module versions, set by BUILD as torch.save writes them
                yield {"_metadata": metadata}
                write(b"b")
        elif isinstance(obj, dict):
            write(b"}")
            yield from self._dict_items(obj)
        elif isinstance(obj, (set, frozenset)):
            self.global_("builtins", "set" if isinstance(obj, set) else "frozenset")
            yield list(obj)
            write(b"\x85R")
        elif isinstance(obj, complex):
            self.global_("builtins", "complex")
            yield (obj.real, obj.imag)
            write(b"R")
        elif isinstance(obj, Opaque):
            yield from self._opaque(obj)
        elif isinstance(obj, type) and issubclass(obj, Opaque):
            self._global_of(obj.__ref__)
        elif isinstance(obj, DType):
            self.global_("torch", obj.name)
        elif isinstance(obj, Device):
            self.global_("torch", "device")
            yield (obj.spec,)
            write(b"R")
        else:
            raise WriteError(f"cannot write a {type(obj).__name__} into a torch checkpoint")

    def _tuple(self, items: tuple) -> Iterator[Any]:
        if not items:
            self.out.append(b")")
        elif len(items) <= 3:
            yield from items
            self.out.append(b"\x85\x86\x87"[len(items) - 1:len(items)])
        else:
            self.out.append(b"(")
            yield from items
            self.out.append(b"t")

    def _batch(self, items: list, op: bytes) -> Iterator[Any]:
        for start in range(0, len(items), 1000):
            self.out.append(b"(")
            yield from items[start:start + 1000]
            self.out.append(op)

    def _dict_items(self, d: dict) -> Iterator[Any]:
        items = list(d.items())
        for start in range(0, len(items), 1000):
            self.out.append(b"(")
            for key, value in items[start:start + 1000]:
                yield key
                yield value
            self.out.append(b"u")

    def _tensor(self, t: TensorOut) -> None:
        rec = t.record
        if rec.is_parameter:
            self.global_("torch._utils", "_rebuild_parameter")
        legacy_class = STORAGE_CLASS.get(t.dtype)
        self.global_("torch._utils", "_rebuild_tensor_v2" if legacy_class else "_rebuild_tensor_v3")
        self.out.append(b"((" + _STORAGE)  # the rebuild function's args, then the persistent id
        if legacy_class:
            self.global_("torch", legacy_class)
        else:
            self.global_("torch.storage", "UntypedStorage")
        # Typed storages count elements; an UntypedStorage counts bytes.
        numel = t.storage_numel if legacy_class else t.storage_numel * element_size(t.dtype)
        self.out.append(b"".join((str_op(t.storage_key), str_op(t.device), int_op(numel), b"tQ",
                                  int_op(rec.storage_offset), ints_op(rec.shape), ints_op(rec.stride),
                                  b"\x88" if rec.requires_grad and not rec.is_parameter else b"\x89")))
        self.global_("collections", "OrderedDict")
        self.out.append(b")R")
        if not legacy_class:
            self.global_("torch", t.dtype)
        self.out.append(b"tR")
        if rec.is_parameter:
            self.out.append(b"\x88" if rec.requires_grad else b"\x89")
            self.global_("collections", "OrderedDict")
            self.out.append(b")R\x87R")

    def _global_of(self, ref) -> str:
        """Name a global in the output: only what torch.load(weights_only=True) accepts, or what the user allowed
        (fix.check_writable refuses the rest when planning; this is the last line). Its resolved name."""
        if ref is None:
            raise WriteError("the checkpoint holds an object of unknown origin that cannot be written back")
        module, name = resolve(ref.module, ref.name)
        full = f"{module}.{name}"
        if not self.policy.writable(module, name):
            raise WriteError(f"the output would name {full} ({ref.verdict.value}), which is not allowed; leave "
                             "that entry out with --drop")
        if full not in TORCH_WEIGHTS_ONLY:
            self.unknown.append(full)
        self.global_(module, name)
        return full

    def _opaque(self, obj: Opaque) -> Iterator[Any]:
        data = obj.ckd
        if self._global_of(data.ref) == "numpy.dtype" and data.state is not None:
            self.classes.append(_numpy_dtype_class(data.args))  # (BUILD of a dtype: torch asks for its class too)
        yield from self._tuple(tuple(data.args))
        self.out.append(b"R" if data.via_reduce else b"\x81")
        if data.items:
            self.out.append(b"(")
            yield from data.items
            self.out.append(b"e")
        if data.dictitems:
            self.out.append(b"(")
            for key, value in data.dictitems:
                yield key
                yield value
            self.out.append(b"u")
        if data.state is not None:
            yield data.state
            self.out.append(b"b")


# NumPy's dtype classes by the code a pickled dtype names (`numpy.dtype("u4", False, True)`, then BUILD): torch's
# weights_only unpickler builds a dtype only of a class in its safe globals, so a file that names numpy.dtype needs
# each class it builds allowed as well (`numpy.dtypes.UInt32DType`). A table, not numpy.dtype(code): nothing the
# file says is handed to a parser of its own.
_DTYPE_CLASSES = {"b1": "Bool", "i1": "Int8", "i2": "Int16", "i4": "Int32", "i8": "Int64", "u1": "UInt8",
                  "u2": "UInt16", "u4": "UInt32", "u8": "UInt64", "f2": "Float16", "f4": "Float32", "f8": "Float64",
                  "f16": "LongDouble", "c8": "Complex64", "c16": "Complex128", "c32": "CLongDouble", "O8": "Object",
                  "O4": "Object", "M8": "DateTime64", "m8": "TimeDelta64"}
_DTYPE_KINDS = {"U": "Str", "S": "Bytes", "V": "Void"}  # sized by the code's digits: U3, S10, V8


def _numpy_dtype_class(args: Any) -> str:
    """The name torch.serialization.safe_globals takes for the class of a pickled NumPy dtype, from its code."""
    code = args[0] if isinstance(args, (tuple, list)) and args and isinstance(args[0], str) else ""
    name = _DTYPE_CLASSES.get(code) or (_DTYPE_KINDS.get(code[:1]) if code[1:].isdigit() else None)
    return f"numpy.dtypes.{name}DType" if name else f"the NumPy dtype class of {code[:20]!r}"


def int_op(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes((n,))
    if 0 <= n < 65536:
        return b"M" + n.to_bytes(2, "little")
    if -(2**31) <= n < 2**31:
        return b"J" + n.to_bytes(4, "little", signed=True)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    if len(raw) < 256:
        return b"\x8a" + bytes((len(raw),)) + raw
    return b"\x8b" + len(raw).to_bytes(4, "little") + raw  # LONG4: past 255 bytes


def str_op(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + len(raw).to_bytes(4, "little") + raw


_STORAGE = str_op("storage")


def ints_op(items: tuple[int, ...]) -> bytes:
    """A tuple of ints (a shape, a stride)."""
    body = b"".join(map(int_op, items))
    if len(items) <= 3:
        return body + b")\x85\x86\x87"[len(items):len(items) + 1] if items else b")"
    return b"(" + body + b"t"


def dumps(obj: Any, policy: Policy = DEFAULT_POLICY) -> tuple[bytes, list[str], list[str]]:
    """The pickle bytes, the globals beyond torch's weights_only list they name (allowed with --allow-global: only
    what `policy`, the defaults unless passed, lets an output name), and the NumPy dtype classes they build (which
    torch's weights_only unpickler also needs in its safe globals)."""
    emitter = Emitter(policy)
    emitter.emit(obj)
    return emitter.getvalue(), sorted(set(emitter.unknown)), sorted(set(emitter.classes))
