"""`ckpt-doctor diff A B`: what changed between two checkpoints, tensor by tensor, streamed one pair at a time.

Names are matched as `inspect A --model B` matches them (the same inferred renames: a `module.` prefix, a nested
state_dict), so a DataParallel file and its clean copy compare as the same weights. For each pair: shape and dtype
changes, max |B − A|, the relative change ‖B − A‖ / ‖A‖ and the cosine similarity, computed in float64 over blocks
of the flattened tensors (never both files in memory). A pair is identical when its bytes are; within --atol/--rtol
it is close (torch.isclose's rule: |B − A| <= atol + rtol·|A|, NaN equal to NaN). When many pairs changed, a forked
worker takes half of that arithmetic to the second core (_Figures); for two files of one size, a forked child
compares their bytes at equal offsets while this process reads their structures (_Ahead).
"""

from __future__ import annotations

from pathlib import Path
from sys import intern

from ._record import field, record, replace
from .dtypes import element_size
from .errors import ReadError
from .pool import can_fork, one_blas_thread, openblas_libraries, workers
from .readers import read_checkpoint
from .readers.held import Holder
from .records import Checkpoint, TensorRecord, relative_to_root, tied_names
from .safepickle.policy import DEFAULT_POLICY, Policy
from .transforms import Op, flags_for, plan_keys

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any


@record
class PairStats:
    max_abs: float
    rel: float  # ‖B − A‖ / ‖A‖; inf when A is all zeros and B is not
    cosine: float | None  # None when either side is all zeros
    identical: bool  # the same bytes
    close: bool  # within the tolerances


IDENTICAL = PairStats(0.0, 0.0, None, True, True)  # the same bytes: nothing computed, no cosine given


@record
class TensorDiff:
    key: str  # the name in B (in A when only A has it)
    a_key: str | None
    status: str  # identical, close, changed, shape, only-a, only-b, tied
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    stats: PairStats | None = None
    tied_to: str | None = None  # tied: the name whose tensor this one is, on the side that has both


@record
class DiffReport:
    a: Checkpoint
    b: Checkpoint
    rows: tuple[TensorDiff, ...]
    renamed_by: tuple[str, ...]  # the fix flags that map A's names onto B's ("--strip-module"), if any
    a_root: str | None
    b_root: str | None
    atol: float
    rtol: float
    bn_drift: tuple[str, ...] = ()  # BatchNorm layers whose running stats changed while their weights did not
    notes: tuple[str, ...] = field(default=())
    names_given: bool = False  # renamed_by is the user's --strip-prefix/--add-prefix/--rename, not the inference

    @property
    def same(self) -> bool:
        """The values: every pair identical, or within the tolerances."""
        return all(r.status in ("identical", "close", "tied") for r in self.rows)

    @property
    def unsafe_sides(self) -> tuple[str, ...]:
        """"A", "B": the sides that would run code under torch.load(weights_only=False) (a whole pickled model:
        its tensors are compared all the same)."""
        from .records import Verdict

        return tuple(side for side, ckpt in (("A", self.a), ("B", self.b)) if ckpt.verdict is not Verdict.SAFE)

    @property
    def exit_code(self) -> int:
        """0 when the checkpoints are the same and neither would run code; 1 otherwise (as diff(1), and as `scan`)."""
        return 0 if self.same and not self.unsafe_sides else 1

    def count(self, status: str) -> int:
        return sum(1 for r in self.rows if r.status == status)


_NUMPY = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4", "int16": "<i2",
          "int8": "i1", "uint8": "u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8", "bool": "?",
          "bfloat16": "<u2"}  # bfloat16: its bits, widened to float32 block by block
BLOCK = 1 << 15  # elements per float64 block: 256 KB each, so the arithmetic stays in the CPU's cache
WINDOW = 1 << 24  # bytes of a tensor mapped at a time, and of each file between drops: memory stays near two windows
FOLIO = 1 << 21  # the largest folio of the page cache one fault maps (a PMD on x86-64): what any read may map
SMALL = 1 << 16  # pairs up to this many bytes are compared as copies: cheaper than setting up two array views
PROBE = 64  # bytes at the start of a mapped pair compared by pread before the rest is compared on the maps
# The arithmetic reads a changed pair by pread, STAGE bytes a side at a time, into one buffer a side that stays in the
# CPU's cache (two processes' buffers fit its L3). Mapped, every page cost a fault and then a drop (0.12 s of kernel
# time a GB, measured: the copy costs about as much), and the widening to float64 read from memory, through 4 KB pages;
# staged, the half of a 1 GB full fine-tune one process computes took 0.34 s of CPU against 0.37.
STAGE = 1 << 21
RATIO = 1e4  # Σx² and Σy² of a block within this factor of each other: Σxy from them and Σ(y − x)² (_sums)
# The float64 arithmetic of a changed pair costs about twice reading it, and threads do not share it out here (the
# GIL: measured), so where the pairs to compare come to WORKER_AFTER bytes or more, a copy of this process forked at
# the first changed pair takes batches of pieces and reads and computes them itself, while this one compares bytes
# and computes the rest. (Forked only once 32 MB of changed pairs had gone by, it left this process alone with them
# for ~20 ms of a 1 GB full fine-tune; a fork that finds little to do costs ~1 ms.)
WORKER_AFTER = 1 << 25  # bytes of pairs (both sides): fewer are not worth a fork
BATCH = 1 << 24  # bytes (both sides) per message to the worker: a few ms of work against a ~0.1 ms round trip
# Near the end a batch is at most an eighth of the pairs left (down to LAST_BATCH), so the two processes end
# together: full batches left the worker up to IN_FLIGHT of them (~13 ms of arithmetic) once this one had none left
LAST_BATCH = 1 << 21
BATCH_PIECES = 256  # and at most this many pieces: answers stay far below a pipe's buffer, so the worker never
# blocks writing one while this process blocks writing it the next batch
IN_FLIGHT = 2  # batches queued at the worker: one in hand and one waiting, so it never idles on a round trip
WORKER_TIMEOUT = 60.0  # seconds of silence before the worker is given up on and its batches computed here
# Comparing the bytes costs about as much as reading both structures and importing NumPy, which come first; so for
# two files of one size (a fine-tune saved by the same code: its tensors at the same offsets) a forked child compares
# them at equal offsets, CHUNK by CHUNK, meanwhile, on the second core (_Ahead). A pair at one offset in both is then
# equal when every chunk inside it is, and its two ends (part-chunks) are: those few bytes are compared here.
AHEAD_AFTER = 1 << 26  # bytes a file: smaller ones are compared here faster than a fork and a pipe would take
CHUNK = 1 << 16  # bytes a flag: a pair's ends, compared here, are at most two chunks of it
AHEAD_PROBE = 1 << 26  # bytes the child compares before it stops if under one chunk in 16 in them was equal


def _mappable(t: TensorRecord) -> bool:
    st = t.storage  # a remote file's tensors are read through torch, from its data windows (readers/source.py)
    return (st is not None and type(st.file).__name__ != "RemotePath" and st.assembly is None and not st.deflated
            and t.is_contiguous and t.numel > 0 and t.dtype in _NUMPY)


def _pieces(ta: TensorRecord, tb: TensorRecord) -> list[tuple]:
    """The pair in pieces of at most WINDOW bytes a side, each (file A, offset A, dtype A, file B, offset B, dtype B,
    elements): plain values, so a piece can be sent to the worker, which maps the files itself."""
    size_a, size_b = element_size(ta.dtype), element_size(tb.dtype)
    step = WINDOW // max(size_a, size_b)
    fa, fb = intern(str(ta.storage.file)), intern(str(tb.storage.file))  # pickled once per message, not per piece
    oa, ob, numel = ta.file_offset or 0, tb.file_offset or 0, ta.numel
    if numel <= step:  # most pairs
        return [(fa, oa, ta.dtype, fb, ob, tb.dtype, numel)]
    return [(fa, oa + first * size_a, ta.dtype, fb, ob + first * size_b, tb.dtype, min(step, numel - first))
            for first in range(0, numel, step)]


def _piece_bytes(piece: tuple) -> int:
    return piece[6] * (element_size(piece[2]) + element_size(piece[5]))


class _Mapped:
    """Each file read once through the page cache: mapped where it is held still (readers/held.py: a file cut short
    under a map would end the process with SIGBUS), else read by pread into one reused buffer a side. A mapped pair's
    bytes are compared straight from the page cache (no copy), a piece at a time, and every WINDOW bytes read the
    file's pages are dropped from this process (MADV_DONTNEED: they stay in the page cache, this process just stops
    holding them), so memory does not grow with the files. The arithmetic reads its pairs by pread (windows), mapped
    or not. `holder` takes the leases (in the main process); a forked worker has none, and maps nothing."""

    def __init__(self, holder: Any = None) -> None:
        self.holder = holder
        self.maps: dict[str, Any] = {}  # path -> its mmap, or its file descriptor where it is read by pread
        self.read_since_drop: dict[str, int] = {}
        self.last_folios: dict[str, tuple[int, int]] = {}  # path -> the folios the last piece read of it lies in
        self.spans: dict[str, tuple[int, int]] = {}  # path -> (first byte, end) of what was read since the drop
        self.buffers: list[Any] = [None, None]  # side A's and side B's pread buffer
        self.descriptors: dict[str, int] = {}  # path -> a descriptor the arithmetic reads it by (windows)
        self.memcmp = _memcmp()
        self.memcmp_at = _libc_memcmp()  # (address, address, bytes) -> 0 when equal; None without libc
        self.addresses: dict[str, int] = {}
        self.views: list[Any] = []
        self.ahead: _Ahead | None = None  # the chunks a child has compared, where there is one

    def _file(self, path: str, nbytes: int, offset: int | None = None) -> Any:
        """The map (or the descriptor) of `path`, about to have `nbytes` more of it read (at `offset`: then what
        is counted is the folios the read maps that the last such read did not, see _folios). A drop covers the
        span read since the last one (its folios whole), not the whole map: madvise walks every page table of the
        range it is given, and over a 1 GB map each drop took 0.1-0.4 ms, 0.09 s of a 1 GB full fine-tune."""
        import mmap
        import os

        mm = self.maps.get(path)
        if mm is None:
            fd = os.open(path, os.O_RDONLY)
            if not (self.holder is not None and self.holder.hold(path)):
                self.maps[path] = fd
                return fd
            try:
                mm = self.maps[path] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
            self.read_since_drop[path] = 0
        if isinstance(mm, int):
            return mm
        if not nbytes:
            return mm
        if offset is None:  # somewhere: the next drop is of the whole map
            count, start, end = nbytes, 0, len(mm)
        else:
            count, start, end = self._folios(path, offset, nbytes), offset, offset + nbytes
        read, span = self.read_since_drop[path] + count, self.spans.get(path)
        if read > WINDOW and span is not None and hasattr(mm, "madvise"):
            first = span[0] - span[0] % FOLIO  # what earlier windows faulted in; re-read from the page cache if needed
            mm.madvise(mmap.MADV_DONTNEED, first, min(-(-span[1] // FOLIO) * FOLIO, len(mm)) - first)
            read, span = count, None
        self.spans[path] = (start, end) if span is None else (min(span[0], start), max(span[1], end))
        self.read_since_drop[path] = read
        return mm

    def _folios(self, path: str, offset: int, nbytes: int) -> int:
        """Bytes of `path` a read of `nbytes` at `offset` maps: a fault maps a whole folio of the page cache (up
        to FOLIO), so a piece of 100 KB can map 2 MB. Counted by its bytes, pieces far apart (one pair in eight of
        a file, say) mapped many times WINDOW between drops; counted by the folios they lie in (less those the last
        piece already counted: neighbours share theirs), memory stays near WINDOW a file."""
        first, last = offset // FOLIO, (offset + max(nbytes, 1) - 1) // FOLIO
        before_first, before_last = self.last_folios.get(path, (-1, -2))
        self.last_folios[path] = first, last
        return (last - first + 1 - max(0, min(last, before_last) - max(first, before_first) + 1)) * FOLIO

    def check(self, t: TensorRecord) -> None:
        import os

        key = str(t.storage.file)
        mm, start = self._file(key, 0), t.file_offset or 0
        size = os.fstat(mm).st_size if isinstance(mm, int) else len(mm)
        if start + t.nbytes > size:
            raise ReadError(f"{key}: {t.key} is cut short ({max(size - start, 0)} of {t.nbytes} bytes)")

    def _read(self, fd: int, offset: int, nbytes: int, side: int) -> Any:
        """`nbytes` at `offset` of a file read by pread, as a uint8 array over this side's buffer."""
        import os

        import numpy as np

        buffer = self.buffers[side]
        if buffer is None or buffer.size < nbytes:
            size = max(nbytes, STAGE)  # on a cache line's boundary, as _scratch's rows: the widening reads it
            raw = np.empty(size + 64, np.uint8)
            buffer = self.buffers[side] = raw[-raw.ctypes.data % 64:][:size]
        view, done = buffer[:nbytes], 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise ReadError(f"a file compared was cut short while it was read ({offset + done:,} bytes in)")
            done += got
        return view

    def _array(self, source: Any, offset: int, dtype: Any, count: int, side: int) -> Any:
        import numpy as np

        if isinstance(source, int):
            return self._read(source, offset, count * dtype.itemsize, side).view(dtype)
        return np.frombuffer(source, dtype, count, offset)

    def piece(self, piece: tuple) -> tuple[Any, Any]:
        """(A's part, B's part) of a piece as flat NumPy arrays of their dtypes, over the page cache."""
        import numpy as np

        fa, oa, da, fb, ob, db, count = piece
        code_a, code_b = np.dtype(_NUMPY[da]), np.dtype(_NUMPY[db])
        ma, mb = self._file(fa, count * code_a.itemsize, oa), self._file(fb, count * code_b.itemsize, ob)
        return self._array(ma, oa, code_a, count, 0), self._array(mb, ob, code_b, count, 1)

    def windows(self, piece: tuple):
        """(A's part, B's part) of a piece as flat NumPy arrays of their dtypes, STAGE bytes a side at a time (a
        whole number of BLOCKs: _sums cuts the same blocks as from the whole piece), read by pread into this
        side's buffer: each window is gone once the next is read."""
        import numpy as np

        fa, oa, da, fb, ob, db, count = piece
        code_a, code_b = np.dtype(_NUMPY[da]), np.dtype(_NUMPY[db])
        size_a, size_b = code_a.itemsize, code_b.itemsize
        fd_a, fd_b = self._descriptor(fa), self._descriptor(fb)
        step = max(STAGE // max(size_a, size_b) // BLOCK, 1) * BLOCK
        for first in range(0, count, step):
            n = min(step, count - first)
            yield (self._read(fd_a, oa + first * size_a, n * size_a, 0).view(code_a),
                   self._read(fd_b, ob + first * size_b, n * size_b, 1).view(code_b))

    def _descriptor(self, path: str) -> int:
        fd = self.descriptors.get(path)
        if fd is None:
            import os

            fd = self.maps.get(path)
            if not isinstance(fd, int):  # mapped (or not yet opened): a descriptor of its own, closed by close()
                fd = os.open(path, os.O_RDONLY)
            self.descriptors[path] = fd
        return fd

    def same_bytes(self, ta: TensorRecord, tb: TensorRecord) -> bool:
        import os

        if ta.dtype != tb.dtype:
            return False
        fa, fb = str(ta.storage.file), str(tb.storage.file)
        oa, ob, nbytes = ta.file_offset or 0, tb.file_offset or 0, ta.nbytes
        ma, mb = self._file(fa, 0), self._file(fb, 0)
        if isinstance(ma, int) or isinstance(mb, int) or self.memcmp_at is None:  # pread, or no libc: by pieces
            if nbytes <= SMALL:
                return bytes(self._bytes(ma, oa, nbytes, 0)) == bytes(self._bytes(mb, ob, nbytes, 1))
            return all(self.memcmp(*self.piece(p)) for p in _pieces(ta, tb))
        # Both mapped: libc's memcmp straight on the maps' addresses, a WINDOW at a time (no array views to set up)
        at_a, at_b = self.address(fa) + oa, self.address(fb) + ob
        inner = self.ahead.inner(fa, oa, fb, ob, nbytes) if self.ahead is not None else None
        if inner is not None:  # the chunks inside compared by the child: only the two ends are left to compare
            first, last = inner
            if first is False:
                return False
            head, tail = first - oa, oa + nbytes - last
            self._file(fa, nbytes, oa)  # counted whole: a fault maps a whole folio of the page cache (up to 2 MB)
            self._file(fb, nbytes, ob)
            return not (self.memcmp_at(at_a, at_b, head) or
                        self.memcmp_at(at_a + nbytes - tail, at_b + nbytes - tail, tail))
        # A changed pair nearly always differs in its first bytes (a fine-tune moves every element): two small
        # preads tell, where memcmp on the maps faulted in a folio of each (and dropped it later): the 1,000 pairs
        # of a 1 GB full fine-tune took 29 ms here, 6-9 ms so. Not for pairs up to SMALL: neighbours that small
        # share their folios, and two syscalls a pair cost 20,000 identical ones ~40 ms.
        if nbytes > SMALL and os.pread(self._descriptor(fa), PROBE, oa) != os.pread(self._descriptor(fb), PROBE, ob):
            return False
        for done in range(0, nbytes, WINDOW):
            n = min(WINDOW, nbytes - done)
            self._file(fa, n, oa + done)  # counts the window read, and drops what earlier windows faulted in
            self._file(fb, n, ob + done)
            if self.memcmp_at(at_a + done, at_b + done, n):
                return False
        return True

    def address(self, path: str) -> int:
        """Where the map of `path` starts in this process's memory."""
        base = self.addresses.get(path)
        if base is None:
            import numpy as np

            view = np.frombuffer(self.maps[path], np.uint8)  # a read-only map: ctypes alone cannot take its address
            base = self.addresses[path] = view.ctypes.data
            self.views.append(view)  # held until close(): the map cannot be closed under it, nor moved
        return base

    def _bytes(self, source: Any, offset: int, nbytes: int, side: int) -> Any:
        return self._read(source, offset, nbytes, side) if isinstance(source, int) else \
            memoryview(source)[offset:offset + nbytes]

    def close(self) -> None:
        import os

        self.views.clear()
        self.addresses.clear()
        for mm in self.maps.values():
            try:
                os.close(mm) if isinstance(mm, int) else mm.close()
            except BufferError:  # an array view still held by an exception's traceback: freed with it
                pass
        for fd in set(self.descriptors.values()) - {m for m in self.maps.values() if isinstance(m, int)}:
            os.close(fd)
        self.descriptors.clear()
        self.maps.clear()


def _libc_memcmp():
    """libc's memcmp(address, address, bytes), or None where there is no libc to call."""
    try:
        import ctypes

        libc_memcmp = ctypes.CDLL(None).memcmp
        libc_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        libc_memcmp.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc_memcmp


def _memcmp():
    """Equal bytes, at memory speed: libc's memcmp on the two arrays (NumPy's compare where there is no libc)."""
    import numpy as np

    libc_memcmp = _libc_memcmp()
    if libc_memcmp is None:
        return lambda x, y: x.nbytes == y.nbytes and np.array_equal(x.view(np.uint8), y.view(np.uint8))
    return lambda x, y: x.nbytes == y.nbytes and libc_memcmp(x.ctypes.data, y.ctypes.data, x.nbytes) == 0


def pair_stats(a: Any, b: Any, atol: float = 0.0, rtol: float = 0.0) -> PairStats:
    """Compare two torch tensors of one shape (a strided view, pieces of a sharded folder, a dtype NumPy lacks): the
    same figures _sums gives a mapped pair."""
    import torch

    def flat(t: Any) -> Any:
        if t.is_complex():  # real and imaginary parts, each an element: ‖Δ‖ and the cosine are the complex ones
            t = torch.view_as_real(t.resolve_conj())
        t = t.detach().reshape(-1).contiguous()
        try:
            return t.numpy()
        except TypeError:  # bfloat16, float8: NumPy has no such dtype
            return t.to(torch.float64).numpy()

    identical = a.dtype == b.dtype and a.shape == b.shape and (  # bytes: a view's reshape may keep its stride
        a.numel() == 0 or torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                      b.contiguous().view(-1).view(torch.uint8))
        if a.dtype != torch.bool else torch.equal(a, b))
    if identical:
        return IDENTICAL
    return _stats([_sums([(flat(a), flat(b))], (False, False), atol, rtol, _scratch())])


def _scratch() -> list:
    """The two float64 blocks _sums works in, each on a 64-byte boundary (a cache line, one AVX-512 vector):
    NumPy only aligns to 16 bytes, and on such blocks the subtraction and the dot products ran up to twice as slow
    (_sums: 1.8 ns an element against 1.3). Kept for a whole diff: fresh 256 KB arrays for every pair came as
    fresh pages from the kernel each time, and faulting them in doubled the system time of a diff."""
    import numpy as np

    row = BLOCK * 8 + 64  # a row and a cache line: the next row starts aligned too
    raw = np.empty(2 * row + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return [raw[start + i * row:start + i * row + BLOCK * 8].view(np.float64) for i in range(2)]


_AMAX: list = []  # [OpenBLAS's damax, or None]: looked for once a process (a forked worker inherits it)


def _amax() -> Any:
    """OpenBLAS's damax extension, (elements, address, 1) -> max |x| of a float64 block in one pass: 0.14 ns an
    element where NumPy's max and min of the block took 0.31 between them. None where the BLAS loaded has no such
    function, or where it fails a probe (its integer width, say): NumPy's max and min are used then."""
    if _AMAX:
        return _AMAX[0]
    found = None
    for path in openblas_libraries():
        try:
            import ctypes

            import numpy as np

            library = ctypes.CDLL(path)
            for name in ("scipy_cblas_damax64_", "cblas_damax64_", "cblas_damax"):
                damax = getattr(library, name, None)
                if damax is None:
                    continue
                damax.restype, damax.argtypes = ctypes.c_double, [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
                probe = np.array([-4.0, 1.0, -9.0, 2.5])
                if damax(2, probe.ctypes.data, 1) == 4.0 and damax(4, probe.ctypes.data, 1) == 9.0:
                    found = damax
                    break
        except (OSError, AttributeError, TypeError):
            continue
        if found is not None:
            break
    _AMAX.append(found)
    return found


def _sums(windows, bf16: tuple[bool, bool], atol: float, rtol: float, scratch: Any) -> tuple:
    """(max |y − x|, Σ(y − x)², Σx², Σy², Σxy, every element within atol + rtol·|x|) in float64 over (x, y)
    windows of two flat arrays: BLAS dot products over cache-sized blocks, NaN equal to NaN, an inf only equal to
    the same inf. bf16[i]: that side holds bfloat16 bits (uint16), widened here block by block.

    The work is bound by the cache, and each NumPy call costs about a microsecond besides it, so a block is
    widened into two rows u and v; Σx², Σy², Σxy are taken while each row is fresh in the cache; y − x is then
    computed over v in place (a third row pushed a block out of a 512 KB L2: 1.7 ns an element against 1.9), and
    its largest |y − x| is one pass of OpenBLAS's damax (_amax) where NumPy's max and min took two. Σxy is no pass
    of its own: (Σx² + Σy² − Σ(y − x)²) / 2, where the two norms are within RATIO of each other and Σ(y − x)² is at
    most half of Σx² + Σy² (Σxy then at least a quarter of it: the subtraction keeps its digits, a few ulps of a
    dot product's); a block whose norms are further apart, or whose pair is far from alike (nearly orthogonal, whose
    cosine near 0 the subtraction would cancel away), takes the dot product (that pass was 7% of a 1 GB full
    fine-tune, a pair of alike blocks). Full blocks use the rows whole (no slicing), and the ndarray methods
    (`u.dot(u)`: half the cost of `u @ u` on a block).
    A block whose Σ(y − x)² is NaN or inf is redone the careful way, its y widened again."""
    import numpy as np

    u, v = scratch
    block = u.size
    amax = _amax()
    at_v = v.ctypes.data if amax is not None else 0  # every block of y − x starts there
    copyto, subtract, largest, smallest = np.copyto, np.subtract, np.maximum.reduce, np.minimum.reduce
    plain = not (bf16[0] or bf16[1])
    max_abs = diff_sq = a_sq = b_sq = dot = 0.0
    close = bool(atol or rtol)
    inf = float("inf")
    with np.errstate(all="ignore"):
        for x, y in windows:
            size = x.size
            for start in range(0, size, block):
                n = size - start
                if n >= block:
                    n, uu, vv = block, u, v
                else:
                    uu, vv = u[:n], v[:n]
                if plain:
                    copyto(uu, x[start:start + n], casting="unsafe")
                    block_a = float(uu.dot(uu))
                    copyto(vv, y[start:start + n], casting="unsafe")
                else:
                    _widen(x[start:start + n], bf16[0], uu)
                    block_a = float(uu.dot(uu))
                    _widen(y[start:start + n], bf16[1], vv)
                block_b = float(vv.dot(vv))
                dd = subtract(vv, uu, out=vv)  # v holds y − x from here on
                block_sq = float(dd.dot(dd))
                if block_sq != block_sq or block_sq == inf:  # NaN or inf somewhere: the careful way
                    vv = np.empty(n)
                    _widen(y[start:start + n], bf16[1], vv)
                    eq = (uu == vv) | (np.isnan(uu) & np.isnan(vv))  # NaN equal to NaN, inf to the same inf
                    dd = np.where(eq, 0.0, dd)
                    if not np.isfinite(dd).all():
                        max_abs = inf
                    uu, vv = np.where(np.isfinite(uu), uu, 0.0), np.where(np.isfinite(vv), vv, 0.0)
                    block_sq = inf if max_abs == inf else float(dd.dot(dd))
                    block_a, block_b, block_ab = float(uu.dot(uu)), float(vv.dot(vv)), float(uu.dot(vv))
                    if close:
                        close = bool(np.all(eq | (np.abs(dd) <= atol + rtol * np.abs(uu))))
                    if max_abs != inf:
                        max_abs = max(max_abs, float(largest(dd)), -float(smallest(dd)))
                else:  # every element finite: their squares summed to a finite number
                    if block_a <= block_b * RATIO and block_b <= block_a * RATIO \
                            and block_sq + block_sq <= block_a + block_b < inf:
                        block_ab = (block_a + block_b - block_sq) * 0.5  # Σxy from 2Σxy = Σx² + Σy² − Σ(y − x)²
                    else:  # norms far apart (one side all zeros, say), a pair far from alike (x·y near 0 or below:
                        # the subtraction cancels Σxy's digits) or Σx² + Σy² past float64: that sum would lose it
                        w = np.empty(n)
                        _widen(y[start:start + n], bf16[1], w)
                        block_ab = float(uu.dot(w))
                    most = amax(n, at_v, 1) if amax is not None else max(float(largest(dd)), -float(smallest(dd)))
                    if max_abs != inf:
                        max_abs = max(max_abs, most)
                    if close and not (most <= atol and 0 <= rtol < inf):  # then |y − x| <= atol <= atol + rtol·|x|
                        tolerance = np.abs(uu, out=uu)  # x and y − x are done with: the test is worked in place
                        np.multiply(tolerance, rtol, out=tolerance)
                        np.add(tolerance, atol, out=tolerance)
                        close = bool(np.less_equal(np.abs(dd, out=dd), tolerance).all())
                diff_sq += block_sq
                a_sq += block_a
                b_sq += block_b
                dot += block_ab
    return max_abs, diff_sq, a_sq, b_sq, dot, close


def _stats(parts: list[tuple]) -> PairStats:
    """One pair's figures from the _sums of its pieces, added exactly (math.fsum): the same figures whichever
    process computed which piece."""
    inf = float("inf")
    if len(parts) == 1:  # most pairs: one piece, nothing to add
        max_abs, diff_sq, a_sq, b_sq, dot, close = parts[0]
    else:
        max_abs = max(p[0] for p in parts)
        diff_sq, a_sq, b_sq, dot = (_total([p[i] for p in parts]) for i in range(1, 5))
        close = all(p[5] for p in parts)
    norm_a = a_sq ** 0.5
    rel = 0.0 if diff_sq == 0 else (diff_sq ** 0.5 / norm_a if norm_a else inf)
    if rel != rel:
        rel = inf
    cosine = dot / (norm_a * b_sq ** 0.5) if norm_a and b_sq and dot == dot else None
    if cosine is not None:  # the same values in two dtypes gave 1.0000000000000002: a cosine is within ±1
        cosine = min(1.0, max(-1.0, cosine))
    return PairStats(max_abs, rel, cosine, False, close and max_abs != inf)


def _total(values: list[float]) -> float:
    from math import fsum

    try:
        return fsum(values)
    except (ValueError, OverflowError):  # inf − inf, or finite pieces past float64's range: inf or NaN either way
        return sum(values)


def _widen(src: Any, bf16: bool, out: Any) -> None:
    import numpy as np

    if bf16:
        src = (src.astype(np.uint32) << 16).view(np.float32)
    np.copyto(out, src, casting="unsafe")


def _piece_sums(mapped: _Mapped, piece: tuple, atol: float, rtol: float, scratch: Any) -> tuple:
    return _sums(mapped.windows(piece), (piece[2] == "bfloat16", piece[5] == "bfloat16"), atol, rtol, scratch)


class _Figures:
    """The _sums of every changed pair's pieces, in this process or — where the pairs still to compare come to
    WORKER_AFTER bytes (`to_compare`, which the caller counts down) — shared with one worker, forked at the first
    changed pair: while the worker has fewer than IN_FLIGHT batches, pieces are gathered into the next batch for it;
    otherwise this process computes them itself, so both cores stay busy. Anything wrong with the worker (it died,
    went silent, raised) only means its batches are computed here after all."""

    def __init__(self, mapped: _Mapped, atol: float, rtol: float, to_compare: int = 0) -> None:
        self.mapped, self.atol, self.rtol, self.to_compare = mapped, atol, rtol, to_compare
        self.scratch = _scratch()
        self.sums: list[tuple | None] = []  # by piece number
        self.batch: list[tuple[int, tuple]] = []  # (piece number, piece) for the worker's next batch
        self.batch_bytes = 0
        self.worker: _Worker | None = None
        self.no_worker = False  # no fork here, or the worker failed: everything in this process from now on

    def add(self, ta: TensorRecord, tb: TensorRecord) -> PairStats | range:
        """The pair's figures if this process computed all its pieces now, else the numbers of its pieces, for
        stats() once finish() has run."""
        if not self._worker_running():  # the usual case: every piece here, now
            return _stats([_piece_sums(self.mapped, p, self.atol, self.rtol, self.scratch) for p in _pieces(ta, tb)])
        first, queued = len(self.sums), False
        batch = min(BATCH, max(self.to_compare // 8, LAST_BATCH))
        for piece in _pieces(ta, tb):
            number, size = len(self.sums), _piece_bytes(piece)
            self.sums.append(None)
            if self._worker_wants_more():
                queued = True
                self.batch.append((number, piece))
                self.batch_bytes += size
                if self.batch_bytes >= batch or len(self.batch) >= BATCH_PIECES:
                    self._send()
            else:
                self.sums[number] = _piece_sums(self.mapped, piece, self.atol, self.rtol, self.scratch)
        numbers = range(first, len(self.sums))
        return numbers if queued else self.stats(numbers)

    def stats(self, numbers: range) -> PairStats:
        return _stats([self.sums[i] for i in numbers])

    def finish(self) -> None:
        """The last batch computed here (the worker has its own queue), then every answer from the worker."""
        for number, piece in self.batch:
            self.sums[number] = _piece_sums(self.mapped, piece, self.atol, self.rtol, self.scratch)
        self.batch, self.batch_bytes = [], 0
        if self.worker is not None:
            self._receive(wait=True)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def _worker_running(self) -> bool:
        """Whether there is a worker, forking it (at the first changed pair) where there is enough to compare."""
        if self.worker is None and not self.no_worker and self.to_compare >= WORKER_AFTER:
            self.no_worker = not _can_fork()
            try:
                self.worker = None if self.no_worker else _Worker(self.atol, self.rtol)
            except OSError:  # no processes or pipes left
                self.no_worker = True
        return self.worker is not None

    def _worker_wants_more(self) -> bool:
        if self.worker is not None:
            self._receive(wait=False)
        return self.worker is not None and len(self.worker.in_flight) < IN_FLIGHT

    def _send(self) -> None:
        try:
            self.worker.send(self.batch)
        except Exception:  # the worker is gone (EPIPE): anything here only costs the worker, never the figures
            self._fail()
        self.batch, self.batch_bytes = [], 0

    def _receive(self, wait: bool) -> None:
        try:
            for numbers, sums in self.worker.answers(wait):
                for number, s in zip(numbers, sums):
                    self.sums[number] = s
        except Exception:  # it died, closed the pipe, went silent or raised
            self._fail()

    def _fail(self) -> None:
        """Give up on the worker: what it held, and the batch gathered for it, are computed here."""
        worker, self.worker, self.no_worker = self.worker, None, True
        todo = [*((n, p) for batch in worker.in_flight for n, p in batch), *self.batch]
        worker.close()
        self.batch, self.batch_bytes = [], 0
        for number, piece in todo:
            self.sums[number] = _piece_sums(self.mapped, piece, self.atol, self.rtol, self.scratch)


class _Ahead:
    """A forked child that compares two files of one size at equal offsets, CHUNK by CHUNK, and writes one flag a
    chunk (1: equal) down a pipe, from the start on, while this process imports NumPy and reads both structures.
    It maps both files itself (held still by this process's leases: it is killed before they are let go of), drops
    each WINDOW once compared, ignores Ctrl-C, and never returns into the caller's code. Anything wrong with it (it
    died, went silent) only means the pairs are compared here after all."""

    def __init__(self, path_a: str, path_b: str, size: int) -> None:
        import os

        read_r, write_w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(read_r)
            os.close(write_w)
            raise
        if pid == 0:
            code = 1
            try:
                import signal

                signal.signal(signal.SIGINT, signal.SIG_IGN)
                os.close(read_r)
                _compare_chunks(path_a, path_b, size, write_w)
                code = 0
            finally:
                os._exit(code)
        os.close(write_w)
        self.pid, self.fd, self.size = pid, read_r, size
        self.paths = (os.path.realpath(path_a), os.path.realpath(path_b))
        self.pairs: dict[tuple[str, str], bool] = {}  # (a file, b file) as records name them -> the two compared
        self.flags = bytearray()
        self.failed = False

    @classmethod
    def start(cls, a_path: Any, b_path: Any, holder: Any) -> _Ahead | None:
        """The child, for two local files of one size past AHEAD_AFTER, held still, with a second core to run on."""
        import os

        path_a, path_b = str(a_path), str(b_path)
        try:
            if not (os.path.isfile(path_a) and os.path.isfile(path_b)):
                return None
            size = os.path.getsize(path_a)
            if size != os.path.getsize(path_b) or size < AHEAD_AFTER or not _can_fork() or not _idle_core():
                return None
            if _libc_memcmp() is None or not (holder.hold(path_a) and holder.hold(path_b)):
                return None
            return cls(path_a, path_b, size)
        except OSError:  # no processes or pipes left, or the files went away: read and compared here
            return None

    def inner(self, fa: str, oa: int, fb: str, ob: int, nbytes: int) -> tuple | None:
        """For a pair at one offset of the two files compared: (False, None) when a chunk inside it differs, else
        (where its first whole chunk starts, where its last ends), once the child has got that far; None when
        the child cannot tell (another pair of files, other offsets, no whole chunk inside, the child failed)."""
        if self.failed or oa != ob or not self._compared(fa, fb):
            return None
        first, last = -(-oa // CHUNK), (oa + nbytes) // CHUNK
        if first >= last or last * CHUNK > self.size:
            return None
        if not self._read_up_to(last):
            return None
        if 0 in self.flags[first:last]:
            return False, None
        return first * CHUNK, last * CHUNK

    def _compared(self, fa: str, fb: str) -> bool:
        known = self.pairs.get((fa, fb))
        if known is None:
            import os

            known = self.pairs[fa, fb] = (os.path.realpath(fa), os.path.realpath(fb)) == self.paths
        return known

    def _read_up_to(self, count: int) -> bool:
        """Whether the flags of the first `count` chunks are in, waiting for them (WORKER_TIMEOUT at most)."""
        import os
        import select

        while len(self.flags) < count:
            try:
                if not select.select([self.fd], [], [], WORKER_TIMEOUT)[0]:
                    raise OSError("no answer")
                got = os.read(self.fd, 1 << 16)
            except OSError:
                got = b""
            if not got:  # it died, or went silent: the rest is compared here
                self.failed = True
                self.close()
                return False
            self.flags += got
        return True

    def close(self) -> None:
        """Stopped for good (killed, not waited for: it may still be comparing), its pipe closed."""
        import os
        import signal

        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            if os.waitpid(self.pid, os.WNOHANG)[0] == 0:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _idle_core() -> bool:
    """Whether a core is free for the child now: fewer threads runnable on the machine (this one among them) than
    cores. On a busy machine the child only takes turns with this process, and it costs about 0.1 s more CPU for a
    1 GB pair than the compare it saves here (its faults, its loop over chunks, the ends compared twice)."""
    runnable = _runnable()
    return runnable is None or runnable < workers()


def _runnable() -> int | None:
    """Threads runnable on the machine at this moment (Linux's /proc/loadavg), None where that cannot be read. Not
    the load average: over a minute it counts a benchmark's own back-to-back runs as load."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def _compare_chunks(path_a: str, path_b: str, size: int, out: int) -> None:
    """The child's work: one flag a CHUNK of the two files (1: the same bytes), a WINDOW's flags a write; it stops
    early where under one chunk in 16 of the first AHEAD_PROBE bytes was equal (its flags would save little)."""
    import ctypes
    import mmap
    import os

    maps = []
    for path in (path_a, path_b):
        fd = os.open(path, os.O_RDONLY)
        try:  # a private map: ctypes takes the address of a writable buffer only (nothing is ever written)
            maps.append(mmap.mmap(fd, size, access=mmap.ACCESS_COPY))
        finally:
            os.close(fd)
    at_a, at_b = (ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps)
    memcmp = _libc_memcmp()
    equal = seen = 0
    probing = True
    for start in range(0, size, WINDOW):
        if probing and start >= AHEAD_PROBE:
            probing = False
            if equal * 16 < seen:  # next to nothing equal: a full fine-tune, whose pairs that process finds
                return  # different in their first bytes; the pipe closes, and it compares them itself
        end = min(start + WINDOW, size)
        flags = bytes(memcmp(at_a + i, at_b + i, min(CHUNK, end - i)) == 0 for i in range(start, end, CHUNK))
        equal, seen = equal + flags.count(1), seen + len(flags)
        data = memoryview(flags)
        while data:
            data = data[os.write(out, data):]
        for m in maps:
            m.madvise(mmap.MADV_DONTNEED, start, end - start)


def _can_fork() -> bool:
    """A second CPU for the worker to run on, and a process that may fork (pool.can_fork)."""

    return workers() > 1 and can_fork()


class _WorkerFailed(Exception):
    pass


class _Worker:
    """A forked copy of this process that answers batches of pieces with their _sums, in order, over two pipes
    (length-prefixed pickles). It reads the files itself, by pread, as this process's arithmetic does
    (_Mapped.windows: a file cut short then is a short read, never SIGBUS, so it needs no lease). It ignores Ctrl-C
    (the parent handles it and closes the pipe), exits when the pipe closes or it is killed, and never returns into
    the caller's code."""

    def __init__(self, atol: float, rtol: float) -> None:
        import os

        fds: list[int] = []
        try:
            task_r, task_w = os.pipe()
            fds += (task_r, task_w)
            answer_r, answer_w = os.pipe()
            fds += (answer_r, answer_w)
            pid = os.fork()
        except OSError:  # out of processes or file descriptors
            for fd in fds:
                os.close(fd)
            raise
        if pid == 0:  # the worker
            code = 1
            try:
                import signal

                signal.signal(signal.SIGINT, signal.SIG_IGN)
                os.close(task_w)
                os.close(answer_r)
                _serve(task_r, answer_w, atol, rtol)
                code = 0
            finally:
                os._exit(code)  # no atexit handlers, no flushing the parent's buffered output twice
        os.close(task_r)
        os.close(answer_w)
        self.pid, self.task_w, self.answer_r = pid, task_w, answer_r
        self.in_flight: list[list[tuple[int, tuple]]] = []  # batches sent and not yet answered, oldest first

    def send(self, batch: list[tuple[int, tuple]]) -> None:
        _write_message(self.task_w, [piece for _, piece in batch])
        self.in_flight.append(batch)

    def answers(self, wait: bool):
        """(piece numbers, their sums) for each batch answered so far; with `wait`, for every batch in flight."""
        import select

        while self.in_flight:
            if not select.select([self.answer_r], [], [], WORKER_TIMEOUT if wait else 0)[0]:
                if wait:
                    raise _WorkerFailed("no answer")
                return
            sums = _read_message(self.answer_r)
            if sums is None:  # the worker raised: its batch is redone here, where the error (if any) is reported
                raise _WorkerFailed("raised")
            if len(sums) != len(self.in_flight[0]):
                raise _WorkerFailed("a short answer")
            batch = self.in_flight.pop(0)
            yield [number for number, _ in batch], sums

    def close(self) -> None:
        """Stopped for good: by the time this is called it has nothing left to do, or is being given up on (it may
        be stuck), so it is killed rather than waited for."""
        import os
        import signal

        for fd in (self.task_w, self.answer_r):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            if os.waitpid(self.pid, os.WNOHANG)[0] == 0:  # still ours and running: its pid cannot be reused yet
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        except ChildProcessError:  # already reaped by someone else
            pass


def _serve(task_r: int, answer_w: int, atol: float, rtol: float) -> None:
    """The worker's loop: a batch of pieces in, their sums out (None if anything went wrong), until EOF."""
    mapped, scratch = _Mapped(), _scratch()
    while True:
        try:
            batch = _read_message(task_r)
        except EOFError:
            return
        try:
            answer = [_piece_sums(mapped, piece, atol, rtol, scratch) for piece in batch]
        except Exception:
            answer = None
        _write_message(answer_w, answer)


def _write_message(fd: int, obj: Any) -> None:
    import os
    import pickle

    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(len(data).to_bytes(8, "little") + data)
    while data:
        data = data[os.write(fd, data):]


def _read_message(fd: int) -> Any:
    import pickle

    return pickle.loads(_read_exactly(fd, int.from_bytes(_read_exactly(fd, 8), "little")))


def _read_exactly(fd: int, n: int) -> bytes:
    import os

    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def compared_root(ckpt: Checkpoint) -> str:
    """Where a side's tensors are compared from: its state_dict, or the whole file when it holds none (an
    optimizer's state_dict, RNG states), whose tensors would otherwise go uncompared and the two files be called
    identical."""
    return "" if ckpt.state_dict_root is None else ckpt.state_dict_root


def match_names(a: Checkpoint, b: Checkpoint, b_path: str,
           policy: Policy = DEFAULT_POLICY) -> tuple[dict[str, str], tuple[str, ...], str | None]:
    """A's state_dict names → B's: the same names when they are, else the renames `inspect A --model B` infers."""
    a_root = compared_root(a)
    a_keys = [t.key for t in relative_to_root(a.tensors, a_root)]
    b_keys = {t.key for t in relative_to_root(b.tensors, compared_root(b))}
    if not a_keys or set(a_keys) & b_keys == set(a_keys) or not b_keys:
        return {k: k for k in a_keys}, (), a_root
    from .compare import compare_checkpoint  # compare, modelspec: ~40 ms, only when names must be matched
    from .modelspec import keys_from_spec

    comparison = compare_checkpoint(a, keys_from_spec(b_path, policy=policy))
    root = comparison.fix_root if comparison.fix_root is not None else comparison.state_dict_root
    if root is None:
        root = a_root
    if root != a_root:
        a_keys = [t.key for t in a.tensors if root == "" or t.key.startswith(root + ".")]
        a_keys = [k[len(root) + 1:] if root else k for k in a_keys]
    renames = dict(comparison.renames)
    mapping = {k: renames.get(k, k) for k in a_keys}
    # The fix's flags that map names, not the whole fix line: its --drop and --model … --allow-missing leave keys
    # on one side, which the table shows as such.
    select = ["--select", root] if root else []
    flags = tuple(select + flags_for([t for t in comparison.transforms if t.op is not Op.DROP])) if renames else ()
    return mapping, flags, root


def diff_checkpoints(a_path: str | Path, b_path: str | Path, *, atol: float = 0.0, rtol: float = 0.0,
                     transforms: tuple = (), progress=None, policy: Policy = DEFAULT_POLICY) -> DiffReport:
    """`transforms` (fix's --strip-prefix/--add-prefix/--rename) map A's names onto B's instead of the inference.
    Both files are read under `policy` (the defaults unless passed)."""
    from .tensordata import load_tensor  # torch: ~1 s, imported when values are compared

    with Holder() as holder:  # the files are let go of once every child is dead and the maps are closed
        ahead = _Ahead.start(a_path, b_path, holder)  # first: a fork is cheapest before NumPy is loaded
        try:
            return _diff(a_path, b_path, atol, rtol, transforms, progress, policy, load_tensor, holder, ahead)
        finally:
            if ahead is not None:
                ahead.close()


def _diff(a_path: str | Path, b_path: str | Path, atol: float, rtol: float, transforms: tuple, progress,
          policy: Policy, load_tensor, holder: Holder, ahead: _Ahead | None) -> DiffReport:
    import numpy  # noqa: F401  (loaded now, when values are compared, so that one_blas_thread finds its OpenBLAS)

    a, b = read_checkpoint(a_path, policy=policy), read_checkpoint(b_path, policy=policy)
    for ckpt in (a, b):
        ckpt.refuse_if_unsafe("compare it", code_too=False)
        ckpt.refuse_values("compare its values")
    if transforms:
        a_root = compared_root(a)
        mapping = dict(plan_keys([t.key for t in relative_to_root(a.tensors, a_root)], list(transforms)).mapping)
        flags = tuple(f for t in transforms for f in t.flags())
    else:
        mapping, flags, a_root = match_names(a, b, str(b_path), policy)
    a_tensors = {t.key: t for t in relative_to_root(a.tensors, a_root)}
    b_tensors = {t.key: t for t in relative_to_root(b.tensors, compared_root(b))}
    real = (a_tensors, b_tensors)  # each file's own names: a header's record of a tie makes no tie (_stored_once)
    # a name a safetensors side holds once (fix's ckpt_doctor.tied) is compared as the tensor it is, where the other
    # side has that name: an untied copy against its tied export is the same weights
    recorded = b.recorded_ties(compared_root(b))
    if recorded:
        b_tensors, targets = dict(b_tensors), set(mapping.values())
        for alias, key in recorded:
            if alias not in b_tensors and key in b_tensors and alias in targets:
                b_tensors[alias] = b_tensors[key]
    recorded = a.recorded_ties(a_root)
    if recorded:
        a_tensors = dict(a_tensors)
        for alias, key in recorded:
            if alias not in a_tensors and key in a_tensors and alias in b_tensors and alias not in mapping:
                a_tensors[alias] = a_tensors[key]
                mapping[alias] = alias
    bits = (_bits_under(a, a_root), _bits_under(b, compared_root(b)))
    rows: list[TensorDiff] = []
    done: set[str] = set()
    with one_blas_thread():
        mapped = _Mapped(holder)
        mapped.ahead = ahead
        pairs = ((a_tensors.get(a_key), b_tensors.get(b_key)) for a_key, b_key in mapping.items())
        to_compare = sum(ta.nbytes + tb.nbytes for ta, tb in pairs if ta is not None and tb is not None)
        figures = _Figures(mapped, atol, rtol, to_compare)
        pending: dict[int, range] = {}  # row → its pieces, for pairs whose figures are still being computed
        try:
            for i, (a_key, b_key) in enumerate(mapping.items()):
                ta, tb = a_tensors.get(a_key), b_tensors.get(b_key)
                if ta is None:
                    continue
                if tb is None:
                    rows.append(TensorDiff(a_key, a_key, "only-a", ta.shape, None, ta.dtype, None))
                    continue
                done.add(b_key)
                row, pieces = _pair(b_key, a_key, ta, tb, atol, rtol, load_tensor, mapped, figures,
                                    (bits[0].get(a_key, ""), bits[1].get(b_key, "")))
                figures.to_compare -= ta.nbytes + tb.nbytes
                if pieces is not None:
                    pending[len(rows)] = pieces
                rows.append(row)
                if progress is not None:
                    progress(i + 1, len(mapping))
            figures.finish()
            for at, pieces in pending.items():
                r, stats = rows[at], figures.stats(pieces)
                rows[at] = TensorDiff(r.key, r.a_key, "close" if stats.close else "changed", r.shape_a, r.shape_b,
                                      r.dtype_a, r.dtype_b, stats)
        finally:
            figures.close()
            if ahead is not None:
                ahead.close()
            mapped.close()
    rows += [TensorDiff(k, None, "only-b", None, t.shape, None, t.dtype) for k, t in b_tensors.items() if k not in done]
    rows = _stored_once(rows, *real)
    return DiffReport(a, b, tuple(rows), flags, a_root, compared_root(b), atol, rtol, tuple(_bn_drift(rows)),
                      names_given=bool(transforms))


def _bits_under(ckpt: Checkpoint, root: str | None) -> dict[str, str]:
    """Checkpoint.value_bits keyed as relative_to_root keys the tensors under `root`."""
    if not ckpt.value_bits:
        return {}
    prefix = root + "." if root else ""
    return {k[len(prefix):]: v for k, v in ckpt.value_bits.items() if k.startswith(prefix)}


def _stored_once(rows: list[TensorDiff], a_tensors: dict[str, TensorRecord],
                 b_tensors: dict[str, TensorRecord]) -> list[TensorDiff]:
    """A name one side holds as the tensor of another (tied weights: lm_head.weight, embed.weight) and the other side
    lacks, where that tensor was compared under the other name: `tied`, not a difference. safetensors stores a
    tied tensor once (fix, save_pretrained), so a tied model and its safetensors copy are the same weights. The
    tensors are each file's own, never a header's record of a tie (a header alone makes no tie)."""
    if not any(r.status in ("only-a", "only-b") for r in rows):
        return rows
    compared = [r for r in rows if r.stats is not None]
    sides = {"only-a": (_tie_groups(a_tensors), {r.a_key for r in compared}),
             "only-b": (_tie_groups(b_tensors), {r.key for r in compared})}
    out = []
    for r in rows:
        if r.status in sides:
            groups, seen = sides[r.status]
            name = r.a_key if r.status == "only-a" else r.key
            partner = next((k for k in groups.get(name, ()) if k != name and k in seen), None)
            if partner is not None:
                r = replace(r, status="tied", tied_to=partner)
        out.append(r)
    return out


def _tie_groups(tensors: dict[str, TensorRecord]) -> dict[str, tuple[str, ...]]:
    """Each name of a tied group (the names of one tensor) → the group's names."""
    names: dict[str, list[str]] = {}
    for alias, key in tied_names(tensors.items()).items():
        names.setdefault(key, [key]).append(alias)
    return {k: tuple(group) for group in names.values() for k in group}


def _pair(key: str, a_key: str, ta: TensorRecord, tb: TensorRecord, atol: float, rtol: float, load,
          mapped: _Mapped, figures: _Figures, bits: tuple[str, str] = ("", "")) -> tuple[TensorDiff, range | None]:
    """One pair, read from the page cache when both are plain runs of bytes (the bytes first: most pairs stop at
    that compare), else through torch (a strided view, pieces of a sharded folder, a dtype NumPy lacks, a lazy
    conjugate view: `bits`, each side's). A changed pair with pieces queued for the worker comes back without its
    figures, and the numbers of the pieces that will give them (figures.stats, once figures.finish has run)."""
    if ta.shape != tb.shape:
        return TensorDiff(key, a_key, "shape", ta.shape, tb.shape, ta.dtype, tb.dtype), None
    if any(bits):
        from .tensordata import with_bits  # torch: loaded with load_tensor already, only for a lazy view

        stats = pair_stats(with_bits(load(ta), bits[0]), with_bits(load(tb), bits[1]), atol, rtol)
    elif _mappable(ta) and _mappable(tb):
        mapped.check(ta)
        mapped.check(tb)
        if mapped.same_bytes(ta, tb):
            stats = IDENTICAL
        else:
            stats = figures.add(ta, tb)
            if isinstance(stats, range):  # pieces queued for the worker
                return TensorDiff(key, a_key, "changed", ta.shape, tb.shape, ta.dtype, tb.dtype), stats
    else:
        stats = pair_stats(load(ta), load(tb), atol, rtol)
    status = "identical" if stats.identical else "close" if stats.close else "changed"
    return TensorDiff(key, a_key, status, ta.shape, tb.shape, ta.dtype, tb.dtype, stats), None


def _bn_drift(rows: list[TensorDiff]) -> list[str]:
    """Layers with running statistics that moved while their affine weights stayed bit-identical: a frozen
    BatchNorm left in train mode (requires_grad off does not stop the running averages)."""
    by_key = {r.key: r for r in rows}
    layers = []
    for r in rows:
        if not r.key.endswith("running_mean"):
            continue
        layer = r.key[: -len("running_mean")].rstrip(".")
        prefix = layer + "." if layer else ""
        stats = [by_key.get(prefix + n) for n in ("running_mean", "running_var")]
        weights = [by_key.get(prefix + n) for n in ("weight", "bias") if prefix + n in by_key]
        moved = any(s is not None and s.status in ("changed", "close") and not (s.stats and s.stats.identical)
                    for s in stats)
        if moved and weights and all(w.status == "identical" for w in weights):
            layers.append(layer or "(root)")
    return layers


def largest_changes(rows: list[TensorDiff]) -> list[TensorDiff]:
    """The pairs whose values moved, largest relative change first; those whose A was all zeros (an infinite
    relative change: a BatchNorm's running_mean, a counter) after every finite one. A pair cast to another dtype
    with its values kept (cast_only) did not move."""
    moved = [r for r in rows if r.stats is not None and not r.stats.identical and not cast_only(r)]
    return sorted(moved, key=lambda r: (r.stats.rel == float("inf"), -r.stats.rel, -r.stats.max_abs))


def cast_only(r: TensorDiff) -> bool:
    """A pair whose dtype changed and whose values did not (float16 → float32: every value kept exactly)."""
    return r.dtype_a != r.dtype_b and r.stats is not None and r.stats.max_abs == 0 and r.stats.rel == 0


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 64) -> str:
    """Relative change over depth, one character per entry (the largest of each run of entries past `width`),
    scaled to the largest finite one; `!` where A was all zeros and B is not (an infinite relative change)."""
    if len(values) > width:
        step = len(values) / width
        values = [max(values[int(i * step):max(int((i + 1) * step), int(i * step) + 1)]) for i in range(width)]
    finite = [v for v in values if v == v and v != float("inf")]
    top = max(finite, default=0.0)
    out = []
    for v in values:
        if v != v or v == float("inf"):
            out.append("!")
        elif top == 0 or v == 0:
            out.append(" " if v == 0 else SPARK[0])
        else:
            out.append(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))])
    return "".join(out)
