"""Writes a torch.save-compatible zip archive: data.pkl from the emitter, each storage streamed from its source."""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from typing import Callable

from .stream import Progress, ReadBack, copy_range, write_bytes

ALIGN = 64  # torch aligns every payload to 64 bytes (torch.load(mmap=True) relies on it)
_U32 = 0xFFFFFFFF


@dataclass
class StorageOut:
    """One `data/N` entry: where its bytes come from (or a producer for converted bytes), and its crc."""

    key: str
    nbytes: int
    source_fd: int = -1
    source_offset: int = 0
    known_crc: int | None = None
    produce: Callable[[int, int, Progress | None], int] | None = None  # (fd, offset, progress) -> crc
    crc: int | None = None
    offset: int = 0  # data offset in the output, set when written


@dataclass
class _Entry:
    name: bytes
    header_offset: int
    size: int
    crc: int


def _local_header(name: bytes, size: int, crc: int, at: int) -> bytes:
    zip64 = size >= _U32
    extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
    base = 30 + len(name) + len(extra)
    pad = (-(at + base + 4)) % ALIGN
    extra += struct.pack("<HH", 0x4B46, pad) + b"Z" * pad  # torch's own padding field ("FK")
    shown = _U32 if zip64 else size
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, 0, 0x21, crc, shown, shown,
                       len(name), len(extra)) + name + extra


class ZipOut:
    """Appends stored (uncompressed) members to an open file, then the central directory with zip64 records."""

    def __init__(self, fd: int, prefix: str) -> None:
        self.fd, self.prefix, self.pos, self.entries = fd, prefix, 0, []

    def add_bytes(self, name: str, data: bytes) -> None:
        crc = zlib.crc32(data)
        header = _local_header(f"{self.prefix}/{name}".encode(), len(data), crc, self.pos)
        write_bytes(self.fd, self.pos, header + data)
        self.entries.append(_Entry(f"{self.prefix}/{name}".encode(), self.pos, len(data), crc))
        self.pos += len(header) + len(data)

    def add_storage(self, storage: StorageOut, progress: Progress | None, readback: ReadBack | None = None) -> None:
        name = f"{self.prefix}/data/{storage.key}".encode()
        header_at = self.pos
        header = _local_header(name, storage.nbytes, 0, header_at)
        data_at = header_at + len(header)
        if storage.produce is not None:
            crc = storage.produce(self.fd, data_at, progress)
        else:
            crc = copy_range(storage.source_fd, storage.source_offset, storage.nbytes, self.fd, data_at, progress,
                             storage.known_crc)
        write_bytes(self.fd, header_at, _local_header(name, storage.nbytes, crc, header_at))
        storage.crc, storage.offset = crc, data_at
        if readback is not None:
            readback.check(data_at, storage.nbytes, crc, f"storage data/{storage.key}")
        self.entries.append(_Entry(name, header_at, storage.nbytes, crc))
        self.pos = data_at + storage.nbytes

    def finish(self) -> None:
        central = []
        for e in self.entries:
            extra_vals = []
            size = e.size
            if e.size >= _U32:
                extra_vals += [e.size, e.size]
                size = _U32
            offset = e.header_offset
            if e.header_offset >= _U32:
                extra_vals.append(e.header_offset)
                offset = _U32
            extra = struct.pack(f"<HH{len(extra_vals)}Q", 1, 8 * len(extra_vals), *extra_vals) if extra_vals else b""
            central.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if extra else 20, 0, 0, 0, 0x21,
                                       e.crc, size, size, len(e.name), len(extra), 0, 0, 0, 0, offset)
                           + e.name + extra)
        cd = b"".join(central)
        cd_at = self.pos
        zip64_at = cd_at + len(cd)
        count = len(self.entries)
        zip64 = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, len(cd), cd_at)
        locator = struct.pack("<IIQI", 0x07064B50, 0, zip64_at, 1)
        end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                          min(len(cd), _U32), min(cd_at, _U32), 0)
        write_bytes(self.fd, self.pos, cd + zip64 + locator + end)
        self.pos += len(cd) + len(zip64) + len(locator) + len(end)
        os.ftruncate(self.fd, self.pos)


def write_torch_zip(fd: int, prefix: str, pickle_bytes: bytes, storages: list[StorageOut],
                    progress: Progress | None = None, readback: ReadBack | None = None) -> None:
    """Entries in torch's order: data.pkl, format/alignment/byteorder records, the storages, version."""
    z = ZipOut(fd, prefix)
    z.add_bytes("data.pkl", pickle_bytes)
    z.add_bytes(".format_version", b"1")
    z.add_bytes(".storage_alignment", b"64")
    z.add_bytes("byteorder", b"little")
    for storage in storages:
        z.add_storage(storage, progress, readback)
    z.add_bytes("version", b"3\n")
    z.finish()
