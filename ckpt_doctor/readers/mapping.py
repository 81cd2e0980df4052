"""The bytes a pickle walk needs, read with pread into memory: never a memory map.

A file mapped while another process truncates it kills the process with SIGBUS on the first page past the new end,
and Python cannot catch that (its handler runs after the faulting instruction, which faults again). So the metadata
paths (pickles walked, signatures searched) read with pread, which returns fewer bytes instead: the walk then ends
early and says so, as for any truncated file. A file is read whole up to READ_UP_TO; past it, a window from the
start that grows (doubling) while the walk runs into its end, so a 10 GB legacy file whose pickles take 2 KB costs
one 16 MB read, not 10 GB — and a pickle of hundreds of MB costs what a map of it cost in resident memory (the pages
a walk touches count there too). The same reads serve a remote source (source.RemoteSource), where the window
starts small: every byte is a byte over the network.
"""

from __future__ import annotations

import os

from ..safepickle import limits
from .source import is_remote, pread

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any, Callable


READ_UP_TO = 16 << 20  # files up to this size are read whole; bigger ones through a growing window
REMOTE_WINDOW = 64 << 10  # a remote file's first window (what its first request fetched)


def read_all(fd: Any, size: int, at: int = 0) -> bytes:
    """`size` bytes from `at` (fewer when the file was cut short since its size was taken)."""
    parts = []
    end = at + size
    while at < end:
        chunk = pread(fd, min(end - at, 1 << 30), at)
        if not chunk:  # cut short since its size was taken: what there is (a walk ends early, as torch would)
            break
        parts.append(chunk)
        at += len(chunk)
    return b"".join(parts) if len(parts) != 1 else parts[0]


def walk_window(fd: Any, size: int, run: Callable[[bytes], Any], budget: list | None = None, at: int = 0,
                first: int | None = None) -> Any:
    """`run(data)` over the bytes [at, at + size) of the file — all of them when they are few, else a window from
    `at` that doubles while the walk `run` returns (a Walk) ran into the window's end, up to limits.MAX_PICKLE_BYTES
    (what a walk reads at most). `first`: the first window, where the walk is expected to end early (the pickle a
    safetensors file's first bytes might be). `budget`, the walker's, is restored before each retry, so a walk costs
    what one walk of the final window costs."""
    if first is not None:
        window = min(size, first)
    else:
        window = size if size <= READ_UP_TO and not is_remote(fd) else min(size, REMOTE_WINDOW if is_remote(fd)
                                                                                 else READ_UP_TO)
    cap = min(size, limits.MAX_PICKLE_BYTES)
    while True:
        data = read_all(fd, window, at)
        if len(data) < window or window >= cap:
            return run(data)
        import copy

        saved = copy.deepcopy(budget) if budget is not None else None
        result = run(data)
        if not (result.truncated or result.end >= len(data)):
            return result
        if budget is not None:
            budget[:] = saved
        window = min(window * 4 if is_remote(fd) else window * 2, cap)


def find_all(fd: Any, size: int, signature: bytes, start: int = 0, block: int = 8 << 20):
    """Offsets of `signature` in the file from `start`, in order, read in blocks (a search over a memory map would
    SIGBUS on a file cut short meanwhile)."""
    keep = len(signature) - 1
    at = start
    carry = b""
    while at < size:
        chunk = pread(fd, min(block, size - at), at)
        if not chunk:
            return
        data = carry + chunk
        base = at - len(carry)
        i = data.find(signature)
        while i >= 0:
            yield base + i
            i = data.find(signature, i + 1)
        carry = data[-keep:] if keep else b""
        at += len(chunk)


def file_size(fd: Any) -> int:
    return os.fstat(fd).st_size if not is_remote(fd) else fd.size
