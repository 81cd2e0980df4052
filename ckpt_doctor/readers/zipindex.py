"""A zip central-directory reader that sees an archive as torch's reader (miniz, PyTorchFileReader) does.

torch.load reads zips with miniz, not Python's zipfile, and the two disagree on hostile files. This reader follows
miniz: the end record is the last signature with 22 bytes after it, found scanning back from the end in 4 KB
steps no further than about 64 KB; a zip64 locator right before it wins over the 32-bit fields; offsets are
absolute; the directory holds as many entries as the end record counts; a local header is checked only for its
signature; names are looked up ignoring ASCII case, and among duplicates miniz's sort order decides. torch then
takes the archive's folder from the first entry's name and refuses entries outside it. Where torch would refuse an
archive, `torch_problem` says why; a member torch could read two ways is listed in `duplicates`.
"""

from __future__ import annotations

import os
import struct
import sys
import zlib
from bisect import bisect_right
from collections import namedtuple
from itertools import repeat
from operator import add, and_, itemgetter, rshift, sub

from ..errors import ReadError
from ..pool import can_fork, die_with_parent
from ..safepickle import limits
from .source import is_remote, pread, read_data

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from collections.abc import Iterator

_EOCD = 0x06054B50
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"


class ZipMember(namedtuple("ZipMember", "name offset size compressed_size method crc header_offset flags is_dir",
                           defaults=(0, False))):
    """One archive member (a tuple: a 20,000-tensor checkpoint has 20,000 of them, made in one pass).

    name, size, compressed_size, method, crc, header_offset, flags: as the central directory has them.
    offset: of the data, past the local header; -1 when the local header is not where the directory says.
    is_dir: a directory entry, of which miniz reads nothing (torch would get uninitialised memory).
    (collections.namedtuple, not typing.NamedTuple: importing typing costs every start ~2.5 ms.)
    """

    __slots__ = ()


_CENTRAL_HEADER = struct.Struct("<4s4xHHxxxxLLLHHHHxxLL")  # sig, flags, method, crc, sizes, name/extra/comment,
# disk, external attributes, local header offset
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, name and extra lengths
HEAD_BYTES = 16  # of each member's data, kept from reading its local header (what member_head is asked for)


class ZipIndex:
    """The members of an archive, in central-directory order, and torch's way of finding them.

    Kept as columns (one list a field of ZipMember, `names` first): a member object is made when one is asked for
    (`member(i)`, `find`), and the list of them, `members`, when it is first asked for."""

    def __init__(self, members: list[ZipMember] | None, path: str, whole: bytes | None = None, base: int = 0,
                 heads: dict[int, bytes] | None = None, columns: tuple | None = None,
                 joined: str | None = None) -> None:
        self._members = members
        self._columns = columns if columns is not None else tuple(map(list, zip(*members))) if members else \
            tuple([] for _ in ZipMember._fields)
        self.names: list[str] = self._columns[0]
        self.path = path
        self.whole = whole  # the archive's bytes, when a small one was read whole to find its members
        self.base = base  # where the archive starts in its file
        self.heads = heads or {}  # data offset -> the first HEAD_BYTES there, read with its local header
        self._npy_heads: list[int] | None = None  # (npy_heads)
        # folded name -> its member's position; names several members share -> all their positions
        self._by_name: dict[str, int] = {}
        self._shared: dict[str, list[int]] = {}
        names = self.names
        # The names as one string, when none holds a line break: folded, and searched, in one call each instead of
        # one a member (20,000 of them cost 15 ms one by one).
        if joined is None:
            joined = "\n".join(names)
            if joined.count("\n") != len(names) - 1:
                joined = None
        self.joined = joined
        if joined is not None and joined.isascii() and names:
            lowered = joined.lower()
            folded = names if lowered == joined else lowered.split("\n")
        else:
            folded = [_fold(n) for n in names]
        by_name = dict(zip(folded, range(len(folded))))
        if len(by_name) != len(folded):  # duplicates: the first position of each name, and all of those shared
            by_name = {}
            for i, f in enumerate(folded):
                if by_name.setdefault(f, i) != i:
                    self._shared.setdefault(f, [by_name[f]]).append(i)
        self._by_name = by_name
        self.duplicates = sorted(names[ix[0]] for ix in self._shared.values())
        first = names[0] if names else ""
        self.prefix = first.split("/", 1)[0] if "/" in first else None
        self.torch_problem: str | None = None
        self.other_readers: str | None = None  # why Python's zipfile could see other members than torch
        self.pending: _Headers | None = None  # the local headers still being read by a child (settle())
        self.guessed = 0  # storages whose local header was not fetched (a remote archive in torch's layout)
        if not names:
            self.torch_problem = "the archive is empty"
        elif self.prefix is None:
            self.torch_problem = f"its first member {first!r} is not in a folder, which torch's reader requires"
        else:
            inside = self.prefix + "/"
            # each line break of `joined` starts a name: a name in the folder is a line break and the folder's name
            if joined is None or ("\n" + joined).count("\n" + inside) != len(names):
                outside = [n for n in names if not n.startswith(inside)]
                if outside:
                    self.torch_problem = (f"member {outside[0]!r} is outside the archive's folder {self.prefix!r}, "
                                          "which torch's reader refuses")

    @property
    def members(self) -> list[ZipMember]:
        if self._members is None:
            if self.pending is not None:
                self.settle()
            self._members = list(map(tuple.__new__, repeat(ZipMember), zip(*self._columns)))
        return self._members

    def member(self, i: int) -> ZipMember:
        """The member at position `i` (made alone, while the list of them is not made)."""
        if self._members is not None:
            return self._members[i]
        if self.pending is not None and i:  # (the first member's header is read at once: see _Headers)
            self.settle()
        return tuple.__new__(ZipMember, [column[i] for column in self._columns])

    @property
    def npy_heads(self) -> list[int] | None:
        """The positions of the members whose first bytes may be NumPy's magic (np.load would read them as arrays):
        those seen to be, and those not seen (deflated, or past what was read); None when not worked out (every
        member's first bytes are then asked for)."""
        if self.pending is not None:
            self.settle()
        return self._npy_heads

    @npy_heads.setter
    def npy_heads(self, value: list[int] | None) -> None:
        self._npy_heads = value

    def settle(self) -> None:
        """The local headers a child was reading (_Headers), taken into the columns: each member's data offset, and
        which may start with NumPy's magic. ReadError when the file changed while they were read."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        found = pending.result()
        offsets = self._columns[1]
        if found is None or found[0][0] != offsets[0]:
            raise ReadError(f"{self.path}: the file changed while it was read (its local headers came back short "
                            "or moved); read it again once nothing writes to it")
        offsets[:] = found[0]
        self._npy_heads = _npy_heads(self, found[1], self._columns[4])

    def __len__(self) -> int:
        return len(self.names)

    def find(self, name: str) -> ZipMember | None:
        """The member torch's reader returns for `name`: ASCII case ignored, duplicates settled as miniz does."""
        folded = name.lower() if name.isascii() else name.translate(_ASCII_LOWER)  # (_fold, without its call:
        hit = self._by_name.get(folded)  # torch_zip asks once a storage)
        if hit is None:
            return None
        if self._shared and folded in self._shared:
            hit = _miniz_pick(self.names, name)
        return self._members[hit] if self._members is not None else self.member(hit)

    def find_all(self, names: list[str]) -> list[int | None]:
        """The position of the member find() returns for each of `names` (None: no such member), found at once: a
        20,000-tensor checkpoint's storages looked up in a few calls rather than a find() each."""
        joined = "\n".join(names)
        if joined.isascii() and joined.count("\n") == len(names) - 1:
            lowered = joined.lower()
            folded = names if lowered == joined else lowered.split("\n") if names else []
        else:
            folded = [_fold(n) for n in names]
        hits = list(map(self._by_name.get, folded))
        if self._shared:
            shared = self._shared
            hits = [_miniz_pick(self.names, name) if hit is not None and f in shared else hit
                    for name, f, hit in zip(names, folded, hits)]
        return hits

    def column(self, field: str) -> list:
        """One field of every member (ZipMember's names), in directory order."""
        if self.pending is not None:
            self.settle()
        return self._columns[ZipMember._fields.index(field)]

    def all_named(self, name: str) -> list[ZipMember]:
        """Every member torch could mean by `name` (several when the archive has duplicates)."""
        folded = _fold(name)
        hits = self._shared.get(folded) or ([self._by_name[folded]] if folded in self._by_name else [])
        return [self.member(i) for i in hits]

    def records(self) -> list[str]:
        """Member names relative to the archive's folder, as torch's `get_all_records` lists them."""
        cut = len(self.prefix) + 1 if self.prefix is not None else 0
        return [n[cut:] for n in self.names]

    def has_record(self, record: str) -> bool:
        """Whether `record` is in records() (compared exactly, not as find() does), without listing them."""
        if self.torch_problem is None:  # every name is in the archive's folder: the one it would be, looked up
            name = f"{self.prefix}/{record}"
            folded = _fold(name)
            hits = self._shared.get(folded) or ([self._by_name[folded]] if folded in self._by_name else [])
            return any(self.names[i] == name for i in hits)
        cut = len(self.prefix) + 1 if self.prefix is not None else 0
        return record in map(itemgetter(slice(cut, None)), self.names)


def _fold(name: str) -> str:
    """ASCII letters lowered, nothing else (miniz's comparison): str.lower() where that is the same thing."""
    return name.lower() if name.isascii() else name.translate(_ASCII_LOWER)


_ASCII_LOWER = {c: c + 32 for c in range(65, 91)}


class ZipTooBig(ReadError):
    """The directory is past a resource bound: no reader, ours or a fallback, should go through it."""


def read_zip_index(fd: int, file_size: int, path: str, base: int = 0, defer: bool = False) -> ZipIndex:
    """The archive's members. Raises ReadError naming what is broken where torch's reader would fail too.

    `base`: where the archive starts in the file (a torch.distributed.checkpoint shard holds one archive per item,
    end to end, each read by torch as a stream of its own); `file_size` is then the archive's length. Offsets in the
    archive are relative to `base`; the members' offsets returned are absolute in the file.

    `defer`: a big local archive's local headers past the first member's may be read by a child meanwhile (the
    index is then `pending` until settled: any member but the first, a column, npy_heads settle it)."""
    eocd_at = _locate_end_record(fd, file_size, base)
    if eocd_at is None:
        raise ReadError(f"{path}: zip archive has no end-of-central-directory record "
                        "(the file is truncated or not a complete zip)")
    eocd = pread(fd, 22, base + eocd_at)
    _, disk, cd_disk, on_disk, count, cd_size, cd_offset, _ = struct.unpack("<IHHHHIIH", eocd)
    zip64 = False
    if eocd_at >= 20 + 56:
        loc = pread(fd, 20, base + eocd_at - 20)
        if loc[:4] == _ZIP64_LOCATOR:
            (z64_at,) = struct.unpack_from("<Q", loc, 8)
            if z64_at > file_size - 56:
                raise ReadError(f"{path}: zip64 end record points past the end of the file (corrupt archive)")
            rec = pread(fd, 56, base + z64_at)
            if rec[:4] == _ZIP64_EOCD:
                if struct.unpack_from("<I", loc, 16)[0] != 1:
                    raise ReadError(f"{path}: zip archive spans several disks, which torch's reader refuses")
                disk, cd_disk, on_disk, count, cd_size, cd_offset = struct.unpack_from("<IIQQQQ", rec, 16)
                zip64 = z64_at == eocd_at - 20 - 56
    if count != on_disk or (disk or cd_disk) and (disk, cd_disk) != (1, 1):
        raise ReadError(f"{path}: zip archive spans several disks, which torch's reader refuses")
    if cd_size < count * 46 or cd_offset + cd_size > file_size:
        raise ReadError(f"{path}: zip central directory points past the end of the file (truncated or corrupt)")
    if count > limits.MAX_ZIP_MEMBERS:
        raise ZipTooBig(f"{path}: zip archive lists {count:,} members, more than the {limits.MAX_ZIP_MEMBERS:,} "
                        "ckpt-doctor reads (a bomb, or no checkpoint)")
    if cd_size > limits.MAX_ZIP_DIRECTORY:
        raise ZipTooBig(f"{path}: zip central directory of {cd_size:,} bytes, more than the "
                        f"{limits.MAX_ZIP_DIRECTORY >> 20} MB ckpt-doctor reads (a bomb, or no checkpoint)")
    cd = pread(fd, cd_size, base + cd_offset)
    # Local headers sit between the payloads. A small archive is read whole (one syscall for 20,000 headers); a big
    # one in blocks of neighbouring headers (a memory map would fault in, and count in RSS, 64 KB around each), which
    # also take the first bytes of each member's data (torch pads the extra field to 64-byte alignment): whether they
    # are NumPy's magic, which the survey asks of every member, then costs no second call. (Read whole only when
    # there are many headers: a DCP item of 8 MB has five, and 100 items read whole cost 0.1 s.)
    whole = pread(fd, file_size, base) if file_size <= limits.ZIP_WHOLE_READ and (
        count > 64 or file_size <= 1 << 20) else None
    # Column by column pays from a few dozen members on; a DCP item's handful is read faster one by one.
    columns = count > 64 and not (is_remote(fd) and whole is None)
    made = _by_columns(fd, cd, count, disk, file_size, path, base, whole, defer) if columns else None
    index, p = made if made is not None else _one_by_one(fd, cd, count, disk, file_size, path, base, whole)
    # Python's zipfile (np.load, most tools) reads the same archive differently: it shifts every offset by the
    # bytes between where the directory ends and where the end record is, and reads entries until the directory's
    # size is used up. When that could give it other members, say so: the survey then walks its view too.
    concat = eocd_at - cd_size - cd_offset - (56 + 20 if zip64 else 0)
    if concat:
        index.other_readers = f"Python's zipfile shifts its offsets by {concat} bytes"
    elif p < cd_size:
        index.other_readers = (f"the directory holds {cd_size - p} bytes past the {count} entries its end record "
                               "counts, which Python's zipfile reads")
    return index


def _one_by_one(fd: int, cd: bytes, count: int, disk: int, file_size: int, path: str, base: int,
                whole: bytes | None) -> tuple[ZipIndex, int]:
    """The members, each checked in turn (raising ReadError at the first that is broken), and where the directory's
    last entry ends. Where the column reader declines: an archive over the network, or one that something is wrong
    with (which this reader names)."""
    heads: dict[int, bytes] = {}
    members = []
    # Over the network a local header is a request: a storage's (a member data/N, raw tensor bytes) is not fetched
    # when torch's writer put it where the headers that were fetched (data.pkl, the records at both ends, in the
    # blocks already read) say every header is: its data then starts at the next 64-byte boundary after a 4-byte
    # padding field. The tensor data is read later only from its local header, which is then checked.
    remote = is_remote(fd) and whole is None
    guessed: list[int] = []
    torch_layout = None if remote else False
    storage_prefix = f"{cd[46:46 + 256].split(b'/', 1)[0].decode('utf-8', 'surrogateescape')}/data/" if count else ""
    new_member = tuple.__new__  # ZipMember's fields in order, without namedtuple's __new__ frame per member
    unpack_central, unpack_local = _CENTRAL_HEADER.unpack_from, _LOCAL_HEADER.unpack_from
    p = 0
    for _ in range(count):
        if p + 46 > len(cd):
            raise ReadError(f"{path}: zip central directory is corrupt")
        sig, flags, method, crc, csize, usize, nlen, xlen, clen, _disk, attrs, local_at = unpack_central(cd, p)
        if sig != _CENTRAL or p + 46 + nlen + xlen + clen > len(cd):
            raise ReadError(f"{path}: zip central directory is corrupt")
        name = cd[p + 46:p + 46 + nlen].decode("utf-8", "surrogateescape")
        if usize == 0xFFFFFFFF or csize == 0xFFFFFFFF or local_at == 0xFFFFFFFF:
            usize, csize, local_at = _zip64_extra(cd[p + 46 + nlen:p + 46 + nlen + xlen], usize, csize, local_at, path)
        elif method == 0 and csize != usize or usize and not csize:
            raise ReadError(f"{path}: zip member {name} has two sizes that disagree ({csize} and {usize}): the "
                            "central directory is corrupt")
        if flags & 0x2000:
            raise ReadError(f"{path}: zip member {name} has a masked local header, which torch's reader refuses")
        if _disk == 0xFFFF or _disk != disk and _disk != 1:
            raise ReadError(f"{path}: zip archive spans several disks, which torch's reader refuses")
        if local_at + 30 + csize > file_size:
            raise ReadError(f"{path}: zip member {name} runs past the end of the file (truncated)")
        p += 46 + nlen + xlen + clen
        if remote and torch_layout is not False and name.startswith(storage_prefix) \
                and name[len(storage_prefix):].isdigit() and fd.cached(30 + nlen, base + local_at) is None \
                and torch_data_at(local_at, nlen, usize) + csize <= file_size:
            guessed.append(len(members))
            members.append(new_member(ZipMember, (name, base + torch_data_at(local_at, nlen, usize), usize, csize,
                                                  method, crc, base + local_at, flags,
                                                  bool(attrs & 0x10) or name.endswith("/"))))
            continue
        if whole is not None:
            head, at = whole, local_at
        else:
            head, at = pread(fd, 30 + nlen + 128 + HEAD_BYTES, base + local_at), 0
        data_at = -1
        if len(head) >= at + 30:
            sig, lnlen, lxlen = unpack_local(head, at)
            if sig == _LOCAL and local_at + 30 + lnlen + lxlen + csize <= file_size:
                data_at = base + local_at + 30 + lnlen + lxlen
                if whole is None and 30 + lnlen + lxlen + HEAD_BYTES <= len(head):
                    heads[data_at] = head[30 + lnlen + lxlen:30 + lnlen + lxlen + HEAD_BYTES]
                if remote and torch_layout is not False:
                    torch_layout = data_at == base + torch_data_at(local_at, lnlen, usize) and lnlen == nlen
            elif remote:
                torch_layout = False
        members.append(new_member(ZipMember, (name, data_at, usize, csize, method, crc, base + local_at, flags,
                                              bool(attrs & 0x10) or name.endswith("/"))))
    if guessed and torch_layout is not True:  # not torch's writer (or nothing to tell): each header is read
        for i in guessed:
            m = members[i]
            local_at = m.header_offset - base
            head = pread(fd, 30 + 4096, m.header_offset)
            data_at = -1
            if len(head) >= 30:
                sig, lnlen, lxlen = unpack_local(head, 0)
                if sig == _LOCAL and local_at + 30 + lnlen + lxlen + m.compressed_size <= file_size:
                    data_at = base + local_at + 30 + lnlen + lxlen
            members[i] = m._replace(offset=data_at)
        guessed = []
    index = ZipIndex(members, path, whole, base, heads)
    index.guessed = len(guessed)
    return index, p


_NPY = b"\x93NUMPY"
_BLOCK = 1 << 20  # local headers are read in blocks of up to this many bytes ...
_GAP = 32 << 10  # ... that skip no more than this between two headers (reading it costs less than a call)


def _by_columns(fd: int, cd: bytes, count: int, disk: int, file_size: int, path: str, base: int,
                whole: bytes | None, defer: bool = False) -> tuple[ZipIndex, int] | None:
    """What _one_by_one makes of a local archive, column by column: the directory's fields taken a column at a
    time from runs of entries of one length, each check made of a whole column, the local headers read in a few
    large reads, and which members' data may start with NumPy's magic worked out here. None where anything is
    unusual (a check fails, zip64 sizes that do not parse): _one_by_one then reads the archive and says what is
    wrong as before."""
    if sys.byteorder != "little":  # (the columns are cast from little-endian bytes)
        return None
    entries = _entries(cd, count)
    if entries is None:
        return None
    p, runs, names_raw, (flags, methods, crcs, csizes, usizes, nlens, xlens, disks, attrs, local_ats) = entries
    joined = None
    if names_raw.isascii() and names_raw.count(b"\n") == count - 1:
        joined = names_raw.decode("ascii")
        names = joined.split("\n")
    else:
        names = [cd[at + 46:at + 46 + n].decode("utf-8", "surrogateescape") for at, n in zip(_starts(runs), nlens)]
    # (a name ends in "/" where the names' bytes hold "/" before a line break or at their end: 0x2F is no part of a
    # longer UTF-8 sequence)
    folders = b"/\n" in names_raw or names_raw.endswith(b"/")
    del names_raw
    big = 0xFFFFFFFF
    wide = [i for i, (u, c, a) in enumerate(zip(usizes, csizes, local_ats)) if u == big or c == big or a == big] \
        if big in usizes or big in csizes or big in local_ats else []
    if wide or methods.count(0) != count or csizes != usizes:
        skip = set(wide)
        for i, (m, c, u) in enumerate(zip(methods, csizes, usizes)):
            if (m == 0 and c != u or u and not c) and i not in skip:
                return None
        starts = _starts(runs)
        for i in wide:
            at = starts[i] + 46 + nlens[i]
            try:
                usizes[i], csizes[i], local_ats[i] = _zip64_extra(cd[at:at + xlens[i]], usizes[i], csizes[i],
                                                                  local_ats[i], path)
            except ReadError:
                return None
    del xlens
    if any(f & 0x2000 for f in set(flags)) or any(d == 0xFFFF or d != disk and d != 1 for d in set(disks)):
        return None
    if max(map(add, local_ats, csizes)) + 30 > file_size:
        return None
    pending = None
    if whole is not None:
        try:
            data, maybe = _data_starts(whole, local_ats, csizes, file_size, -1)
        except IndexError:  # (the file was cut short meanwhile)
            return None
        offsets = data if not base else [d + base if d >= 0 else -1 for d in data]
    else:
        headers = None
        if defer and count >= FORK_AT and isinstance(fd, int) and can_fork():
            headers = _local_headers(fd, local_ats[:1], nlens[:1], csizes[:1], file_size, base)  # the first alone
            if headers is None:
                return None
            try:
                pending = _Headers((fd, local_ats, nlens, csizes, file_size, base))
                headers = headers[0] + [-1] * (count - 1), []  # the rest once settled
            except OSError:  # no processes or maps left: read here
                headers = None
        if headers is None:
            headers = _local_headers(fd, local_ats, nlens, csizes, file_size, base)
        if headers is None:
            return None
        offsets, maybe = headers
    if any(a & 0x10 for a in set(attrs)) or folders:
        is_dir = [bool(a & 0x10) or n.endswith("/") for a, n in zip(attrs, names)]
    else:
        is_dir = [False] * count
    at = list(map(add, local_ats, repeat(base))) if base else local_ats
    index = ZipIndex(None, path, whole, base, columns=(names, offsets, usizes, csizes, methods, crcs, at, flags,
                                                       is_dir), joined=joined)
    if pending is None:
        index.npy_heads = _npy_heads(index, maybe, methods)
    else:
        index.pending = pending
    return index, p


def _npy_heads(index: ZipIndex, maybe: list[int], methods: list[int]) -> list[int]:
    """ZipIndex.npy_heads from the positions _local_headers saw NumPy's magic at, or did not see (`maybe`)."""
    if methods.count(0) != len(methods):  # a deflated member's first bytes are known only once inflated
        maybe = sorted(set(maybe).union(i for i, m in enumerate(methods) if m))
    return [i for i in maybe if _may_be_npy(index.member(i))]


# Members from which a big archive's local headers (read by pread, not from its bytes read whole) are read by a
# forked child (_Headers) while the survey walks the main pickle: 20,000 headers spread over a file cost ~30 ms.
FORK_AT = 4096


class _Headers:
    """_local_headers' answer for a big archive, worked out by a forked child while this process reads on: the
    survey walks torch's first member, data.pkl (its header read here at once), meanwhile, and takes the rest
    (ZipIndex.settle) when it first asks for another member. The child answers in an anonymous shared map (it never
    blocks on a pipe nobody reads), ignores Ctrl-C and exits without returning into the caller's code. Anything
    wrong with it (it died, raised) only means the headers are read here after all; a child never waited for (the
    survey failed first) is killed and reaped when this object goes."""

    def __init__(self, args: tuple) -> None:
        import mmap

        self.args = args
        count = len(args[1])
        self.pid = 0
        self.shared = mmap.mmap(-1, 16 * (count + 1))  # two counts, then at most 2 * count ints
        parent = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                import signal

                signal.signal(signal.SIGINT, signal.SIG_IGN)
                die_with_parent(parent)  # (Ctrl-C ends the command at once: not a child reading on after it)
                found = _local_headers(*args)
                if found is None:
                    code = _CUT
                else:
                    from array import array

                    offsets, maybe = found
                    self.shared[:16] = struct.pack("<qq", len(offsets), len(maybe))
                    self.shared[16:16 + 8 * (len(offsets) + len(maybe))] = array("q", offsets + maybe).tobytes()
                    code = 0
            finally:
                os._exit(code)

    def result(self) -> tuple[list[int], list[int]] | None:
        """_local_headers' answer: the child's, else worked out here."""
        try:
            code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        except ChildProcessError:  # reaped by someone else: its answer is not known to be whole
            code = 1
        self.pid = 0
        try:
            if code == _CUT:
                return None
            if code == 0:
                from array import array

                count, seen = struct.unpack_from("<qq", self.shared)
                found = array("q", self.shared[16:16 + 8 * (count + seen)]).tolist()
                if count == len(self.args[1]):
                    return found[:count], found[count:]
            return _local_headers(*self.args)
        finally:
            self.shared.close()


    def __del__(self) -> None:  # (not weakref.finalize: its exit handler would keep the command from os._exit)
        if self.pid:
            import signal

            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except Exception:  # gone already (OSError), or Python is shutting down
                pass


_CUT = 3  # the child's exit code where the file came back short


def _data_starts(block: bytes, at: list[int], sizes: list[int], room: int,
                 missing: int) -> tuple[list[int], list[int]]:
    """From the local headers at positions `at` of `block`, each header's signature and its name and extra lengths
    taken a byte column at a time: where each member's data starts in `block` (`missing` where no local header is
    where the directory says, or where its data, of `sizes` bytes, would run past `room`), and the positions in `at`
    of those whose data starts with NumPy's magic or runs past `block` (not seen). IndexError when `block` ends inside
    a header."""
    signed = list(map(block.startswith, repeat(_LOCAL), at))
    lengths = _ints(block, at, 26, 4)  # the two lengths as one int: name + (extra << 16)
    data = list(map(add, at, map(add, map(and_, lengths, repeat(0xFFFF)),
                                 map(add, map(rshift, lengths, repeat(16)), repeat(30)))))
    if False in signed or max(map(add, data, sizes)) > room:
        data = [d if s and d + c <= room else missing for d, s, c in zip(data, signed, sizes)]
    seen = list(map(block.startswith, repeat(_NPY), data))  # (a missing one's offset is -1: _may_be_npy drops it)
    if True not in seen and max(data) + len(_NPY) <= len(block):
        return data, []
    return data, [n for n, (d, hit) in enumerate(zip(data, seen)) if hit or d + len(_NPY) > len(block)]


def _ints(buf: bytes, positions: list[int], k: int, width: int) -> list[int]:
    """The little-endian unsigned int of `width` (2 or 4) bytes at each of `positions`, plus `k`, of `buf`
    (IndexError past its end): a byte of each at a time, from views of `buf` that start where that byte is."""
    out = bytearray(width * len(positions))
    take = itemgetter(*positions)
    with memoryview(buf) as view:
        for j in range(width):
            got = take(view[k + j:])
            out[j::width] = bytes(got) if len(positions) != 1 else bytes([got])
    return memoryview(out).cast("H" if width == 2 else "I").tolist()


# the central directory entry's fields kept: (offset, width) of flags, method, crc32, compressed size, size, disk,
# external attributes (the low byte: 0x10 marks a folder), local header offset
_FIELDS = ((8, 2), (10, 2), (16, 4), (20, 4), (24, 4), (34, 2), (38, 1), (42, 4))
_RUN_BYTES = (0, 1, 2, 3, 28, 29, 30, 31, 32, 33)  # alike in a run: the signature and the three lengths
_RUN = 16  # entries alike from where a run is taken column-wise; fewer are cut one by one ...
_ALONE = 64  # ... and so are this many after them, before the next run is looked for


def _entries(cd: bytes, count: int) -> tuple[int, list[int], bytes, tuple[list[int], ...]] | None:
    """The `count` entries of a central directory: where the last ends, where each starts (as runs of equal
    entries: where, size, how many), their names joined by
    line breaks, and the columns flags, method, crc32, compressed size, size, name length, extra length, disk,
    external attributes (low byte) and local header offset; None where an entry is not one or runs past the end.
    Entries of one length and signature in a run (torch names its storages data/0, data/1, ...: a run is all those
    of as many digits) are taken a field at a time, by slicing every entry's bytes of it at once."""
    end = len(cd)
    flags, methods, crcs, csizes, usizes, disks, attrs, local_ats = columns = tuple([] for _ in _FIELDS)
    nlens: list[int] = []
    xlens: list[int] = []
    runs: list[tuple[int, int, int]] = []  # (where, entry size, entries): where each entry starts, compressed
    names: list[bytes] = []
    unpack_central = _CENTRAL_HEADER.unpack_from
    p = i = alone = 0
    while i < count:
        if p + 46 > end or cd[p:p + 4] != _CENTRAL:
            return None
        nlen, xlen, clen = _LENGTHS.unpack_from(cd, p + 28)
        size = 46 + nlen + xlen + clen
        limit = min(count - i, (end - p) // size)
        if limit < 1:
            return None
        run = _run_length(cd, p, size, limit) if not alone else 1
        if run < _RUN:
            alone = alone - 1 if alone else _ALONE
            for _ in range(run):
                _sig, f, m, crc, c, u, nlen, xlen, clen, d, a, at = unpack_central(cd, p)
                for column, value in zip(columns, (f, m, crc, c, u, d, a & 0xFF, at)):
                    column.append(value)
                runs.append((p, size, 1))
                names.append(cd[p + 46:p + 46 + nlen] + b"\n")
                nlens.append(nlen)
                xlens.append(xlen)
                p += size
            i += run
            continue
        stop = p + size * run
        for column, (at, width) in zip(columns, _FIELDS):
            if width == 1:
                column += cd[p + at:stop:size]
                continue
            out = bytearray(width * run)
            for j in range(width):
                out[j::width] = cd[p + at + j:stop:size]
            column += memoryview(out).cast("H" if width == 2 else "I").tolist()
        joined = bytearray((nlen + 1) * run)
        for j in range(nlen):
            joined[j::nlen + 1] = cd[p + 46 + j:stop:size]
        joined[nlen::nlen + 1] = b"\n" * run
        names.append(bytes(joined))
        runs.append((p, size, run))
        nlens += [nlen] * run
        xlens += [xlen] * run
        p = stop
        i += run
    return p, runs, b"".join(names)[:-1], (flags, methods, crcs, csizes, usizes, nlens, xlens, disks, attrs,
                                           local_ats)


def _starts(runs: list[tuple[int, int, int]]) -> list[int]:
    """Where each entry starts, from _entries' runs."""
    starts: list[int] = []
    for p, size, n in runs:
        starts += range(p, p + size * n, size)
    return starts


def _run_length(cd: bytes, p: int, size: int, limit: int) -> int:
    """How many entries of `size` bytes from `p` on (at most `limit`) share the first's signature and lengths:
    looked for in chunks that double while they all do."""
    n = 0
    chunk = 64
    while n < limit:
        k = min(chunk, limit - n)
        q = p + n * size
        lead = k
        for b in _RUN_BYTES:
            column = cd[q + b:q + b + size * k:size]
            lead = min(lead, len(column) - len(column.lstrip(cd[p + b:p + b + 1])))
        n += lead
        if lead < k:
            break
        chunk *= 2
    return n


_LENGTHS = struct.Struct("<HHH")


def _may_be_npy(m: ZipMember) -> bool:
    """Whether member_head could give NumPy's magic for `m` (it gives nothing of a member it cannot read)."""
    return not (m.offset < 0 or m.is_dir or m.flags & 1) and (m.method != 0 or m.compressed_size >= len(_NPY))


def _local_headers(fd: int, local_ats: list[int], nlens: list[int], csizes: list[int], file_size: int,
                   base: int) -> tuple[list[int], list[int]] | None:
    """Each member's data offset (-1 where no local header is where the directory says) from its local header,
    read in blocks of neighbouring headers (a checkpoint of small tensors: the whole file, 1 MB at a time; one of
    big tensors: a read a header, as before) and taken from each a column at a time, and the positions of the
    members whose data was seen to start with NumPy's magic, or was not seen (a header whose extra field runs on).
    None when a block comes back short (the file was cut meanwhile)."""
    count = len(local_ats)
    ordered = local_ats == sorted(local_ats)
    order = list(range(count)) if ordered else sorted(range(count), key=local_ats.__getitem__)
    ats = local_ats if ordered else [local_ats[k] for k in order]
    want = 30 + 128 + HEAD_BYTES  # of each header, past its name: what _one_by_one reads of it
    # where what is read of each header ends, and the gaps too wide to read through, between one and the next
    stops = list(map(add, ats, map(add, nlens if ordered else [nlens[k] for k in order], repeat(want))))
    gaps = list(map(sub, ats[1:], stops))
    cuts = ([i + 1 for i, gap in enumerate(gaps) if gap > _GAP] if gaps and max(gaps) > _GAP else []) + [count]
    del gaps
    sizes = csizes if ordered else [csizes[k] for k in order]
    found: list[int] = []  # data offsets, in the order of `ats`
    maybe = []
    i = 0
    cut = 0
    while i < count:
        while cuts[cut] <= i:
            cut += 1
        j = max(min(bisect_right(ats, ats[i] + _BLOCK, i + 1), cuts[cut]), i + 1)
        start = ats[i]
        block = pread(fd, min(max(stops[i:j]), file_size) - start, base + start)
        try:
            data, seen = _data_starts(block, list(map(sub, ats[i:j], repeat(start))), sizes[i:j], file_size - start,
                                      -1 - start - base)
        except IndexError:
            return None
        maybe += (i + n for n in seen)
        found += map(add, data, repeat(start + base))
        i = j
    if ordered:
        return found, maybe
    offsets = [-1] * count
    for k, offset in zip(order, found):
        offsets[k] = offset
    return offsets, sorted(order[n] for n in maybe)


def torch_data_at(local_at: int, nlen: int, size: int, alignment: int = 64) -> int:
    """Where torch's writer (PyTorchStreamWriter's getPadding) starts a record's data: past the local header, its
    name, the zip64 extra it writes for big records or offsets, and a padding field, on the next 64-byte boundary."""
    start = local_at + 30 + nlen + 4
    if size >= 0xFFFFFFFF or local_at >= 0xFFFFFFFF:
        start += 4 + (16 if size >= 0xFFFFFFFF else 0) + (8 if local_at >= 0xFFFFFFFF else 0)
    return -(-start // alignment) * alignment


def _locate_end_record(fd: int, file_size: int, base: int = 0) -> int | None:
    """miniz's search: 4 KB blocks from the end backwards, the last signature with a whole record after it, giving up
    once it has looked about 64 KB back."""
    if file_size < 22:
        return None
    at = max(file_size - 4096, 0)
    while True:
        block = pread(fd, min(4096, file_size - at), base + at)
        i = len(block) - 4
        while i >= 0:
            i = block.rfind(b"PK\x05\x06", 0, i + 4)
            if i < 0:
                break
            if file_size - (at + i) >= 22:
                return at + i
            i -= 1
        if at == 0 or file_size - at >= 0xFFFF + 22:
            return None
        at = max(at - (4096 - 3), 0)


def _zip64_extra(extra: bytes, usize: int, csize: int, local_at: int, path: str) -> tuple[int, int, int]:
    q = 0
    while q + 4 <= len(extra):
        tag, size = struct.unpack("<HH", extra[q:q + 4])
        body = extra[q + 4:q + 4 + size]
        if tag == 1:
            values = list(struct.unpack(f"<{len(body) // 8}Q", body[:len(body) // 8 * 8]))
            if usize == 0xFFFFFFFF and values:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF and values:
                csize = values.pop(0)
            if local_at == 0xFFFFFFFF and values:
                local_at = values.pop(0)
            return usize, csize, local_at
        q += 4 + size
    raise ReadError(f"{path}: zip64 sizes missing from the central directory (corrupt archive)")


def member_head(fd: int, member: ZipMember, size: int, index: ZipIndex | None = None) -> bytes:
    """The first `size` bytes of a member (inflating no more than that), or b"" when it cannot be read; from the
    archive's bytes when `index` read them whole (no system call per member: 20,000 of them took 20 ms)."""
    if member.offset < 0 or member.is_dir or member.flags & 1:
        return b""
    if index is not None and index.whole is not None and member.method == 0:
        start = member.offset - index.base
        return index.whole[start:start + min(member.compressed_size, size)]
    if index is not None and member.method == 0 and size <= HEAD_BYTES and member.offset in index.heads:
        return index.heads[member.offset][:min(member.compressed_size, size)]
    raw = pread(fd, min(member.compressed_size, size if member.method == 0 else 1 << 16), member.offset)
    if member.method == 0:
        return raw
    if member.method != 8:
        return b""
    try:
        return zlib.decompressobj(-15).decompress(raw, size)
    except zlib.error:
        return b""


def read_member(fd: int, member: ZipMember, path: str, check_crc: bool = True,
                budget: list[int] | None = None) -> bytes:
    """A member's bytes, as torch's reader gets them. `budget` (a one-item list) is debited by what inflating
    costs, so all members of one archive together stay under limits.MAX_INFLATED_TOTAL."""
    if member.offset < 0:
        raise ReadError(f"{path}: zip member {member.name} has no local header where the directory says "
                        "(corrupt or truncated archive)")
    if member.is_dir:
        raise ReadError(f"{path}: zip member {member.name} is marked as a folder: torch's reader would hand back "
                        "uninitialised memory for it")
    if member.flags & 1:
        raise ReadError(f"{path}: zip member {member.name} is encrypted, which torch's reader refuses")
    if member.method == 8:
        if member.size > limits.MAX_INFLATED_MEMBER or member.size > member.compressed_size * limits.MAX_DEFLATE_RATIO:
            raise ReadError(f"{path}: zip member {member.name} claims to inflate to {member.size:,} bytes from "
                            f"{member.compressed_size:,} (a zip bomb?)")
        if budget is not None:
            if budget[0] < member.size:
                raise ReadError(f"{path}: zip members inflate to more than "
                                f"{limits.MAX_INFLATED_TOTAL >> 20} MB together (a zip bomb?)")
            budget[0] -= member.size
        raw = pread(fd, member.compressed_size, member.offset)
        inflater = zlib.decompressobj(-15)
        try:
            # No more than the directory's size, as miniz fills a buffer of that size and stops: a stream that
            # would inflate longer gives torch its first `size` bytes, and so it gives them here.
            data = inflater.decompress(raw, member.size)
        except zlib.error as exc:
            raise ReadError(f"{path}: zip member {member.name} does not inflate ({exc})") from None
    elif member.method == 0:
        data = pread(fd, member.compressed_size, member.offset)
    else:
        raise ReadError(f"{path}: zip member {member.name} uses compression method {member.method}, "
                        "which torch's reader refuses")
    if len(data) != member.size:
        raise ReadError(f"{path}: zip member {member.name} is {len(data)} bytes, the directory says {member.size}")
    if check_crc and zlib.crc32(data) != member.crc:
        raise ReadError(f"{path}: zip member {member.name} fails its CRC check (the file is corrupt)")
    return data


def inflated_range(fd: int, offset: int, compressed: int, skip: int, nbytes: int, what: str,
                   whole: tuple[int, int] | None = None) -> Iterator[bytes]:
    """Bytes [skip, skip + nbytes) of the raw deflate stream of `compressed` bytes at `offset` (a deflated zip member:
    a storage torch.load inflates), in blocks, inflated as they are asked for. The stream is fed 16 KB at a time, so
    a block is at most 16 KB x 1032 (deflate's best ratio) and memory stays bounded whatever the member's size
    (small feeds also inflated fastest here: 140 MB/s, against 60 MB/s capping the output instead). No more than
    the member's size is used, as miniz fills a buffer of that size and stops. `whole`: the (size, crc32) the
    directory records; the stream is then inflated to its end and checked against them (torch does not check; a
    copy made from it must). Raises ReadError naming `what`."""
    if whole is not None:
        if is_remote(fd):
            checked = (fd.shown, fd.tag, fd.size, offset)
        else:
            st = os.fstat(fd)
            checked = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, offset)
        if checked in _CHECKED:  # inflated to its end and checked once already: a view need not again
            whole = None
    inflater = zlib.decompressobj(-15)
    end = skip + nbytes
    limit = whole[0] if whole is not None else end
    pos = read = crc = 0
    while pos < limit and read < compressed and not inflater.eof:
        raw = read_data(fd, min(1 << 20, compressed - read), offset + read)
        if not raw:
            raise ReadError(f"{what}: the file ends inside its compressed bytes (truncated)")
        read += len(raw)
        with memoryview(raw) as view:
            for at in range(0, len(raw), 16 << 10):
                try:
                    out = inflater.decompress(view[at:at + (16 << 10)])
                except zlib.error as exc:
                    raise ReadError(f"{what}: does not inflate ({exc}): the file is corrupt") from None
                if not out:
                    if inflater.eof:
                        break
                    continue
                if pos + len(out) > limit:
                    out = out[:limit - pos]
                if whole is not None:
                    crc = zlib.crc32(out, crc)
                lo, hi = max(skip - pos, 0), min(end - pos, len(out))
                pos += len(out)
                if lo < hi:
                    yield out if (lo, hi) == (0, len(out)) else out[lo:hi]
                if pos >= limit:
                    break
    if pos < limit:
        raise ReadError(f"{what}: inflates to {pos:,} bytes, not the {limit:,} its zip directory records (the file is "
                        "corrupt)")
    if whole is not None and crc != whole[1]:
        raise ReadError(f"{what}: fails its CRC check once inflated (the file is corrupt)")
    if whole is not None:
        _CHECKED.add(checked)


_CHECKED: set[tuple[int, ...]] = set()  # deflated members inflated whole and found to match their crc32


def local_members(fd: int, file_size: int, start: int = 0, limit: int = 4096) -> list[tuple[str, int]]:
    """(name, data offset) of every local header from `start` on: what is left to look at in an archive whose
    central directory is gone (a truncated download), in one appended to a pickle, or in several archives laid end
    to end (a torch.distributed.checkpoint shard). Headers are found by their signature, so members whose sizes
    follow their data (torch's writer) are found too."""
    from .mapping import find_all

    found: list[tuple[str, int]] = []
    if file_size - start < 30:
        return found
    # searched in blocks read, not in a memory map: a file cut short meanwhile must not kill the process (SIGBUS)
    for at in find_all(fd, file_size, _LOCAL, start):
        if len(found) >= limit or at + 30 > file_size:
            break
        if found and at < found[-1][2]:
            continue  # inside the header just read (the search goes on 30 bytes past each header, as before)
        nlen, xlen = struct.unpack_from("<HH", pread(fd, 4, at + 26))
        name = pread(fd, nlen, at + 30).decode("utf-8", "surrogateescape")
        found.append((name, at + 30 + nlen + xlen, at + 30))
    return [(name, data_at) for name, data_at, _ in found]


# --- miniz's choice among duplicate names ---------------------------------------------------------------------

def _miniz_pick(names: list[str], wanted: str) -> int:
    """The index miniz's lookup returns: it heap-sorts the names (an unstable sort) and binary-searches them."""
    raw = [n.encode("utf-8", "surrogateescape").translate(_LOWER_TABLE) for n in names]
    size = len(raw)
    idx = list(range(size))

    def sift(root: int, end: int) -> None:
        while True:
            child = root * 2 + 1
            if child >= end:
                return
            if child + 1 < end and _cmp(raw[idx[child]], raw[idx[child + 1]]) < 0:
                child += 1
            if not _cmp(raw[idx[root]], raw[idx[child]]) < 0:
                return
            idx[root], idx[child] = idx[child], idx[root]
            root = child

    if size > 1:
        for start in range((size - 2) >> 1, -1, -1):
            sift(start, size)
        for end in range(size - 1, 0, -1):
            idx[end], idx[0] = idx[0], idx[end]
            sift(0, end)
    target = wanted.encode("utf-8", "surrogateescape").split(b"\0")[0].translate(_LOWER_TABLE)
    lo, hi = 0, size - 1
    while lo <= hi:
        mid = lo + ((hi - lo) >> 1)
        c = _cmp(raw[idx[mid]], target)
        if c == 0:
            return idx[mid]
        if c < 0:
            lo = mid + 1
        else:
            hi = mid - 1
    raise KeyError(wanted)


_LOWER_TABLE = bytes(c + 32 if 65 <= c <= 90 else c for c in range(256))


def _cmp(a: bytes, b: bytes) -> int:
    """miniz's byte order on ASCII-lowered names: the first differing byte, then the length."""
    m = min(len(a), len(b))
    if a[:m] != b[:m]:
        for x, y in zip(a, b):
            if x != y:
                return x - y
    return len(a) - len(b)
