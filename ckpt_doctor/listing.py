"""`inspect DIR` of a folder holding many checkpoints (a run's saves, a model zoo, a downloads folder): one line per
file, read as `inspect FILE` reads it (the same report, so the same verdict), several files at once.

Files are found as `scan` finds them — recursively, symlinks followed, sniffed by their bytes whatever their name —
and kept when they look like a checkpoint (a zip, a tar, safetensors, or a pickle).
"""

from __future__ import annotations

from ._record import record
from pathlib import Path

from .errors import CkptDoctorError


@record
class FileLine:
    path: Path
    format: str | None = None
    tensors: int = 0
    parameters: int = 0
    nbytes: int = 0  # of distinct storages
    dtypes: tuple[str, ...] = ()
    verdict: str = "safe"  # of its globals and hazards: safe, code, dangerous
    findings: tuple[str, ...] = ()
    error: str | None = None

    @property
    def exit_code(self) -> int:
        if self.findings:
            return 1
        return 2 if self.error else 0


@record
class FolderListing:
    folder: Path
    files: tuple[FileLine, ...]
    problems: tuple[str, ...] = ()  # paths under the folder that could not be listed

    @property
    def exit_code(self) -> int:
        """1 when a file would run code (as `inspect FILE`), else 2 when one could not be read, else 0."""
        codes = {f.exit_code for f in self.files}
        if 1 in codes:
            return 1
        return 2 if 2 in codes or self.problems else 0


def list_folder(folder: Path) -> FolderListing:
    from .pool import map_paths
    from .readers import _looks_like_checkpoint
    from .sniff import folder_files

    found, problems = folder_files(folder)
    paths = [p for p in found if _looks_like_checkpoint(p)]
    return FolderListing(folder, tuple(map_paths(inspect_line, paths)), tuple(problems))


def inspect_line(path: Path) -> FileLine:
    """One file's line: what `inspect FILE` reports, summed up; a file that cannot be read is a line with its error."""
    import gc

    from .report import inspect_checkpoint

    gc.disable()  # as in `inspect`: acyclic records, nothing for the collector to free (a forked worker too)
    try:
        report = inspect_checkpoint(path)
    except CkptDoctorError as exc:
        findings = tuple(getattr(exc, "findings", ()))
        verdict = "dangerous" if any(f.endswith("(dangerous)") for f in findings) else "code" if findings else "safe"
        return FileLine(path, error=str(exc), findings=findings, verdict=verdict)
    ckpt = report.checkpoint
    return FileLine(path, ckpt.format.value, len(ckpt.tensors), report.parameter_count, report.total_bytes,
                    tuple(sorted({t.dtype for t in ckpt.tensors})), ckpt.verdict.value, ckpt.finding_names())
