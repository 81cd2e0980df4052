"""Copies byte ranges between files in bounded memory, with a crc32 of what was written."""

from __future__ import annotations

import errno
import os
import zlib
from typing import Callable

CHUNK = 8 << 20  # 8 MB: peak memory is one chunk whatever the checkpoint's size


class Progress:
    """Counts bytes; the CLI hands a callback that draws a bar on stderr when work takes long."""

    def __init__(self, total: int, callback: Callable[[int, int], None] | None = None) -> None:
        self.total, self.done, self.callback = total, 0, callback

    def advance(self, n: int) -> None:
        self.done += n
        if self.callback is not None:
            self.callback(self.done, self.total)


def copy_range(src_fd: int, src_offset: int, nbytes: int, dst_fd: int, dst_offset: int,
               progress: Progress | None = None, known_crc: int | None = None) -> int:
    """Copy `nbytes`; returns their crc32. With `known_crc`, the kernel copies and no byte enters Python."""
    if known_crc is not None and hasattr(os, "copy_file_range"):
        copied = 0
        try:
            while copied < nbytes:
                n = os.copy_file_range(src_fd, dst_fd, min(CHUNK * 8, nbytes - copied),
                                       src_offset + copied, dst_offset + copied)
                if n == 0:
                    raise EOFError
                copied += n
                if progress:
                    progress.advance(n)
            return known_crc
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # else read/write
                raise
            if progress:
                progress.advance(-copied)
    crc = 0
    copied = 0
    while copied < nbytes:
        chunk = os.pread(src_fd, min(CHUNK, nbytes - copied), src_offset + copied)
        if not chunk:
            raise EOFError(f"source ended {nbytes - copied} bytes early")
        crc = zlib.crc32(chunk, crc)
        written = 0
        view = memoryview(chunk)
        while written < len(chunk):
            written += os.pwrite(dst_fd, view[written:], dst_offset + copied + written)
        copied += len(chunk)
        if progress:
            progress.advance(len(chunk))
    return crc


def write_bytes(dst_fd: int, offset: int, data: bytes) -> None:
    view = memoryview(data)
    written = 0
    while written < len(data):
        written += os.pwrite(dst_fd, view[written:], offset + written)


def crc_range(fd: int, offset: int, nbytes: int, progress: Progress | None = None) -> int:
    crc = 0
    done = 0
    while done < nbytes:
        chunk = os.pread(fd, min(CHUNK, nbytes - done), offset + done)
        if not chunk:
            raise EOFError("file ended early")
        crc = zlib.crc32(chunk, crc)
        done += len(chunk)
        if progress:
            progress.advance(len(chunk))
    return crc


class ReadBack:
    """Re-reads each range as soon as it is written, in a second thread, and checks its crc32.

    zlib and pread release the GIL, so on two cores the verification runs beside the copy instead of
    after it; `failures()` waits for the last range.
    """

    SYNC_EVERY = 256 << 20

    def __init__(self, path: str, progress: Progress | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.fd = os.open(path, os.O_RDONLY)
        self.progress = progress
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-doctor-verify")
        self.futures: list = []
        self.unsynced = 0

    def check(self, offset: int, nbytes: int, expected: int, what: str) -> None:
        self.futures.append(self.pool.submit(self._check, offset, nbytes, expected, what))

    def _check(self, offset: int, nbytes: int, expected: int, what: str) -> str | None:
        crc = crc_range(self.fd, offset, nbytes, self.progress)
        self.unsynced += nbytes
        if self.unsynced >= self.SYNC_EVERY:
            # Flush what is verified while the copy goes on, so the final fsync has little left to wait for.
            os.fdatasync(self.fd)
            self.unsynced = 0
        return None if crc == expected else f"{what} (crc {crc:08x}, source {expected:08x})"

    def failures(self) -> list[str]:
        try:
            return [f for f in (fut.result() for fut in self.futures) if f]
        finally:
            self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
