"""Objects a pickle builds that only hold data, read as that data from what the pickle records — an
argparse.Namespace's attributes, a NumPy scalar's dtype code and bytes, a pathlib path's parts — with nothing
imported or called: `fix --plain-data` writes them as a dict, a number, a str, and inspect shows their values."""

from __future__ import annotations

import struct

from .policy import resolve
from .unpickler import SNAPSHOT, Opaque

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Any

NAMESPACE = ("argparse", "Namespace")
SCALARS = SNAPSHOT  # numpy's scalar(dtype, bytes), as numpy 2 and numpy 1 name it
# the pathlib classes the allow-list names (Python 3.13 pickles them from pathlib._local)
POSIX_PATHS = {(m, n) for n in ("Path", "PosixPath", "PurePosixPath") for m in ("pathlib", "pathlib._local")}
WINDOWS_PATHS = {(m, n) for n in ("WindowsPath", "PureWindowsPath") for m in ("pathlib", "pathlib._local")}
MAX_PATH = 1 << 16  # characters of a path's parts together: one string the memo repeats could make gigabytes
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
        if data.state is not None or not all(isinstance(a, str) for a in data.args) \
                or sum(map(len, data.args)) > MAX_PATH:
            return NOT_PLAIN
        from pathlib import PurePosixPath, PureWindowsPath  # joins the parts as text: no file is looked at

        return str((PurePosixPath if name in POSIX_PATHS else PureWindowsPath)(*data.args))
    if name in SCALARS and data.state is None and len(data.args) == 2 and data.via_reduce \
            and data.args_built is not None and data.args_built[0] == 1:  # its dtype's one BUILD came before it
        return _scalar(*data.args)
    return NOT_PLAIN


def _scalar(dtype: Any, raw: Any) -> Any:
    """numpy's scalar(dtype, bytes): its value, from the dtype's code and byte order as the pickle records them."""
    if not isinstance(dtype, Opaque) or not isinstance(raw, bytes):
        return NOT_PLAIN
    data = dtype.ckd
    args, state = data.args, data.state
    # numpy's own pickle of a plain dtype, dtype(code, False, True) and one BUILD of (3, order, None, None, None, -1,
    # -1, 0): with copy False numpy ignores the BUILD; other fields, flags or a second BUILD make another dtype
    if data.ref is None or resolve(data.ref.module, data.ref.name) != ("numpy", "dtype") or len(args) != 3 \
            or type(args[0]) is not str or args[1] is not False or args[2] is not True or data.kwargs \
            or not data.via_reduce or data.builds != 1 or type(state) is not tuple or len(state) not in (8, 9) \
            or state[0] not in (3, 4) or state[2:8] != (None, None, None, -1, -1, 0) or state[8:] not in ((), (None,)):
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
    code = obj.ckd.args[0].ckd.args[0] if type(value) is float else None  # (a float comes of a scalar only)
    return f"<{plain_kind(obj)} {_shortest(value, '<' + _FORMATS[code]) if code in _NARROW else value}>"


_NARROW = ("f4", "f2")  # float32, float16: shown with the digits that read back as the same value


def _shortest(value: float, fmt: str) -> str:
    """The fewest digits that read back as the same float32 or float16, as NumPy prints it (0.81, not the float64
    0.8100000023841858 its bits are)."""
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        try:
            if struct.unpack(fmt, struct.pack(fmt, float(text)))[0] == value:
                return text
        except OverflowError:  # rounded past the dtype's largest (65504 of float16 to 7e+04)
            continue
    return repr(value)
