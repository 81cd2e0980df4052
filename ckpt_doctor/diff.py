"""`ckpt-doctor diff A B`: what changed between two checkpoints, tensor by tensor, streamed one pair at a time.

Names are matched as `inspect A --model B` matches them (the same inferred renames: a `module.` prefix, a nested
state_dict), so a DataParallel file and its clean copy compare as the same weights. For each pair: shape and dtype
changes, max |B − A|, the relative change ‖B − A‖ / ‖A‖ and the cosine similarity, computed in float64 over blocks
of the flattened tensors (never both files in memory). A pair is identical when its bytes are; within --atol/--rtol
it is close (torch.isclose's rule: |B − A| <= atol + rtol·|A|, NaN equal to NaN).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .records import Checkpoint, TensorRecord



@dataclass(frozen=True)
class PairStats:
    max_abs: float
    rel: float  # ‖B − A‖ / ‖A‖; inf when A is all zeros and B is not
    cosine: float | None  # None when either side is all zeros
    identical: bool  # the same bytes
    close: bool  # within the tolerances


@dataclass(frozen=True)
class TensorDiff:
    key: str  # the name in B (in A when only A has it)
    a_key: str | None
    status: str  # identical, close, changed, shape, only-a, only-b
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    stats: PairStats | None = None


@dataclass(frozen=True)
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

    @property
    def same(self) -> bool:
        return all(r.status in ("identical", "close") for r in self.rows)

    def count(self, status: str) -> int:
        return sum(1 for r in self.rows if r.status == status)


_NUMPY = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4", "int16": "<i2",
          "int8": "i1", "uint8": "u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8", "bool": "?",
          "bfloat16": "<u2"}  # bfloat16: its bits, widened to float32 block by block
BLOCK = 1 << 15  # elements per float64 block: 256 KB each, so the arithmetic stays in the CPU's cache
WINDOW = 1 << 24  # bytes of a tensor mapped at a time, and of each file between drops: memory stays near two windows
SMALL = 1 << 16  # pairs up to this many bytes are compared as copies: cheaper than setting up two array views


def _mappable(t: TensorRecord) -> bool:
    st = t.storage
    return st is not None and st.assembly is None and t.is_contiguous and t.numel > 0 and t.dtype in _NUMPY


class _Mapped:
    """Each file mapped read-only once; a pair is compared straight from the page cache (no copy), a window at a
    time, and every WINDOW bytes read the file's pages are dropped from this process (MADV_DONTNEED: they stay in
    the page cache, this process just stops holding them), so memory does not grow with the files."""

    def __init__(self) -> None:
        self.maps: dict[str, Any] = {}
        self.read_since_drop: dict[str, int] = {}
        self.memcmp = _memcmp()

    def _map(self, t: TensorRecord, nbytes: int) -> Any:
        import mmap
        import os

        key = str(t.storage.file)
        mm = self.maps.get(key)
        if mm is None:
            fd = os.open(key, os.O_RDONLY)
            try:
                mm = self.maps[key] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
            self.read_since_drop[key] = 0
        start = t.file_offset or 0
        if start + t.nbytes > len(mm):
            from .errors import ReadError

            raise ReadError(f"{key}: {t.key} is cut short ({max(len(mm) - start, 0)} of {t.nbytes} bytes)")
        read = self.read_since_drop[key] + nbytes
        if read > WINDOW and hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_DONTNEED)  # what earlier windows faulted in; re-read from the page cache if needed
            read = nbytes
        self.read_since_drop[key] = read
        return mm

    def windows(self, ta: TensorRecord, tb: TensorRecord):
        """(A's window, B's window) as flat NumPy arrays of their dtypes, WINDOW bytes at a time."""
        import numpy as np

        code_a, code_b = np.dtype(_NUMPY[ta.dtype]), np.dtype(_NUMPY[tb.dtype])
        step = WINDOW // max(code_a.itemsize, code_b.itemsize)
        for first in range(0, ta.numel, step):
            count = min(step, ta.numel - first)
            ma, mb = self._map(ta, count * code_a.itemsize), self._map(tb, count * code_b.itemsize)
            oa = (ta.file_offset or 0) + first * code_a.itemsize
            ob = (tb.file_offset or 0) + first * code_b.itemsize
            yield np.frombuffer(ma, code_a, count, oa), np.frombuffer(mb, code_b, count, ob)

    def same_bytes(self, ta: TensorRecord, tb: TensorRecord) -> bool:
        if ta.dtype != tb.dtype:
            return False
        if ta.nbytes <= SMALL:
            ma, mb = self._map(ta, ta.nbytes), self._map(tb, tb.nbytes)
            oa, ob = ta.file_offset or 0, tb.file_offset or 0
            return ma[oa:oa + ta.nbytes] == mb[ob:ob + tb.nbytes]
        return all(self.memcmp(x, y) for x, y in self.windows(ta, tb))

    def close(self) -> None:
        for mm in self.maps.values():
            try:
                mm.close()
            except BufferError:  # an array view still held by an exception's traceback: freed with it
                pass


def _memcmp():
    """Equal bytes, at memory speed: libc's memcmp on the two arrays (NumPy's compare where there is no libc)."""
    import numpy as np

    try:
        import ctypes

        libc_memcmp = ctypes.CDLL(None).memcmp
        libc_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        libc_memcmp.restype = ctypes.c_int
    except (OSError, AttributeError):
        return lambda x, y: x.nbytes == y.nbytes and np.array_equal(x.view(np.uint8), y.view(np.uint8))
    return lambda x, y: x.nbytes == y.nbytes and libc_memcmp(x.ctypes.data, y.ctypes.data, x.nbytes) == 0


def pair_stats(a: Any, b: Any, atol: float = 0.0, rtol: float = 0.0) -> PairStats:
    """Compare two torch tensors of one shape: see array_stats."""
    import torch

    def flat(t: Any) -> Any:
        t = t.detach().reshape(-1).contiguous()
        try:
            return t.numpy()
        except TypeError:  # bfloat16, float8: NumPy has no such dtype
            return t.to(torch.float64).numpy()

    identical = a.dtype == b.dtype and a.shape == b.shape and (
        a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        if a.dtype != torch.bool else torch.equal(a, b))
    return array_stats(flat(a), flat(b), identical, atol, rtol)


def array_stats(x: Any, y: Any, identical: bool, atol: float = 0.0, rtol: float = 0.0) -> PairStats:
    """Compare two flat NumPy arrays: see window_stats."""
    return PairStats(0.0, 0.0, None, True, True) if identical else window_stats([(x, y)], (False, False), atol, rtol)


def window_stats(windows, bf16: tuple[bool, bool], atol: float = 0.0, rtol: float = 0.0) -> PairStats:
    """max |y − x|, ‖y − x‖ / ‖x‖ and the cosine in float64 over (x, y) windows of two flat arrays (BLAS dot
    products over cache-sized blocks; NaN equal to NaN), and whether every element is within atol + rtol·|x|
    (torch.isclose's rule). bf16[i]: that side holds bfloat16 bits (uint16), widened here block by block."""
    import numpy as np

    u, v, d = np.empty(BLOCK), np.empty(BLOCK), np.empty(BLOCK)
    max_abs = diff_sq = a_sq = b_sq = dot = 0.0
    close = bool(atol or rtol)
    inf = float("inf")
    with np.errstate(all="ignore"):
        for x, y in windows:
            for start in range(0, x.size, BLOCK):
                n = min(BLOCK, x.size - start)
                uu, vv, dd = u[:n], v[:n], d[:n]
                _widen(x[start:start + n], bf16[0], uu)
                _widen(y[start:start + n], bf16[1], vv)
                np.subtract(vv, uu, out=dd)
                block_sq = float(dd @ dd)
                if block_sq != block_sq or block_sq == inf:  # NaN or inf somewhere: the careful way
                    eq = (uu == vv) | (np.isnan(uu) & np.isnan(vv))  # NaN equal to NaN, inf to the same inf
                    dd = np.where(eq, 0.0, dd)
                    if not np.isfinite(dd).all():
                        max_abs = inf
                    uu, vv = np.where(np.isfinite(uu), uu, 0.0), np.where(np.isfinite(vv), vv, 0.0)
                    block_sq = inf if max_abs == inf else float(dd @ dd)
                    if close:
                        close = bool(np.all(eq | (np.abs(dd) <= atol + rtol * np.abs(uu))))
                elif close:
                    close = bool(np.all(np.abs(dd) <= atol + rtol * np.abs(uu)))
                if max_abs != inf:
                    max_abs = max(max_abs, float(dd.max()), -float(dd.min()))
                diff_sq += block_sq
                a_sq += float(uu @ uu)
                b_sq += float(vv @ vv)
                dot += float(uu @ vv)
    norm_a = a_sq ** 0.5
    rel = 0.0 if diff_sq == 0 else (diff_sq ** 0.5 / norm_a if norm_a else inf)
    if rel != rel:
        rel = inf
    cosine = dot / (norm_a * b_sq ** 0.5) if norm_a and b_sq and dot == dot else None
    return PairStats(max_abs, rel, cosine, False, close and max_abs != inf)


def _widen(src: Any, bf16: bool, out: Any) -> None:
    import numpy as np

    if bf16:
        src = (src.astype(np.uint32) << 16).view(np.float32)
    np.copyto(out, src, casting="unsafe")


def _match(a: Checkpoint, b: Checkpoint, b_path: str) -> tuple[dict[str, str], tuple[str, ...], str | None]:
    """A's state_dict names → B's: the same names when they are, else the renames `inspect A --model B` infers."""
    a_root = a.state_dict_root
    a_keys = [t.key for t in a.state_dict_tensors()]
    b_keys = {t.key for t in b.state_dict_tensors()}
    if not a_keys or set(a_keys) & b_keys == set(a_keys) or not b_keys:
        return {k: k for k in a_keys}, (), a_root
    from .compare import compare_checkpoint
    from .modelspec import keys_from_spec

    comparison = compare_checkpoint(a, keys_from_spec(b_path))
    root = comparison.fix_root if comparison.fix_root is not None else comparison.state_dict_root
    if root != a_root:
        a_keys = [t.key for t in a.tensors if root == "" or t.key.startswith(root + ".")]
        a_keys = [k[len(root) + 1:] if root else k for k in a_keys]
    renames = dict(comparison.renames)
    mapping = {k: renames.get(k, k) for k in a_keys}
    flags = tuple(f for f in comparison.suggested_fix if not f.startswith("-o")) if renames else ()
    return mapping, flags, root


def diff_checkpoints(a_path: str | Path, b_path: str | Path, *, atol: float = 0.0, rtol: float = 0.0,
                     transforms: tuple = (), progress=None) -> DiffReport:
    """`transforms` (fix's --strip-prefix/--add-prefix/--rename) map A's names onto B's instead of the inference."""
    from .readers import read_checkpoint
    from .records import relative_to_root
    from .tensordata import load_tensor

    a, b = read_checkpoint(a_path), read_checkpoint(b_path)
    for ckpt in (a, b):
        ckpt.refuse_if_unsafe("compare it", code_too=False)
    if transforms:
        from .transforms import plan_keys

        a_root = a.state_dict_root
        mapping = dict(plan_keys([t.key for t in a.state_dict_tensors()], list(transforms)).mapping)
        flags = tuple(f for t in transforms for f in t.flags())
    else:
        mapping, flags, a_root = _match(a, b, str(b_path))
    a_tensors = {t.key: t for t in relative_to_root(a.tensors, a_root)}
    b_tensors = {t.key: t for t in b.state_dict_tensors()}
    rows: list[TensorDiff] = []
    done: set[str] = set()
    mapped = _Mapped()
    try:
        for i, (a_key, b_key) in enumerate(mapping.items()):
            ta, tb = a_tensors.get(a_key), b_tensors.get(b_key)
            if ta is None:
                continue
            if tb is None:
                rows.append(TensorDiff(a_key, a_key, "only-a", ta.shape, None, ta.dtype, None))
                continue
            done.add(b_key)
            rows.append(_pair(b_key, a_key, ta, tb, atol, rtol, load_tensor, mapped))
            if progress is not None:
                progress(i + 1, len(mapping))
    finally:
        mapped.close()
    rows += [TensorDiff(k, None, "only-b", None, t.shape, None, t.dtype) for k, t in b_tensors.items() if k not in done]
    return DiffReport(a, b, tuple(rows), flags, a_root, b.state_dict_root, atol, rtol, tuple(_bn_drift(rows)))


def _pair(key: str, a_key: str, ta: TensorRecord, tb: TensorRecord, atol: float, rtol: float, load,
          mapped: _Mapped) -> TensorDiff:
    """One pair, read from the page cache when both are plain runs of bytes (the bytes first: most pairs stop at
    that compare), else through torch (a strided view, pieces of a sharded folder, a dtype NumPy lacks)."""
    if ta.shape != tb.shape:
        return TensorDiff(key, a_key, "shape", ta.shape, tb.shape, ta.dtype, tb.dtype)
    if _mappable(ta) and _mappable(tb):
        if mapped.same_bytes(ta, tb):
            stats = PairStats(0.0, 0.0, None, True, True)
        else:
            bf16 = (ta.dtype == "bfloat16", tb.dtype == "bfloat16")
            stats = window_stats(mapped.windows(ta, tb), bf16, atol, rtol)
    else:
        stats = pair_stats(load(ta), load(tb), atol, rtol)
    status = "identical" if stats.identical else "close" if stats.close else "changed"
    return TensorDiff(key, a_key, status, ta.shape, tb.shape, ta.dtype, tb.dtype, stats)


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
    """The pairs that moved, largest relative change first; those whose A was all zeros (an infinite relative
    change: a BatchNorm's running_mean, a counter) after every finite one."""
    moved = [r for r in rows if r.stats is not None and not r.stats.identical]
    return sorted(moved, key=lambda r: (r.stats.rel == float("inf"), -r.stats.rel, -r.stats.max_abs))


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
