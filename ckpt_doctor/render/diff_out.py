"""`ckpt-doctor diff`: the table (stdout), the summary that fits one screen (stderr), and the JSON."""

from __future__ import annotations

from typing import Any

from ..advice import command_line, shell_path, shell_word
from ..analyze import collapse_labels
from ..diff import DiffReport, TensorDiff, cast_only, largest_changes, sparkline
from ..readers.source import usage, usage_line
from .columns import KEYS, draw_table
from .lines import Line, Severity

TOP = 5


def _num(x: float | None) -> str:
    if x is None:
        return ""
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    return f"{x:.3g}"


def _shape(r: TensorDiff) -> str:
    a = list(r.shape_a) if r.shape_a is not None else None
    b = list(r.shape_b) if r.shape_b is not None else None
    return str(a if b is None else b) if a == b or a is None or b is None else f"{a} → {b}"


def _dtype(r: TensorDiff) -> str:
    if r.dtype_a and r.dtype_b and r.dtype_a != r.dtype_b:
        return f"{r.dtype_a} → {r.dtype_b}"
    return r.dtype_b or r.dtype_a or ""


def diff_table(report: DiffReport, full: bool = False, tablefmt: str = "simple") -> str:
    rows = list(report.rows)
    if full:
        groups = [(r.key, [i]) for i, r in enumerate(rows)]
    else:
        groups = collapse_labels([r.key for r in rows],
                                 [(r.status, r.shape_a, r.shape_b, r.dtype_a, r.dtype_b) for r in rows])
    body = []
    for label, members in groups:
        members_rows = [rows[i] for i in members]
        first = members_rows[0]
        stats = [m.stats for m in members_rows if m.stats is not None]
        max_abs = max((s.max_abs for s in stats), default=None)
        rel = max((s.rel for s in stats), default=None)
        cos = min((s.cosine for s in stats if s.cosine is not None), default=None)
        status = first.status + (f" ×{len(members_rows)}" if len(members_rows) > 1 else "")
        body.append([label, status, _shape(first), _dtype(first), _num(max_abs), _num(rel), _num(cos)])
    if not body:
        return "(no tensors)"
    return draw_table(["key", "status", "shape", "dtype", "max|Δ|", "‖Δ‖/‖A‖", "cosine"], body, tablefmt,
                      max_width=KEYS)


def _labels(rows: list[TensorDiff], limit: int = 6) -> str:
    groups = collapse_labels([r.key for r in rows], [() for _ in rows])
    names = [label for label, _ in groups]
    return ", ".join(names[:limit]) + (f", … {len(names) - limit} more" if len(names) > limit else "")


def diff_summary(report: DiffReport) -> list[str]:
    lines: list[tuple[str, str]] = []
    a, b = report.a, report.b
    lines.append(("A", f"{a.path} ({a.format.value}, {len(a.tensors):,} tensors)"))
    lines.append(("B", f"{b.path} ({b.format.value}, {len(b.tensors):,} tensors)"))
    if report.renamed_by:
        lines.append(("names", "A's names mapped onto B's "
                               + ("by the flags given: " if report.names_given else "as `inspect A --model B` infers: ")
                               + " ".join(shell_word(f) for f in report.renamed_by)))
    rows = list(report.rows)
    counted = {s: [r for r in rows if r.status == s] for s in ("identical", "close", "changed", "shape", "only-a",
                                                                "only-b", "tied")}
    tol = f" (within --atol {report.atol:g} --rtol {report.rtol:g})" if report.atol or report.rtol else ""
    lines.append(("compared", f"{sum(1 for r in rows if r.stats is not None):,} pairs: "
                              f"{len(counted['identical']):,} bit-identical, {len(counted['close']):,} close{tol}, "
                              f"{len(counted['changed']):,} changed"))
    if counted["identical"] and (counted["changed"] or counted["close"]):
        lines.append(("identical", _labels(counted["identical"])))
    cast = [r for r in counted["changed"] if cast_only(r)]
    if cast:  # changed bytes, the same values: said as such, not as the top changes (max|Δ| 0)
        kinds = ", ".join(sorted({f"{r.dtype_a} → {r.dtype_b}" for r in cast}))
        lines.append(("cast", f"{len(cast)}: dtype changed ({kinds}), every value kept: {_labels(cast)}"))
    for r in largest_changes(rows)[:TOP]:
        s = r.stats
        lines.append(("top change", f"{r.key}: ‖Δ‖/‖A‖ {_num(s.rel)}, max|Δ| {_num(s.max_abs)}, "
                                    f"cosine {_num(s.cosine) or '—'}"))
    for status, label in (("shape", "shape changed"), ("only-a", "only in A"), ("only-b", "only in B")):
        if counted[status]:
            lines.append((label, f"{len(counted[status])}: {_labels(counted[status])}"))
    if counted["tied"]:  # the side that has the name holds it as another's tensor; the other stores that one once
        where = [f"{r.key} ({r.tied_to}'s tensor in {'A' if r.shape_a is not None else 'B'}, stored once in "
                 f"{'B' if r.shape_a is not None else 'A'})" for r in counted["tied"]]
        lines.append(("tied", f"{len(where)}: " + ", ".join(where[:4]) + (f", … {len(where) - 4} more"
                                                                            if len(where) > 4 else "")))
    if report.bn_drift:
        shown = ", ".join(report.bn_drift[:8]) + (f", … {len(report.bn_drift) - 8} more" if len(report.bn_drift) > 8
                                                   else "")
        lines.append(("batchnorm", f"{len(report.bn_drift)} layers whose running stats changed while their weights "
                                   f"stayed bit-identical (a frozen BatchNorm left in train mode?): {shown}"))
    paired = [r for r in rows if r.stats is not None]
    if len(paired) > 1 and any(r.stats.rel != 0 for r in paired):  # (NaN, inf: drawn as "!")
        lines.append(("depth", sparkline([r.stats.rel for r in paired]) + "  (‖Δ‖/‖A‖ over A's order; ! where A was "
                               "all zeros)"))
    for side in report.unsafe_sides:
        ckpt = a if side == "A" else b
        names = [g.qualname for g in ckpt.unsafe_globals]
        lines.append(("unsafe", f"{side} ({ckpt.path}) would run code under torch.load(weights_only=False): "
                                + ", ".join(names[:3]) + (f", … {len(names) - 3} more" if len(names) > 3 else "")
                                + f"; `{command_line(('scan', shell_path(ckpt.path)))}` says what and where"))
    values = ("identical" + (" within the tolerances" if counted["close"] else "")) if report.same else \
        "the checkpoints differ"
    if cast and len(cast) == len(rows) - len(counted["identical"]) - len(counted["close"]):
        values += " in dtype only: every value kept"
    if report.unsafe_sides:
        values += f"; but {' and '.join(report.unsafe_sides)} would run code when loaded as saved"
    lines.append(("verdict", values))
    network = usage_line()
    if network is not None:
        lines.append(("network", network))
    width = max(len(label) for label, _ in lines)
    return [Line(f"{label:<{width}}  {text}", Severity.PROBLEM if label in ("unsafe", "verdict") and report.exit_code
                 else Severity.INFO) for label, text in lines]


def diff_json(report: DiffReport) -> dict[str, Any]:
    def stat(r: TensorDiff) -> dict[str, Any]:
        s = r.stats
        out: dict[str, Any] = {"key": r.key, "a_key": r.a_key, "status": r.status,
                               "shape_a": list(r.shape_a) if r.shape_a is not None else None,
                               "shape_b": list(r.shape_b) if r.shape_b is not None else None,
                               "dtype_a": r.dtype_a, "dtype_b": r.dtype_b, "tied_to": r.tied_to}
        out.update({"max_abs": _finite(s.max_abs), "rel": _finite(s.rel), "cosine": s.cosine} if s is not None else
                   {"max_abs": None, "rel": None, "cosine": None})
        return out

    return {
        "ok": report.exit_code == 0, "exit_code": report.exit_code, "unsafe": list(report.unsafe_sides),
        "a": str(report.a.path), "b": str(report.b.path), "identical": report.same,
        "atol": report.atol, "rtol": report.rtol, "renamed_by": list(report.renamed_by),
        "counts": {s: report.count(s) for s in ("identical", "close", "changed", "shape", "only-a", "only-b",
                                                "tied")},
        "bn_drift": list(report.bn_drift),
        "tensors": [stat(r) for r in report.rows],
        **_remote(),
    }


def _remote() -> dict[str, Any]:
    """Bytes and requests used over the network (a URL as A or B), when any were."""
    used = usage()
    return {"remote": used} if used is not None else {}


def _finite(x: float) -> float | str:
    return x if x == x and x not in (float("inf"), float("-inf")) else str(x)
