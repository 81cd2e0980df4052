"""Renders a VerifyReport: the per-mode table, the module summary and the JSON of DESIGN.md."""

from __future__ import annotations

from typing import Any

from .columns import simple_table

from ..analyze import human_bytes
from ..verify import VerifyReport


def verify_json(report: VerifyReport) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ok": report.ok,
        "checkpoint": report.checkpoint,
        "model": report.model,
        "tolerance": {"rtol": report.tolerance.rtol, "atol": report.tolerance.atol,
                      "default": "torch.testing.assert_close's for each output's dtype, x16 where the batch was "
                                 "split" if report.tolerance.rtol is None or report.tolerance.atol is None else None},
        "runs": [{"mode": r.mode.value, "world_size": r.world_size, "backend": r.backend, "devices": list(r.devices),
                  "status": r.status.value, "max_abs_diff": r.max_abs_diff, "rtol": r.rtol, "atol": r.atol,
                  "seconds": round(r.seconds, 3), "detail": r.detail, "peak_memory": r.peak_memory,
                  **({"ranks": [_rank_json(k) for k in r.ranks]} if r.ranks else {})} for r in report.runs],
    }
    if report.comparison is not None:
        from .compare_out import comparison_json

        out["comparison"] = comparison_json(report.comparison)
    if report.summary:
        out["summary"] = [{"module": m.name, "type": m.kind, "output_shape": m.output_shape, "params": m.params}
                          for m in report.summary]
    if report.compared_to is not None:
        out["compared_to"] = report.compared_to
        out["first_difference"] = report.first_difference
    return out


def _rank_json(rank: Any) -> dict[str, Any]:
    """One DDP rank: its device, the batch rows it ran (DistributedSampler's split), its verdict and memory."""
    return {"rank": rank.rank, "device": rank.device, "status": rank.status, "samples": rank.samples,
            "max_abs_diff": rank.max_abs_diff, "rtol": rank.rtol, "atol": rank.atol, "error": rank.error or None,
            "where": rank.where or None, "peak_memory": rank.peak_memory}


def verify_table(report: VerifyReport) -> str:
    rows = []
    for r in report.runs:
        peak = ", ".join(f"{d} {human_bytes(b)}" for d, b in r.peak_memory.items()) or "-"
        diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.3g}"
        rows.append([r.mode.value, r.status.value.upper(), r.world_size, r.backend, ",".join(r.devices), diff,
                     f"{r.seconds:.2f}", peak, r.detail])
    text = simple_table(["mode", "status", "world", "backend", "devices", "max|diff|", "seconds", "peak memory",
                         "detail"], rows)
    if report.summary:
        text += "\n\n" + simple_table(["module", "type", "output shape", "params"],
                                       [[m.name, m.kind, m.output_shape, f"{m.params:,}"] for m in report.summary])
    return text
