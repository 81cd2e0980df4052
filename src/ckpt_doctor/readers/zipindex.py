"""A zip central-directory reader that gives each member's data offset without touching its bytes."""

from __future__ import annotations

import os
import struct
import zlib
from typing import NamedTuple

from ..errors import ReadError

_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
WHOLE_READ_LIMIT = 16 << 20
MAX_INFLATED = 128 * 1024 * 1024  # a compressed pickle larger than this once inflated is a bomb


class ZipMember(NamedTuple):
    """One archive member (a tuple: a 20,000-tensor checkpoint has 20,000 of them, made in one pass)."""

    name: str
    offset: int  # of the data, past the local header
    size: int
    compressed_size: int
    method: int
    crc: int
    header_offset: int


_CENTRAL_HEADER = struct.Struct("<4s6xHxxxxLLLHHH8xL")  # signature, method, crc, sizes, name/extra/comment, offset
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, name and extra lengths


def read_zip_index(fd: int, file_size: int, path: str) -> dict[str, ZipMember]:
    """Members by name. Raises ReadError naming what is broken: a truncated or corrupt archive."""
    tail_len = min(file_size, 65536 + 22)
    tail = os.pread(fd, tail_len, file_size - tail_len)
    pos = tail.rfind(_EOCD)
    if pos < 0 or len(tail) - pos < 22:
        raise ReadError(f"{path}: zip archive has no end-of-central-directory record "
                        "(the file is truncated or not a complete zip)")
    (_, _, _, count, cd_size, cd_offset, _) = struct.unpack("<4H2LH", tail[pos + 4:pos + 22])
    eocd_at = file_size - tail_len + pos
    if count == 0xFFFF or cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF:
        loc_at = eocd_at - 20
        loc = os.pread(fd, 20, loc_at) if loc_at >= 0 else b""
        if len(loc) != 20 or loc[:4] != _ZIP64_LOCATOR:
            raise ReadError(f"{path}: zip64 locator missing (the archive is corrupt)")
        (z64_at,) = struct.unpack("<Q", loc[8:16])
        rec = os.pread(fd, 56, z64_at)
        if len(rec) != 56 or rec[:4] != _ZIP64_EOCD:
            raise ReadError(f"{path}: zip64 end record missing (the archive is corrupt)")
        count, cd_size, cd_offset = struct.unpack("<QQQ", rec[32:56])
    if cd_offset + cd_size > file_size or count > 10_000_000:
        raise ReadError(f"{path}: zip central directory points past the end of the file (truncated or corrupt)")
    cd = os.pread(fd, cd_size, cd_offset)
    entries = []
    p = 0
    for _ in range(count):
        if p + 46 > len(cd):
            raise ReadError(f"{path}: zip central directory is corrupt")
        sig, method, crc, csize, usize, nlen, xlen, clen, local_at = _CENTRAL_HEADER.unpack_from(cd, p)
        if sig != _CENTRAL:
            raise ReadError(f"{path}: zip central directory is corrupt")
        name = cd[p + 46:p + 46 + nlen].decode("utf-8", "replace")
        if usize == 0xFFFFFFFF or csize == 0xFFFFFFFF or local_at == 0xFFFFFFFF:
            extra = cd[p + 46 + nlen:p + 46 + nlen + xlen]
            usize, csize, local_at = _zip64_extra(extra, usize, csize, local_at, path)
        p += 46 + nlen + xlen + clen
        if method == 0 and csize != usize:
            raise ReadError(f"{path}: zip member {name} is stored uncompressed but its two sizes differ "
                            f"({csize} and {usize}): the central directory is corrupt")
        entries.append((name, usize, csize, method, crc, local_at))
    return _locate_data(fd, file_size, entries, path)


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


def _locate_data(fd: int, file_size: int, entries: list[tuple[str, int, int, int, int, int]],
                 path: str) -> dict[str, ZipMember]:
    # Local headers sit between the payloads. A small archive is read whole (one syscall for 20,000 headers);
    # a big one gets one pread per header (a memory map would fault in, and count in RSS, 64 KB around each).
    whole = os.pread(fd, file_size, 0) if file_size <= WHOLE_READ_LIMIT else None
    located = {}
    for name, usize, csize, method, crc, local_at in entries:
        if whole is not None:
            head = whole if local_at + 30 <= file_size else b""
            at = local_at
        else:
            head, at = os.pread(fd, 30, local_at), 0
        if len(head) < at + 30:
            raise ReadError(f"{path}: zip member {name} has no local header (corrupt or truncated archive)")
        sig, nlen, xlen = _LOCAL_HEADER.unpack_from(head, at)
        if sig != _LOCAL:
            raise ReadError(f"{path}: zip member {name} has no local header (corrupt or truncated archive)")
        data_at = local_at + 30 + nlen + xlen
        if data_at + csize > file_size:
            raise ReadError(f"{path}: zip member {name} runs past the end of the file (truncated)")
        located[name] = ZipMember(name, data_at, usize, csize, method, crc, local_at)
    return located


def read_member(fd: int, member: ZipMember, path: str, check_crc: bool = True) -> bytes:
    raw = os.pread(fd, member.compressed_size, member.offset)
    if member.method == 8:
        inflater = zlib.decompressobj(-15)
        data = inflater.decompress(raw, MAX_INFLATED)
        if inflater.unconsumed_tail:
            raise ReadError(f"{path}: zip member {member.name} inflates past {MAX_INFLATED >> 20} MB (a zip bomb?)")
    elif member.method == 0:
        data = raw
    else:
        raise ReadError(f"{path}: zip member {member.name} uses compression method {member.method}, "
                        "which checkpoints never use")
    if len(data) != member.size:
        raise ReadError(f"{path}: zip member {member.name} is {len(data)} bytes, the directory says {member.size}")
    if check_crc and zlib.crc32(data) != member.crc:
        raise ReadError(f"{path}: zip member {member.name} fails its CRC check (the file is corrupt)")
    return data
