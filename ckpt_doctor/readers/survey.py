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
import stat
import struct
import zlib
from .._record import field, record
from pathlib import Path

from ..errors import CkptDoctorError, ReadError
from ..records import Hazard
from ..safepickle import limits
from ..safepickle.policy import DEFAULT_POLICY, GlobalRef, Policy, Verdict
from ..safepickle.walker import Walk, new_budget, starts_pickle, walk
from ..sniff import HEAD, Container
from .mapping import READ_UP_TO, find_all, read_all, walk_window
from .source import RemotePath, is_remote, open_source, pread, source_file
from .table import sniff_file, sniff_head, walk_pickles
from .zipindex import ZipIndex, ZipMember, ZipTooBig, local_members, member_head, read_member, read_zip_index

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any

    from ..safepickle.statedict import StateDictRead

LEGACY_PICKLES = 5  # magic number, protocol version, system info, the object, the storage keys
_TEXT_RECORDS = frozenset({"version", ".data/version", "byteorder", ".format_version", ".storage_alignment",
                           ".data/serialization_id", "extra/producer_info.json"})


@record(frozen=False)
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
    main_read: StateDictRead | None = None  # main_pickle walked and unpickled in one pass (safepickle.statedict)
    tar: Any = None  # torch_tar.TarLayout
    items: list[Survey] = field(default_factory=list)  # each archive of a DCP shard, walked (its offset: .base)
    base: int = 0  # where this archive starts in its file (an item of a DCP shard)
    budget: list[int] = field(default_factory=new_budget)  # what walking this file may cost, all walks together
    policy: Policy = DEFAULT_POLICY  # the allow-list every global of the file is judged by (the readers' too)
    # What the items of one DCP folder share (ItemCache): a walk and an unpickled tensor by their pickle's bytes
    cache: Any = field(default=None, repr=False, compare=False)
    thorough: bool = field(default=True, repr=False, compare=False)  # survey_file's: the whole-file searches too

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
        self.hazards.extend(Hazard(Verdict.DANGEROUS, f"{a}: torch reads such a pickle one way from a file and "
                                   "another from a stream (no pickler writes one)") for a in result.anomalies)
        self.hazards.extend(Hazard(Verdict.DANGEROUS, e) for e in result.effects)
        if result.refused:
            self.refused = self.refused or result.refused


def survey_file(path: Path, thorough: bool = True, *, policy: Policy = DEFAULT_POLICY) -> Survey:
    """Walk every pickle of the file at `path`. Raises ReadError only when the file cannot be opened or read.

    `thorough=False` skips the two walks that read a whole file looking for signatures (splitting a DCP shard into
    its archives, and local headers of an archive whose directory is broken): the DCP reader, which knows each item
    of a shard from its metadata, walks those itself and asks here only what torch.load and zipfile would read.
    `policy`: the allow-list the globals are judged by (kept on the Survey for the reader that reads the file)."""
    if isinstance(path, RemotePath):
        return _survey_remote(path, thorough, policy)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a named pipe put in its place never blocks
    except PermissionError:
        raise ReadError(f"{path}: permission denied (cannot open for reading)") from None
    except IsADirectoryError:
        raise ReadError(f"{path}: is a directory") from None
    except OSError as exc:
        raise ReadError(f"{path}: cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ReadError(f"{path}: not a regular file")
        size = st.st_size
        container, head = sniff_file(fd, size)
        return _survey_source(path, fd, size, container, head, thorough, policy)
    except OSError as exc:
        raise ReadError(f"{path}: read failed ({exc.strerror})") from None
    finally:
        os.close(fd)


def _survey_remote(path: RemotePath, thorough: bool, policy: Policy) -> Survey:
    """An object behind a URL: the same walks, through a source that fetches by range what they read."""
    src = open_source(path)
    head = pread(src, HEAD, 0)
    container = sniff_head(head, src.size)
    if container is Container.TAR:
        raise ReadError(f"{path}: a tar archive (torch's pre-0.4 format) is not read over the network; download it "
                        "and inspect the copy")
    return _survey_source(path, src, src.size, container, head, thorough, policy)


def _survey_source(path: Path, fd: Any, size: int, container: Container, head: bytes, thorough: bool,
                   policy: Policy) -> Survey:
    if True:
        survey = Survey(path, size, container, head, thorough=thorough, policy=policy)
        walk_pickles(survey, fd)  # what the container's row of readers/table.py walks
        if head[:6] == b"\x93NUMPY" and container is not Container.NUMPY:
            # np.load reads a file that starts with NumPy's magic as an array, whatever else its first block is (a
            # header whose bytes are also a valid tar header): the pickle an object array holds is walked too.
            survey_npy(survey, fd)
        if container is not Container.ZIP and (head[:4] == b"PK\x05\x06" or _ends_like_a_zip(fd, size)):
            # np.load and Python's zipfile open this as an archive (an empty-zip magic first, or an end record
            # last) although torch does not: what they would read is walked too.
            survey.notes.append("Python's zipfile (np.load) opens this file as a zip archive")
            _survey_zipfile_view(survey, fd)
        return survey


def survey_pickles(survey: Survey, fd: int) -> None:
    """A file torch.load unpickles from byte 0: the legacy sequence (five pickles, then raw storages, which the
    reader walks past), or a bare pickle and whatever pickles follow it."""
    state: list = []

    def run(data: bytes) -> Walk:
        result = walk(data, "pickle", max_pickles=1, budget=survey.budget, policy=survey.policy)
        legacy = bool(result.pickles) and _is_magic(data, result.pickles[0][1])
        if legacy:
            result = walk(data, "pickle", max_pickles=LEGACY_PICKLES, budget=survey.budget, policy=survey.policy)
        elif result.pickles and survey.container is Container.PICKLE and result.pickles[0][1] < len(data):
            _walk_on(result, walk(data, "pickle", start=result.pickles[0][1], budget=survey.budget,
                                  policy=survey.policy, following=True))
        after = result.pickles[-1][1] if result.pickles else 0
        state[:] = [legacy, after, data[after:after + 4] == b"PK\x03\x04"]
        return result

    # A safetensors file is walked as torch.load would unpickle it only as far as its first bytes read as a pickle
    # (a few bytes, almost always): a 64 KB window first, not 16 MB of its tensor data.
    first = 64 << 10 if survey.container is Container.SAFETENSORS else None
    result = walk_window(fd, survey.size, run, survey.budget, first=first)
    legacy, after, zip_magic = state
    survey._add(result)
    survey.broken = result.broken
    survey.main_walk = result
    appended_zip = not legacy and after and zip_magic
    if appended_zip:
        # A zip appended to a pickle: torch.load runs the pickle; a zip reader finds the archive at the end.
        survey.notes.append(f"a zip archive follows the pickle at byte {after}")
        _survey_local_pickles(survey, fd, after, "in the zip appended to the pickle")
    if survey.container is Container.SAFETENSORS and result.globals:
        survey.hazards.append(Hazard(Verdict.DANGEROUS, "a safetensors file whose first bytes are also a pickle: "
                                     "torch.load unpickles it when its name does not end in .safetensors"))


def _walk_on(first: Walk, rest: Walk) -> None:
    """Extend the walk of a file's first pickle by the walk of what follows it (not walked twice)."""
    known = {(g.module, g.name) for g in first.globals}
    first.globals += [g for g in rest.globals if (g.module, g.name) not in known]
    first.pickles += rest.pickles
    first.notes += rest.notes
    first.anomalies += rest.anomalies
    first.end, first.broken, first.truncated = rest.end, rest.broken, rest.truncated
    first.refused = first.refused or rest.refused


_MAGIC_PICKLE = rb"\A\x80[\x02-\x05]\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19\.\Z"  # compiled when first used (re caches it)


def _is_magic(data: Any, end: int) -> bool:
    """Whether the first pickle (`data[:end]`) is torch's legacy magic number (0x1950a86a20f9469cfc6c), however it
    is spelled."""
    if end > 256:
        return False
    first = bytes(data[:end])
    if re.match(_MAGIC_PICKLE, first):
        return True
    import io

    # The unpickler's modules, which surveying a safetensors file or a zip never needs: imported only for a pickle
    # whose first bytes may spell torch's magic number (only then).
    from ..safepickle.unpickler import SafeUnpickler
    from ._pickled import PICKLE_ERRORS

    try:
        return SafeUnpickler(io.BytesIO(first), "magic").load() == 0x1950A86A20F9469CFC6C
    except PICKLE_ERRORS:
        return False  # a malformed first pickle simply is not the magic number


def survey_zip(survey: Survey, fd: int) -> None:
    """A file torch.load takes for a zip: its archive, and, when the survey is thorough and the archive is broken or
    read two ways, the archives laid end to end in it (a DCP shard)."""
    _survey_zip(survey, fd, local_scan=survey.thorough)
    if survey.thorough and (survey.zip is None or survey.zip.other_readers):
        _survey_items(survey, fd)
        if is_remote(fd) and survey.zip is None and not isinstance(survey.zip_error, ZipTooBig):
            _survey_remote_broken_zip(survey, fd)


def _survey_zip(survey: Survey, fd: int, base: int = 0, local_scan: bool = True) -> None:
    """The archive at `base` (an item of a DCP shard when not 0) of `survey.size` bytes."""
    path = survey.path
    try:  # (deferred: a big archive's local headers read by a child while its data.pkl is walked, below)
        index = read_zip_index(fd, survey.size, str(path), base, defer=not base)
    except ZipTooBig as exc:
        survey.zip_error = exc
        survey.refused = str(exc).removeprefix(f"{path}: ")  # no fallback reader goes through it either
        return
    except ReadError as exc:
        survey.zip_error = exc
        if not base and local_scan and not is_remote(fd):
            _survey_broken_zip(survey, fd)
        elif not base:
            _survey_zipfile_view(survey, fd)
        return
    survey.zip = index
    budget = [limits.MAX_INFLATED_TOTAL]
    prefix = (index.prefix + "/") if index.prefix is not None else ""
    for dup in index.duplicates:
        survey.hazards.append(Hazard(Verdict.DANGEROUS, f"the archive holds {len(index.all_named(dup))} members "
                                     f"named {dup} (ignoring case): torch's reader picks one by its sort order, other "
                                     "readers another" + ("; every copy was walked" if _is_pickle_name(dup) else "")))
    chosen = index.find(prefix + "data.pkl")
    remote = is_remote(fd)
    unfetched = 0

    def look_at(i: int) -> None:
        nonlocal unfetched
        member = index.member(i)
        name = member.name
        rel = name[len(prefix):] if name.startswith(prefix) else name
        if member.is_dir:
            return
        if remote and rel[:5] == "data/" and rel[5:].isdigit() and fd.cached(16, member.offset) is None:
            unfetched += 1  # a storage far from both ends: its first bytes would cost a request each
            return
        head = member_head(fd, member, 16, index)
        if head[:6] == b"\x93NUMPY":  # an .npy, whatever its name: np.load reads any member by its magic
            _survey_npy_member(survey, fd, member, budget)
            return
        if rel in _TEXT_RECORDS or rel.startswith("data/") and not _is_pickle_name(rel) \
                or rel.startswith("code/") and rel.endswith(".py"):
            return  # text records, storages (raw tensor bytes) and TorchScript source: never unpickled
        is_main = member == chosen  # by value: the index makes a member anew each time it is asked for one
        if not is_main and not starts_pickle(head):
            return  # no opcode at its start: nothing any loader would unpickle (and nothing inflated)
        _survey_member(survey, fd, member, is_main, budget)

    first = -1
    if index.pending is not None:  # the storages' local headers still being read: find() found data.pkl first
        if chosen is not None:  # (member 0, as torch writes it: any other member would have settled the index)
            look_at(0)  # the first member the loop below would look at, looked at while the child reads
            first = 0
        index.settle()
    if index.npy_heads is None:
        looked_at: Any = range(len(index))
    else:
        # What the loop below does nothing with, passed over column-wise: storages torch's writer names (data/N),
        # whose first bytes the index found not to be NumPy's magic. Every other member goes through it.
        looked_at = sorted(set(_not_storages(index, prefix)).union(index.npy_heads))
    for i in looked_at:
        if i != first:
            look_at(i)
    if unfetched:
        survey.notes.append(f"over the network: the first bytes of {unfetched} storage{'s' if unfetched > 1 else ''} "
                            "(data/N, raw tensor bytes torch never unpickles) were not fetched; the .npy magic "
                            "np.load would act on is looked for in each when the file is scanned locally")
    if index.other_readers:
        survey.hazards.append(Hazard(Verdict.DANGEROUS, f"zip readers disagree on this archive: "
                                     f"{index.other_readers}; torch sees one set of members, np.load and other "
                                     "Python tools another (both were walked)"))
        if not base:
            _survey_zipfile_view(survey, fd)
    # (none of them a storage data/N: those of looked_at)
    code = [index.names[i] for i in looked_at if index.names[i][len(prefix):].startswith("code/")
            and not index.member(i).is_dir]
    if index.has_record("constants.pkl"):
        survey.hazards.append(Hazard(Verdict.CODE, "a TorchScript archive: torch.load hands it to torch.jit.load, "
                                     f"which runs its code ({len(code)} files under code/)"))
    elif code:
        survey.hazards.append(Hazard(Verdict.CODE, f"{len(code)} TorchScript code files under code/ "
                                     "(executable by torch.jit.load)"))


def _not_storages(index: ZipIndex, prefix: str) -> list[int]:
    """The positions of the members not named as torch names a storage, `prefix`data/N (N in ASCII digits)."""
    storage = re.escape(prefix + "data/")
    if index.joined is None:
        return [i for i, n in enumerate(index.names) if not re.match(storage + "[0-9]+\\Z", n)]
    # the names a line each, after a line break: where a line break is not followed by a storage's name, a name
    # starts that is not one; its position is the count of line breaks before it
    text = "\n" + index.joined
    found = []
    line = at = 0
    for match in re.finditer(f"\n(?!{storage}[0-9]+(?:\n|\\Z))", text):
        line += text.count("\n", at, match.start())
        at = match.start()
        found.append(line)
    return found


def split_archives(fd: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of each zip archive of a file that is several laid end to end (a torch.distributed.checkpoint
    shard: one `torch.save` archive per item); [] unless they tile the whole file, or tile it up to a safetensors
    blob that runs exactly to its end (a shard in torch's safetensors format: its values, then its tensors). An
    archive ends with its end record, whose directory offset and size (relative to the archive's start) lead back
    to exactly that record. A remote source is split from its end first (each archive's end record leads to its
    start, where the one before it ends: its structure fetched, not its tensor data); only when that chain does not
    tile it is it searched as a local file is."""
    if is_remote(fd):
        items = _split_from_end(fd, size)
        if items:
            return items
    items = []
    start = 0
    for at in find_all(fd, size, b"PK\x05\x06"):  # searched in blocks read, not in a map (a cut file: no SIGBUS)
        if at < start:
            continue
        if len(items) >= limits.MAX_ZIP_MEMBERS:
            break
        if at + 22 > size:
            return []
        cd_size, cd_offset, comment = struct.unpack_from("<IIH", pread(fd, 10, at + 12))
        end_of_dir = at
        if at - start >= 20 + 56 and pread(fd, 4, at - 20) == b"PK\x06\x07":  # torch always writes zip64
            (z64_at,) = struct.unpack_from("<Q", pread(fd, 8, at - 12))
            if start + z64_at + 56 <= at and pread(fd, 4, start + z64_at) == b"PK\x06\x06":
                cd_size, cd_offset = struct.unpack_from("<QQ", pread(fd, 16, start + z64_at + 40))
                end_of_dir = start + z64_at
        first = start
        if start + cd_offset + cd_size != end_of_dir:  # padding before it? (a writer that aligns each archive)
            first = _padded_start(fd, start, at, cd_size, cd_offset)
        if first is not None and at + 22 + comment <= size:
            items.append((first, at + 22 + comment - first))
            start = at + 22 + comment
    if start == size:
        return items if len(items) > 1 else []
    return items if items and _safetensors_tail(fd, start, size) else []


def _padded_start(fd: int, start: int, at: int, cd_size: int, cd_offset: int) -> int | None:
    """Where the archive whose end record is at `at` starts, when zero bytes (fewer than _MAX_PAD) lie between `start`,
    where the one before it ended, and its first local header (ckpt-doctor's own DCP writer puts each item on a
    64-byte boundary); None when its records do not lead to such a start."""
    if at >= 20 + 56 and pread(fd, 4, at - 20) == b"PK\x06\x07":  # zip64: its end record just before the locator
        record = at - 20 - 56
        if pread(fd, 4, record) != b"PK\x06\x06":
            return None
        (z64_at,) = struct.unpack_from("<Q", pread(fd, 8, at - 12))
        cd_size, cd_offset = struct.unpack_from("<QQ", pread(fd, 16, record + 40))
        first = record - z64_at
        if first + cd_offset + cd_size != record:
            return None
    else:
        first = at - cd_size - cd_offset
    if not start < first <= start + _MAX_PAD or pread(fd, first - start, start).strip(b"\0") \
            or pread(fd, 4, first) != b"PK\x03\x04":
        return None
    return first


_MAX_PAD = 4096  # zero bytes split_archives lets lie between two archives


def _split_from_end(fd: Any, size: int) -> list[tuple[int, int]]:
    """split_archives by the chain of end records from the file's end: the archives, when there are several and
    they tile the file; [] otherwise (a safetensors blob at its end, an archive comment, a file no chain explains).
    Two requests an archive: its last 4 KB (end records and directory), its first bytes (the local header)."""
    items: list[tuple[int, int]] = []
    end = size
    while end > 0:
        if len(items) >= limits.MAX_ZIP_MEMBERS or end < 22:
            return []
        tail_at = max(end - 4096, 0)
        tail = pread(fd, end - tail_at, tail_at)
        at = len(tail) - 22
        if len(tail) != end - tail_at or tail[at:at + 4] != b"PK\x05\x06" or tail[at + 20:at + 22] != b"\0\0":
            return []  # torch writes no archive comment: its end record ends the archive
        cd_size, cd_offset = struct.unpack_from("<II", tail, at + 12)
        end_of_dir = at
        if at >= 20 + 56 and tail[at - 20:at - 16] == b"PK\x06\x07":  # zip64 (torch always writes it): its
            (z64_at,) = struct.unpack_from("<Q", tail, at - 12)  # end record just before its locator
            z64 = at - 20 - 56
            if tail[z64:z64 + 4] != b"PK\x06\x06":
                return []
            cd_size, cd_offset = struct.unpack_from("<QQ", tail, z64 + 40)
            end_of_dir = z64
            if tail_at + z64 - cd_size - cd_offset + z64_at != tail_at + z64:  # the locator names that record
                return []
        start = tail_at + end_of_dir - cd_size - cd_offset
        if start < 0 or pread(fd, 4, start) != b"PK\x03\x04":
            return []
        items.append((start, end - start))
        end = start
    items.reverse()
    return items if len(items) > 1 else []


def _safetensors_tail(fd: int, start: int, size: int) -> bool:
    """Whether the bytes from `start` to the end are one safetensors blob with DCP's sharding information (its
    header parsed and its tensors tiling its data to the last byte, as the safetensors reader checks)."""
    from .safetensors_reader import read_safetensors  # only when a DCP shard may end in a safetensors blob

    if size - start < 10 or pread(fd, 1, start + 8) != b"{":
        return False
    try:
        blob = read_safetensors(Path("blob"), fd, size, start)
    except ReadError:
        return False
    return "DCP_SHARDING_INFO" in blob.metadata


def _survey_items(survey: Survey, fd: int) -> None:
    """A file of archives end to end (a DCP shard): each is walked as the stream torch's DCP reader hands to
    torch.load. The two whole-file views were walked too; their disagreement is then what such a file is."""
    items = split_archives(fd, survey.size)
    if not items:
        return
    survey.zip_error = None  # the whole file is no archive, but each of its items is
    survey.hazards = [h for h in survey.hazards if not h.what.startswith("zip readers disagree")]
    blob = " then a safetensors blob of its tensors (torch's safetensors format)," \
        if items[-1][0] + items[-1][1] < survey.size else ""  # (zeros may pad the archives apart)
    survey.notes.append(f"{len(items)} torch.save archive{'s' if len(items) > 1 else ''} end to end (a "
                        f"torch.distributed.checkpoint shard),{blob} each archive walked")
    for offset, length in items:
        item = survey_item(survey.path, fd, offset, length, survey.budget, policy=survey.policy)
        survey.globals.extend(item.globals)
        survey.hazards.extend(item.hazards)
        if item.refused:
            survey.refused = survey.refused or item.refused
        if item.zip_error is not None:
            survey.notes.append(f"the archive at byte {offset}: {str(item.zip_error).removeprefix(f'{survey.path}: ')}")
        survey.items.append(item)


class ItemCache:
    """What reading many small archives of one folder (DCP items: one torch.save archive per chunk, mostly alike)
    reuses: the walk of a pickle, and the tensor it unpickles to, by the pickle's exact bytes and the policy that
    judged it. A walk is a function of the bytes it walks, its label (the same member name in every item) and the
    policy, so equal keys give the same findings and refusals (a verdict is never served under another policy); only
    pickles of at most MAX_BYTES are kept, at most MAX_ENTRIES of them, MAX_HELD bytes in all (walks and trees
    together)."""

    MAX_BYTES = 64 << 10
    MAX_ENTRIES = 16_384
    MAX_HELD = 64 << 20  # bytes kept, all tables together

    def __init__(self) -> None:
        self.walks: dict[tuple[Policy, str, bytes], tuple[Walk, tuple[int, ...]]] = {}
        self.trees: dict[tuple[Policy, bytes], Any] = {}
        self.held = 0

    def keep(self, table: dict, key: Any, value: Any, size: int = 0) -> bool:
        """Keep `value` under `key` (`size`: the bytes it holds), while the cache is within its bounds."""
        if len(table) >= self.MAX_ENTRIES or self.held + size > self.MAX_HELD:
            return False
        table[key] = value
        self.held += size
        return True

    def walk(self, data: bytes, name: str, budget: list, policy: Policy) -> Walk:
        """walk(data, name) under `policy` against `budget`, or the walk of the same bytes under the same policy
        already made: the budget is debited by
        what that walk cost all the same (it bounds the time the unpickler then takes too), and a budget that cannot
        pay for it gets a walk of its own (which meets the limit as before)."""
        key = (policy, name, data)
        known = self.walks.get(key)
        if known is not None:
            result, cost = known
            if all(budget[i] >= c for i, c in enumerate(cost)):
                for i, c in enumerate(cost):
                    budget[i] -= c
                return result
        before = budget[:3]
        result = walk(data, name, budget=budget, policy=policy)
        if known is None:
            self.keep(self.walks, key, (result, tuple(b - a for b, a in zip(before, budget[:3]))), len(data))
        return result


def survey_item(path: Path, fd: int, offset: int, length: int, budget: list[int] | None = None,
                cache: ItemCache | None = None, *, policy: Policy = DEFAULT_POLICY) -> Survey:
    """One archive inside a file (a DCP item), walked as its own zip under `policy`."""
    item = Survey(path, length, Container.ZIP, pread(fd, 16, offset), base=offset, policy=policy)
    item.cache = cache
    if budget is not None:
        item.budget = budget
    _survey_zip(item, fd, offset)
    return item


def _survey_member(survey: Survey, fd: int, member: ZipMember, is_main: bool, budget: list[int]) -> None:
    """Walk one member that starts a pickle. A big stored one is walked in place in the file's map; only the
    data.pkl torch would unpickle is kept, for the reader, when it is small enough to unpickle."""
    name = member.name
    result = data = None
    # A big stored pickle the reader will unpickle (its size known from the directory, within the bound of what is
    # unpickled) is read whole once: a window grown while the walk runs into its end walked it again per doubling.
    whole = is_main and member.size <= limits.MAX_UNPICKLE_BYTES and not is_remote(fd)
    if member.method == 0 and member.size > limits.ZIP_WHOLE_READ and member.offset >= 0 and not member.is_dir \
            and not whole:
        # read through a window that grows while the walk needs more (never mapped: no SIGBUS on a cut file)
        result = walk_window(fd, member.size,
                             lambda data: walk(data, name, budget=survey.budget, policy=survey.policy),
                             survey.budget, member.offset)
    if result is None:
        try:
            data = read_member(fd, member, str(survey.path), check_crc=False, budget=budget)
        except ReadError as exc:
            survey.notes.append(str(exc))
            return
        cache = survey.cache
        fast = None
        if is_main and len(data) <= limits.MAX_UNPICKLE_BYTES and cache is None:  # (a DCP item: cached by bytes)
            # The one-pass reader, which imports the unpickler's records: only for a data.pkl torch would unpickle.
            from ..safepickle.statedict import read_state_dict

            fast = read_state_dict(data, name, survey.policy, survey.budget)
        if fast is not None:  # torch.save's state_dict grammar: walked and unpickled in one pass
            result = fast.walk
            survey.main_read = fast
        elif cache is not None and len(data) <= cache.MAX_BYTES:
            result = cache.walk(data, name, survey.budget, survey.policy)
        else:
            result = walk(data, name, budget=survey.budget, policy=survey.policy)
    if not (is_main or _is_pickle_name(name)) and not result.pickles:
        return  # a member that is no pickle (a text file, an image): nothing a loader would unpickle
    survey._add(result)
    if is_main:
        survey.main_walk = result
        survey.broken = result.broken
        survey.main_pickle = data if data is not None and len(data) <= limits.MAX_UNPICKLE_BYTES else None
        if result.pickles and result.pickles[0][1] < member.size:
            survey.notes.append(f"{name} holds {member.size - result.pickles[0][1]} bytes after its end, which torch "
                                "ignores")


def _survey_npy_member(survey: Survey, fd: int, member: ZipMember, budget: list[int]) -> None:
    try:
        data = read_member(fd, member, str(survey.path), check_crc=False, budget=budget)
    except ReadError as exc:
        survey.notes.append(str(exc))
        return
    _survey_npy_bytes(survey, data, member.name)


def _is_pickle_name(name: str) -> bool:
    lower = name.lower()
    return lower.endswith(".pkl") or lower.endswith(".debug_pkl") or lower.endswith(".pickle")


def _survey_broken_zip(survey: Survey, fd: int) -> None:
    """An archive torch's reader refuses (truncated, several disks): walk what Python's zipfile sees of it, and the
    pickles its local headers start."""
    _survey_zipfile_view(survey, fd)
    _survey_local_pickles(survey, fd, 0, "found from its local header")


def _survey_remote_broken_zip(survey: Survey, fd: Any) -> None:
    """An object no zip reader opens whole (the zipfile view was walked): the pickles its local headers start, as
    _survey_broken_zip walks them, which reads all of its bytes; a DCP shard's archives (split from its end, each
    walked, as every loader reads them) spare that search, and the scan says so."""
    if not survey.items or fd.cached(survey.size, 0) is not None:  # (an object fetched whole: no cost)
        _survey_local_pickles(survey, fd, 0, "found from its local header")
        return
    survey.notes.append("over the network: the file's local headers (the members of its archives no directory "
                        "lists, which no loader reads) were not searched, which would fetch all its bytes; scan a "
                        "local copy for that")


ZIP_END_SEARCH = 65536 + 22  # Python's zipfile looks for its end record in the last 64 KB and the record's 22 bytes


def ends_like_a_zip(tail: bytes) -> bool:
    """Whether an end-of-central-directory record sits where Python's zipfile looks for one: `tail` is a file's last
    ZIP_END_SEARCH bytes (all of a smaller one)."""
    return b"PK\x05\x06" in tail


def _ends_like_a_zip(fd: int, size: int) -> bool:
    return ends_like_a_zip(pread(fd, min(size, ZIP_END_SEARCH), max(size - ZIP_END_SEARCH, 0)))


def _survey_zipfile_view(survey: Survey, fd: int) -> None:
    """The members Python's zipfile lists (what np.load and other Python tools read): every one that is a pickle
    or an .npy is walked. Only asked when torch's reader could see the archive otherwise."""
    import zipfile

    budget = [limits.MAX_INFLATED_TOTAL]
    try:
        with source_file(fd) as f:
            f.seek(0)
            with zipfile.ZipFile(f) as archive:
                infos = archive.infolist()[:limits.MAX_ZIP_MEMBERS]
                for info in infos:
                    if info.is_dir() or info.file_size > limits.MAX_INFLATED_MEMBER or budget[0] < info.file_size:
                        continue
                    with archive.open(info) as member:
                        head = member.read(16)
                    if not (head[:6] == b"\x93NUMPY" or starts_pickle(head)):
                        continue
                    budget[0] -= info.file_size
                    with archive.open(info) as member:
                        data = member.read(info.file_size + 1)
                    label = f"{info.filename} (as Python's zipfile reads it)"
                    if head[:6] == b"\x93NUMPY":
                        _survey_npy_bytes(survey, data, label)
                    else:
                        survey._add(walk(data, label, budget=survey.budget, policy=survey.policy))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, RuntimeError,
            NotImplementedError, UnicodeError, OverflowError, struct.error, zlib.error) as exc:
        survey.notes.append(f"Python's zipfile cannot read it either ({type(exc).__name__})")


def _survey_local_pickles(survey: Survey, fd: int, start: int, how: str) -> None:
    whole = read_all(fd, survey.size) if survey.size <= READ_UP_TO and not is_remote(fd) else None
    for name, data_at in local_members(fd, survey.size, start):
        if data_at >= survey.size:
            continue
        label = f"{name} ({how})"
        if whole is not None:  # a small file: read once, each walk from its byte
            if not (_is_pickle_name(name) or starts_pickle(whole, data_at)):
                continue
            result = walk(whole, label, start=data_at, budget=survey.budget, policy=survey.policy)
        else:  # a big one: a window from each member's data (no map: a cut file must not SIGBUS)
            if not (_is_pickle_name(name) or starts_pickle(pread(fd, 16, data_at))):
                continue
            result = walk_window(fd, survey.size - data_at,
                                 lambda data: walk(data, label, budget=survey.budget, policy=survey.policy),
                                 survey.budget, data_at)
        if result.pickles or result.globals or _is_pickle_name(name):
            survey._add(result)


def survey_tar(survey: Survey, fd: int) -> None:
    from .torch_tar import tar_layout

    layout = tar_layout(fd, survey.size, survey.path, survey.budget, survey.policy)
    survey.tar = layout
    if layout.refused:
        survey.refused = survey.refused or layout.refused
    for w in layout.walks:
        survey._add(w)
    for link in layout.links:
        survey.hazards.append(Hazard(Verdict.DANGEROUS, f"tar {link}: torch extracts it and reads what it points to"))
    # torch falls back to the legacy pickle sequence from byte 0 when tarfile fails later, and a stream opened
    # elsewhere (BytesIO) never tries tar: the same bytes read as pickles must be walked too.
    if starts_pickle(survey.head):
        if True:
            result = walk_window(fd, survey.size, lambda data: walk(data, "the file read as a pickle from byte 0",
                                                                     max_pickles=LEGACY_PICKLES, budget=survey.budget,
                                                                     policy=survey.policy),
                                 survey.budget)
            survey._add(result)
            if result.pickles:
                survey.hazards.append(Hazard(Verdict.DANGEROUS, "the file is both a tar archive and a pickle: "
                                             "torch.load reads one or the other depending on how it is called"))


# Where an .npy's pickle is named, after the member (whose name may hold ": " itself: torch.save names the archive
# after the file): `archive/data/1: the pickle after the NumPy header at byte 288`.
NPY_PICKLE = ": the pickle after the NumPy header"
NPY_NOTE = ": a NumPy array whose data np.load(allow_pickle=True) would unpickle"  # the note after its member


def survey_npy(survey: Survey, fd: Any) -> None:
    at = _npy_pickle_start(read_all(fd, min(survey.size, (1 << 16) + 12)), lambda at: pread(fd, 1, at))
    if at is None:
        return
    where = "the file"
    survey._add(walk_window(fd, survey.size, lambda data: walk(data, f"{where}{NPY_PICKLE}",
                                                                start=at, budget=survey.budget, policy=survey.policy),
                            survey.budget))
    survey.notes.append(f"{where}{NPY_NOTE}")


def _survey_npy_bytes(survey: Survey, data: Any, where: str) -> None:
    """A NumPy array: np.load(allow_pickle=True) unpickles what follows the header when the dtype holds objects."""
    at = _npy_pickle_start(data)
    if at is None:
        return
    survey._add(walk(data, f"{where}{NPY_PICKLE}", start=at, budget=survey.budget,
                     policy=survey.policy))
    survey.notes.append(f"{where}{NPY_NOTE}")


def _npy_pickle_start(data: Any, first: Any = None) -> int | None:
    """Where the pickle np.load(allow_pickle=True) would unpickle starts in an .npy whose first bytes are `data`;
    None when there is none. The header is a Python literal (read with ast.literal_eval, which evaluates nothing);
    when its dtype is not plainly numeric, or the data starts with PROTO, the data is walked as the pickle it may be.
    `first(at)`: the byte at `at` when `data` is only the file's head."""
    if len(data) < 10:
        return None
    major = data[6]
    header_len, start = ((int.from_bytes(data[8:10], "little"), 10) if major == 1 else
                         (int.from_bytes(data[8:12], "little"), 12))
    descr: Any = None
    try:
        import ast

        header = ast.literal_eval(bytes(data[start:start + min(header_len, 1 << 16)]).decode("latin-1"))
        descr = header.get("descr") if isinstance(header, dict) else None
    except (ValueError, SyntaxError, MemoryError, RecursionError, UnicodeError):
        pass
    plain = isinstance(descr, str) and re.fullmatch(r"[<>|=]?[?bBhHiIlLqQpPefdgFDGSUV]\d*", descr) is not None
    at = start + header_len
    if plain and (data[at:at + 1] if first is None else first(at)) != b"\x80":
        return None
    return at


def survey_or_error(path: Path, *, policy: Policy = DEFAULT_POLICY) -> tuple[Survey | None, CkptDoctorError | None]:
    try:
        return survey_file(path, policy=policy), None
    except CkptDoctorError as exc:
        return None, exc
