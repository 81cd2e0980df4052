"""One checkpoint file, read by the reader its container's row of readers/table.py names (torch zip, pre-0.4 tar,
legacy pickle, safetensors; what is no checkpoint said as what it is). Folder readers read their member files
with it."""

from __future__ import annotations

import os
from pathlib import Path

from .._record import replace
from ..errors import NotACheckpoint, ReadError
from ..records import Checkpoint, Verdict
from ..safepickle.policy import DEFAULT_POLICY, Policy
from ..sniff import Container, describe_other, what_else
from .source import close_source, open_source
from .survey import NPY_NOTE, Survey, survey_file
from .table import function, reader

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".pkl", ".tar", ".model", ".pth.tar")

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Callable


def read_file(path: Path, survey: Survey | None = None, *, policy: Policy = DEFAULT_POLICY) -> Checkpoint:
    """One file of a container the file readers know: what a folder reader reads its members (a DeepSpeed rank's
    states, Lightning's meta.pt) with. `readers.read_file` adds what a lone file is within its folder. `policy`
    judges its globals (a survey given was made under its own)."""
    return read_surveyed(path, survey or survey_file(path, policy=policy), read_container)


def read_surveyed(path: Path, survey: Survey, read: Callable[[Path, Survey], Checkpoint]) -> Checkpoint:
    """One checkpoint file. Every pickle in it is walked first (survey.py); what the walk found is the
    checkpoint's globals, and stays known when the file then fails to read: a broken file that names a global
    off the allow-list is reported as unsafe (exit 1), not merely as corrupt."""
    try:
        if survey.refused:
            if survey.container is Container.PICKLE:  # text read as a pickle can ask for a memo of gigabytes
                _check_pickle(path, survey, known_only=True)
            raise ReadError(f"{path}: refused to read it: {survey.refused}")
        ckpt = read(path, survey)
    except ReadError as exc:
        findings = survey.finding_names()
        if findings and not exc.findings:
            shown = ", ".join(findings[:4]) + (f", … {len(findings) - 4} more" if len(findings) > 4 else "")
            kind = NotACheckpoint if isinstance(exc, NotACheckpoint) else ReadError
            raise kind(f"{exc} — and it would run code: {shown}", findings) from None
        raise
    found = [*survey.globals, *ckpt.globals]
    globals_ = tuple({(g.module, g.name): g for g in found}.values())
    places = tuple(dict.fromkeys(g.source for g in found if g.verdict is not Verdict.SAFE))
    return replace(ckpt, globals=globals_, hazards=tuple(survey.hazards), finding_sources=places,
                   notes=_tensors_named(tuple(dict.fromkeys([*ckpt.notes, *survey.notes])), ckpt))


def _tensors_named(notes: tuple[str, ...], ckpt: Checkpoint) -> tuple[str, ...]:
    """A note about a member that holds a tensor's bytes (a NumPy array saved as a uint8 tensor) names the tensor
    too: `archive/data/7` alone tells nobody which entry of theirs it is."""
    about = {n[:-len(NPY_NOTE)] for n in notes if n.endswith(NPY_NOTE)}
    if not about:
        return notes
    keys: dict[str, str] = {}
    for t in ckpt.tensors:  # (records made only for a file with such a note)
        entry = t.storage.entry if t.storage is not None else None
        if entry in about:
            keys.setdefault(entry, t.key)
    return tuple(f"{n[:-len(NPY_NOTE)]} (tensor {keys[n[:-len(NPY_NOTE)]]}){NPY_NOTE}"
                 if n.endswith(NPY_NOTE) and n[:-len(NPY_NOTE)] in keys else n for n in notes)


def read_container(path: Path, survey: Survey) -> Checkpoint:
    """The file read by the reader its container's row names (readers/table.py)."""
    return function(reader(survey.container).read)(path, survey)


# The readers of the table's rows, each (path, survey) -> Checkpoint; each reader module is imported when a file of
# its kind is read, so other formats do not pay for it.

def read_empty(path: Path, survey: Survey) -> Checkpoint:
    raise ReadError(f"{path}: file is empty (0 bytes)")


def read_zip(path: Path, survey: Survey) -> Checkpoint:
    if survey.items:  # a DCP shard: what it is comes from its folder (readers/dcp.py)
        raise ReadError(f"{path}: a torch.distributed.checkpoint shard; read the folder it belongs to")
    from .torch_zip import read_torch_zip  # only when a zip is read

    _check_torch_zip(path, survey)
    return read_torch_zip(path, survey)


def read_tar(path: Path, survey: Survey) -> Checkpoint:
    from .torch_tar import MEMBERS, read_torch_tar  # only when a tar is read

    layout = survey.tar
    if layout is not None and not layout.refused and not any(m in layout.members for m in MEMBERS):
        names = list(layout.members)
        raise NotACheckpoint(f"{path}: not a PyTorch checkpoint: a tar archive of {_some(names)}, without the "
                             f"members {', '.join(MEMBERS)} of torch's pre-0.4 format; extract it and inspect "
                             "what it holds")
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_torch_tar(path, fd, survey.tar, (), ())
    finally:
        os.close(fd)


def read_safetensors_file(path: Path, survey: Survey) -> Checkpoint:
    from .safetensors_reader import read_safetensors  # only when a safetensors file is read

    fd = open_source(path)  # a local file's descriptor, or a URL's range reader (readers/source.py)
    try:
        return read_safetensors(path, fd, survey.size)
    finally:
        close_source(fd)


def read_pickle(path: Path, survey: Survey) -> Checkpoint:
    from .torch_legacy import read_torch_legacy  # only when a pickle is read

    _check_pickle(path, survey)
    return read_torch_legacy(path, survey)


def read_npy(path: Path, survey: Survey) -> Checkpoint:
    raise NotACheckpoint(f"{path}: not a PyTorch checkpoint: {_npy_kind(survey)}")


def read_other(path: Path, survey: Survey) -> Checkpoint:
    other = what_else(survey.head)
    if other is not None:
        raise _not_a_checkpoint(path, *other)
    if survey.size < 8:
        raise ReadError(f"{path}: only {survey.size} bytes, too short to be a checkpoint (truncated?)")
    why = describe_other(survey.head, survey.size)
    if why.startswith("no "):  # nothing any reader knows: no checkpoint, not a broken one
        raise NotACheckpoint(f"{path}: not a PyTorch checkpoint: {why}")
    raise ReadError(f"{path}: not a checkpoint: {why}")


# Whether a model folder's file is its checkpoint, for the rows whose answer is not always the same.

def zip_in_folder(path: Path, head: bytes) -> bool:
    """torch's reader needs a zip's first member in a folder: an .npz or a plain zip is none."""
    name_length = int.from_bytes(head[26:28], "little")
    return b"/" in head[30:30 + name_length] or len(head) < 30 + name_length


def pickle_in_folder(path: Path, head: bytes) -> bool:
    """A pickle that starts with PROTO, or any under a checkpoint's usual suffix (text files can start with an opcode
    letter)."""
    return head[:1] == b"\x80" or path.name.endswith(CHECKPOINT_SUFFIXES)


def _not_a_checkpoint(path: Path, what: str, advice: str) -> NotACheckpoint:
    return NotACheckpoint(f"{path}: not a PyTorch checkpoint: {what}" + (f"; {advice}" if advice else ""))


def _some(names: list[str], shown: int = 3) -> str:
    """`2 files (a.txt, dir/b.txt)`, at most `shown` named."""
    listed = ", ".join(repr(n) if not n.isprintable() else n for n in names[:shown])
    more = ", …" if len(names) > shown else ""
    return f"{len(names)} file{'s' if len(names) != 1 else ''} ({listed}{more})"


def _check_torch_zip(path: Path, survey: Survey) -> None:
    """A zip that holds nothing of torch's layout (no data.pkl, constants.pkl or version record in a folder) is no
    checkpoint, broken or not: NumPy's .npz, or any other archive."""
    index = survey.zip
    if index is None:
        return  # the archive itself is broken: the torch reader says how
    torch_records = {"data.pkl", "constants.pkl", "version", ".data/version"}
    if any("/" in m.name and m.name.split("/", 1)[1].lower() in torch_records for m in index.members):
        return
    names = [m.name for m in index.members if not m.is_dir]
    if names and all(n.lower().endswith(".npy") for n in names):
        arrays = _some([n[:-4] for n in names]).replace("file", "array")
        if survey.findings or survey.hazards:  # what it would run is said after this
            how = "numpy.load(..., allow_pickle=True) unpickles its arrays of Python objects"
        elif survey.globals:
            how = ("load it with numpy.load (allow_pickle=True for its arrays of Python objects: every global their "
                   "pickles name is on the allow-list)")
        else:
            how = "load it with numpy.load"
        raise NotACheckpoint(f"{path}: not a PyTorch checkpoint: a NumPy .npz archive of {arrays}; {how}")
    raise NotACheckpoint(f"{path}: not a PyTorch checkpoint: a zip archive of {_some(names)}, without torch's layout "
                         "(a folder holding data.pkl); extract it and inspect what it holds")


def _check_pickle(path: Path, survey: Survey, known_only: bool = False) -> None:
    """A file whose first byte is a pickle opcode but which CPython's unpickler rejects before it looks up anything
    (text, an image, an HDF5 file) is named as what it is: torch.load reads no pickle from it. A pickle that ends
    early after its first bytes (it starts with PROTO, or the data ran out) is left to the reader: a broken one.
    known_only: only a file whose bytes say what it is (a refused walk of anything else stays refused)."""
    walked = survey.main_walk
    if walked is None or survey.globals or survey.hazards:
        return  # it names globals: a pickle (that may break off later), judged as one
    first_end = walked.pickles[0][1] if walked.pickles else None
    stops = walked.unresolved is not None and (first_end is None or walked.unresolved[0] < first_end)
    if first_end is not None and not stops:
        return  # a whole pickle
    other = what_else(survey.head)
    if other is not None:
        raise _not_a_checkpoint(path, *other)
    if known_only or survey.head[:1] == b"\x80" or walked.truncated and not stops:
        return
    known = describe_other(survey.head, survey.size)
    if not known.startswith("no "):  # a cut safetensors file whose length's first byte is an opcode
        raise ReadError(f"{path}: not a checkpoint: {known}")
    why = walked.unresolved[1] if stops and walked.unresolved else walked.broken
    raise NotACheckpoint(f"{path}: not a PyTorch checkpoint, nor a pickle torch.load could read: "
                         f"{str(why).split(': ', 1)[-1]}")


def _npy_kind(survey: Survey) -> str:
    """`a NumPy array (.npy, float32, shape (2, 3)); load it with numpy.load`, from the header (a Python literal,
    read with ast.literal_eval, which evaluates nothing)."""
    head = survey.head
    dtype, shape = None, None
    try:
        import ast

        size, start = ((int.from_bytes(head[8:10], "little"), 10) if head[6] == 1 else
                       (int.from_bytes(head[8:12], "little"), 12))
        header = ast.literal_eval(head[start:start + size].decode("latin-1"))
        dtype, shape = header.get("descr"), header.get("shape")
    except (ValueError, SyntaxError, MemoryError, RecursionError, UnicodeError, IndexError, AttributeError):
        pass
    if survey.findings or survey.hazards:  # what it would run is said after this
        return "a NumPy array of Python objects (.npy): numpy.load(..., allow_pickle=True) unpickles it"
    if survey.globals:  # an object array: a pickle, walked as one
        return ("a NumPy array of Python objects (.npy), a pickle whose globals are all on the allow-list; load it "
                "with numpy.load(..., allow_pickle=True)")
    parts = [".npy"]
    if isinstance(dtype, str):
        parts.append(_NPY_DTYPES.get(dtype.lstrip("<>|="), dtype))
    if isinstance(shape, tuple):
        parts.append(f"shape {shape}")
    return f"a NumPy array ({', '.join(parts)}); load it with numpy.load"


_NPY_DTYPES = {"f2": "float16", "f4": "float32", "f8": "float64", "i1": "int8", "i2": "int16", "i4": "int32",
               "i8": "int64", "u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64", "b1": "bool",
               "c8": "complex64", "c16": "complex128", "O": "object"}


