"""Model outputs: flattened, split by rank, and compared the way `torch.testing.assert_close` compares them.

One module answers "do these outputs agree?" for every run of `verify` — single against DataParallel, each DDP rank
against its shard of the single run, one checkpoint's modules against another's — in the parent process and in
the rank workers alike. The authority is torch.testing: its default (rtol, atol) for the output's own dtype, its
elementwise rule |actual - expected| <= atol + rtol * |expected|, and its verdict (the comparison is
`assert_close` itself). Outputs computed on a split batch go through other kernels with other summation orders, so
their tolerance is the default scaled by SPLIT_SCALE; `--rtol/--atol` replace both.
"""

from __future__ import annotations

from ._record import record
from typing import Any

SPLIT_SCALE = 16.0  # a batch split differs in the last few bits of each reduction: 4 bits of slack


@record
class Tolerance:
    """The user's --rtol/--atol (None: torch.testing's default for each output's dtype), and the scale for split
    batches."""

    rtol: float | None = None
    atol: float | None = None

    def for_dtype(self, dtype: Any, split: bool) -> tuple[float, float]:
        if self.rtol is not None and self.atol is not None:
            return self.rtol, self.atol
        rtol, atol = default_tolerances(dtype)
        scale = SPLIT_SCALE if split else 1.0
        return (self.rtol if self.rtol is not None else rtol * scale,
                self.atol if self.atol is not None else atol * scale)


@record
class OutputDiff:
    """How far one set of outputs is from another, and whether torch.testing accepts it."""

    ok: bool
    max_abs_diff: float
    rtol: float  # the tolerance of the worst output (the first that fails, else the widest used)
    atol: float
    detail: str = ""  # for a failure: which output, and assert_close's own account

    def describe(self) -> str:
        return f"max |diff| {self.max_abs_diff:.3g} (rtol {self.rtol:.3g}, atol {self.atol:.3g})"


def default_tolerances(dtype: Any) -> tuple[float, float]:
    """torch.testing.assert_close's (rtol, atol) for a dtype, asked of torch itself where it says."""
    import torch

    try:
        from torch.testing._comparison import default_tolerances as torch_defaults

        return tuple(float(x) for x in torch_defaults(dtype))  # type: ignore[return-value]
    except (ImportError, TypeError):  # the private helper moved: its documented table
        return {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
                torch.float64: (1e-7, 1e-7), torch.complex64: (1.3e-6, 1e-5),
                torch.complex128: (1e-7, 1e-7)}.get(dtype, (0.0, 0.0))


def flat_outputs(out: Any) -> list[Any]:
    """Every tensor of a forward's result, in order (tensors, tuples, lists, dicts, Hugging Face ModelOutput)."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in flat_outputs(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in flat_outputs(v)]
    if hasattr(out, "to_tuple"):
        return flat_outputs(out.to_tuple())
    return []


def compare_outputs(actual: list[Any], expected: list[Any], tolerance: Tolerance = Tolerance(), *,
                    split: bool = False) -> OutputDiff:
    """assert_close on each pair of outputs, in their own dtype; the max |difference| for the report."""
    import torch

    worst, rtol_used, atol_used = 0.0, 0.0, 0.0
    if len(actual) != len(expected):
        return OutputDiff(False, float("inf"), 0.0, 0.0, f"{len(actual)} outputs where {len(expected)} were expected")
    for i, (a, e) in enumerate(zip(actual, expected)):
        a, e = a.detach().cpu(), e.detach().cpu()
        rtol, atol = tolerance.for_dtype(e.dtype, split)
        if a.shape != e.shape:
            return OutputDiff(False, float("inf"), rtol, atol,
                              f"output {i} has shape {list(a.shape)} where {list(e.shape)} was expected")
        diff = float((a.double() - e.double()).abs().max()) if a.numel() else 0.0
        worst = max(worst, diff)
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, check_device=False, equal_nan=True)
        except AssertionError as exc:
            account = " ".join(line.strip() for line in str(exc).strip().splitlines()[:4])
            return OutputDiff(False, worst, rtol, atol, f"output {i} {list(e.shape)}: {account}")
        rtol_used, atol_used = max(rtol_used, rtol), max(atol_used, atol)
    return OutputDiff(True, worst, rtol_used, atol_used)


def shard_indices(batch: int, world: int, rank: int) -> list[int]:
    """The samples rank `rank` takes, as DistributedSampler(shuffle=False, drop_last=False) splits them: the batch
    padded by repeating its first samples to a multiple of `world`, then every world-th from `rank`."""
    indices = list(range(batch))
    total = -(-batch // world) * world
    while len(indices) < total:
        indices += indices[:total - len(indices)]
    return indices[rank:total:world]


def take(tensors: list[Any], indices: list[int], batch: int) -> list[Any]:
    """Each tensor's rows at `indices` when its first dimension is the batch; others as they are."""
    import torch

    index = torch.tensor(indices, dtype=torch.long)
    return [t.index_select(0, index.to(t.device)) if t.dim() and t.shape[0] == batch else t for t in tensors]
