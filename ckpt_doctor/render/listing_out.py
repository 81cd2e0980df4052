"""Renders a FolderListing (`inspect DIR` of a folder of checkpoints): one row per file, a total, the JSON."""

from __future__ import annotations

from ..analyze import human_bytes
from ..listing import FolderListing
from .lines import Line, Severity
from .scan_out import MAX_SKIPPED_LINES

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any


def _name(listing: FolderListing, path) -> str:
    try:
        return str(path.relative_to(listing.folder))
    except ValueError:
        return str(path)


def listing_table(listing: FolderListing, tablefmt: str = "simple") -> str:
    from .columns import draw_table  # only when a table is drawn: --json does not import the table code

    rows = []
    for f in listing.files:
        if f.error:
            verdict = f.verdict.upper() if f.findings else "unreadable"
            rows.append([_name(listing, f.path), "-", "-", "-", "-", "-", f"{verdict}: {f.error}"])
            continue
        safety = f.verdict if f.verdict == "safe" else f.verdict.upper()
        if f.refused_by_default_load and f.verdict == "safe":
            safety += "; " + f.default_load.brief()
        rows.append([_name(listing, f.path), f.format, f"{f.tensors:,}", f"{f.parameters:,}", human_bytes(f.nbytes),
                     ",".join(f.dtypes) or "-", safety])
    # one line per file, as `inspect FOLDER` promises: a safety detail too long for 120 columns goes below as a note
    return draw_table(["file", "format", "tensors", "parameters", "size", "dtypes", "safety"], rows, tablefmt,
                      overflow="notes")


def listing_summary(listing: FolderListing) -> list[str]:
    files = listing.files
    read = [f for f in files if not f.error]
    unsafe = [f for f in files if f.findings]
    lines = [f"total  {len(files):,} checkpoint file(s) in {listing.folder}: {sum(f.tensors for f in read):,} tensors, "
             f"{sum(f.parameters for f in read):,} parameters, {human_bytes(sum(f.nbytes for f in read))}"]
    if unsafe:
        lines.append(Line(f"UNSAFE  {len(unsafe)} file(s) would run code under torch.load(weights_only=False): "
                          + ", ".join(_name(listing, f.path) for f in unsafe[:5]) + (" …" if len(unsafe) > 5 else ""),
                          Severity.PROBLEM))
    refused = [f for f in files if f.refused_by_default_load and not f.findings]
    if refused:
        lines.append(f"torch.load  {len(refused)} file(s) that run nothing torch.load(path) refuses with its defaults here: "
                     + ", ".join(_name(listing, f.path) for f in refused[:5]) + (" …" if len(refused) > 5 else "")
                     + (" (--require-default-load: exit 1)" if listing.require_default_load else
                        "; inspecting the file says why, and the way out"))
    unreadable = [f for f in files if f.error and not f.findings]
    if unreadable:
        lines.append(Line(f"Error: {len(unreadable)} file(s) could not be read (see the safety column)",
                          Severity.PROBLEM))
    lines += [f"skipped {_name(listing, s.path)}: {s.reason}" for s in listing.skipped[:MAX_SKIPPED_LINES]]
    if len(listing.skipped) > MAX_SKIPPED_LINES:
        lines.append(f"skipped {len(listing.skipped) - MAX_SKIPPED_LINES:,} more files that are no checkpoint and run "
                     "nothing (--json lists them all)")
    lines += [Line(f"Error: {p}", Severity.PROBLEM) for p in listing.problems]
    if not files and not listing.problems:
        lines.append(Line(f"Error: {listing.folder}: no checkpoint found in the folder or below it", Severity.PROBLEM))
    return lines


def listing_json(listing: FolderListing) -> dict[str, Any]:
    read = [f for f in listing.files if not f.error]
    return {
        "ok": listing.exit_code == 0,
        "folder": str(listing.folder),
        "exit_code": listing.exit_code,
        "files": [{"path": str(f.path), "format": f.format, "tensors": f.tensors, "parameters": f.parameters,
                   "bytes": f.nbytes, "dtypes": list(f.dtypes), "verdict": f.verdict, "findings": list(f.findings),
                   "error": f.error, "link": f.link,
                   "default_load": f.default_load.json() if f.default_load is not None else None}
                  for f in listing.files],
        "total": {"files": len(listing.files), "tensors": sum(f.tensors for f in read),
                  "parameters": sum(f.parameters for f in read), "bytes": sum(f.nbytes for f in read),
                  "unsafe": sum(1 for f in listing.files if f.findings),
                  "unreadable": sum(1 for f in listing.files if f.error and not f.findings)},
        "skipped": [{"path": str(s.path), "reason": s.reason} for s in listing.skipped],
        "problems": list(listing.problems),
    }
