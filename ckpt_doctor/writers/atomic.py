"""Atomic output: a temporary file beside the destination, fsynced and renamed; an existing output needs --force."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Iterator

from ..errors import Rerun, WriteError
from ..readers.source import is_url
from ..units import human_bytes


def is_input(path: Path, inputs: tuple[Path, ...]) -> bool:
    """Whether `path` is one of the local `inputs` (a remote input is never a local file)."""
    for source in inputs:
        if is_url(source):
            continue
        try:
            if path.exists() and os.path.samefile(path, source):
                return True
        except FileNotFoundError:
            pass
    return False


def check_destination(output: Path, inputs: tuple[Path, ...], force: bool) -> None:
    """Refuse to overwrite an input (ever) or an existing output (without --force)."""
    if is_url(output):
        raise WriteError(f"{output}: ckpt-doctor writes local files only; give a path on this machine")
    if is_input(output, inputs):
        raise WriteError(f"{output}: is the input file; the input is never modified — write elsewhere")
    if output.is_dir():
        raise WriteError(f"{output}: is a directory; give a file name such as {output / 'model.safetensors'}")
    if (output.exists() or output.is_symlink()) and not force:
        raise WriteError(f"{output}: already exists; replace it with {{0}}", reruns=(Rerun(add=("--force",)),))
    check_folder(output)


def check_folder(output: Path) -> None:
    """The folder `output` is to be written in: there, a folder, writable."""
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.is_dir():
        raise WriteError(f"{output}: {parent} is a file, not a folder" if parent.exists() else
                         f"{output}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise WriteError(f"{output}: folder {parent} is not writable (permission denied)")


class StagedFiles:
    """Files written whole (each fsynced in its temporary file) and renamed into place together, in the order they
    were written, once all are: a failure before then leaves none of them, and the files they would replace as they
    were. What several files make one output of (shards and their index) needs it."""

    def __init__(self) -> None:
        self.pending: list[tuple[Path, Path]] = []  # (temporary file, destination)
        self.placed: list[Path] = []

    def commit(self) -> None:
        """Each file renamed into place, in order. The last (an index naming the others), where one is there from
        before, is removed first: killed between two renames, the folder holds no index, never an old one naming
        some new files and some old."""
        if len(self.pending) > 1:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.pending[-1][1])
        for tmp, output in self.pending:
            try:
                os.replace(tmp, output)
            except OSError as exc:
                raise WriteError(f"{output}: write failed ({exc.strerror}); nothing was written") from None
            self.placed.append(output)
        for folder in {output.parent if str(output.parent) else Path(".") for _, output in self.pending}:
            fsync_dir(folder)

    def discard(self) -> None:
        """Removes every temporary file, and what a commit that failed partway had renamed into place."""
        for path in (*(tmp for tmp, _ in self.pending), *self.placed):
            with contextlib.suppress(OSError):
                path.unlink()


@contextlib.contextmanager
def staged_outputs() -> Iterator[StagedFiles]:
    """The StagedFiles that atomic_output(…, staged=) calls in the block write: renamed into place when the block
    ends, removed when it fails (an interrupted run too)."""
    staged = StagedFiles()
    try:
        yield staged
        staged.commit()
    except BaseException:
        staged.discard()
        raise


@contextlib.contextmanager
def atomic_output(output: Path, size_hint: int = 0, staged: StagedFiles | None = None) -> Iterator[tuple[int, Path]]:
    """(fd, temp path) of a new file beside `output`; renamed onto `output` only if the block succeeds (with
    `staged`, once every file of the staged_outputs block is written).

    A symlink at `output` is replaced by the new file, never written through. On any failure (a full disk,
    an interrupted run) the temporary file is removed and `output` is left as it was. `size_hint` (about what
    will be written) goes into the message for a full disk.
    """
    parent = output.parent if str(output.parent) else Path(".")
    remove_stale_temps(output)
    fd, tmp_path = _create_temp(output, parent)
    try:
        yield fd, tmp_path
        os.fsync(fd)
        os.close(fd)
        fd = -1
        if staged is not None:
            staged.pending.append((tmp_path, output))  # (the temporary file is the staged one's to rename or remove)
            return
        os.replace(tmp_path, output)
        fsync_dir(parent)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise WriteError(f"{output}: no space left{_space_note(parent, size_hint)}; nothing was written") \
                from None
        if exc.errno == errno.EFBIG:
            raise WriteError(f"{output}: the file size limit (ulimit -f) is reached; nothing was written") from None
        raise WriteError(f"{output}: write failed ({exc.strerror}); nothing was written") from None
    finally:
        if fd >= 0:
            os.close(fd)
        if staged is None or (tmp_path, output) not in staged.pending:
            with contextlib.suppress(FileNotFoundError):
                tmp_path.unlink()


TEMP_SUFFIX = ".ckpt-doctor-tmp"


def _create_temp(output: Path, parent: Path) -> tuple[int, Path]:
    """A new file `.NAME.PID.RANDOM.ckpt-doctor-tmp` beside `output`, with the mode a plain new file gets (the
    umask applies). What tempfile.mkstemp does, without the 5 ms its import costs every `fix`."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = parent / f".{output.name}.{os.getpid()}.{os.urandom(4).hex()}{TEMP_SUFFIX}"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
        except OSError as exc:
            raise WriteError(f"{output}: cannot create a temporary file in {parent} ({exc.strerror})") from None
    raise WriteError(f"{output}: cannot create a temporary file in {parent} (every name tried exists)")


def remove_stale_temps(output: Path) -> None:
    """Temporary files a killed run left beside `output` (their process is gone) are removed."""
    parent = output.parent if str(output.parent) else Path(".")
    for leftover in parent.glob(f".{glob_escape(output.name)}.*{TEMP_SUFFIX}"):
        pid = leftover.name[len(output.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                leftover.unlink()


def glob_escape(name: str) -> str:
    import glob

    return glob.escape(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _space_note(folder: Path, needed: int) -> str:
    """` (needs about 12.0 MB, 5.0 MB free in FOLDER)`, or what of it is known."""

    parts = [f"needs about {human_bytes(needed)}"] if needed else []
    try:
        info = os.statvfs(folder)
        parts.append(f"{human_bytes(info.f_bavail * info.f_frsize)} free in {folder}")
    except (OSError, AttributeError):
        pass
    return f" ({', '.join(parts)})" if parts else ""


def fsync_dir(folder: Path) -> None:
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
