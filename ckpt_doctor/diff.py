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

BLOCK = 1 << 22  # elements per float64 block: 32 MB for each of the pair


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
          "int8": "i1", "uint8": "u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8", "bool": "?"}


def as_array(data: bytes, dtype: str) -> Any:
    """A flat NumPy view of a contiguous tensor's bytes, bfloat16 widened to float32; None for dtypes NumPy lacks."""
    import numpy as np

    if dtype == "bfloat16":
        return (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
    code = _NUMPY.get(dtype)
    return None if code is None else np.frombuffer(data, code)


_ARRAYS = {*_NUMPY, "bfloat16"}
PAGE = 4096


def _mappable(t: TensorRecord) -> bool:
    st = t.storage
    return st is not None and st.assembly is None and t.is_contiguous and t.numel > 0


class _Buffers:
    """Reusable read buffers for one pair: no fresh pages to fault in per tensor, no copy kept, so memory is the
    largest pair whatever the file sizes."""

    def __init__(self) -> None:
        self.bufs = [bytearray(), bytearray()]
        self.fds: dict[str, int] = {}

    def read(self, which: int, t: TensorRecord) -> memoryview:
        import os

        key = str(t.storage.file)
        fd = self.fds.get(key)
        if fd is None:
            fd = self.fds[key] = os.open(key, os.O_RDONLY)
        if len(self.bufs[which]) < t.nbytes:
            self.bufs[which] = bytearray(t.nbytes)
        view = memoryview(self.bufs[which])[:t.nbytes]
        got = os.preadv(fd, [view], t.file_offset or 0)
        if got != t.nbytes:
            from .errors import ReadError

            raise ReadError(f"{key}: {t.key} is cut short ({got} of {t.nbytes} bytes)")
        return view

    def read_pair(self, slot: int, ta: TensorRecord, tb: TensorRecord) -> tuple[memoryview, memoryview]:
        return self.read(2 * slot, ta), self.read(2 * slot + 1, tb)

    def close(self) -> None:
        import os

        for fd in self.fds.values():
            os.close(fd)


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
    """max |y − x|, ‖y − x‖ / ‖x‖ and the cosine in float64, over blocks (BLAS dot products; NaN equal to NaN), and
    whether they are within atol + rtol·|x| (torch.isclose's rule). `identical`: the caller compared the bytes, and
    nothing is computed (cosine is then not given)."""
    import numpy as np

    if identical:
        return PairStats(0.0, 0.0, None, True, True)
    max_abs = diff_sq = a_sq = b_sq = dot = 0.0
    close = bool(atol or rtol)
    with np.errstate(all="ignore"):
        for start in range(0, x.size, BLOCK):
            u = x[start:start + BLOCK].astype(np.float64)
            v = y[start:start + BLOCK].astype(np.float64)
            d = v - u
            block_sq = float(np.dot(d, d))
            if block_sq != block_sq or block_sq == float("inf"):  # NaN or inf somewhere: the careful way
                both = np.isnan(u) & np.isnan(v)
                u, v = np.where(both, 0.0, u), np.where(both, 0.0, v)
                d = np.where(both, 0.0, d)
                if not np.isfinite(d).all():
                    max_abs = float("inf")
                    d = np.where(np.isfinite(d), d, 0.0)
                block_sq = float(np.dot(d, d)) if max_abs != float("inf") else float("inf")
                u, v = np.nan_to_num(u), np.nan_to_num(v)
            if d.size and max_abs != float("inf"):
                max_abs = max(max_abs, float(d.max()), -float(d.min()))
            diff_sq += block_sq
            a_sq += float(np.dot(u, u))
            b_sq += float(np.dot(v, v))
            dot += float(np.dot(u, v))
            if close:
                close = bool(np.all(np.abs(d) <= atol + rtol * np.abs(u)))
    norm_a = a_sq ** 0.5
    rel = 0.0 if diff_sq == 0 else (diff_sq ** 0.5 / norm_a if norm_a else float("inf"))
    if rel != rel:
        rel = float("inf")
    cosine = dot / (norm_a * b_sq ** 0.5) if norm_a and b_sq and dot == dot else None
    return PairStats(max_abs, rel, cosine, False, close and max_abs != float("inf"))


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
    total = len(mapping)
    buffers = _Buffers()
    try:
        _compare_all(mapping, a_tensors, b_tensors, rows, done, atol, rtol, load_tensor, buffers, progress, total)
    finally:
        buffers.close()
    rows += [TensorDiff(k, None, "only-b", None, t.shape, None, t.dtype) for k, t in b_tensors.items() if k not in done]
    return DiffReport(a, b, tuple(rows), flags, a_root, b.state_dict_root, atol, rtol, tuple(_bn_drift(rows)))


def _compare_all(mapping, a_tensors, b_tensors, rows, done, atol, rtol, load_tensor, buffers, progress, total):
    """Every pair in A's order, one at a time. (Reading the next pair in a thread while comparing this one gained
    nothing here: both are bound by memory bandwidth.)"""
    for i, (a_key, b_key) in enumerate(mapping.items()):
        ta, tb = a_tensors.get(a_key), b_tensors.get(b_key)
        if ta is None:
            continue
        if tb is None:
            rows.append(TensorDiff(a_key, a_key, "only-a", ta.shape, None, ta.dtype, None))
            continue
        done.add(b_key)
        readable = ta.shape == tb.shape and _mappable(ta) and _mappable(tb) and ta.dtype in _ARRAYS and \
            tb.dtype in _ARRAYS
        data = buffers.read_pair(0, ta, tb) if readable else None
        rows.append(_pair(b_key, a_key, ta, tb, atol, rtol, load_tensor, data))
        if progress is not None:
            progress(i + 1, total)


def _pair(key: str, a_key: str, ta: TensorRecord, tb: TensorRecord, atol: float, rtol: float, load,
          data: tuple[memoryview, memoryview] | None = None) -> TensorDiff:
    if ta.shape != tb.shape:
        return TensorDiff(key, a_key, "shape", ta.shape, tb.shape, ta.dtype, tb.dtype)
    stats = None
    if data is not None:
        import numpy as np

        da, db = data  # the bytes first: most pairs stop at this compare
        same = ta.dtype == tb.dtype and np.array_equal(np.frombuffer(da, np.uint8), np.frombuffer(db, np.uint8))
        stats = array_stats(as_array(da, ta.dtype), as_array(db, tb.dtype), same, atol, rtol)
    if stats is None:  # a strided view, or a dtype NumPy lacks (float8): through torch
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
