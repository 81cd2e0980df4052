"""`fix --plain-data`: objects torch.load(weights_only=True) refuses that only hold data, written as that data — an
argparse.Namespace of hyper-parameters as a dict of them, a NumPy scalar as a Python number, a pathlib path as its
text — so a training script's `{"args": args, "best_acc": np.float64(…)}` keeps its values instead of losing the
entries to --drop. Each is read from what the pickle records (a Namespace's attributes, a scalar's dtype code and
bytes, a path's parts); nothing is imported or called. Anything else stays as it is, for the planner to refuse."""

from __future__ import annotations

import struct

from .._record import replace
from ..records import Checkpoint
from ..safepickle.policy import resolve
from ..safepickle.unpickler import Opaque
from ..tree import join, run_nested

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Any, Generator

NAMESPACE = ("argparse", "Namespace")
SCALARS = {("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar")}
POSIX_PATHS = {("pathlib", n) for n in ("Path", "PosixPath", "PurePath", "PurePosixPath")}
WINDOWS_PATHS = {("pathlib", n) for n in ("WindowsPath", "PureWindowsPath")}
# A NumPy dtype's code (as its pickle gives it) -> struct's format for one value of it
_FORMATS = {"b1": "?", "i1": "b", "u1": "B", "i2": "h", "u2": "H", "i4": "i", "u4": "I", "i8": "q", "u8": "Q",
            "f2": "e", "f4": "f", "f8": "d", "c8": "2f", "c16": "2d"}
_NUMPY_NAMES = {"b1": "bool", "i1": "int8", "u1": "uint8", "i2": "int16", "u2": "uint16", "i4": "int32", "u4": "uint32",
                "i8": "int64", "u8": "uint64", "f2": "float16", "f4": "float32", "f8": "float64", "c8": "complex64",
                "c16": "complex128"}
# The globals a file's objects name that --plain-data writes as data (numpy.dtype: a scalar's, and only there)
PLAIN_NAMES = frozenset({".".join(NAMESPACE), "numpy.dtype", *(".".join(n) for n in SCALARS | POSIX_PATHS |
                                                                 WINDOWS_PATHS)})
_NOT = object()  # no plain value


def plain_value(obj: Any) -> Any:
    """What `obj` holds as plain data, or _NOT: a Namespace's attributes as a dict (their values as they are), a
    NumPy scalar as a bool, int, float or complex, a path as a str."""
    if not isinstance(obj, Opaque):
        return _NOT
    data = obj.ckd
    if data.ref is None or data.items or data.dictitems or data.kwargs:
        return _NOT
    name = resolve(data.ref.module, data.ref.name)
    if name == NAMESPACE:
        state = {} if data.state is None else data.state
        if data.args or type(state) is not dict or not all(isinstance(k, str) for k in state) or data.builds > 1:
            return _NOT  # (two BUILDs: pickle's would update one __dict__ with both; only the last is kept here)
        return dict(state)
    if name in POSIX_PATHS or name in WINDOWS_PATHS:
        if data.state is not None or not all(isinstance(a, str) for a in data.args):
            return _NOT
        from pathlib import PurePosixPath, PureWindowsPath  # joins the parts as text: no file is looked at

        return str((PurePosixPath if name in POSIX_PATHS else PureWindowsPath)(*data.args))
    if name in SCALARS and data.state is None and len(data.args) == 2:
        return _scalar(*data.args)
    return _NOT


def _scalar(dtype: Any, raw: Any) -> Any:
    """numpy's scalar(dtype, bytes): its value, from the dtype's code and byte order as the pickle records them."""
    if not isinstance(dtype, Opaque) or not isinstance(raw, bytes):
        return _NOT
    data = dtype.ckd
    args, state = data.args, data.state
    if data.ref is None or resolve(data.ref.module, data.ref.name) != ("numpy", "dtype") or not args \
            or not isinstance(args[0], str) or type(state) is not tuple or len(state) not in (8, 9) \
            or state[0] not in (3, 4):  # numpy's own dtype pickles, which np.dtype.__setstate__ takes
        return _NOT
    fmt = _FORMATS.get(args[0])
    order = {"<": "<", "|": "<", ">": ">"}.get(state[1])
    if fmt is None or order is None or struct.calcsize(order + fmt) != len(raw):
        return _NOT
    values = struct.unpack(order + fmt, raw)
    return complex(*values) if len(values) == 2 else values[0]


def _kind(obj: Opaque) -> str:
    """`argparse.Namespace`, `pathlib.PosixPath`, or a NumPy scalar by its type: `numpy.float64`."""
    ref = obj.ckd.ref
    if resolve(ref.module, ref.name) in SCALARS:
        return f"numpy.{_NUMPY_NAMES[obj.ckd.args[0].ckd.args[0]]}"
    return f"{ref.module}.{ref.name}"


def with_plain_data(ckpt: Checkpoint) -> tuple[Checkpoint, list[tuple[str, str, str]]]:
    """`ckpt` with every object plain_value reads written as its value (the containers above it copied, nothing
    else), and what was converted: (path, what it was, what it is now: `argparse.Namespace`, `dict`). Tensors keep
    their paths: a Namespace's attribute is under the same path as the dict's key that replaces it."""
    converted: list[tuple[str, str, str]] = []
    inside: set[int] = set()  # the containers being walked: one met within itself is left for the planner to refuse

    def walk(obj: Any, path: str) -> Generator:  # yields the walk of each child, sent its result
        if id(obj) in inside:  # met within itself: as it is (the planner refuses the cycle)
            return obj
        value = plain_value(obj)
        walking = [id(obj)]  # a Namespace that holds itself: its new dict is made once, not once a level
        if value is not _NOT:
            converted.append((path or "the root", _kind(obj), type(value).__name__))
            obj = value
            walking.append(id(obj))
        if not (isinstance(obj, dict) or type(obj) in (list, tuple)):
            return obj
        inside.update(walking)
        if isinstance(obj, dict):
            pairs = []
            for k, v in obj.items():
                pairs.append((k, (yield walk(v, join(path, k)))))
            items = [v for _, v in pairs]
        else:
            items = []
            for i, v in enumerate(obj):
                items.append((yield walk(v, join(path, i))))
        inside.difference_update(walking)
        if all(new is old for new, old in zip(items, obj.values() if isinstance(obj, dict) else obj)):
            return obj
        if not isinstance(obj, dict):
            return items if type(obj) is list else tuple(items)
        out = type(obj)(pairs)
        if getattr(obj, "_metadata", None) is not None:
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out

    root = run_nested(walk(ckpt.root, ""))
    return (ckpt, converted) if root is ckpt.root else (replace(ckpt, root=root), converted)
