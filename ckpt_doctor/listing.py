"""`inspect DIR` of a folder holding many checkpoints (a run's saves, a model zoo, a downloads folder): one line per
file, read as `inspect FILE` reads it (the same report, so the same verdict), several files at once.

Files are found as `scan` finds them — at any depth, symlinks followed, judged by their bytes whatever their name —
and kept when they are a checkpoint, bear a checkpoint's name, or hold a pickle a loader would run (so whatever
`scan DIR` flags is listed, and sets the exit code). A subfolder that is one checkpoint is one line.
"""

from __future__ import annotations

from pathlib import Path

from ._record import record
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

    paths, problems = checkpoint_paths(folder)
    lines = [line for line in map_paths(inspect_line, paths) if line is not None]
    return FolderListing(folder, tuple(lines), tuple(problems))


def checkpoint_paths(folder: Path) -> tuple[list[Path], list[str]]:
    """What to list under `folder`, at any depth: every regular file (each is judged by inspect_line, which keeps
    the checkpoints and whatever a loader would unpickle, as scan does), every subfolder that is one checkpoint
    (a Hugging Face shard index, a DCP or DeepSpeed folder: one line, not one per shard), each real file once; in
    path order. Also the paths that could not be read."""
    from .readers import is_one_checkpoint
    from .sniff import folder_files

    found, problems = folder_files(folder, whole=is_one_checkpoint, once=True)
    return sorted(found, key=lambda p: p.parts), problems


def inspect_line(path: Path) -> FileLine | None:
    """One line: what `inspect PATH` reports, summed up; a file that cannot be read is a line with its error. None
    for a file that is no checkpoint and holds nothing a loader would unpickle (a README, an image)."""
    import gc

    from .readers import CHECKPOINT_SUFFIXES, read_file
    from .readers.survey import survey_file
    from .report import inspect_checkpoint
    from .scan import holds_no_pickle

    gc.disable()  # as in `inspect`: acyclic records, nothing for the collector to free (a forked worker too)
    try:
        if path.is_dir():
            report = inspect_checkpoint(path)
        else:
            survey = survey_file(path)
            if not path.name.lower().endswith(CHECKPOINT_SUFFIXES) and holds_no_pickle(survey):
                return None  # (a zip, tar or safetensors file always holds something: holds_no_pickle says no)
            report = inspect_checkpoint(path, checkpoint=read_file(path, survey))
    except CkptDoctorError as exc:
        findings = tuple(getattr(exc, "findings", ()))
        verdict = "dangerous" if any(f.endswith("(dangerous)") for f in findings) else "code" if findings else "safe"
        return FileLine(path, error=str(exc), findings=findings, verdict=verdict)
    except OSError as exc:
        return FileLine(path, error=f"{path}: cannot be read ({exc.strerror or exc})")
    ckpt = report.checkpoint
    return FileLine(path, ckpt.format.value, len(ckpt.tensors), report.parameter_count, report.total_bytes,
                    tuple(sorted({t.dtype for t in ckpt.tensors})), ckpt.verdict.value, ckpt.finding_names())
