"""scan: what every pickle in the given files and folders would make torch.load(weights_only=False) run.

Each file is surveyed (readers/survey.py: every pickle walked statically, wherever it hides) and then read as a
checkpoint, exactly as `inspect` reads it: the two commands share both steps, so their verdicts cannot differ.
Folders are scanned as torch and the Hugging Face Hub see them: recursively, symlinks followed, every regular file
sniffed by its content whatever its name; the folder's verdict is the worst of its files. A file of a folder that is
no checkpoint (text, an image, an HDF5 file, a NumPy array) and names no global off the allow-list is skipped, with
a line that says what it is; named alone, it is an error (exit 2).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ._record import field, record, replace
from .advice import Suggestion
from .default_load import DefaultLoad, default_load
from .errors import CkptDoctorError, NotACheckpoint
from .readers import index_members, named_as_checkpoint, read_file, remote_members
from .readers.source import real_url
from .readers.survey import Survey, survey_file
from .records import GlobalRef, Hazard
from .safepickle.policy import DEFAULT_POLICY, Policy, Verdict
from .sniff import Container, dangling, deep, kernel_filesystem, link_target, walk_folder, other_format


@record
class FileScan:
    path: Path
    container: str | None  # what the bytes are: zip, tar, pickle, safetensors, npy, other
    format: str | None  # the checkpoint format, when it reads as a checkpoint
    globals: tuple[GlobalRef, ...]
    hazards: tuple[Hazard, ...] = ()
    error: str | None = None  # why it does not read as a checkpoint
    notes: tuple[str, ...] = ()
    link: str | None = None  # where the symlink at `path` points
    default_load: DefaultLoad | None = None  # what torch.load(path) with torch's defaults does here (when read)
    rescue: Suggestion | None = None  # the `fix` that writes a file torch.load loads with its defaults, when needed
    advice: tuple[tuple[str, Suggestion], ...] = ()  # the commands its notes print (Checkpoint.advice)

    @property
    def findings(self) -> tuple[GlobalRef, ...]:
        return tuple(g for g in self.globals if g.verdict is not Verdict.SAFE)

    @property
    def dangerous(self) -> tuple[GlobalRef, ...]:
        return tuple(g for g in self.globals if g.verdict is Verdict.DANGEROUS)

    @property
    def verdict(self) -> Verdict:
        return max([g.verdict for g in self.globals] + [h.verdict for h in self.hazards], key=lambda v: v.rank,
                   default=Verdict.SAFE)

    @property
    def exit_code(self) -> int:
        if self.verdict is not Verdict.SAFE:
            return 1
        return 2 if self.error else 0

    @property
    def refused_by_default_load(self) -> bool:
        return self.default_load is not None and not self.default_load.ok


@record
class Skipped:
    """A file of a folder that is no checkpoint and holds nothing a loader would run: said, and left out."""
    path: Path
    reason: str  # what it is: `not a PyTorch checkpoint: an HDF5 file (Keras/h5py); load it with …`


@record
class ScanReport:
    files: tuple[FileScan, ...]
    problems: tuple[str, ...] = ()  # paths that could not be scanned at all
    skipped: tuple[Skipped, ...] = field(default=())  # files of a folder that are no checkpoint and run nothing
    require_default_load: bool = False  # --require-default-load: a file torch.load(path) refuses is a finding

    @property
    def verdict(self) -> Verdict:
        return max((f.verdict for f in self.files), key=lambda v: v.rank, default=Verdict.SAFE)

    @property
    def findings(self) -> int:
        return sum(len(f.findings) + len(f.hazards) for f in self.files)

    @property
    def errors(self) -> tuple[str, ...]:
        return tuple(f.error for f in self.files if f.error and f.verdict is Verdict.SAFE) + self.problems

    @property
    def exit_code(self) -> int:
        """1 when anything would run code (the worst file decides), or torch.load with its defaults refuses a file
        and --require-default-load asks that it not; else 2 when something could not be checked."""
        if self.verdict is not Verdict.SAFE:
            return 1
        if self.require_default_load and any(f.refused_by_default_load for f in self.files):
            return 1
        return 2 if self.errors else 0


def scan_file(path: Path, *, in_folder: bool = False, policy: Policy = DEFAULT_POLICY) -> FileScan | None:
    """The scan of one file under `policy`; None for a file of a folder that is skipped (scan_one)."""
    result = scan_one(path, in_folder=in_folder, policy=policy)
    return None if isinstance(result, Skipped) else result


def scan_one(path: Path, *, in_folder: bool = False, taken: set[str] | None = None,
             policy: Policy = DEFAULT_POLICY) -> FileScan | Skipped:
    """The scan of one file, its globals judged by `policy`. A file found in a folder is Skipped when it is no
    checkpoint and names nothing off the allow-list (an image, an HDF5 file, a clean NumPy array), or holds no pickle
    at all (a README)."""
    link = link_target(path)
    try:
        survey = survey_file(path, policy=policy)
    except CkptDoctorError as exc:
        return FileScan(path, None, None, (), error=str(exc), link=link)
    fmt, error, loads, fix, advice = None, None, None, None, ()
    try:
        ckpt = read_file(path, survey)
        fmt = ckpt.format.value
        globals_, hazards, notes, advice = ckpt.globals, ckpt.hazards, ckpt.notes, ckpt.advice
        loads = default_load(ckpt)
        if not loads.ok or ckpt.verdict is not Verdict.SAFE:
            from .fix.rescue import rescue  # the fix planner: only for a file torch.load refuses

            fix = rescue(ckpt, ["--map-location", "cpu"] if loads.missing_devices else [], taken, policy=policy)
    except CkptDoctorError as exc:
        if in_folder and is_skipped(exc, survey, path):
            return Skipped(path, str(exc).removeprefix(f"{path}: "))
        error = str(exc)
        globals_, hazards, notes = tuple(survey.globals), tuple(survey.hazards), tuple(survey.notes)
    return FileScan(path, survey.container.value, fmt, tuple(_dedupe(globals_)), tuple(hazards), error,
                    tuple(dict.fromkeys(notes)), link, loads, fix, advice)


def is_skipped(exc: CkptDoctorError, survey: Survey, path: Path) -> bool:
    """Whether a file of a folder that did not read as a checkpoint is left out of the folder's verdict: it is
    something else (NotACheckpoint) or holds no pickle, names nothing a loader would run, and is not named as a
    checkpoint unless its bytes say what else it is (an HDF5 `weights.bin`, Core ML's `weight.bin`, a NumPy array
    as `x.pt` are skipped; a git-lfs pointer, a web page or an empty `model.pt` is a checkpoint that is missing or
    broken: an error; `.tar` is every tar archive's name)."""
    if getattr(exc, "findings", ()) or survey.findings or survey.hazards:
        return False
    if named_as_checkpoint(path, tar_archive=survey.container is Container.TAR) and not other_format(survey.head):
        return False
    return isinstance(exc, NotACheckpoint) or holds_no_pickle(survey)


def holds_no_pickle(survey: Survey) -> bool:
    """Nothing in the file any loader would unpickle, and no checkpoint container: a README, an image."""
    if survey.globals or survey.hazards:
        return False
    if survey.container in (Container.OTHER, Container.EMPTY):
        return True
    walked = survey.main_walk
    return (survey.container is Container.PICKLE and not survey.globals and walked is not None
            and not walked.pickles)


def _dedupe(refs) -> list[GlobalRef]:
    seen: dict[tuple[str, str, str], GlobalRef] = {}
    for ref in refs:
        seen.setdefault((ref.module, ref.name, ref.source.split(" at byte ")[0]), ref)
    return list(seen.values())


def files_to_scan(paths: list[str], policy: Policy = DEFAULT_POLICY
                  ) -> tuple[list[tuple[Path, bool]], list[str], list[Skipped]]:
    """(file, found in a folder) for every path named and every regular file under folders named (sniff.walk_folder:
    file links followed, folder links only inside the folder, special files skipped); problems for paths that do
    not exist or cannot be listed; what the walks skipped, each with why."""
    files: list[tuple[Path, bool]] = []
    problems: list[str] = []
    skipped: list[Skipped] = []
    for raw in paths:
        path = deep(raw)
        if type(path).__name__ == "RemotePath":  # a URL: read by range requests (readers/source.py)
            try:
                members = remote_members(real_url(path), policy=policy)  # a shard index's shards, an s3:// folder's objects
            except CkptDoctorError as exc:
                problems.append(str(exc))
                continue
            files += [(path, False)] if members is None else [(p, True) for p in members]
            continue
        try:
            st = os.stat(path)
        except OSError as exc:
            if link_target(path) is not None:
                problems.append(dangling(path))
            elif exc.errno == errno.ENOENT:
                problems.append(f"{path}: no such file or directory")
            else:
                problems.append(f"{path}: cannot be read ({exc.strerror})")
            continue
        mode, kind = st.st_mode, kernel_filesystem(st.st_dev)
        if kind is not None and not stat.S_ISDIR(mode):
            problems.append(f"{path}: a file of the kernel's {kind} filesystem, not a checkpoint on disk: not read")
        elif stat.S_ISDIR(mode):
            walked = walk_folder(path)
            problems += walked.problems
            skipped += [Skipped(p, why) for p, why in walked.skipped]
            files += [(p, True) for p in walked.files]
        elif not stat.S_ISREG(mode):
            problems.append(f"{path}: not a regular file")
        elif path.name.endswith(".index.json"):  # a shard index: its shards, as inspect reads it
            try:
                files += [(shard, False) for shard in index_members(path)]
            except CkptDoctorError as exc:
                problems.append(str(exc))
        else:
            files.append((path, False))
    return files, problems, skipped


def _is_folder(raw: str) -> bool:
    if raw.startswith(("https://", "http://", "s3://")):  # a URL names a file (readers/source.py)
        return False
    try:
        return stat.S_ISDIR(os.stat(deep(raw)).st_mode)
    except OSError:
        return False


def _with_dcp_items(results: list[FileScan], skipped: list[Skipped], unread: list[str],
                    policy: Policy = DEFAULT_POLICY) -> tuple[list[FileScan], list[Skipped]]:
    """In a torch.distributed.checkpoint folder, the byte ranges its metadata names are what torch's DCP reader
    loads: each is walked too (a range need not start where the file's own archives do)."""
    # only when a DCP folder is scanned: the DCP reader and what it imports
    from .readers.dcp import METADATA, RANK_METADATA, inflate_zstd, metadata_items
    from .readers.mapping import file_size  # (only when a DCP folder is scanned)
    from .readers.source import close_source, open_source
    from .readers.survey import survey_item
    from .safepickle import limits  # (only when a DCP folder is scanned)

    folders = {r.path.parent for r in results if r.path.name == METADATA or RANK_METADATA.fullmatch(r.path.name)}
    ranges: dict[Path, list[tuple[int, int, tuple[str, ...]]]] = {}
    for folder in sorted(folders, key=str):
        remote = type(folder).__name__ == "RemotePath"  # a URL's folder is not listed again: its objects scanned
        names = [p.name for p in (*(r.path for r in results), *(s.path for s in skipped)) if p.parent == folder]
        try:
            ranges.update(metadata_items(folder, names if remote else None, policy=policy))
        except CkptDoctorError as exc:
            unread.append(f"{exc} — the items torch's DCP loader would unpickle from it were not all walked")
    # A shard of compressed items holds no pickle a file reader sees: it is scanned through its items.
    results = results + [FileScan(s.path, "other", None, ()) for s in skipped if s.path in ranges]
    skipped = [s for s in skipped if s.path not in ranges]
    out = []
    errors: list[str] = []
    for result in results:
        spans = ranges.get(result.path)
        if spans:
            extra_globals, extra_hazards = [], []
            fd = open_source(result.path)  # a descriptor, or a URL's remote object (its blocks kept)
            try:
                size = file_size(fd)
                for at, length, transforms in sorted(set(spans)):
                    if at >= size:
                        continue
                    length = min(length, size - at)  # torch's reader reads an item up to the end of its file
                    if transforms:  # a zstd-compressed item: walked inflated (to at most what one may hold)
                        try:
                            inflated, _, full = inflate_zstd(result.path, at, length, limits.MAX_INFLATED_TOTAL,
                                                             f"{result.path} item at byte {at}")
                        except CkptDoctorError as exc:
                            errors.append(str(exc))
                            continue
                        ifd = os.open(inflated, os.O_RDONLY)
                        try:
                            item = survey_item(inflated, ifd, 0, full, policy=policy)
                        finally:
                            os.close(ifd)
                            os.unlink(inflated)  # walked: not kept
                    else:
                        item = survey_item(result.path, fd, at, length, policy=policy)
                    extra_globals += item.globals
                    extra_hazards += item.hazards
            finally:
                close_source(fd)
            known = {h.what for h in result.hazards}
            result = replace(result, globals=tuple(_dedupe([*result.globals, *extra_globals])),
                             hazards=(*result.hazards, *(h for h in extra_hazards if h.what not in known)),
                             error=result.error or (errors[0] if errors else None))
            errors.clear()
        out.append(result)
    return out, skipped


def _identity(path: Path) -> tuple[int, ...] | None:
    """Which file a local path is (device, inode, size, modification time; links followed); None for a URL."""
    if type(path).__name__ == "RemotePath":
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _alias(first: FileScan, path: Path) -> FileScan:
    """The scan of `first`'s file under another name: its verdict; the rescue it suggests is `first`'s (one output
    for the one file), said in a note."""
    note = f"the same file as {first.path} (scanned once)"
    return replace(first, path=path, link=link_target(path), rescue=None, notes=(*first.notes, note))


def scan(paths: list[str], *, require_default_load: bool = False, policy: Policy = DEFAULT_POLICY) -> ScanReport:
    """What `scan PATHS` reports: every file named or found under a folder, its globals judged by `policy` (the
    defaults unless one is passed: `Policy.allowing([...])` adds names, as --allow-global does)."""
    files, problems, walk_skipped = files_to_scan(paths, policy)
    results: list[FileScan] = []
    skipped: list[Skipped] = []
    taken: set[str] = set()  # the outputs the rescues suggest: a.pt and a.pth are not both rescued to a_fixed.pt
    # A file under several names (links to one file, in a folder or named twice) is walked once: each name gets its
    # verdict, so a folder of a thousand links to one shard costs one shard's scan, not a thousand.
    done: dict[tuple[int, ...], FileScan | Skipped] = {}
    stopped: set = set()  # remote DCP folders whose files cost more than their items (readers/dcp.fetch_overrun)
    for path, in_folder in files:
        if type(path).__name__ == "RemotePath" and in_folder:
            from .readers.dcp import fetch_overrun  # (only for a remote folder's files)

            if path.parent in stopped:
                continue
            why = fetch_overrun(path.parent)
            if why is not None:
                problems.append(why)
                stopped.add(path.parent)
                continue
        same = _identity(path)
        first = done.get(same) if same is not None else None
        if first is not None:
            results.append(_alias(first, path)) if isinstance(first, FileScan) else \
                skipped.append(Skipped(path, first.reason))
            continue
        result = scan_one(path, in_folder=in_folder, taken=taken, policy=policy)
        if same is not None:
            done[same] = result
        if isinstance(result, Skipped):
            skipped.append(result)
        else:
            results.append(result)
    results, skipped = _with_dcp_items(results, skipped, problems, policy)
    skipped = walk_skipped + skipped  # never opened: a pipe a DCP folder's metadata names as a shard included
    for folder in (deep(p) for p in paths if _is_folder(p)):
        if not any(folder in r.path.parents for r in results):
            count = sum(1 for s in skipped if folder in s.path.parents)
            problems.append(f"{folder}: folder holds nothing to scan: none of its {count} files is a checkpoint or "
                            "names a global")
    return ScanReport(tuple(results), tuple(problems), tuple(skipped), require_default_load)
