"""Renders a ScanReport: one row per finding (dangerous first), a verdict line per file, and the JSON."""

from __future__ import annotations

from typing import Any

from ..records import Verdict
from ..scan import FileScan, ScanReport


def _file_json(f: FileScan) -> dict[str, Any]:
    return {"path": str(f.path), "verdict": f.verdict.value, "container": f.container, "format": f.format,
            "error": f.error, "link": f.link,
            "dangerous": [g.qualname for g in f.dangerous],
            "findings": [g.qualname for g in f.findings],
            "globals": [{"global": g.qualname, "verdict": g.verdict.value, "reason": g.reason, "source": g.source}
                        for g in f.globals],
            "hazards": [{"verdict": h.verdict.value, "what": h.what} for h in f.hazards],
            "notes": list(f.notes)}


def scan_json(report: ScanReport) -> dict[str, Any]:
    return {
        "verdict": report.verdict.value,
        "exit_code": report.exit_code,
        "findings": report.findings,
        "dangerous": sum(len(f.dangerous) for f in report.files),
        "files": [_file_json(f) for f in report.files],
        "skipped": list(report.skipped),
        "problems": list(report.problems),
    }


def scan_table(report: ScanReport, show_safe: bool = False) -> str:
    from .columns import simple_table

    rows = []
    for f in report.files:
        for g in sorted(f.globals, key=lambda g: -g.verdict.rank):
            if g.verdict is Verdict.SAFE and not show_safe:
                continue
            rows.append([str(f.path), g.verdict.value.upper() if g.verdict is not Verdict.SAFE else "safe",
                         g.qualname, g.source, g.reason])
        for h in f.hazards:
            rows.append([str(f.path), h.verdict.value.upper(), "(the file)", "", h.what])
    if not rows:
        return "(no globals off the allow-list)"
    return simple_table(["file", "verdict", "global", "in", "why"], rows)


def scan_summary(report: ScanReport) -> list[str]:
    lines = []
    for f in report.files:
        safe = sum(1 for g in f.globals if g.verdict is Verdict.SAFE)
        what = f.format or f.container or "unreadable"
        link = f" (→ {f.link})" if f.link else ""
        if f.verdict is Verdict.SAFE:
            state = "clean: every global is on the allow-list"
        else:
            names = [g.qualname for g in f.findings] + [h.what.split(":")[0] for h in f.hazards]
            more = f", … {len(names) - 5} more" if len(names) > 5 else ""
            state = f"{f.verdict.value.upper()}: {', '.join(names[:5])}{more}"
        lines.append(f"{f.path}{link}: {what} — {state} ({safe} allow-listed)")
        if f.error:
            lines.append(f"  also: {f.error}")
        for note in f.notes:
            lines.append(f"  note: {note}")
    if report.skipped:
        lines.append(f"{len(report.skipped)} files hold no pickle (text, images): nothing there for torch.load to run")
    return lines
