"""A pickle reader that never imports or calls what a file names: known globals become inert records."""

from __future__ import annotations

import _pickle  # pickle.Unpickler itself (the C one), without pickle.py's own import (~0.7 ms a start)
import io
from collections import Counter, OrderedDict

from ..dtypes import STORAGE_CLASS_DTYPE, element_size, torch_dtype_name
from . import limits
from .policy import DEFAULT_POLICY, HANDS_BACK, HASHING, TENSOR_REBUILDERS, GlobalRef, Policy, Verdict, resolve
from .walker import HashBuckets

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any, Callable


class _SealedClass(type):
    """The type of the stand-in classes: BUILD or setattr on a class the file names (on the real class, a change for
    the whole process: policy.SIDE_EFFECTS) is refused, and one stand-in class serves every file read after."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise SideEffect(f"setattr of {name!r} on the class {_qualname(cls)} would change it for the whole process")

    @property
    def __setstate__(cls) -> Any:  # a data descriptor of the metaclass: BUILD on the class finds this first
        raise SideEffect(f"BUILD on the class {_qualname(cls)} would set its attributes for the whole process")


def _qualname(cls: Any) -> str:
    ref = cls.__dict__.get("__ref__")
    return ref.qualname if ref is not None else "object"


class Opaque(metaclass=_SealedClass):
    """An object of a class the file names, or the result of calling a global the file names.

    Nothing is called: the constructor arguments, the state given by BUILD and the items appended or
    set are only recorded, so the tree can still be walked (e.g. a whole-model pickle's `_modules`).
    """

    __ref__: GlobalRef | None = None
    __snapshot__ = False  # SNAPSHOT's classes: their arguments' BUILDs are recorded as they are when one is made

    def __new__(cls, *args: Any, **kwargs: Any) -> "Opaque":
        self = object.__new__(cls)
        data = _OpaqueData(cls.__ref__, args, kwargs)
        if cls.__snapshot__:  # the BUILDs each Opaque argument had been given by now
            data.args_built = tuple(a._ckd.builds if isinstance(a, Opaque) else None for a in args)
        object.__setattr__(self, "_ckd", data)
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._ckd.via_reduce = True  # REDUCE calls the class; NEWOBJ only calls __new__

    def __call__(self, *args: Any, **kwargs: Any) -> "Opaque":
        return _opaque_class(self._ckd.ref)(*args, **kwargs)

    def __setstate__(self, state: Any) -> None:
        # pickle's BUILD takes the state as it is now (copied into __dict__, slotstate set by setattr)
        if type(state) is dict:
            state = dict(state)
        elif type(state) is tuple and len(state) == 2 and all(s is None or type(s) is dict for s in state):
            state = tuple(None if s is None else dict(s) for s in state)
        self._ckd.state = state
        self._ckd.builds += 1

    def append(self, item: Any) -> None:
        self._ckd.items.append(item)

    def extend(self, items: Any) -> None:
        self._ckd.items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._ckd.dictitems.append((key, value))

    def add(self, item: Any) -> None:
        self._ckd.items.append(item)

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        ref = self._ckd.ref
        return f"<{ref.qualname if ref else 'object'}>"

    @property
    def ckd(self) -> "_OpaqueData":
        return self._ckd


class _OpaqueData:
    """What a pickle did to an Opaque: constructor arguments, BUILD state, appended and set items."""

    __slots__ = ("ref", "args", "kwargs", "state", "items", "dictitems", "via_reduce", "builds", "args_built")

    def __init__(self, ref: GlobalRef | None, args: tuple, kwargs: dict) -> None:
        self.ref, self.args, self.kwargs = ref, args, kwargs
        self.args_built: tuple | None = None  # (SNAPSHOT's classes) each Opaque argument's BUILDs when this was made
        self.state: Any = None
        self.items: list = []
        self.dictitems: list = []
        self.via_reduce = False
        self.builds = 0  # BUILDs given: `state` is the last one's (a class's own __setstate__ decides what a second does)


_OPAQUE_CLASSES: dict[GlobalRef | None, type] = {}


# Globals whose constructor reads its arguments' state at once: a NumPy scalar decodes its bytes by its dtype as the
# dtype is then (a BUILD given to the dtype later does not change the scalar), so what the dtype had is recorded
SNAPSHOT = frozenset({("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar")})


def _opaque_class(ref: GlobalRef | None) -> type:
    cls = _OPAQUE_CLASSES.get(ref)
    if cls is None:
        snapshot = ref is not None and (ref.module, ref.name) in SNAPSHOT
        cls = type("Opaque", (Opaque,), {"__ref__": ref, "__snapshot__": snapshot})
        _OPAQUE_CLASSES[ref] = cls
    return cls


# The reader-internal records below are plain slotted classes, not dataclasses: one of each is made per tensor
# while a 20,000-tensor pickle is read, and defining dataclasses costs import time that `inspect` pays on every run.

class StorageRef:
    """A storage named through persistent_load; where its bytes are is settled by the reader."""

    __slots__ = ("key", "dtype", "numel", "location", "resolved", "view_of", "view_offset")

    def __init__(self, key: str, dtype: str, numel: int, location: str, resolved: Any = None,
                 view_of: "StorageRef | None" = None, view_offset: int = 0) -> None:
        self.key, self.dtype, self.numel, self.location = key, dtype, numel, location
        self.resolved = resolved  # the reader's StorageRecord
        self.view_of = view_of  # legacy storage views into a bigger storage
        self.view_offset = view_offset  # bytes into `view_of`

    def __setstate__(self, state: Any) -> None:  # (a BUILD's slot state would set its fields by setattr)
        raise TypeError("a storage cannot be given state (BUILD on a storage, which torch.load refuses)")

    def __reduce__(self) -> tuple:  # a copy (pickled to a worker, copy.copy) is made anew, never given state
        return StorageRef, (self.key, self.dtype, self.numel, self.location, self.resolved, self.view_of,
                            self.view_offset)


class RawTensor:
    """A tensor as the pickle describes it, before it has a key path."""

    __slots__ = ("storage", "dtype", "offset", "shape", "stride", "requires_grad", "is_parameter", "device", "note",
                 "bits", "attrs")

    def __init__(self, storage: StorageRef | None, dtype: str, offset: int, shape: tuple[int, ...],
                 stride: tuple[int, ...], requires_grad: bool = False, is_parameter: bool = False,
                 device: str | None = None, note: str = "", bits: str = "", attrs: tuple[str, ...] = ()) -> None:
        self.storage, self.dtype, self.offset, self.shape, self.stride = storage, dtype, offset, shape, stride
        self.requires_grad, self.is_parameter = requires_grad, is_parameter
        self.device = device  # set when the tensor has no storage (meta) or was moved on rebuild
        self.note = note
        self.bits = bits  # "conj", "neg", "conj,neg": torch.load sets these bits, so its values are not its bytes
        self.attrs = attrs  # the names of the Python attributes torch.save kept of it (fix does not write them)

    def __setstate__(self, state: Any) -> None:
        # A BUILD's slot state would set the record's fields by setattr (another shape, dtype or storage than the
        # rebuild's), where torch.load hands the state to Tensor.set_, which refuses all but a storage and its view.
        raise TypeError("a tensor cannot be given state (BUILD on a tensor)")

    def __reduce__(self) -> tuple:  # a copy (pickled to a worker, copy.copy) is made anew, never given state
        return RawTensor, (self.storage, self.dtype, self.offset, self.shape, self.stride, self.requires_grad,
                           self.is_parameter, self.device, self.note, self.bits, self.attrs)


class Token:
    """A torch object a pickle may name as a value (a dtype, a device, a storage class), kept as its name. One
    token serves every mention of its global, so a pickle's BUILD must not change it (torch's own are immutable)."""

    __slots__ = ("value",)
    torch_name = ""

    def __init__(self, value: str) -> None:
        self.value = value

    def __setstate__(self, state: Any) -> None:
        raise TypeError(f"{self!r} cannot be given state (BUILD on a torch dtype, device or storage type)")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.value == self.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.value))

    def __repr__(self) -> str:
        return f"torch.{self.value}" if type(self) is DType else f"torch.{self.torch_name}({self.value!r})"


class StorageType(Token):
    __slots__ = ()
    torch_name = "storage"

    @property
    def dtype(self) -> str:
        return self.value


class DType(Token):
    __slots__ = ()

    @property
    def name(self) -> str:
        return self.value


class Device(Token):
    __slots__ = ()
    torch_name = "device"

    @property
    def spec(self) -> str:
        return self.value


_INT64 = 1 << 63


def _ints(value: Any) -> tuple[int, ...]:
    if (type(value) is tuple or type(value) is list) and len(value) <= 64:
        for item in value:
            if type(item) is not int or not -_INT64 <= item < _INT64:
                raise TypeError("shape/stride is not a tuple of 64-bit ints")
        return value if type(value) is tuple else tuple(value)
    raise TypeError("shape/stride is not a tuple of 64-bit ints")


def _handed_back(value: Any, depths: dict[int, tuple[tuple, int]]) -> Any:
    """`value`, which a call hands back as it was given (build_intlist, restore_type_tag, a legacy ("module", obj)
    persistent id), refused if tuples nest in it deeper than limits.MAX_TUPLE_DEPTH. The walk counts tuples built in
    tuples, and one a call hands back starts again from 0 there: a chain of such calls (5 bytes a level) built a key
    whose hash recursed in C once per level and took the process down. `depths`: each tuple measured so far, by id,
    kept with the tuple (so that no id is reused while it is listed), for one load."""
    if not isinstance(value, tuple):
        return value
    todo: list[tuple[tuple, bool]] = [(value, False)]
    while todo:  # each tuple once, by id: a tuple sharing its parts 40 levels deep is 40 steps, not 3**40
        item, done = todo.pop()
        if done:
            depths[id(item)] = (item, 1 + max((depths[id(c)][1] for c in item if isinstance(c, tuple)), default=0))
        elif id(item) not in depths:
            todo.append((item, True))
            todo.extend((c, False) for c in item if isinstance(c, tuple) and id(c) not in depths)
    depth = depths[id(value)][1]
    if depth > limits.MAX_TUPLE_DEPTH:
        raise Refused(f"a call hands back tuples nested {depth:,} deep: hashing one overflows CPython's stack (no "
                      "pickler writes one)")
    return value


def _short_repr(value: Any) -> str:
    """At most ~80 characters of repr, made without building the whole one (a tuple sharing its parts 40 levels deep
    has 3**40 leaves)."""
    import reprlib

    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother = 3, 40, 40
    return short.repr(value)[:80]


def rebuilt_tensor(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                   dtype: str | None = None) -> RawTensor:
    """What torch's tensor rebuilders make of their arguments, as a record; TypeError where torch's would fail."""
    if not isinstance(storage, StorageRef) or type(offset) is not int or not 0 <= offset < _INT64:
        raise TypeError("tensor storage is not a storage record")
    return RawTensor(storage, dtype or storage.dtype, offset, _ints(size), _ints(stride), bool(requires_grad))


def _rebuild_tensor(storage, offset, size, stride, *rest):
    return rebuilt_tensor(storage, offset, size, stride)


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return _with_bits(rebuilt_tensor(storage, offset, size, stride, requires_grad), metadata)


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    if not isinstance(dtype, DType):
        raise TypeError("dtype is not a torch dtype")
    return _with_bits(rebuilt_tensor(storage, offset, size, stride, requires_grad, dtype.name), metadata)


def _with_bits(tensor: RawTensor, metadata: Any) -> RawTensor:
    """The conjugate and negative bits torch.save records of a lazy view (`x.conj()`, `x.conj().imag`), which
    torch.load sets again (torch._utils.set_tensor_metadata): its values are then the conjugate, or the negation,
    of its bytes. torch sets a bit wherever its key is there, whatever bool it is given, and fails where it cannot
    (TypeError here too: a conjugate bit on a real tensor, a value of no bool). A negative bit on a bool tensor it
    sets, and the tensor then fails wherever its values are read (tensordata.with_bits says so)."""
    if not isinstance(metadata, dict) or not metadata:
        return tensor
    bits = [name for name in ("conj", "neg") if name in metadata]
    if not bits:
        return tensor
    if any(not (metadata[b] is None or type(metadata[b]) in (bool, int)) for b in bits):
        raise TypeError("a tensor's metadata bit is no bool")
    if "conj" in bits and not tensor.dtype.startswith("complex"):
        raise TypeError(f"a conjugate bit on a {tensor.dtype} tensor (torch.load fails on it)")
    tensor.bits = ",".join(bits)
    tensor.note = " and ".join({"conj": "conjugate", "neg": "negative"}[b] for b in bits) + \
        " bit set (a lazy view): torch.load gives the " + \
        " of the ".join({"conj": "conjugate", "neg": "negation"}[b] for b in bits) + " of its bytes"
    return tensor


def _rebuild_parameter(data, requires_grad=True, hooks=None, state=None):
    if not isinstance(data, RawTensor):
        raise TypeError("parameter data is not a tensor")
    data.is_parameter = True
    data.requires_grad = bool(requires_grad)
    return _with_attributes(data, state)


def _rebuild_qtensor(storage, offset, size, stride, quantizer_params, requires_grad, hooks):
    return rebuilt_tensor(storage, offset, size, stride, requires_grad)


def _rebuild_meta_tensor_no_storage(dtype, size, stride, requires_grad=False):
    if not isinstance(dtype, DType):
        raise TypeError("dtype is not a torch dtype")
    return RawTensor(None, dtype.name, 0, _ints(size), _ints(stride), bool(requires_grad), device="meta")


def _rebuild_device_tensor_from_cpu_tensor(data, dtype, device, requires_grad):
    if not isinstance(data, RawTensor):
        raise TypeError("data is not a tensor")
    data.device = device.spec if isinstance(device, Device) else str(device)
    data.requires_grad = bool(requires_grad)
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    result = func(*args) if callable(func) else None
    if isinstance(result, RawTensor) and isinstance(new_type, type) and issubclass(new_type, Opaque):
        ref = new_type.__ref__
        if ref is not None and ref.qualname == "torch.nn.parameter.Parameter":
            result.is_parameter = True
        elif ref is not None and ref.qualname != "torch.Tensor":  # (a plain tensor given attributes comes so too)
            result.note = f"tensor subclass {ref.qualname}"
    return _with_attributes(result, state)


def _with_attributes(tensor: Any, state: Any) -> Any:
    """The Python attributes torch.save kept of a tensor (`t.partition_dim = 1`: its __dict__, the state
    torch.load sets again), by name: ckpt-doctor reads the tensor, and fix writes it, without them."""
    attributes = state if isinstance(state, dict) else \
        state[0] if isinstance(state, tuple) and state and isinstance(state[0], dict) else None  # (dict, slots)
    if isinstance(tensor, RawTensor) and attributes:
        names = [str(k) for k in list(attributes)[:4]]
        tensor.attrs = tuple(str(k) for k in attributes)
        said = f"Python attributes set on it ({', '.join(names)}{', …' if len(attributes) > 4 else ''}), which " \
            "torch.load sets again and fix does not write"
        tensor.note = f"{tensor.note}; {said}" if tensor.note else said
    return tensor


def _parameter(data=None, requires_grad=True):
    return _rebuild_parameter(data, requires_grad)


class SizeValue(tuple):
    """A torch.Size from the file, kept as one so that a rewrite names torch.Size again (code reading the file
    back may call .numel() on it)."""

    __slots__ = ()


def _size(*args):
    return SizeValue(_ints(args[0])) if args else SizeValue()


def _device(*args):
    return Device(":".join(str(a) for a in args))


def _codecs_encode(text="", encoding="latin1", *rest):
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "ascii"):
        raise TypeError("_codecs.encode used for something other than bytes")
    return text.encode(encoding)


def _reconstructor(cls, base, state=None):
    obj = cls.__new__(cls) if isinstance(cls, type) and issubclass(cls, Opaque) else _opaque_class(None)()
    if state is not None:
        obj.ckd.args = (state,)
    return obj


_REBUILDERS: dict[str, Callable[..., Any]] = {
    "_rebuild_tensor": _rebuild_tensor,
    "_rebuild_tensor_v2": _rebuild_tensor_v2,
    "_rebuild_tensor_v3": _rebuild_tensor_v3,
    "_rebuild_parameter": _rebuild_parameter,
    "_rebuild_parameter_with_state": _rebuild_parameter,
    "_rebuild_qtensor": _rebuild_qtensor,
    "_rebuild_meta_tensor_no_storage": _rebuild_meta_tensor_no_storage,
    "_rebuild_device_tensor_from_cpu_tensor": _rebuild_device_tensor_from_cpu_tensor,
}

def _set(work, items=(), *rest):
    if type(items) not in (list, tuple, set, frozenset):
        raise TypeError("set of something other than a list")
    work.charge(list(items), "set()")
    return set(items)


def _frozenset(work, items=(), *rest):
    if type(items) not in (list, tuple, set, frozenset):
        raise TypeError("frozenset of something other than a list")
    work.charge(list(items), "frozenset()")
    return frozenset(items)


def _bytearray(source=b"", encoding=None, *rest):
    # Only from bytes or text the pickle holds: bytearray(10**12) would allocate a terabyte.
    if type(source) is str and encoding in ("latin1", "latin-1", "utf-8", "ascii"):
        return bytearray(source.encode(encoding))
    if type(source) in (bytes, bytearray):
        return bytearray(source)
    if type(source) is list and all(type(b) is int and 0 <= b < 256 for b in source):
        return bytearray(source)
    raise TypeError("bytearray of something other than bytes")


def _complex(work, real=0.0, imag=0.0, *rest):
    if type(real) not in (int, float) or type(imag) not in (int, float):
        raise TypeError("complex of something other than numbers")
    value = complex(real, imag)
    work.made(value, "complex()")  # hash(complex(x, y)) = hash(x) + 1000003 * hash(y): a file chooses it
    return value


def _slice(*args):
    # Not of slices: CPython frees a slice without the "trashcan" that tuples and lists use, so a chain of slices
    # 300,000 deep (a 1.2 MB pickle) recursed in C once per level when freed, and took the process with it.
    if any(type(a) is slice for a in args):
        raise TypeError("a slice of slices")
    return slice(*args)


def _mapping(kind, pairs: bool):
    """OrderedDict() (`pairs`: of key-value pairs) or Counter() (of the items to count), from a container the pickle
    holds (never a lazy range that could count to 10**18); what they hash is counted first."""

    def build(work, items=(), *rest, **kwargs):
        if type(items) not in (list, tuple, dict):
            raise TypeError(f"{kind.__name__} of something other than a list or dict")
        if not items:  # torch's OrderedDict() of every tensor's hooks: nothing to hash
            return work.keep(kind())
        if type(items) is dict:
            keys = list(items)
        elif pairs:
            keys = [p[0] if type(p) in (tuple, list) and len(p) == 2 else p for p in items]
        else:
            keys = list(items)
        work.charge(keys, f"{kind.__name__}()")
        return work.keep(kind(items))

    return build


def _defaultdict(factory=None, *rest):
    return {}  # the factory is never called; the items arrive by SETITEMS


_MAKES_CHOSEN = frozenset({"builtins.complex"})  # calls whose results hash as the file chooses: _HashWork.made

_SAFE_CALLABLES: dict[str, Any] = {
    "collections.OrderedDict": _mapping(OrderedDict, True),  # torch writes OrderedDict() and fills it by SETITEMS
    "collections.Counter": _mapping(Counter, False),
    "collections.defaultdict": _defaultdict,
    "torch.Size": _size,
    "torch.device": _device,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "_codecs.encode": _codecs_encode,
    "copyreg._reconstructor": _reconstructor,
    "torch.jit._pickle.build_intlist": lambda x: x,  # these hand their argument back: policy.HANDS_BACK
    "torch.jit._pickle.build_doublelist": lambda x: x,
    "torch.jit._pickle.build_boollist": lambda x: x,
    "torch.jit._pickle.build_tensorlist": lambda x: x,
    "torch.jit._pickle.build_genericlist": lambda x: x,
    "torch.jit._pickle.restore_type_tag": lambda value, type_str=None: value,
    "builtins.set": _set, "builtins.frozenset": _frozenset, "builtins.bytearray": _bytearray,
    "builtins.complex": _complex, "builtins.slice": _slice,
}




def _measured(identity: Callable[..., Any], depths: dict[int, tuple[tuple, int]]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return _handed_back(identity(*args, **kwargs), depths)

    return call


class StandIn:
    """An allowed function as the unpickler hands it out: calling it calls its inert stand-in above; BUILD or
    setattr on it is refused (on the real function it would change the process: policy.SIDE_EFFECTS).

    Malformed arguments make the file unreadable, as they make torch.load fail; what the file would run is already
    known from the walk (readers/survey.py), so nothing is lost by stopping."""

    __slots__ = ("_func", "_ref", "_work")

    def __init__(self, func: Callable[..., Any], ref: GlobalRef, work: _HashWork | None = None) -> None:
        object.__setattr__(self, "_func", func)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_work", work)  # given first to the calls that hash their argument

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if self._work is not None:
                return self._func(self._work, *args, **kwargs)
            return self._func(*args, **kwargs)
        except (TypeError, ValueError, KeyError, IndexError, OverflowError, AttributeError) as exc:
            raise MalformedPickle(f"{self._ref.qualname} is called with malformed arguments ({exc})") from None

    def __setstate__(self, state: Any) -> None:
        raise SideEffect(f"BUILD on {self._ref.qualname} would set attributes of a function for the whole process")

    def __setattr__(self, name: str, value: Any) -> None:
        raise SideEffect(f"setattr of {name!r} on {self._ref.qualname} would change it for the whole process")

    def __repr__(self) -> str:
        return f"<{self._ref.qualname}>"


class Refused(Exception):
    """A bound no honest pickle reaches, met while unpickling (not a ValueError: StandIn passes it on unchanged)."""


class SideEffect(Refused):
    """BUILD or setattr on a function or class the file names: on the real one, a change to the whole process."""


_CHOSEN = (int, float, complex, tuple, frozenset)  # values whose hashes a file can make collide


class _HashWork:
    """What the set(), frozenset(), OrderedDict() and Counter() calls of one load hash: each item, and each tuple
    under it (tuples are hashed anew each time; measured once per load, by id), against limits.MAX_HASH_WORK; and
    no more than limits.MAX_KEYS_OF_ONE_HASH distinct keys of one hash, which CPython inserts in quadratic time. The
    walk cannot count these: it does not know what a list holds when it is handed over, again and again."""

    __slots__ = ("buckets", "left", "mappings", "nodes")

    def __init__(self) -> None:
        self.left = limits.MAX_HASH_WORK
        self.nodes: dict[int, tuple[tuple, int]] = {}  # id -> (the tuple, kept so that its id is not reused; nodes)
        self.buckets: Any = None  # the values calls made whose hash the file chose, by hash (walker.HashBuckets)
        self.mappings: list[Any] = []  # the OrderedDicts and Counters made (unshadowed once the load is done)

    def keep(self, mapping: Any) -> Any:
        self.mappings.append(mapping)
        return mapping

    def unshadow(self) -> None:
        """Attributes a BUILD set on an OrderedDict or Counter (pickle.load puts its state in the instance's
        __dict__, as torch's unpickler does) that hide a method of its class are dropped: `items` set to 1 made every
        reader's `.items()` a TypeError. Only `_metadata` is ever read of them."""
        for mapping in self.mappings:
            if mapping.__dict__:
                for name in [n for n in mapping.__dict__ if hasattr(type(mapping), n)]:
                    del mapping.__dict__[name]
        self.mappings.clear()

    def made(self, value: Any, what: str) -> None:
        """Count a value a call made whose hash the file chose (a complex): the walk cannot know a call's result,
        and a dict of 40,000 complex keys of one hash took CPython 95 s to build."""
        if self.buckets is None:
            self.buckets = HashBuckets()
        if self.buckets.add(hash(value), value) is not None:
            raise Refused(f"{what} makes more than {limits.MAX_KEYS_OF_ONE_HASH:,} distinct values of one hash "
                          "(a hash flood: as dict keys or set members CPython inserts them in quadratic time)")

    def charge(self, keys: list, what: str) -> None:
        """Count the hashing of `keys` before it is done; refuse what is past the bounds."""
        self.left -= len(keys)
        kinds = set(map(type, keys)) if self.left >= 0 else set()
        if any(issubclass(kind, tuple) for kind in kinds):
            for key in keys:
                if isinstance(key, tuple):
                    self.left -= self._count(key)
                    if self.left < 0:
                        break
        if self.left < 0:
            raise Refused(f"{what} calls hash more than {limits.MAX_HASH_WORK:,} items and tuples (a hash flood; no "
                          "checkpoint needs one)")
        most = limits.MAX_KEYS_OF_ONE_HASH
        if len(keys) <= most or not any(issubclass(kind, _CHOSEN) for kind in kinds):
            return  # str and bytes hashes are salted per process; stand-ins hash by identity
        hashes = list(map(hash, keys))
        if len(keys) - len(set(hashes)) < most:
            return  # no hash can be shared by more than `most` keys
        for digest, count in Counter(hashes).items():
            if count > most:
                group = [k for k, h in zip(keys, hashes) if h == digest][:most + 1]
                if len(set(map(repr, group))) > most:  # distinct values (equal ones are one key)
                    raise Refused(f"{what} is given more than {most:,} distinct items of one hash: CPython takes "
                                  "quadratic time to insert them")

    def _count(self, value: tuple) -> int:
        """Tuples hashing `value` visits (each tuple once by id to measure; shared parts count each time)."""
        known = self.nodes.get(id(value))
        if known is not None:
            return known[1]
        todo: list[tuple[tuple, bool]] = [(value, False)]
        while todo:
            item, done = todo.pop()
            if done:
                total = 1 + sum(self.nodes[id(c)][1] for c in item if isinstance(c, tuple))
                self.nodes[id(item)] = (item, min(total, limits.MAX_HASH_WORK + 1))
            elif id(item) not in self.nodes:
                todo.append((item, True))
                todo.extend((c, False) for c in item if isinstance(c, tuple) and id(c) not in self.nodes)
        return self.nodes[id(value)][1]


class MalformedPickle(ValueError):
    """A global the allow-list accepts was given arguments torch's own rebuild would refuse."""


class memory_guard:
    """`with memory_guard():` caps the address space while a pickle is read, so a memo or allocation bomb is a
    MemoryError, not an OOM kill. (A class, not a contextlib generator: importing contextlib costs every start.)"""

    def __enter__(self) -> None:
        self.restore = None
        try:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * resource.getpagesize()
        except (ImportError, OSError, ValueError):
            return
        cap = used + limits.UNPICKLE_HEADROOM
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)
        if soft != resource.RLIM_INFINITY and soft <= cap:
            return
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
        self.restore = (soft, hard)

    def __exit__(self, *exc: object) -> None:
        if self.restore is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, self.restore)


class SafeUnpickler(_pickle.Unpickler):
    """Unpickles into plain containers, RawTensor/StorageRef records and Opaque stand-ins.

    `find_class` never imports: it returns one of the inert functions above or an Opaque class.
    Every global named is recorded in `self.globals` with its verdict under `policy` (the defaults unless passed).
    """

    def __init__(self, file: io.BufferedIOBase, source: str,
                 resolve_storage: Callable[[StorageRef], None] | None = None,
                 persistent: Callable[[Any], Any] | None = None, *, policy: Policy = DEFAULT_POLICY) -> None:
        super().__init__(file, encoding="utf-8", errors="surrogateescape")
        self.source = source
        self.policy = policy  # the allow-list each global named is judged by
        self.globals: list[GlobalRef] = []
        # one answer per name: a pickle may name one global millions of times
        self._classes: dict[tuple[str, str], Any] = {}
        self.storages: dict[str, StorageRef] = {}
        self.notes: list[str] = []
        self._resolve_storage = resolve_storage
        self._persistent = persistent  # a format's own persistent ids (the tar format's integers)
        self.length = file.getbuffer().nbytes if isinstance(file, io.BytesIO) else 0  # bounds the tree walk
        self._depths: dict[int, tuple[tuple, int]] = {}  # tuples calls handed back, measured (_handed_back)
        self._work = _HashWork()

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self._classes:
            self._classes[key] = self._find_class(module, name)
        return self._classes[key]

    def _find_class(self, module: str, name: str) -> Any:
        verdict, reason = self.policy.classify(module, name)
        ref = GlobalRef(module, name, verdict, reason, self.source)
        self.globals.append(ref)
        if verdict is Verdict.SAFE:
            module, name = resolve(module, name)
            qual = f"{module}.{name}"
            if module == "torch._utils" and name in TENSOR_REBUILDERS:
                func = _REBUILDERS.get(name)
                return StandIn(func, ref) if func else _opaque_class(ref)
            if qual in _SAFE_CALLABLES:
                target = _SAFE_CALLABLES[qual]
                if qual in HANDS_BACK:  # what they return is measured (_handed_back)
                    target = _measured(target, self._depths)
                return StandIn(target, ref, self._work if qual in HASHING or qual in _MAKES_CHOSEN else None)
            if qual == "torch.nn.parameter.Parameter":
                return StandIn(_parameter, ref)
            if module in ("torch", "torch.cuda", "torch.storage") and name in STORAGE_CLASS_DTYPE:
                return StorageType(STORAGE_CLASS_DTYPE[name])
            if module == "torch" and torch_dtype_name(name) is not None:
                return DType(torch_dtype_name(name))
        return _opaque_class(ref)

    def load(self) -> Any:
        try:
            with memory_guard():
                root = super().load()
            self._work.unshadow()
            return root
        finally:
            self._depths.clear()  # the tuples measured are the tree's own now, or garbage
            self._work.nodes.clear()
            self._work.mappings.clear()

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is not None:
            return _handed_back(self._persistent(pid), self._depths)
        if type(pid) is tuple and len(pid) >= 2 and pid[0] == "module":
            # a legacy whole-model pickle's container class (torch returns it as is)
            return _handed_back(pid[1], self._depths)
        if type(pid) is tuple and len(pid) >= 5 and pid[0] == "storage":
            storage_type, key, location, numel = pid[1:5]
            view = pid[5] if len(pid) > 5 else None
            if type(storage_type) is StorageType and type(numel) is int and 0 <= numel < _INT64:
                key = key if type(key) is str else str(key)
                ref = self.storages.get(key)
                if ref is None:
                    location = location if type(location) is str else str(location)
                    ref = StorageRef(key, storage_type.dtype, numel, location)
                    self.storages[key] = ref
                    if self._resolve_storage is not None:
                        self._resolve_storage(ref)
                if view is not None and isinstance(view, tuple) and len(view) == 3:
                    _, view_offset, view_numel = view
                    elsize = element_size(ref.dtype)
                    return StorageRef(ref.key, ref.dtype, int(view_numel), ref.location, view_of=ref,
                                      view_offset=int(view_offset) * elsize)
                return ref
        self.notes.append(f"unexpected persistent id {_short_repr(pid)}")
        return _opaque_class(None)(pid)
