"""Renders a FolderListing (`inspect DIR` of a folder of checkpoints): one row per file, a total, the JSON."""

from __future__ import annotations

from ..analyze import human_bytes
from ..listing import FolderListing

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any


def _name(listing: FolderListing, path) -> str:
    try:
        return str(path.relative_to(listing.folder))
    except ValueError:
        return str(path)


def listing_table(listing: FolderListing) -> str:
    from .columns import simple_table

    rows = []
    for f in listing.files:
        if f.error:
            verdict = f.verdict.upper() if f.findings else "unreadable"
            rows.append([_name(listing, f.path), "-", "-", "-", "-", "-", f"{verdict}: {f.error}"])
            continue
        rows.append([_name(listing, f.path), f.format, f"{f.tensors:,}", f"{f.parameters:,}", human_bytes(f.nbytes),
                     ",".join(f.dtypes) or "-", f.verdict if f.verdict == "safe" else f.verdict.upper()])
    return simple_table(["file", "format", "tensors", "parameters", "size", "dtypes", "safety"], rows,
                        max_width=None)  # one line per file, as `inspect FOLDER` promises


def listing_summary(listing: FolderListing) -> list[str]:
    files = listing.files
    read = [f for f in files if not f.error]
    unsafe = [f for f in files if f.findings]
    lines = [f"total  {len(files):,} checkpoint file(s) in {listing.folder}: {sum(f.tensors for f in read):,} tensors, "
             f"{sum(f.parameters for f in read):,} parameters, {human_bytes(sum(f.nbytes for f in read))}"]
    if unsafe:
        lines.append(f"UNSAFE  {len(unsafe)} file(s) would run code under torch.load(weights_only=False): "
                     + ", ".join(_name(listing, f.path) for f in unsafe[:5]) + (" …" if len(unsafe) > 5 else ""))
    unreadable = [f for f in files if f.error and not f.findings]
    if unreadable:
        lines.append(f"Error: {len(unreadable)} file(s) could not be read (see the safety column)")
    lines += [f"Error: {p}" for p in listing.problems]
    if not files and not listing.problems:
        lines.append(f"Error: {listing.folder}: no checkpoint found in the folder or below it")
    return lines


def listing_json(listing: FolderListing) -> dict[str, Any]:
    read = [f for f in listing.files if not f.error]
    return {
        "folder": str(listing.folder),
        "exit_code": listing.exit_code,
        "files": [{"path": str(f.path), "format": f.format, "tensors": f.tensors, "parameters": f.parameters,
                   "bytes": f.nbytes, "dtypes": list(f.dtypes), "verdict": f.verdict, "findings": list(f.findings),
                   "error": f.error} for f in listing.files],
        "total": {"files": len(listing.files), "tensors": sum(f.tensors for f in read),
                  "parameters": sum(f.parameters for f in read), "bytes": sum(f.nbytes for f in read),
                  "unsafe": sum(1 for f in listing.files if f.findings),
                  "unreadable": sum(1 for f in listing.files if f.error and not f.findings)},
        "problems": list(listing.problems),
    }
