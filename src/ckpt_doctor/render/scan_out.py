"""Renders a ScanReport: one row per global (dangerous first), and the JSON."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from ..records import Verdict
from ..scan import ScanReport

_ORDER = {Verdict.DANGEROUS: 0, Verdict.UNKNOWN: 1, Verdict.SAFE: 2}


def scan_json(report: ScanReport, problems: list[str]) -> dict[str, Any]:
    return {
        "dangerous": report.dangerous,
        "files": [{"path": str(f.path), "format": f.format, "error": f.error,
                   "dangerous": [g.qualname for g in f.dangerous],
                   "globals": [{"global": g.qualname, "verdict": g.verdict.value, "reason": g.reason,
                                "source": g.source} for g in f.globals],
                   "executable_code": list(f.executable_code), "notes": list(f.notes)} for f in report.files],
        "problems": problems,
    }


def scan_table(report: ScanReport, show_safe: bool = False) -> str:
    rows = []
    for f in report.files:
        refs = sorted(f.globals, key=lambda g: _ORDER[g.verdict])
        for g in refs:
            if g.verdict is Verdict.SAFE and not show_safe:
                continue
            rows.append([str(f.path), g.verdict.value.upper() if g.verdict is Verdict.DANGEROUS else g.verdict.value,
                         g.qualname, g.source, g.reason])
        if f.executable_code:
            rows.append([str(f.path), "code", f"{len(f.executable_code)} TorchScript files", "code/",
                         "executable content: never torch.jit.load a file you do not trust"])
    if not rows:
        return "(no globals beyond the allow-list)"
    return tabulate(rows, headers=["file", "verdict", "global", "in", "why"], tablefmt="simple", disable_numparse=True)


def scan_summary(report: ScanReport) -> list[str]:
    lines = []
    for f in report.files:
        safe = sum(1 for g in f.globals if g.verdict is Verdict.SAFE)
        unknown = sum(1 for g in f.globals if g.verdict is Verdict.UNKNOWN)
        state = f"DANGEROUS ({', '.join(g.qualname for g in f.dangerous)})" if f.dangerous else "no dangerous global"
        lines.append(f"{f.path}: {f.format or 'unreadable'} — {state}; {safe} allow-listed, {unknown} unknown"
                     + (f"; {len(f.executable_code)} TorchScript code files" if f.executable_code else ""))
        if f.error:
            lines.append(f"  also: {f.error}")
        for note in f.notes:
            lines.append(f"  note: {note}")
    return lines
