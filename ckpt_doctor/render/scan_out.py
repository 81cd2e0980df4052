"""Renders a ScanReport: one row per finding (dangerous first), a verdict line per file, and the JSON."""

from __future__ import annotations

from typing import Any

from ..readers.source import usage, usage_line
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
            "notes": list(f.notes),
            "default_load": f.default_load.json() if f.default_load is not None else None,
            "suggested_commands": [dict(s.json(), label=label) for label, s in
                                   ((("rescue", f.rescue),) if f.rescue is not None else ()) + f.advice]}


def scan_json(report: ScanReport) -> dict[str, Any]:
    return {
        "ok": report.exit_code == 0,
        "verdict": report.verdict.value,
        "exit_code": report.exit_code,
        "findings": report.findings,
        "dangerous": sum(len(f.dangerous) for f in report.files),
        "files": [_file_json(f) for f in report.files],
        "skipped": [{"path": str(s.path), "reason": s.reason} for s in report.skipped],
        "problems": list(report.problems),
        **_remote(),
    }


def _remote() -> dict[str, Any]:
    used = usage()
    return {"remote": used} if used is not None else {}


def scan_table(report: ScanReport, show_safe: bool = False, tablefmt: str = "simple") -> str | None:
    """One row per global off the allow-list (every global with show_safe) and per hazard; None when there is
    nothing to show and no file was read: no claim is made about a file that could not be read."""
    from .columns import draw_table  # only when a table is drawn: --json does not import the table code

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
        unread = sum(1 for f in report.files if f.error)
        if unread == len(report.files):
            return None
        if tablefmt != "simple":  # a program given --format gets the empty table; the summary on stderr says why
            return draw_table(SCAN_HEADERS, [], tablefmt)
        read = f" in the {len(report.files) - unread} file(s) read" if unread else ""
        return f"(no globals off the allow-list{read})"
    return draw_table(SCAN_HEADERS, rows, tablefmt)


SCAN_HEADERS = ["file", "verdict", "global", "in", "why"]


def scan_summary(report: ScanReport, with_severity: bool = False) -> list:
    """Lines for stderr; with_severity: (line, whether it says why the exit code is 1) pairs, for the colour."""
    lines: list[tuple[str, bool]] = []
    for f in report.files:
        safe = sum(1 for g in f.globals if g.verdict is Verdict.SAFE)
        what = f.format or f.container or "unreadable"
        link = f" (→ {f.link})" if f.link else ""
        if f.error and f.verdict is Verdict.SAFE:  # nothing found is no "clean" for a file that was not read
            lines.append((f"{f.path}{link}: NOT READ — {f.error.removeprefix(f'{f.path}: ')}", True))
            continue
        if f.verdict is Verdict.SAFE:
            state = "clean: every global is on ckpt-doctor's allow-list"  # (torch.load's is narrower: its line)
        else:
            names = [g.qualname for g in f.findings] + [h.what.split(":")[0] for h in f.hazards]
            more = f", … {len(names) - 5} more" if len(names) > 5 else ""
            state = f"{f.verdict.value.upper()}: {', '.join(names[:5])}{more}"
        lines.append((f"{f.path}{link}: {what} — {state} ({safe} allow-listed)", f.verdict is not Verdict.SAFE))
        loads = f.default_load
        if loads is not None and loads.applies and not loads.ok:
            trust = (f"; for code you trust: torch.serialization.add_safe_globals([{', '.join(loads.trusted_way_out)}])"
                     if loads.trusted_way_out else "")
            lines.append((f"  torch.load: FAILS with torch's defaults here: {'; '.join(loads.reasons())}{trust}",
                          report.require_default_load))
        if f.rescue is not None:
            lines.append((f"  rescue: `{f.rescue.command}` ({f.rescue.why})", False))
        if f.error:
            lines.append((f"  also: {f.error}", False))
        for note in f.notes:
            lines.append((f"  note: {note}", False))
    for skipped in report.skipped[:MAX_SKIPPED_LINES]:
        lines.append((f"skipped {skipped.path}: {skipped.reason}", False))
    if len(report.skipped) > MAX_SKIPPED_LINES:
        lines.append((f"skipped {len(report.skipped) - MAX_SKIPPED_LINES:,} more files that are no checkpoint and run "
                      "nothing (--json lists them all)", False))
    network = usage_line()
    if network is not None:
        lines.append((network, False))
    return lines if with_severity else [line for line, _ in lines]


MAX_SKIPPED_LINES = 50  # a folder of a dataset's images says so in a screenful
