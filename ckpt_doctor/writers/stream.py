"""Copies byte ranges between files in bounded memory, with a crc32 of what was written."""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, Callable, Iterator

from ..dtypes import Cast, element_size
from ..errors import WriteError
from ..readers.zipindex import inflated_range

try:  # ISA-L's crc32 is zlib's CRC-32 (the one zip records) at 9 GB/s here, against zlib's 2.7 GB/s
    from isal.isal_zlib import crc32, crc32_combine
except ImportError:  # a platform isal has no wheel for (zlib has no crc32_combine: pieces are then summed)
    from zlib import crc32

    crc32_combine = None

CHUNK = 8 << 20  # 8 MB: peak memory is one chunk whatever the checkpoint's size
# The kernel copies (copy_file_range) 64 KB at a time. A copy whose calls start on a multiple of 64 KB in the
# source, to the same offset modulo 64 KB in the destination, fills whole 64 KB page-cache folios; otherwise it
# gets 4 KB pages. 1.5 GB copied here: 0.47-0.55 s so (as `cp`), 0.73-1.03 s starting 4 KB off the grid, 0.75-0.8 s
# at a destination 4,032 bytes off the source's phase, 0.88-1.17 s at 64 bytes off. Off the source's phase, a
# read and a write through a 1 MB buffer (which stays in the CPU's cache between the two) took 0.41-0.51 s.
FOLIO = 64 << 10
COPY_BUFFER = 1 << 20
WINDOW = 16 << 20  # the read-back reports its progress this often


class Progress:
    """Counts bytes; the CLI hands a callback that draws a bar on stderr when work takes long."""

    def __init__(self, total: int, callback: Callable[[int, int], None] | None = None) -> None:
        self.total, self.done, self.callback = total, 0, callback

    def advance(self, n: int) -> None:
        self.done += n
        if self.callback is not None:
            self.callback(self.done, self.total)


def copy_bytes(src_fd: Any, src_offset: int, nbytes: int, dst_fd: int, dst_offset: int,
               progress: Progress | None = None, written: WrittenRanges | None = None) -> None:
    """Copy `nbytes`: in the kernel (copy_file_range) when both ends have the same phase on the FOLIO grid, else
    (or where the kernel cannot) through a buffer."""
    copied = 0
    if src_fd.__class__ is int and hasattr(os, "copy_file_range") and (src_offset - dst_offset) % FOLIO == 0:
        step = FOLIO - src_offset % FOLIO  # up to the grid first (see FOLIO), then whole multiples of it
        try:
            while copied < nbytes:
                n = os.copy_file_range(src_fd, dst_fd, min(step, nbytes - copied),
                                       src_offset + copied, dst_offset + copied)
                step = CHUNK * 8
                if n == 0:
                    raise EOFError(f"source ended {nbytes - copied} bytes early")
                copied += n
                if progress:
                    progress.advance(n)
            return
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # else read/write
                raise
    _buffered_copy(src_fd, src_offset + copied, nbytes - copied, dst_fd, dst_offset + copied, progress, False,
                   written if not copied else None)


def copy_range(src_fd: Any, src_offset: int, nbytes: int, dst_fd: int, dst_offset: int,
               progress: Progress | None = None, known_crc: int | None = None,
               written: WrittenRanges | None = None) -> int:
    """Copy `nbytes`; returns their crc32. With `known_crc` nothing is summed and the kernel may copy. `written`: told
    of the range's first bytes as they are in (WrittenRanges.partial) when it is copied through a buffer."""
    if known_crc is not None:
        copy_bytes(src_fd, src_offset, nbytes, dst_fd, dst_offset, progress, written)
        return known_crc
    return _buffered_copy(src_fd, src_offset, nbytes, dst_fd, dst_offset, progress, True, written)


def _buffered_copy(src_fd: int, src_offset: int, nbytes: int, dst_fd: int, dst_offset: int,
                   progress: Progress | None, with_crc: bool, written: WrittenRanges | None = None) -> int:
    """Read and write through one reused buffer (see FOLIO); the crc32 of the bytes when asked, else 0. `written` is
    told every WINDOW bytes how far the range at `dst_offset` is written."""
    crc = 0
    copied = told = 0
    for chunk in _chunks(src_fd, src_offset, nbytes, "source"):
        if with_crc:
            crc = crc32(chunk, crc)
        write_bytes(dst_fd, dst_offset + copied, chunk)
        copied += len(chunk)
        if progress:
            progress.advance(len(chunk))
        if written is not None and copied - told >= WINDOW and copied < nbytes:
            written.partial(dst_offset, copied)
            told = copied
    return crc


def _chunks(fd: int, offset: int, nbytes: int, what: str) -> Iterator[memoryview]:
    """`nbytes` of `fd` from `offset`, read into one reused buffer a chunk at a time: each chunk is good until
    the next is read. `what` names the file if it ends early. A remote source (readers/source.py) hands views of
    its data windows instead: large sequential requests, the next fetched while this one is written."""
    if fd.__class__ is not int:  # handed on COPY_BUFFER at a time, as a local copy is: a 256 MB fix over HTTP took
        for block in fd.data_blocks(offset, nbytes):  # 4.3 s here in 32 MB writes, 1.8 s in 1 MB ones
            for at in range(0, len(block), COPY_BUFFER):
                yield block[at:at + COPY_BUFFER]
        return
    buffer = memoryview(bytearray(min(COPY_BUFFER, nbytes)))
    done = 0
    while done < nbytes:
        want = buffer[:nbytes - done]
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [want], offset + done)
        else:
            data = os.pread(fd, len(want), offset + done)
            n = len(data)
            want[:n] = data
        if n == 0:
            raise EOFError(f"{what} ended {nbytes - done} bytes early")
        yield buffer[:n]
        done += n


def write_bytes(dst_fd: int, offset: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    written = 0
    while written < len(data):
        written += os.pwrite(dst_fd, view[written:], offset + written)


def deflated_producer(src_fd: int, storage: Any, skip: int, nbytes: int, what: str,
                      convert: tuple[str, str, str] | None = None) -> Callable[[int, int, Progress | None], int]:
    """Bytes [skip, skip + nbytes) of a storage that is a deflated zip member (a re-zipped torch file), inflated
    straight into the output a CHUNK at a time, so memory stays one chunk whatever the storage's size; `convert`:
    (from dtype, to dtype, the output's name of the tensor), converted on the way (a value the cast makes infinite
    refuses the write: dtypes.Cast). The whole member is inflated and checked against the crc32 its
    archive records, when it records one (a corrupt member: ReadError, nothing written). Returns a producer for the
    writers: (fd, offset, progress) -> the crc32 of what it wrote."""

    def produce(fd: int, at: int, progress: Progress | None) -> int:
        whole = (storage.nbytes, storage.crc) if storage.crc is not None else None
        crc, written, carry = 0, 0, b""
        elsize = 1
        cast = None
        if convert is not None:
            elsize = element_size(convert[0])
            cast = Cast(*convert)
        for block in inflated_range(src_fd, storage.offset, storage.deflated, skip, nbytes,
                                    f"{storage.file}: {what} (storage {storage.entry or storage.key})", whole):
            if progress:
                progress.advance(len(block))
            if cast is not None:
                block = carry + block
                cut = len(block) - len(block) % elsize
                block, carry = block[:cut], block[cut:]
                block = cast.block(block) if block else b""
            write_bytes(fd, at + written, block)
            crc = crc32(block, crc)
            written += len(block)
        if cast is not None:
            cast.done()
        return crc

    return produce


def crc_range(fd: int, offset: int, nbytes: int, progress: Progress | None = None, crc: int = 0) -> int:
    """crc32 of a range of a file (continuing `crc`, that of the bytes before it), read by pread into one reused 1 MB
    buffer (it stays in the CPU's cache from the read to the crc). Never through a map: a file cut short under a
    map faults (SIGBUS) and ends the process, and no lease can hold still a file this process is writing. A range
    cut short is an EOFError."""
    pending = 0
    for chunk in _chunks(fd, offset, nbytes, "the output"):
        crc = crc32(chunk, crc)
        pending += len(chunk)
        if progress and pending >= WINDOW:
            progress.advance(pending)
            pending = 0
    if progress and pending:
        progress.advance(pending)
    return crc


def linux_call(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """A libc function of Linux's (int result, errno kept), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        func = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    func.argtypes = argtypes
    func.restype = ctypes.c_int
    return func


def _sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux's sync_file_range(SYNC_FILE_RANGE_WRITE): start writing a range to disk and return at once."""
    import ctypes

    func = linux_call("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    if func is None:
        return None
    return lambda fd, offset, nbytes: func(fd, offset, nbytes, 2)  # 2 = SYNC_FILE_RANGE_WRITE; errors ignored


def preallocate(fd: int, nbytes: int) -> None:
    """Reserve the disk blocks of a file about to be written, and set its size (Linux's fallocate; nothing where
    the filesystem or the platform has none: no zeros are written). The filesystem then allocates once instead of
    while the data is flushed: 1.5 GB copied, flushed and read back here in 0.54-0.63 s, against 0.70-0.83 s.
    A full disk is found now, before any copying (OSError ENOSPC). The writer truncates to the size it ends at."""
    import ctypes

    func = linux_call("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    if func is None or nbytes <= 0 or func(fd, 0, 0, nbytes) == 0:
        return
    code = ctypes.get_errno()
    if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        raise OSError(code, os.strerror(code))


class _Helper:
    """One thread running the jobs handed to it, in order (concurrent.futures would add 4 ms of imports)."""

    def __init__(self, name: str) -> None:
        import queue
        import threading

        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = False
        self.results: list = []  # a job's return value, or the exception it raised
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable, *args) -> None:
        self._jobs.put((job, args))

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            if self._cancelled:
                continue
            job, args = item
            try:
                self.results.append(job(*args))
            except Exception as exc:  # the caller of stop() decides
                self.results.append(exc)

    def stop(self, cancel: bool = False) -> list:
        """Waits for the jobs handed in so far (or, with `cancel`, only the one running); their results."""
        self._cancelled = self._cancelled or cancel
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        return self.results


class WrittenRanges:
    """What happens to each range of the output once it is written.

    Its disk write is started at once, from a helper thread (sync_file_range on Linux; the call can block while
    the disk queue is full, and the copy must not wait on it), so the fsync that makes the output durable has
    almost nothing left to do: after a 1.5 GB copy that fsync takes 0.26 s here, with this 0.01 s (issued from the
    copying thread instead, the calls themselves blocked for 0.15 s). With `verify`, each range is also re-read
    in a second thread and its crc32 compared with the source's; crc32 releases the GIL, so the check
    runs beside the copy. A range copied through a buffer (a remote source's stream) is read back, and flushed, as
    its pieces are written (partial()), so a storage of a gigabyte does not leave all of its check to after its
    copy. `failures()` waits for the last check.
    """

    FLUSH_EVERY = 16 << 20  # 4, 64 and 256 MB were slower here

    def __init__(self, fd: int, path: str, verify: bool, progress: Progress | None = None) -> None:
        self.fd, self.progress = fd, progress
        self._flush = _sync_file_range()
        self._flushed_to = 0  # writes go front to back: all before this has had its disk write started
        self._flusher = _Helper("ckpt-doctor-flush") if self._flush is not None else None
        self.read_fd = os.open(path, os.O_RDONLY) if verify else -1
        self._checker = _Helper("ckpt-doctor-verify") if verify else None
        self._part: tuple[int, int, int] | None = None  # (range offset, read back up to, crc so far): checker's own

    def done(self, offset: int, nbytes: int, expected_crc: int, what: str) -> None:
        if self._checker is not None:
            self._checker.submit(self._check, offset, nbytes, expected_crc, what)
        self._flush_to(offset + nbytes)

    def partial(self, offset: int, nbytes: int) -> None:
        """The first `nbytes` of the range at `offset` are written (done() follows once all of it is)."""
        if self._checker is not None:
            self._checker.submit(self._check_part, offset, nbytes)
        self._flush_to(offset + nbytes)

    def _flush_to(self, end: int) -> None:
        if self._flusher is not None and end - self._flushed_to >= self.FLUSH_EVERY:
            # headers between ranges included
            self._flusher.submit(self._flush, self.fd, self._flushed_to, end - self._flushed_to)
            self._flushed_to = end

    def _read_back(self, offset: int, nbytes: int, what: str) -> int:
        """crc32 of the range's first `nbytes`, continuing what partial() had read of it."""
        done, crc = (self._part[1], self._part[2]) if self._part and self._part[0] == offset else (offset, 0)
        try:
            crc = crc_range(self.read_fd, done, offset + nbytes - done, self.progress, crc)
        except EOFError:
            raise WriteError(f"{what}: the output was cut short while it was read back (another process truncated "
                             "it?); nothing written") from None
        self._part = (offset, offset + nbytes, crc)
        return crc

    def _check_part(self, offset: int, nbytes: int) -> None:
        self._read_back(offset, nbytes, f"bytes {offset:,}-{offset + nbytes - 1:,} of the output")

    def _check(self, offset: int, nbytes: int, expected: int, what: str) -> str | None:
        crc = self._read_back(offset, nbytes, what)
        self._part = None
        return None if crc == expected else f"{what} (crc {crc:08x}, source {expected:08x})"

    def failures(self) -> list[str]:
        """The ranges whose bytes, read back, differ from their source (waits for the last check)."""
        try:
            results = self._checker.stop() if self._checker is not None else []
        finally:
            self.close()
        for result in results:
            if isinstance(result, Exception):
                raise result
        return [r for r in results if r]

    def close(self) -> None:
        for helper in (self._flusher, self._checker):
            if helper is not None:
                helper.stop(cancel=True)
        self._flusher = self._checker = None
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1
