"""Reads torch's pre-0.4 tar format: members `storages`, `tensors` and `pickle`, as torch.load's tar path reads them.

`storages` is a pickle of the storage count, then per storage a pickle of (key, location, storage type), an int64
element count and the raw bytes, then a pickle of the storage views; `tensors` is a pickle of the tensor count, then
per tensor a pickle of (key, storage key, tensor type), an int32 ndim, 4 spare bytes, ndim int64 sizes, ndim int64
strides and an int64 offset; `pickle` is the object, naming tensors and storages by integer persistent ids. torch
unpickles every one of these pickles with the full unpickler, so each is walked; the member torch takes is the last
of its name, as tarfile's getmember returns it. torch.load(weights_only=True) refuses the format altogether.
"""

from __future__ import annotations

import io
import os
import struct
import tarfile
from pathlib import Path
from typing import Any

from .._record import field, record, replace
from ..advice import Promise, fix_line
from ..dtypes import element_size
from ..errors import ReadError
from ..records import Checkpoint, Format, GlobalRef, StorageRecord
from ..safepickle.policy import DEFAULT_POLICY, Policy
from ..safepickle.unpickler import RawTensor, SafeUnpickler, StorageRef, StorageType
from ..safepickle.walker import Walk, walk
from ..sniff import MAX_TAR_METADATA, tar_field_number, tar_metadata_too_big
from ._pickled import build_checkpoint, run_unpickler
from .mapping import walk_window

MEMBERS = ("storages", "tensors", "pickle")
MAX_TAR_MEMBERS = 100_000  # a torch tar file has three


@record(frozen=False)
class TarLayout:
    """What torch's tar path would read, and what walking its pickles found."""

    members: dict[str, tarfile.TarInfo] = field(default_factory=dict)  # the last of each name
    links: list[str] = field(default_factory=list)  # `storages`/`tensors`/`pickle` that are links or not files
    storages: dict[Any, StorageRef] = field(default_factory=dict)
    tensors: dict[Any, RawTensor] = field(default_factory=dict)
    walks: list[Walk] = field(default_factory=list)
    globals: list[GlobalRef] = field(default_factory=list)
    problem: str | None = None  # where reading stopped, when it did
    refused: str | None = None  # headers no checkpoint has (tarfile would hold hundreds of MB): not read at all
    unpicklers: list[SafeUnpickler] = field(default_factory=list)
    policy: Policy = DEFAULT_POLICY  # what the walks judged globals by; the `pickle` member is read under it too


def _precheck(fd: int, size: int) -> str | None:
    """Walk the headers before tarfile does: tarfile reads PAX and GNU long-name payloads into memory whole (a 900 MB
    one took 2.6 GB) and lists every member. What no checkpoint needs is refused here, before tarfile is asked."""
    at, count = 0, 0
    while at + 512 <= size:
        block = os.pread(fd, 512, at)
        if block.count(0) == 512:
            return None
        big = tar_metadata_too_big(block)
        if big is not None:
            return f"a tar metadata header of {big:,} bytes at byte {at} (over {MAX_TAR_METADATA >> 20} MB)"
        length = tar_field_number(block[124:136])
        if length is None or length < 0:
            return None  # tarfile will say what is wrong
        count += 1
        if count > MAX_TAR_MEMBERS:
            return f"the tar archive holds more than {MAX_TAR_MEMBERS:,} members"
        at += 512 + (length + 511) // 512 * 512
    return None


def tar_layout(fd: int, size: int, path: Path, budget: list[int] | None = None,
               policy: Policy = DEFAULT_POLICY) -> TarLayout:
    """List the archive with tarfile (the module torch uses) and walk every pickle torch would unpickle, judging
    its globals by `policy`."""
    layout = TarLayout(policy=policy)
    layout.refused = _precheck(fd, size)
    if layout.refused:
        layout.problem = layout.refused
        return layout
    with os.fdopen(os.dup(fd), "rb") as f:
        f.seek(0)  # a dup shares the file position, which an earlier read may have moved
        try:
            with tarfile.open(fileobj=f, mode="r:", format=tarfile.PAX_FORMAT) as tar:
                count = 0
                for info in tar:
                    count += 1
                    if count > MAX_TAR_MEMBERS:
                        layout.problem = f"the tar archive holds more than {MAX_TAR_MEMBERS:,} members"
                        break
                    layout.members[info.name] = info
        except (tarfile.TarError, OSError, ValueError, UnicodeError, OverflowError) as exc:
            layout.problem = f"the tar archive breaks off ({exc})"
    for name in MEMBERS:
        info = layout.members.get(name)
        if info is None:
            continue
        if info.issparse():
            layout.links.append(f"member {name} is sparse: tarfile fills its holes when torch extracts it, so its "
                                "bytes on disk are not what torch unpickles")
        elif not info.isreg():
            kind = "a link to " + info.linkname if info.issym() or info.islnk() else "not a regular file"
            layout.links.append(f"member {name} is {kind}")
    reader = _Reader(fd, path, layout, budget)
    try:
        reader.storages()
        reader.tensors()
    except _Stop as exc:
        layout.problem = layout.problem or str(exc)
    reader.walk_member("pickle")
    return layout


class _Stop(Exception):
    pass


class _Reader:
    def __init__(self, fd: int, path: Path, layout: TarLayout, budget: list[int] | None) -> None:
        self.fd, self.path, self.layout, self.budget = fd, path, layout, budget

    def _region(self, name: str) -> tuple[int, int] | None:
        info = self.layout.members.get(name)
        if info is None or not info.isreg() or info.issparse():
            return None
        return info.offset_data, info.offset_data + info.size

    def _walk_at(self, name: str, at: int, end: int, label: str) -> tuple[Walk, bytes, int]:
        """Walk the one pickle at `at` (reading more of the member until it ends), and its bytes."""
        chunk = 1 << 16
        while True:
            data = os.pread(self.fd, min(chunk, end - at), at)
            result = walk(data, label, max_pickles=1, budget=self.budget, policy=self.layout.policy)
            if not result.truncated or len(data) >= end - at:
                break
            chunk *= 4
        self.layout.walks.append(result)
        self.layout.globals.extend(result.globals)
        if result.refused:
            raise _Stop(result.refused)
        if not result.pickles:
            raise _Stop(result.broken or f"member {name}: no pickle at byte {at}")
        stop = result.pickles[0][1]
        return result, data[:stop], at + stop

    def _load(self, raw: bytes, label: str) -> Any:
        unpickler = SafeUnpickler(io.BytesIO(raw), label, policy=self.layout.policy)
        self.layout.unpicklers.append(unpickler)
        try:
            return run_unpickler(unpickler, self.path)
        except ReadError as exc:  # reading stops here; what the walks found so far stays
            raise _Stop(str(exc)) from None

    def walk_member(self, name: str) -> None:
        region = self._region(name)
        if region is None:
            return
        start, end = region
        # read, not mapped: a file cut short meanwhile ends the walk early instead of killing the process (SIGBUS)
        result = walk_window(self.fd, end - start,
                             lambda data: walk(data, f"tar member {name}", budget=self.budget,
                                               policy=self.layout.policy),
                             self.budget, start)
        self.layout.walks.append(result)
        self.layout.globals.extend(result.globals)

    def storages(self) -> None:
        region = self._region("storages")
        if region is None:
            return
        at, end = region
        _, raw, at = self._walk_at("storages", at, end, "tar member storages (storage count)")
        count = self._load(raw, "tar member storages (storage count)")
        if type(count) is not int or count < 0 or count > end - at:
            raise _Stop(f"tar member storages: the storage count {count!r} is not a count")
        for i in range(count):
            label = f"tar member storages (storage {i})"
            _, raw, at = self._walk_at("storages", at, end, label)
            args = self._load(raw, label)
            if not (type(args) is tuple and len(args) == 3 and type(args[2]) is StorageType):
                raise _Stop(f"{label}: expected (key, location, storage type), found {args!r:.80}")
            key, location, storage_type = args
            head = os.pread(self.fd, 8, at)
            if len(head) < 8:
                raise _Stop(f"{label}: cut short")
            (numel,) = struct.unpack("<q", head)
            nbytes = numel * element_size(storage_type.dtype)
            if numel < 0 or at + 8 + nbytes > end:
                raise _Stop(f"{label}: needs {nbytes} bytes past the end of the member")
            ref = StorageRef(str(key), storage_type.dtype, numel, str(location))
            ref.resolved = StorageRecord(str(key), storage_type.dtype, nbytes, str(location), self.path, at + 8)
            self.layout.storages[key] = ref
            at += 8 + nbytes
        _, raw, at = self._walk_at("storages", at, end, "tar member storages (views)")
        views = self._load(raw, "tar member storages (views)")
        for view in views if type(views) is list else ():
            if type(view) is tuple and len(view) == 4 and view[1] in self.layout.storages:
                target, root_key, offset, numel = view
                root = self.layout.storages[root_key]
                if type(offset) is int and type(numel) is int and offset >= 0 and numel >= 0:
                    self.layout.storages[target] = StorageRef(
                        str(target), root.dtype, numel, root.location, view_of=root,
                        view_offset=offset * element_size(root.dtype))

    def tensors(self) -> None:
        region = self._region("tensors")
        if region is None:
            return
        at, end = region
        _, raw, at = self._walk_at("tensors", at, end, "tar member tensors (tensor count)")
        count = self._load(raw, "tar member tensors (tensor count)")
        if type(count) is not int or count < 0 or count > end - at:
            raise _Stop(f"tar member tensors: the tensor count {count!r} is not a count")
        for i in range(count):
            label = f"tar member tensors (tensor {i})"
            _, raw, at = self._walk_at("tensors", at, end, label)
            args = self._load(raw, label)
            if not (type(args) is tuple and len(args) == 3):
                raise _Stop(f"{label}: expected (key, storage key, type), found {args!r:.80}")
            key, storage_key, _ = args
            head = os.pread(self.fd, 8, at)
            if len(head) < 8:
                raise _Stop(f"{label}: cut short")
            (ndim,) = struct.unpack_from("<i", head)
            if not 0 <= ndim <= 64 or at + 16 + 16 * ndim > end:
                raise _Stop(f"{label}: {ndim} dimensions do not fit the member")
            body = os.pread(self.fd, 16 * ndim + 8, at + 8)
            sizes = struct.unpack_from(f"<{ndim}q", body, 0)
            strides = struct.unpack_from(f"<{ndim}q", body, 8 * ndim)
            (offset,) = struct.unpack_from("<q", body, 16 * ndim)
            at += 16 + 16 * ndim
            storage = self.layout.storages.get(storage_key)
            if storage is None:
                raise _Stop(f"{label}: names storage {storage_key!r}, which the storages member lacks")
            self.layout.tensors[key] = RawTensor(storage, storage.dtype, offset, tuple(sizes), tuple(strides))


def read_torch_tar(path: Path, fd: int, layout: TarLayout, notes: tuple[str, ...],
                   extra_globals: tuple[GlobalRef, ...]) -> Checkpoint:
    """The checkpoint the tar's `pickle` member describes, its tensors read from `tensors` and `storages`."""
    if layout.problem:
        raise ReadError(f"{path}: pre-0.4 tar checkpoint that torch cannot read: {layout.problem}")
    missing = [m for m in MEMBERS if m not in layout.members]
    if missing:
        raise ReadError(f"{path}: a tar archive without the member(s) {', '.join(missing)} of torch's pre-0.4 "
                        "format; torch.load fails on it")
    info = layout.members["pickle"]
    if not info.isreg():
        raise ReadError(f"{path}: tar member pickle is not a regular file")
    raw = os.pread(fd, info.size, info.offset_data)
    objects: dict[Any, Any] = {**layout.storages, **layout.tensors}

    def persistent(pid: Any) -> Any:
        if type(pid) is tuple and pid:
            return pid[0]  # a module's class (torch checks its source, then returns it)
        try:
            return objects[int(pid)]
        except (KeyError, TypeError, ValueError):
            raise ReadError(f"{path}: tar member pickle names object {pid!r:.40}, which the archive lacks") from None

    unpickler = SafeUnpickler(io.BytesIO(raw), "tar member pickle", persistent=persistent, policy=layout.policy)
    root = run_unpickler(unpickler, path)

    rewrite = fix_line(str(path), (), Promise.WRITES, "writes it as a file torch.load loads with its defaults")
    notes = notes + ("torch's pre-0.4 tar format: torch.load(weights_only=True) refuses it; rewrite it with "
                     f"`{rewrite.command}`",)
    ckpt = build_checkpoint(path, Format.TORCH_TAR, root, layout.unpicklers + [unpickler], notes=notes,
                            extra_globals=extra_globals)
    return replace(ckpt, advice=(("rewrite", rewrite),))
