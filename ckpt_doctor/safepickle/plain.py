"""Objects a pickle builds that only hold data, read as that data from what the pickle records — an
argparse.Namespace's attributes, a NumPy scalar's dtype code and bytes, a pathlib path's parts — with nothing
imported or called: `fix --plain-data` writes them as a dict, a number, a str, and inspect shows their values."""

from __future__ import annotations

import struct

from .policy import resolve
from .unpickler import Opaque

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Any

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
NOT_PLAIN = object()  # plain_value's answer for what is no plain data


def plain_value(obj: Any) -> Any:
    """What `obj` holds as plain data, or NOT_PLAIN: a Namespace's attributes as a dict (their values as they are), a
    NumPy scalar as a bool, int, float or complex, a path as a str."""
    if not isinstance(obj, Opaque):
        return NOT_PLAIN
    data = obj.ckd
    if data.ref is None or data.items or data.dictitems or data.kwargs:
        return NOT_PLAIN
    name = resolve(data.ref.module, data.ref.name)
    if name == NAMESPACE:
        state = {} if data.state is None else data.state
        if data.args or type(state) is not dict or not all(isinstance(k, str) for k in state) or data.builds > 1:
            return NOT_PLAIN  # (two BUILDs: pickle's would update one __dict__ with both; only the last is kept here)
        return dict(state)
    if name in POSIX_PATHS or name in WINDOWS_PATHS:
        if data.state is not None or not all(isinstance(a, str) for a in data.args):
            return NOT_PLAIN
        from pathlib import PurePosixPath, PureWindowsPath  # joins the parts as text: no file is looked at

        return str((PurePosixPath if name in POSIX_PATHS else PureWindowsPath)(*data.args))
    if name in SCALARS and data.state is None and len(data.args) == 2:
        return _scalar(*data.args)
    return NOT_PLAIN


def _scalar(dtype: Any, raw: Any) -> Any:
    """numpy's scalar(dtype, bytes): its value, from the dtype's code and byte order as the pickle records them."""
    if not isinstance(dtype, Opaque) or not isinstance(raw, bytes):
        return NOT_PLAIN
    data = dtype.ckd
    args, state = data.args, data.state
    if data.ref is None or resolve(data.ref.module, data.ref.name) != ("numpy", "dtype") or not args \
            or not isinstance(args[0], str) or type(state) is not tuple or len(state) not in (8, 9) \
            or state[0] not in (3, 4):  # numpy's own dtype pickles, which np.dtype.__setstate__ takes
        return NOT_PLAIN
    fmt = _FORMATS.get(args[0])
    order = {"<": "<", "|": "<", ">": ">"}.get(state[1])
    if fmt is None or order is None or struct.calcsize(order + fmt) != len(raw):
        return NOT_PLAIN
    values = struct.unpack(order + fmt, raw)
    return complex(*values) if len(values) == 2 else values[0]


def plain_kind(obj: Opaque) -> str:
    """`argparse.Namespace`, `pathlib.PosixPath`, or a NumPy scalar by its type: `numpy.float64`."""
    ref = obj.ckd.ref
    if resolve(ref.module, ref.name) in SCALARS:
        return f"numpy.{_NUMPY_NAMES[obj.ckd.args[0].ckd.args[0]]}"
    return f"{ref.module}.{ref.name}"


def plain_text(obj: Any) -> str | None:
    """How inspect shows a NumPy scalar or a path: `<numpy.float64 0.81>`, `<pathlib.PosixPath runs/exp1>` (its value
    in an object's brackets: torch.load's defaults refuse it all the same); None for anything else."""
    value = plain_value(obj)
    if value is NOT_PLAIN or isinstance(value, dict):
        return None
    return f"<{plain_kind(obj)} {value}>"
