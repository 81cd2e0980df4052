"""The result types' class decorator: a frozen dataclass, as `dataclasses` makes one, at a fraction of the start-up.

`inspect` defines about fifteen result types before it reads a byte; `import dataclasses` (which imports inspect,
ast, dis and tokenize) and generating each class's methods with exec cost ~9 ms of a ~50 ms run. `record` gives the
same behaviour for what ckpt-doctor uses, with methods shared by every class instead of generated:

- fields from the class's annotations, in order (a base record's first), with defaults or
  `field(default=…, default_factory=…, repr=False, compare=False)`;
- construction by position or keyword, with dataclasses' errors for a missing or unknown argument;
- repr, and equality of two instances of the same class field by field;
- frozen (the default): assignment raises FrozenInstanceError and instances hash by their fields;
  `record(frozen=False)`: mutable, unhashable, as a dataclass with eq;
- `replace(obj, **changes)`, for these and for real dataclasses alike;
- `asdict(obj)` and `field_names(cls)`, as dataclasses' asdict and fields give them (verify's per-rank results
  travel as JSON);
- `record(slots=True)`: the fields held in slots, not a __dict__ (a DCP folder of a million chunks makes a million
  Pieces: ~90 bytes each instead of ~360).

Every result type is a record. The unpickler's stand-ins (RawTensor, StorageRef, Opaque) are no results: they are
slotted classes made once per pickle opcode, where even a record's __init__ would be felt.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any, Callable

MISSING: Any = type("MISSING", (), {"__repr__": lambda self: "MISSING"})()


class FrozenInstanceError(AttributeError):
    """Assignment to a field of a frozen record (dataclasses.FrozenInstanceError's role)."""


class _Field:
    __slots__ = ("default", "default_factory", "repr", "compare")

    def __init__(self, default: Any, default_factory: Any, repr: bool = True, compare: bool = True) -> None:
        self.default, self.default_factory, self.repr, self.compare = default, default_factory, repr, compare


def field(*, default: Any = MISSING, default_factory: Callable[[], Any] | Any = MISSING, repr: bool = True,
          compare: bool = True) -> Any:
    if default is not MISSING and default_factory is not MISSING:
        raise ValueError("cannot specify both default and default_factory")
    return _Field(default, default_factory, repr, compare)


def record(cls: type | None = None, /, *, frozen: bool = True, slots: bool = False) -> Any:
    """`@record`, `@record(frozen=False)` or `@record(slots=True)` on a class with annotated fields."""

    def make(cls: type) -> type:
        fields: dict[str, _Field] = {}
        for base in reversed(cls.__mro__[1:]):
            fields.update(getattr(base, "__record_fields__", {}))
        for name in cls.__dict__.get("__annotations__", {}):
            value = cls.__dict__.get(name, MISSING)
            spec = value if isinstance(value, _Field) else _Field(value, MISSING)
            if isinstance(value, _Field):
                if spec.default is MISSING:
                    delattr(cls, name)
                else:
                    setattr(cls, name, spec.default)
            fields[name] = spec
        required_after_default = [n for i, n in enumerate(fields) if _required(fields[n])
                                  and any(not _required(fields[m]) for m in list(fields)[:i])]
        if required_after_default:
            raise TypeError(f"non-default argument {required_after_default[0]!r} follows default argument")
        if any(getattr(base, "__record_slots__", False) for base in cls.__mro__[1:]) \
                or slots and cls.__bases__ != (object,):
            raise TypeError("record(slots=True) is for a class of no base, and no class derives from one")
        if slots:
            ns = {k: v for k, v in cls.__dict__.items() if k not in fields and k not in ("__dict__", "__weakref__")}
            ns["__slots__"] = tuple(fields)
            cls = type(cls)(cls.__name__, cls.__bases__, ns)
        cls.__record_fields__ = fields
        cls.__record_compared__ = tuple(name for name, spec in fields.items() if spec.compare)
        cls.__record_slots__ = slots
        cls.__init__ = _init
        cls.__repr__ = _repr
        cls.__eq__ = _eq
        if slots:
            cls.__reduce__ = _reduce_slots
            # each field's slot set directly (past the frozen guard): a third less than object.__setattr__
            cls.__record_setters__ = {name: getattr(cls, name).__set__ for name in fields}
        if frozen:
            cls.__setattr__ = _refuse_set
            cls.__delattr__ = _refuse_del
            cls.__hash__ = _hash
        else:
            cls.__hash__ = None  # type: ignore[assignment]
        return cls

    return make if cls is None else make(cls)


def _required(spec: _Field) -> bool:
    return spec.default is MISSING and spec.default_factory is MISSING


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    fields = type(self).__record_fields__
    if len(args) > len(fields):
        raise TypeError(f"{type(self).__name__}() takes {len(fields)} arguments but {len(args)} were given")
    values = {}
    for i, (name, spec) in enumerate(fields.items()):
        if i < len(args):
            if name in kwargs:
                raise TypeError(f"{type(self).__name__}() got multiple values for argument {name!r}")
            values[name] = args[i]
        elif name in kwargs:
            values[name] = kwargs.pop(name)
        elif spec.default is not MISSING:
            values[name] = spec.default
        elif spec.default_factory is not MISSING:
            values[name] = spec.default_factory()
        else:
            raise TypeError(f"{type(self).__name__}() missing required argument: {name!r}")
    if kwargs:
        raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {next(iter(kwargs))!r}")
    _fill(self, values)


def _fill(obj: Any, values: dict) -> None:
    if type(obj).__record_slots__:
        setters = type(obj).__record_setters__
        for name, value in values.items():
            setters[name](obj, value)
    else:
        obj.__dict__.update(values)


def _fields_of(obj: Any) -> dict:
    """A record's fields and their values, by name."""
    if type(obj).__record_slots__:
        return {name: getattr(obj, name) for name in type(obj).__record_fields__}
    return obj.__dict__


def _reduce_slots(self: Any) -> tuple:
    return _rebuild, (type(self), _fields_of(self))


def _rebuild(cls: type, values: dict) -> Any:
    return fast_new(cls, **values)


def _repr(self: Any) -> str:
    d = _fields_of(self)
    shown = ", ".join(f"{name}={d[name]!r}" for name, spec in type(self).__record_fields__.items() if spec.repr)
    return f"{type(self).__qualname__}({shown})"


def _values(obj: Any) -> tuple:
    if type(obj).__record_slots__:
        return tuple(getattr(obj, name) for name in type(obj).__record_compared__)
    d = obj.__dict__
    return tuple(d[name] for name in type(obj).__record_compared__)


def _eq(self: Any, other: Any) -> Any:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _values(self) == _values(other)


def _hash(self: Any) -> int:
    return hash(_values(self))


def _refuse_set(self: Any, name: str, value: Any) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _refuse_del(self: Any, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r}")


def fast_new(cls: type, **fields: Any) -> Any:
    """A record of `cls` made without __init__'s argument binding and the frozen __setattr__ guard: the readers
    make one per tensor, and binding costs ~1.1 µs against 0.5 µs. The caller gives every field."""
    obj = object.__new__(cls)
    _fill(obj, fields)
    return obj


def fast_new_columns(cls: type, count: int, columns: Any) -> list:
    """`count` records of `cls`, as fast_new makes them, from `columns`: an iterable of each field's values, in the
    fields' order (every field given). A slotted record's fields are set a column at a time, by C calls alone
    (20,000 of StorageRecord in ~12 ms; a __dict__ each costs twice that)."""
    made = list(map(object.__new__, repeat(cls, count)))
    if cls.__record_slots__:
        setters = cls.__record_setters__
        for name, column in zip(cls.__record_fields__, columns):
            deque(map(setters[name], made, column), maxlen=0)
    else:
        deque(map(dict.update, map(vars, made), map(dict, map(zip, repeat(tuple(cls.__record_fields__)),
                                                            zip(*columns)))), maxlen=0)
    return made


def replace(obj: Any, /, **changes: Any) -> Any:
    """A copy of `obj` with some fields changed (dataclasses.replace); the copy of a record is made without a
    second pass through __init__ (the readers re-key 20,000 tensors with it)."""
    fields = getattr(type(obj), "__record_fields__", None)
    if fields is None:
        import dataclasses

        return dataclasses.replace(obj, **changes)
    for name in changes:
        if name not in fields:
            raise TypeError(f"{type(obj).__name__}() got an unexpected keyword argument {name!r}")
    return fast_new(type(obj), **{**_fields_of(obj), **changes})


def field_names(cls: type) -> tuple[str, ...]:
    """The names of a record class's fields, in order (dataclasses.fields' names)."""
    return tuple(cls.__record_fields__)


def asdict(obj: Any) -> Any:
    """A record as a dict of its fields, records inside it (in lists, tuples and dicts too) made dicts in turn, as
    dataclasses.asdict does."""
    fields = getattr(type(obj), "__record_fields__", None)
    if fields is not None:
        d = _fields_of(obj)
        return {name: asdict(d[name]) for name in fields}
    if isinstance(obj, (list, tuple)):
        return type(obj)(asdict(v) for v in obj) if type(obj) in (list, tuple) else obj
    if isinstance(obj, dict):
        return type(obj)((asdict(k), asdict(v)) for k, v in obj.items())
    return obj
