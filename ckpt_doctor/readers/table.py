"""The one table of input formats: for each, how a file of it is known from its first bytes, how every pickle it can
hold is walked, what reads it, and whether a model folder's file of it is a checkpoint. The sniffer's order, the
survey's walk and the readers' dispatch all follow it: a new format is one reader module and one row here (see
"Adding an input format" in docs/development.md)."""

from __future__ import annotations

import os
from importlib import import_module

from .._record import record
from ..sniff import (HEAD, Container, anything, is_empty, is_npy, is_pickle, is_tar, is_zip, looks_like_safetensors,
                     tarfile_opens)

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from pathlib import Path
    from typing import Any, Callable

    from ..records import Checkpoint
    from .survey import Survey


@record
class Reader:
    """One input format. Each function is given as itself or as "module:function", the module relative to
    ckpt_doctor.readers, imported when a file first needs it: a reader's own imports wait for a file of its kind."""

    container: Container  # what the bytes are (scan's `container`): Container.declare("toy") for a new format
    claims: Callable[[bytes, int], bool] | str  # (the first HEAD bytes, the file's size) -> whether they are its
    read: Callable[[Path, Survey], Checkpoint] | str  # -> the Checkpoint, or ReadError / NotACheckpoint saying why not
    # (survey, fd) -> None: walks every pickle a loader could run from such a file into the survey. torch.load
    # unpickles from byte 0 a file it takes for no zip and no tar, so a row walks that unless it says otherwise.
    survey: Callable[[Survey, Any], None] | str | None = ".survey:survey_pickles"
    confirm: Callable[[int, bytes], bool] | str | None = None  # (fd, head): a second look at a local file it claims
    in_folder: Callable[[Path, bytes], bool] | str | bool = True  # a model folder's file of it is a checkpoint


# In torch.load's order (a zip, then a tar, then a pickle from byte 0): the first row that claims a file's bytes
# (and, for a local file, confirms them) names it. A format whose bytes another row would claim too goes above it.
# The built-in walks and readers are named, not imported: survey.py and files.py follow this table (they import it).
READERS: tuple[Reader, ...] = (
    Reader(Container.EMPTY, is_empty, ".files:read_empty", survey=None, in_folder=False),
    Reader(Container.ZIP, is_zip, ".files:read_zip", survey=".survey:survey_zip", in_folder=".files:zip_in_folder"),
    Reader(Container.TAR, is_tar, ".files:read_tar", survey=".survey:survey_tar", confirm=tarfile_opens),
    Reader(Container.SAFETENSORS, looks_like_safetensors, ".files:read_safetensors_file"),
    Reader(Container.NUMPY, is_npy, ".files:read_npy", survey=".survey:survey_npy", in_folder=False),
    Reader(Container.PICKLE, is_pickle, ".files:read_pickle", in_folder=".files:pickle_in_folder"),
    Reader(Container.OTHER, anything, ".files:read_other", survey=None, in_folder=False),
)


def sniff_head(head: bytes, size: int, fd: int | None = None) -> Container:
    """The container of a file whose first bytes are `head` (HEAD of them, or all of a shorter file); `fd`, an open
    local file, for the rows that take a second look."""
    for row in READERS:
        if function(row.claims)(head, size) and (fd is None or row.confirm is None or
                                                 function(row.confirm)(fd, head)):
            return row.container
    return Container.OTHER


def sniff_file(fd: int, size: int) -> tuple[Container, bytes]:
    """The container of an open local file, and its first bytes."""
    head = os.pread(fd, HEAD, 0)
    return sniff_head(head, size, fd), head


def reader(container: Container) -> Reader:
    """The row of a container."""
    for row in READERS:
        if row.container is container:
            return row
    raise AssertionError(f"no row of readers/table.py reads {container.value}")


def walk_pickles(survey: Survey, fd: Any) -> None:
    """Walk what the row of the survey's container walks."""
    walk = reader(survey.container).survey
    if walk is not None:
        function(walk)(survey, fd)


def is_checkpoint_in_folder(container: Container, path: Path, head: bytes) -> bool:
    """Whether a model folder's file of this container is a checkpoint to read (not a README or an image)."""
    test = reader(container).in_folder
    return test if isinstance(test, bool) else bool(function(test)(path, head))


_functions: dict[str, Any] = {}


def function(ref: Callable | str) -> Any:
    """A row's function: itself, or the one its "module:function" names (imported the first time it is needed)."""
    if not isinstance(ref, str):
        return ref
    found = _functions.get(ref)
    if found is None:
        module, _, name = ref.partition(":")
        found = _functions[ref] = getattr(import_module(module, __package__), name)
    return found
