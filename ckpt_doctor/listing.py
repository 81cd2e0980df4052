"""`inspect DIR` of a folder holding many checkpoints (a run's saves, a model zoo, a downloads folder): one line per
file, read as `inspect FILE` reads it (the same report, so the same verdict), several files at once.

Files are found as `scan` finds them — at any depth, file links followed, folder links only inside the folder,
special files skipped with a line, judged by their bytes whatever their name — and kept when they are a checkpoint,
bear a checkpoint's name, or hold a pickle a loader would run (so whatever `scan DIR` flags is listed, and sets the
exit code). A subfolder that is one checkpoint is one line. The other files (text, images, HDF5 files, clean NumPy
arrays) are skipped, each with what it is, and set no exit code.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any

from pathlib import Path

from ._record import field, record
from .errors import CkptDoctorError
from .pool import map_paths
from .readers import checkpoint_paths, read_file
from .readers.survey import survey_file
from .report import inspect_checkpoint
from .safepickle.policy import DEFAULT_POLICY, Policy
from .scan import Skipped, is_skipped
from .sniff import link_target


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
    default_load: Any = None  # DefaultLoad: what torch.load(path) with torch's defaults does here
    link: str | None = None  # where the symlink at `path` points

    @property
    def exit_code(self) -> int:
        if self.findings:
            return 1
        return 2 if self.error else 0

    @property
    def refused_by_default_load(self) -> bool:
        return self.default_load is not None and not self.default_load.ok


@record
class FolderListing:
    folder: Path
    files: tuple[FileLine, ...]
    problems: tuple[str, ...] = ()  # paths under the folder that could not be listed
    skipped: tuple[Skipped, ...] = field(default=())  # files that are no checkpoint and run nothing
    require_default_load: bool = False  # --require-default-load: a file torch.load(path) refuses counts as 1

    @property
    def exit_code(self) -> int:
        """1 when a file would run code (as `inspect FILE`), or torch.load refuses one under --require-default-load;
        else 2 when one could not be read, else 0."""
        codes = {f.exit_code for f in self.files}
        if 1 in codes or self.require_default_load and any(f.refused_by_default_load for f in self.files):
            return 1
        return 2 if 2 in codes or self.problems else 0


def list_folder(folder: Path, require_default_load: bool = False, *,
                policy: Policy = DEFAULT_POLICY) -> FolderListing:
    """`inspect FOLDER` of many checkpoints: one line per file, each read under `policy`."""
    import functools

    paths, problems, walk_skipped = checkpoint_paths(folder)
    results = map_paths(functools.partial(inspect_line, policy=policy), paths)
    lines = tuple(r for r in results if isinstance(r, FileLine))
    skipped = [Skipped(p, why) for p, why in walk_skipped] + [r for r in results if isinstance(r, Skipped)]
    return FolderListing(folder, lines, tuple(problems), tuple(skipped), require_default_load)


def inspect_line(path: Path, *, policy: Policy = DEFAULT_POLICY) -> FileLine | Skipped:
    """One line: what `inspect PATH` reports, summed up; a file that cannot be read is a line with its error. A file
    that is no checkpoint and names nothing off the allow-list (a README, an image, a NumPy array) is Skipped, as
    `scan DIR` skips it — unless it bears a checkpoint's name (`model.pt` that is a web page is an error)."""
    import gc


    link = link_target(path)
    gc.disable()  # as in `inspect`: acyclic records, nothing for the collector to free (a forked worker too)
    try:
        if path.is_dir():
            report = inspect_checkpoint(path, policy=policy)
        else:
            survey = survey_file(path, policy=policy)
            try:
                checkpoint = read_file(path, survey)
            except CkptDoctorError as exc:
                if is_skipped(exc, survey, path):
                    return Skipped(path, str(exc).removeprefix(f"{path}: "))
                raise
            report = inspect_checkpoint(path, checkpoint=checkpoint, policy=policy)
    except CkptDoctorError as exc:
        findings = tuple(getattr(exc, "findings", ()))
        verdict = "dangerous" if any(f.endswith("(dangerous)") for f in findings) else "code" if findings else "safe"
        return FileLine(path, error=str(exc), findings=findings, verdict=verdict, link=link)
    except OSError as exc:
        return FileLine(path, error=f"{path}: cannot be read ({exc.strerror or exc})", link=link)
    ckpt = report.checkpoint
    return FileLine(path, ckpt.format.value, len(ckpt.tensors), report.parameter_count, report.total_bytes,
                    tuple(sorted({t.dtype for t in ckpt.tensors})), ckpt.verdict.value, ckpt.finding_names(),
                    default_load=report.default_load, link=link)
