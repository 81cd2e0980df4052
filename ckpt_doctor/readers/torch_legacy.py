"""Reads the pre-1.6 torch format (a run of pickles, then each storage as a count and raw bytes) and bare pickles."""

from __future__ import annotations

import io
import struct
from pathlib import Path

from ..dtypes import element_size
from ..errors import ReadError
from ..records import Checkpoint, Format, GlobalRef, StorageRecord
from ..safepickle import limits
from ..safepickle.policy import Policy
from ..safepickle.unpickler import SafeUnpickler
from ..safepickle.walker import starts_pickle, walk
from ._pickled import build_checkpoint, run_unpickler
from .source import close_source, open_source, pread
from .survey import LEGACY_PICKLES, Survey

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
_LABELS = ("pickle 1 (magic number)", "pickle 2 (protocol version)", "pickle 3 (system info)", "pickle 4 (object)",
           "pickle 5 (storage keys)")


def read_torch_legacy(path: Path, survey: Survey) -> Checkpoint:
    walked = survey.main_walk
    assert walked is not None
    spans = walked.pickles
    fd = open_source(path)  # a descriptor, or a URL's remote object (readers/source.py)
    try:
        if not spans:
            raise ReadError(f"{path}: {walked.broken or 'not a valid pickle'}")
        needed = spans[min(len(spans), LEGACY_PICKLES) - 1][1]  # the legacy pickles (a bare pickle: its first)
        if needed > limits.MAX_UNPICKLE_BYTES:
            needed = spans[0][1]
        if needed > limits.MAX_UNPICKLE_BYTES:
            raise ReadError(f"{path}: a pickle of {needed:,} bytes, over the {limits.MAX_UNPICKLE_BYTES >> 20} MB "
                            "ckpt-doctor unpickles (it was walked: what it would run is reported)")
        head = pread(fd, needed, 0)
        first = _load(head, spans[0], _LABELS[0], path, survey.policy)
        if first[1] != MAGIC_NUMBER:
            # A bare pickle (pickle.dump): the first object is the content; torch.load would refuse it after
            # unpickling it ("Invalid magic number").
            notes = ["a bare pickle, not written by torch.save"]
            if len(spans) > 1 or walked.broken and walked.end > spans[0][1]:
                notes.append(f"{survey.size - spans[0][1]} bytes after the first pickle, which torch never reads")
            return build_checkpoint(path, Format.PICKLE, first[1], [first[0]], notes=tuple(notes))
        if len(spans) < LEGACY_PICKLES:
            raise ReadError(f"{path}: legacy torch file cut short: {walked.broken or 'fewer than five pickles'}")
        if len(head) < spans[LEGACY_PICKLES - 1][1]:
            raise ReadError(f"{path}: legacy torch file whose pickles are over the "
                            f"{limits.MAX_UNPICKLE_BYTES >> 20} MB ckpt-doctor unpickles")
        loaded = [first] + [_load(head, spans[i], _LABELS[i], path, survey.policy) for i in range(1, LEGACY_PICKLES)]
        (_, version), (_, sys_info), (body, root), (_, keys) = loaded[1], loaded[2], loaded[3], loaded[4]
        if version != PROTOCOL_VERSION:
            raise ReadError(f"{path}: legacy torch file with protocol version {version!r}; only "
                            f"{PROTOCOL_VERSION} exists")
        notes: list[str] = []
        if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
            notes.append("saved on a big-endian machine: tensor bytes are big-endian")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ReadError(f"{path}: legacy torch file whose storage key list is not a list of strings")
        offset = spans[-1][1]
        for key in keys:
            ref = body.storages.get(key)
            count_bytes = pread(fd, 8, offset)
            if ref is None or len(count_bytes) != 8:
                what = "is not named by the object pickle" if ref is None else "is cut short"
                raise ReadError(f"{path}: storage {key} {what} (the file is corrupt or truncated)")
            (count,) = struct.unpack("<q", count_bytes)
            nbytes = count * element_size(ref.dtype)
            if count < 0 or offset + 8 + nbytes > survey.size:
                raise ReadError(f"{path}: storage {key} needs {nbytes} bytes past offset {offset + 8}, "
                                f"the file has {survey.size} (truncated)")
            ref.resolved = StorageRecord(key, ref.dtype, nbytes, ref.location, path, offset + 8)
            offset += 8 + nbytes
        missing = set(body.storages) - set(keys)
        if missing:
            raise ReadError(f"{path}: storages {sorted(missing)[:3]} are named but not stored (corrupt file)")
        trailing_notes, extra = _trailing(fd, offset, survey.size, survey.policy)
        notes.extend(trailing_notes)
    finally:
        close_source(fd)
    return build_checkpoint(path, Format.TORCH_LEGACY, root, [u for u, _ in loaded], notes=tuple(notes),
                            extra_globals=extra)


def _load(data: bytes, span: tuple[int, int], label: str, path: Path, policy: Policy):
    """Unpickle one walked pickle under `policy`: (the unpickler, with its records; the object)."""
    unpickler = SafeUnpickler(io.BytesIO(data[span[0]:span[1]]), label, policy=policy)
    return unpickler, run_unpickler(unpickler, path)


def _trailing(fd: int, at: int, size: int, policy: Policy) -> tuple[list[str], tuple[GlobalRef, ...]]:
    """A note on bytes after the last storage, and the globals they name (a pickle or a zip appended)."""
    left = size - at
    if left <= 0:
        return [], ()
    data = pread(fd, min(left, limits.MAX_PICKLE_BYTES), at)
    notes = [f"{left} trailing bytes after the last storage; torch never reads them"]
    if data[:4] == b"PK\x03\x04":
        notes.append("a zip archive follows the storages")
    if not starts_pickle(data):
        return notes, ()
    result = walk(data, f"pickle after the storages (byte {at})", policy=policy)
    return notes + result.notes, tuple(result.globals)
