"""Writes a torch.save-compatible zip archive: data.pkl from the emitter, each storage streamed from its source."""

from __future__ import annotations

import os
import struct
from .._record import record
from typing import Callable

from .stream import FOLIO, Progress, WrittenRanges, copy_bytes, copy_range, crc32, preallocate, write_bytes

ALIGN = 64  # torch aligns every payload to 64 bytes (torch.load(mmap=True) relies on it)
_U32 = 0xFFFFFFFF


@record(frozen=False)
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


@record(frozen=False)
class _Entry:
    name: bytes
    header_offset: int
    size: int
    crc: int
    flags: int = 0


# Copies of this much or more start at their source's offset modulo FOLIO, so the kernel can copy them (see
# stream.FOLIO), for up to 64 KB of padding; smaller ones are 64-byte aligned and go through the copy buffer.
FOLIO_PHASE_MIN = 8 << 20
DESCRIPTOR = 0x08  # general-purpose flag: crc and sizes follow the data (what torch.save writes)
RUN_CHUNK = 16 << 20  # a run of storages is copied this much at a time, so verifying and flushing keep pace


def _source_phase(source_offset: int, nbytes: int) -> tuple[int, int]:
    """(phase, align) for a copy of `nbytes` from `source_offset`: see FOLIO."""
    if nbytes < FOLIO_PHASE_MIN or source_offset % ALIGN:
        return 0, ALIGN
    return source_offset % FOLIO, FOLIO


def _local_header(name: bytes, size: int, crc: int, at: int, phase: int = 0, align: int = ALIGN,
                  flags: int = 0) -> bytes:
    """The member's local header, padded so its data starts at `phase` modulo `align`. With the DESCRIPTOR
    flag, crc and sizes are left zero here: a data descriptor after the data holds them."""
    zip64 = size >= _U32
    extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
    base = 30 + len(name) + len(extra)
    pad = (phase - (at + base + 4)) % align
    if len(extra) + 4 + pad > 0xFFFF:  # more than an extra field holds: settle for torch's alignment
        pad = (phase - (at + base + 4)) % ALIGN
    extra += struct.pack("<HH", 0x4B46, pad) + b"Z" * pad  # torch's own padding field ("FK")
    shown = _U32 if zip64 else size
    if flags & DESCRIPTOR:
        crc = shown = 0
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, flags, 0, 0, 0x21, crc, shown, shown,
                       len(name), len(extra)) + name + extra


class ZipOut:
    """Appends stored (uncompressed) members to an open file, then the central directory with zip64 records.

    `base`: where the archive starts in the file (a DCP item inside its rank's file; a multiple of ALIGN). Offsets
    inside the archive count from there, and data is aligned in the file (add_bytes, add_storage and finish honour
    it; add_run writes whole files only)."""

    def __init__(self, fd: int, prefix: str, base: int = 0) -> None:
        self.fd, self.prefix, self.pos, self.entries, self.base = fd, prefix, 0, [], base

    def add_bytes(self, name: str, data: bytes) -> None:
        crc = crc32(data)
        header = _local_header(f"{self.prefix}/{name}".encode(), len(data), crc, self.base + self.pos)
        write_bytes(self.fd, self.base + self.pos, header + data)
        self.entries.append(_Entry(f"{self.prefix}/{name}".encode(), self.pos, len(data), crc))
        self.pos += len(header) + len(data)

    def add_storage(self, storage: StorageOut, progress: Progress | None,
                    written: WrittenRanges | None = None) -> None:
        name = f"{self.prefix}/data/{storage.key}".encode()
        header_at = self.pos
        layout = (0, ALIGN) if storage.produce is not None else _source_phase(storage.source_offset, storage.nbytes)
        # With the source's crc known the header is final before the copy; else it is rewritten once the crc is.
        base = self.base
        header = _local_header(name, storage.nbytes, storage.known_crc or 0, base + header_at, *layout)
        write_bytes(self.fd, base + header_at, header)
        data_at = header_at + len(header)
        if storage.produce is not None:
            crc = storage.produce(self.fd, base + data_at, progress)
        else:
            crc = copy_range(storage.source_fd, storage.source_offset, storage.nbytes, self.fd, base + data_at,
                             progress, storage.known_crc, written)
        if crc != storage.known_crc:
            write_bytes(self.fd, base + header_at, _local_header(name, storage.nbytes, crc, base + header_at, *layout))
        storage.crc, storage.offset = crc, base + data_at
        if written is not None:
            written.done(base + data_at, storage.nbytes, crc, f"storage data/{storage.key}")
        self.entries.append(_Entry(name, header_at, storage.nbytes, crc))
        self.pos = data_at + storage.nbytes

    def _descriptor_after(self, storage: StorageOut) -> int:
        """Length of the data descriptor that follows `storage` in its source (torch.save writes one), or 0."""
        desc = os.pread(storage.source_fd, 16, storage.source_offset + storage.nbytes)
        return 16 if desc == struct.pack("<IIII", 0x08074B50, storage.known_crc, storage.nbytes, storage.nbytes) \
            else 0

    def continues(self, prev: StorageOut, nxt: StorageOut) -> int | None:
        """Whether `nxt` directly follows `prev` in their source file, with a local header that is already the one
        this archive would write for it (same name, stored, its crc and size in the header or in a data descriptor
        after `prev`): then both are copied as one range, headers and descriptors included. Returns the length
        of the descriptor between them (0 or 16), or None."""
        if prev.source_fd.__class__ is not int:  # a remote source: its data windows already make few requests
            return None
        if prev.produce is not None or nxt.produce is not None or prev.source_fd != nxt.source_fd \
                or prev.known_crc is None or nxt.known_crc is None or max(prev.nbytes, nxt.nbytes) >= _U32 \
                or prev.source_offset % ALIGN or nxt.source_offset % ALIGN:  # (old files: copied one by one)
            return None
        name = f"{self.prefix}/data/{nxt.key}".encode()
        gap = self._descriptor_after(prev)
        at = prev.source_offset + prev.nbytes + gap
        head = os.pread(prev.source_fd, 30 + len(name), at)
        if len(head) != 30 + len(name):
            return None
        sig, _, flags, method, _, _, crc, csize, usize, nlen, xlen = struct.unpack("<IHHHHHIIIHH", head[:30])
        if gap:
            sizes_ok = flags & DESCRIPTOR and (crc, csize, usize) == (0, 0, 0)
        else:
            sizes_ok = not flags & DESCRIPTOR and (crc, csize, usize) == (nxt.known_crc, nxt.nbytes, nxt.nbytes)
        ok = sig == 0x04034B50 and method == 0 and sizes_ok and head[30:] == name \
            and at + 30 + nlen + xlen == nxt.source_offset
        return gap if ok else None

    def add_run(self, run: list[StorageOut], descriptor: int, progress: Progress | None,
                written: WrittenRanges | None) -> None:
        """Storages that lie back to back in their source, copied as one range with the local headers (and data
        descriptors, `descriptor` bytes after each) between them. A big run sits a whole number of FOLIOs from
        the source, and the copies end on FOLIO boundaries, 16 MB at a time, instead of one call per storage
        with both ends anywhere. Each storage is still verified, and handed to `written`,
        as soon as its bytes are in."""
        first, last = run[0], run[-1]
        flags = 0x0800 | DESCRIPTOR if descriptor else 0  # as the source's headers: UTF-8 names, descriptors
        name = f"{self.prefix}/data/{first.key}".encode()
        header_at = self.pos
        # (continues() checked the source's headers are ours and its data aligned: the whole run stays aligned)
        header = _local_header(name, first.nbytes, first.known_crc or 0, header_at,
                               *_source_phase(first.source_offset, last.source_offset + last.nbytes
                                              - first.source_offset), flags)
        write_bytes(self.fd, header_at, header)
        shift = header_at + len(header) - first.source_offset  # a multiple of FOLIO for a big run
        copied, end = first.source_offset, last.source_offset + last.nbytes + self._descriptor_after(last)
        waiting = iter(run)
        pending = next(waiting, None)
        entry_at = header_at
        for s in run:
            s_end = s.source_offset + s.nbytes
            target = end if s is last else s_end - s_end % FOLIO
            if target - copied < RUN_CHUNK and s is not last:
                continue
            copy_bytes(first.source_fd, copied, target - copied, self.fd, copied + shift)
            copied = target
            while pending is not None and pending.source_offset + pending.nbytes <= copied:
                pending.crc, pending.offset = pending.known_crc, pending.source_offset + shift
                self.entries.append(_Entry(f"{self.prefix}/data/{pending.key}".encode(), entry_at, pending.nbytes,
                                           pending.crc, flags))
                if progress:
                    progress.advance(pending.nbytes)
                if written is not None:
                    written.done(pending.offset, pending.nbytes, pending.crc, f"storage data/{pending.key}")
                entry_at = pending.offset + pending.nbytes + descriptor  # the next storage's local header
                pending = next(waiting, None)
        self.pos = end + shift

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
            central.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if extra else 20, e.flags, 0, 0, 0x21,
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
        write_bytes(self.fd, self.base + self.pos, cd + zip64 + locator + end)
        self.pos += len(cd) + len(zip64) + len(locator) + len(end)
        if not self.base:  # a whole file: nothing of a preallocation left past the end
            os.ftruncate(self.fd, self.pos)


def write_torch_zip(fd: int, prefix: str, pickle_bytes: bytes, storages: list[StorageOut],
                    progress: Progress | None = None, written: WrittenRanges | None = None) -> None:
    """Entries in torch's order: data.pkl, format/alignment/byteorder records, the storages, version."""
    # Headers, descriptors and the central directory take well under 512 bytes a storage; padding is not counted
    # (an estimate short of the end leaves the rest to be allocated as it is written).
    preallocate(fd, len(pickle_bytes) + sum(s.nbytes for s in storages) + 512 * len(storages) + 4096)
    z = ZipOut(fd, prefix)
    z.add_bytes("data.pkl", pickle_bytes)
    z.add_bytes(".format_version", b"1")
    z.add_bytes(".storage_alignment", b"64")
    z.add_bytes("byteorder", b"little")
    i = 0
    while i < len(storages):
        run, gap = [storages[i]], None
        while i + len(run) < len(storages):  # each pair's source headers are read once
            step = z.continues(run[-1], storages[i + len(run)])
            if step is None or gap is not None and step != gap:
                break
            gap = step
            run.append(storages[i + len(run)])
        if gap is not None:
            z.add_run(run, gap, progress, written)
        else:
            z.add_storage(run[0], progress, written)
        i += len(run)
    z.add_bytes("version", b"3\n")
    z.finish()
