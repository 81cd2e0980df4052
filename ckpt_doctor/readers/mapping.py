"""The file as a read-only memory map, for walking a pickle in place."""

from __future__ import annotations

import contextlib
import mmap
import os

from ..safepickle import limits

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any, Iterator


@contextlib.contextmanager
def mapped(fd: int, size: int) -> Iterator[Any]:
    """The file as a read-only memory map: the walker reads it in place, so a gigabyte pickle costs no copy, and
    pages the walker skips (a string's payload) are never touched. A file system that cannot map gets a read."""
    if size == 0:
        yield b""
        return
    try:
        view = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        yield os.pread(fd, min(size, limits.MAX_PICKLE_BYTES), 0)
        return
    with view:
        yield view
