"""The file as a read-only memory map, for walking a pickle in place."""

from __future__ import annotations

import mmap
import os

from ..safepickle import limits

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any


READ_UP_TO = 16 << 20  # files up to this size are read whole; bigger ones mapped (a truncation then is SIGBUS)


def _read_all(fd: int, size: int) -> bytes:
    parts = []
    at = 0
    while at < size:
        chunk = os.pread(fd, size - at, at)
        if not chunk:  # cut short since its size was taken: walk what there is (it ends early, as torch would)
            break
        parts.append(chunk)
        at += len(chunk)
    return b"".join(parts) if len(parts) != 1 else parts[0]


class mapped:
    """`with mapped(fd, size) as data:` the file as a read-only memory map: the walker reads it in place, so a
    gigabyte pickle costs no copy, and pages the walker skips (a string's payload) are never touched. A file system
    that cannot map gets a read, and so does a file of at most READ_UP_TO bytes (a copy costs little there, and a
    file truncated by another process while it is read is then reported, not a crash). (A class, not a contextlib
    generator: importing contextlib costs every start.)"""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size, self.view = fd, size, None

    def __enter__(self) -> Any:
        fd, size = self.fd, self.size
        if size == 0:
            return b""
        if size <= READ_UP_TO:  # read, not mapped: a file cut short while mapped would kill the process (SIGBUS)
            return _read_all(fd, size)
        try:
            self.view = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return os.pread(fd, min(size, limits.MAX_PICKLE_BYTES), 0)
        return self.view

    def __exit__(self, *exc: object) -> None:
        if self.view is not None:
            self.view.close()
