"""Per-tensor statistics read one tensor at a time, and BatchNorm running stats left at their initial values."""

from __future__ import annotations

import math
from ._record import record

from .records import TensorRecord
from .tensordata import load_tensor, with_bits

CHUNK = 1 << 24
HIST_BINS = 16


@record
class TensorStats:
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    nan: int
    inf: int
    hist: tuple[int, ...] = ()  # counts of the finite values in HIST_BINS equal bins from min to max

    @property
    def constant(self) -> bool:
        """Every finite value the same (all zeros, or one constant)."""
        return self.min is not None and self.min == self.max


def tensor_stats(record: TensorRecord, bits: str = "") -> TensorStats | None:
    """None for dtypes without an order (bool, complex, quantized). `bits`: the conjugate and negative bits torch.load
    sets on it (Checkpoint.value_bits): the figures are of its values."""
    import torch

    if record.dtype == "bool" or record.dtype.startswith(("complex", "q", "bits", "float4")):
        return None
    tensor = with_bits(load_tensor(record), bits).reshape(-1)
    if tensor.numel() == 0:
        return TensorStats(None, None, None, None, 0, 0)
    total = total_sq = 0.0
    lo, hi = math.inf, -math.inf
    nan = inf = finite_count = 0
    for start in range(0, tensor.numel(), CHUNK):
        chunk = tensor[start:start + CHUNK].to(torch.float64)
        is_nan = torch.isnan(chunk)
        is_inf = torch.isinf(chunk)
        nan += int(is_nan.sum())
        inf += int(is_inf.sum())
        finite = chunk[~(is_nan | is_inf)]
        if finite.numel():
            finite_count += finite.numel()
            total += float(finite.sum())
            total_sq += float((finite * finite).sum())
            lo = min(lo, float(finite.min()))
            hi = max(hi, float(finite.max()))
    if not finite_count:
        return TensorStats(None, None, None, None, nan, inf)
    mean = total / finite_count
    var = max(total_sq / finite_count - mean * mean, 0.0) * finite_count / max(finite_count - 1, 1)
    hist = [0] * HIST_BINS
    if hi > lo:  # a second pass over the tensor already in memory
        for start in range(0, tensor.numel(), CHUNK):
            chunk = tensor[start:start + CHUNK].to(torch.float64)
            chunk = chunk[torch.isfinite(chunk)]
            counts = torch.histc(chunk, bins=HIST_BINS, min=lo, max=hi) if chunk.numel() else None
            if counts is not None:
                hist = [h + int(c) for h, c in zip(hist, counts.tolist())]
    else:
        hist[0] = finite_count
    return TensorStats(lo, hi, mean, math.sqrt(var), nan, inf, tuple(hist))


def batchnorm_at_init(tensors: list[TensorRecord], stats: dict[str, TensorStats | None]) -> list[str]:
    """Layers whose running_mean is all 0, running_var all 1 and num_batches_tracked 0 (never trained)."""
    keys = {t.key for t in tensors}
    flagged = []
    for key in keys:
        if not key.endswith(".running_mean"):
            continue
        layer = key[: -len(".running_mean")]
        mean, var = stats.get(key), stats.get(layer + ".running_var")
        tracked = stats.get(layer + ".num_batches_tracked")
        if mean is None or var is None:
            continue
        if (mean.min, mean.max, var.min, var.max) == (0.0, 0.0, 1.0, 1.0) and (tracked is None or tracked.max == 0):
            flagged.append(layer)
    return sorted(flagged)
