"""The static findings of one file: every pickle in it walked, wherever it hides, before anything is unpickled.

`survey_file` is what `scan` reports and what every reader starts from, so `scan` and `inspect` cannot disagree:
the globals of a Checkpoint are its survey's. The pickles walked are those torch.load would unpickle — in its own
order of formats (zip by its first bytes, then tar, then the legacy pickle sequence from byte 0) — and every other
pickle a loader could be pointed at: zip members that are pickles, pickles after a STOP, inside byte strings,
after a legacy file's storages, inside an object array of a .npy file, in the bytes of a file that is both a tar
and a pickle. Globals seen before a file breaks off are kept.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CkptDoctorError, ReadError
from ..records import Hazard
from ..safepickle import limits
from ..safepickle.policy import GlobalRef, Verdict
from ..safepickle.walker import Walk, starts_pickle, walk
from ..sniff import Container, sniff
from .zipindex import ZipIndex, local_members, member_head, read_member, read_zip_index

LEGACY_PICKLES = 5  # magic number, protocol version, system info, the object, the storage keys
_TEXT_RECORDS = frozenset({"version", ".data/version", "byteorder", ".format_version", ".storage_alignment",
                           ".data/serialization_id", "extra/producer_info.json"})


@dataclass
class Survey:
    path: Path
    size: int
    container: Container
    head: bytes
    globals: list[GlobalRef] = field(default_factory=list)
    hazards: list[Hazard] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    refused: str | None = None  # a resource bound a pickle exceeds: it must not be unpickled
    broken: str | None = None  # why the main pickle breaks off, when it does
    # What the readers reuse instead of reading twice:
    zip: ZipIndex | None = None
    zip_error: ReadError | None = None
    main_pickle: bytes | None = None  # the data.pkl torch would unpickle
    main_walk: Walk | None = None
    tar: Any = None  # torch_tar.TarLayout

    @property
    def findings(self) -> list[GlobalRef]:
        return [g for g in self.globals if g.verdict is not Verdict.SAFE]

    @property
    def verdict(self) -> Verdict:
        ranks = [g.verdict for g in self.globals] + [h.verdict for h in self.hazards]
        return max(ranks, key=lambda v: v.rank, default=Verdict.SAFE)

    def finding_names(self) -> tuple[str, ...]:
        """One short label per finding, for an error message: `os.system (dangerous)`."""
        names = [f"{g.qualname} ({g.verdict.value})" for g in self.findings]
        names += [f"{h.what} ({h.verdict.value})" for h in self.hazards]
        return tuple(dict.fromkeys(names))

    def _add(self, result: Walk) -> None:
        self.globals.extend(result.globals)
        self.notes.extend(result.notes)
        if result.refused:
            self.refused = self.refused or result.refused


def survey_file(path: Path) -> Survey:
    """Walk every pickle of the file at `path`. Raises ReadError only when the file cannot be opened or read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        raise ReadError(f"{path}: permission denied (cannot open for reading)") from None
    except IsADirectoryError:
        raise ReadError(f"{path}: is a directory") from None
    except OSError as exc:
        raise ReadError(f"{path}: cannot be opened ({exc.strerror})") from None
    try:
        size = os.fstat(fd).st_size
        container, head = sniff(fd, size)
        survey = Survey(path, size, container, head)
        if container is Container.ZIP:
            _survey_zip(survey, fd)
        elif container is Container.TAR:
            _survey_tar(survey, fd)
        elif container is Container.NUMPY:
            _survey_npy(survey, fd)
        elif container in (Container.PICKLE, Container.SAFETENSORS):
            _survey_pickles(survey, fd)
        return survey
    except OSError as exc:
        raise ReadError(f"{path}: read failed ({exc.strerror})") from None
    finally:
        os.close(fd)


def _read_capped(fd: int, at: int, size: int, path: Path) -> bytes:
    if size - at > limits.MAX_PICKLE_BYTES:
        raise ReadError(f"{path}: {size - at:,} bytes of pickle data, over the {limits.MAX_PICKLE_BYTES >> 20} MB "
                        "ckpt-doctor walks")
    return os.pread(fd, size - at, at)


def _survey_pickles(survey: Survey, fd: int) -> None:
    """A file torch.load unpickles from byte 0: the legacy sequence (five pickles, then raw storages, which the
    reader walks past), or a bare pickle and whatever pickles follow it."""
    data = _read_first_pickles(fd, survey)
    result = walk(data, "pickle", max_pickles=1)
    legacy = bool(result.pickles) and _is_magic(data[:result.pickles[0][1]])
    if legacy:
        result = walk(data, "pickle", max_pickles=LEGACY_PICKLES)
    elif result.pickles and survey.container is Container.PICKLE:
        data = _read_capped(fd, 0, survey.size, survey.path)
        result = walk(data, "pickle")
    survey._add(result)
    survey.broken = result.broken
    survey.main_walk = result
    after = result.pickles[-1][1] if result.pickles else 0
    if not legacy and after and data[after:after + 4] == b"PK\x03\x04":
        # A zip appended to a pickle: torch.load runs the pickle; a zip reader finds the archive at the end.
        survey.notes.append(f"a zip archive follows the pickle at byte {after}")
        _survey_local_pickles(survey, fd, after, "in the zip appended to the pickle")
    if survey.container is Container.SAFETENSORS and result.globals:
        survey.hazards.append(Hazard(Verdict.DANGEROUS, "a safetensors file whose first bytes are also a pickle: "
                                     "torch.load unpickles it when its name does not end in .safetensors"))


def _read_first_pickles(fd: int, survey: Survey) -> bytes:
    """The start of the file, long enough for the legacy format's five pickles (not its raw storages)."""
    size = 1 << 20
    while True:
        data = os.pread(fd, min(size, survey.size), 0)
        result = walk(data, "pickle", max_pickles=LEGACY_PICKLES)
        if not result.truncated or len(data) >= survey.size or size >= limits.MAX_PICKLE_BYTES:
            return data
        size *= 8


_MAGIC_PICKLE = re.compile(rb"\A\x80[\x02-\x05]\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19\.\Z")


def _is_magic(first: bytes) -> bool:
    """Whether the first pickle is torch's legacy magic number (0x1950a86a20f9469cfc6c), however it is spelled."""
    if _MAGIC_PICKLE.match(first):
        return True
    import io

    from ..safepickle.unpickler import SafeUnpickler

    from ._pickled import PICKLE_ERRORS

    try:
        return SafeUnpickler(io.BytesIO(first), "magic").load() == 0x1950A86A20F9469CFC6C
    except PICKLE_ERRORS:
        return False  # a malformed first pickle simply is not the magic number


def _survey_zip(survey: Survey, fd: int) -> None:
    path = survey.path
    try:
        index = read_zip_index(fd, survey.size, str(path))
    except ReadError as exc:
        survey.zip_error = exc
        _survey_broken_zip(survey, fd)
        return
    survey.zip = index
    budget = [limits.MAX_INFLATED_TOTAL]
    prefix = (index.prefix + "/") if index.prefix is not None else ""
    main = prefix + "data.pkl"
    for dup in index.duplicates:
        survey.hazards.append(Hazard(Verdict.DANGEROUS, f"the archive holds {len(index.all_named(dup))} members "
                                     f"named {dup} (ignoring case): torch's reader picks one by its sort order, other "
                                     "readers another" + ("; every copy was walked" if _is_pickle_name(dup) else "")))
    chosen = index.find(main)
    walked: set[int] = set()
    for member in index.members:
        name = member.name
        rel = name[len(prefix):] if name.startswith(prefix) else name
        if member.is_dir or rel in _TEXT_RECORDS or rel.startswith("data/") and not _is_pickle_name(rel) \
                or rel.startswith("code/") and rel.endswith(".py"):
            continue  # text records, storages (raw tensor bytes) and TorchScript source: never unpickled
        is_main = member is chosen
        if not is_main and not starts_pickle(member_head(fd, member, 16)):
            continue  # no opcode at its start: nothing any loader would unpickle (and nothing inflated to find out)
        try:
            data = read_member(fd, member, str(path), check_crc=False, budget=budget)
        except ReadError as exc:
            survey.notes.append(str(exc))
            continue
        result = walk(data, name)
        if not (is_main or _is_pickle_name(name)) and not result.pickles:
            del data
            continue  # a member that is no pickle (a text file, an image): nothing a loader would unpickle
        walked.add(id(member))
        survey._add(result)
        if is_main:
            survey.main_pickle = data
            survey.main_walk = result
            survey.broken = result.broken
            if result.pickles and result.pickles[0][1] < len(data):
                survey.notes.append(f"{name} holds {len(data) - result.pickles[0][1]} bytes after its end, which "
                                    "torch ignores")
    code = [m.name for m in index.members if m.name[len(prefix):].startswith("code/") and not m.is_dir]
    if "constants.pkl" in index.records():
        survey.hazards.append(Hazard(Verdict.CODE, "a TorchScript archive: torch.load hands it to torch.jit.load, "
                                     f"which runs its code ({len(code)} files under code/)"))
    elif code:
        survey.hazards.append(Hazard(Verdict.CODE, f"{len(code)} TorchScript code files under code/ "
                                     "(executable by torch.jit.load)"))


def _is_pickle_name(name: str) -> bool:
    lower = name.lower()
    return lower.endswith(".pkl") or lower.endswith(".debug_pkl") or lower.endswith(".pickle")


def _survey_broken_zip(survey: Survey, fd: int) -> None:
    """An archive without a readable central directory (truncated): walk the pickles its local headers start."""
    _survey_local_pickles(survey, fd, 0, "found from its local header")


def _survey_local_pickles(survey: Survey, fd: int, start: int, how: str) -> None:
    for name, data_at in local_members(fd, survey.size, start):
        if _is_pickle_name(name) and data_at < survey.size:
            data = os.pread(fd, min(survey.size - data_at, limits.MAX_PICKLE_BYTES), data_at)
            survey._add(walk(data, f"{name} ({how})"))


def _survey_tar(survey: Survey, fd: int) -> None:
    from .torch_tar import tar_layout

    layout = tar_layout(fd, survey.size, survey.path)
    survey.tar = layout
    survey.globals.extend(layout.globals)
    for w in layout.walks:
        survey.notes.extend(w.notes)
        if w.refused:
            survey.refused = survey.refused or w.refused
    for link in layout.links:
        survey.hazards.append(Hazard(Verdict.DANGEROUS, f"tar {link}: torch extracts it and reads what it points to"))
    # torch falls back to the legacy pickle sequence from byte 0 when tarfile fails later, and a stream opened
    # elsewhere (BytesIO) never tries tar: the same bytes read as pickles must be walked too.
    head = os.pread(fd, min(survey.size, 1 << 20), 0)
    if starts_pickle(head):
        result = walk(head, "the file read as a pickle from byte 0", max_pickles=LEGACY_PICKLES)
        survey._add(result)
        if result.pickles:
            survey.hazards.append(Hazard(Verdict.DANGEROUS, "the file is both a tar archive and a pickle: torch.load "
                                         "reads one or the other depending on how it is called"))


def _survey_npy(survey: Survey, fd: int) -> None:
    """A NumPy array file: an object array is a pickle after the header, run by np.load(allow_pickle=True)."""
    head = os.pread(fd, 12, 0)
    major = head[6] if len(head) > 6 else 0
    if major == 1:
        header_len, start = int.from_bytes(head[8:10], "little"), 10
    else:
        header_len, start = int.from_bytes(head[8:12], "little"), 12
    header = os.pread(fd, min(header_len, 1 << 16), start)
    if b"O" in header.split(b"'shape'")[0]:
        at = start + header_len
        data = _read_capped(fd, at, survey.size, survey.path)
        survey._add(walk(data, "the object array's pickle"))
        survey.notes.append("a NumPy object array: np.load(allow_pickle=True) unpickles it")


def survey_or_error(path: Path) -> tuple[Survey | None, CkptDoctorError | None]:
    try:
        return survey_file(path), None
    except CkptDoctorError as exc:
        return None, exc
