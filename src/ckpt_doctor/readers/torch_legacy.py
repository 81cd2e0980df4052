"""Reads the pre-1.6 torch format (a run of pickles, then each storage as a count and raw bytes) and bare pickles."""

from __future__ import annotations

import struct
from pathlib import Path

from ..dtypes import element_size
from ..errors import ReadError
from ..records import Checkpoint, Format, StorageRecord
from ..unpickler import SafeUnpickler
from ._pickled import build_checkpoint, run_unpickler

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001


def read_torch_legacy(path: Path, size: int) -> Checkpoint:
    with open(path, "rb") as f:
        first = SafeUnpickler(f, "pickle 1 (magic number)")
        magic = run_unpickler(first, path)
        if magic != MAGIC_NUMBER:
            # A bare pickle (pickle.dump): the first object is the content.
            notes = ("a bare pickle, not written by torch.save",)
            extra_notes, extra = _trailing(f, size)
            return build_checkpoint(path, Format.PICKLE, magic, [first], notes=notes + extra_notes,
                                    extra_globals=extra)
        second = SafeUnpickler(f, "pickle 2 (protocol version)")
        version = run_unpickler(second, path)
        if version != PROTOCOL_VERSION:
            raise ReadError(f"{path}: legacy torch file with protocol version {version!r}; only "
                            f"{PROTOCOL_VERSION} exists")
        third = SafeUnpickler(f, "pickle 3 (system info)")
        sys_info = run_unpickler(third, path)
        notes: list[str] = []
        if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
            notes.append("saved on a big-endian machine: tensor bytes are big-endian")
        body = SafeUnpickler(f, "pickle 4 (object)")
        root = run_unpickler(body, path)
        keys_up = SafeUnpickler(f, "pickle 5 (storage keys)")
        keys = run_unpickler(keys_up, path)
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ReadError(f"{path}: legacy torch file whose storage key list is not a list of strings")
        offset = f.tell()
        for key in keys:
            ref = body.storages.get(key)
            head = _read_at(f, offset, 8)
            if ref is None or len(head) != 8:
                what = "is not named by the object pickle" if ref is None else "is cut short"
                raise ReadError(f"{path}: storage {key} {what} (the file is corrupt or truncated)")
            (count,) = struct.unpack("<q", head)
            nbytes = count * element_size(ref.dtype)
            if count < 0 or offset + 8 + nbytes > size:
                raise ReadError(f"{path}: storage {key} needs {nbytes} bytes past offset {offset + 8}, "
                                f"the file has {size} (truncated)")
            ref.resolved = StorageRecord(key, ref.dtype, nbytes, ref.location, path, offset + 8)
            offset += 8 + nbytes
        missing = set(body.storages) - set(keys)
        if missing:
            raise ReadError(f"{path}: storages {sorted(missing)[:3]} are named but not stored (corrupt file)")
        f.seek(offset)
        trailing_notes, extra = _trailing(f, size)
        notes.extend(trailing_notes)
    return build_checkpoint(path, Format.TORCH_LEGACY, root, [first, second, third, body, keys_up],
                            notes=tuple(notes), extra_globals=extra)


def _read_at(f, offset: int, size: int) -> bytes:
    f.seek(offset)
    return f.read(size)


def _trailing(f, size: int) -> tuple[tuple[str, ...], tuple]:
    """A note on bytes after the last pickle, and the globals they name (a second pickle, an appended zip)."""
    at = f.tell()
    left = size - at
    if left <= 0:
        return (), ()
    from ..scan import scan_file_tail

    kind, refs, more = scan_file_tail(f, at)
    return (f"{left} trailing bytes after the last pickle ({kind}); torch never reads them", *more), tuple(refs)
