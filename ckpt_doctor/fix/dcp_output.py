"""`fix --format dcp`: a torch.distributed.checkpoint folder that `dcp.load` reads into an FSDP2 / DTensor model.

The folder is laid out as torch's own FileSystemWriter lays out one rank (its default, `single_file_per_rank=True`):
each item is a `torch.save` archive of its own, one after the other in `__0_0.distcp` (creating a file per item cost
0.7 ms each here, 0.7 s for 1,000 tensors), and `.metadata` is the pickle of torch's `Metadata`
(TensorStorageMetadata with one whole chunk per tensor, BytesStorageMetadata for a value, planner_data and
storage_data as DefaultSavePlanner and FileSystemWriter fill them). Nothing is loaded into memory: every tensor's
bytes are streamed from the source's records into its item (copied by the kernel where they are contiguous), so peak
memory is flat in the checkpoint's size and torch is not imported (a dtype conversion or a strided view excepted).
It is written into a temporary folder beside OUT, each file synced, read back by ckpt-doctor's own DCP reader and
compared tensor by tensor (crc32 of the bytes) with what was written from the source, and only then renamed onto OUT.
An existing OUT is replaced only with --force, and only when it is itself a DCP folder.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ..errors import PlanError, Rerun, WriteError
from .._record import replace
from ..assemble import contiguous_strides
from ..dtypes import element_size
from ..readers import read_checkpoint
from ..records import OutTensor
from ..writers.atomic import fsync_dir as _fsync_dir
from ..writers.pickler import Emitter, TensorOut, dumps, int_op, ints_op, str_op
from ..writers.stream import crc_range, deflated_producer, write_bytes
from ..writers.torch_writer import StorageOut, ZipOut
from .produce import Sources, assembly_producer, contiguous_producer, convert_producer

_DCP_NAME = re.compile(r"\.metadata|__\d+\.metadata|__\d+_\d+\.distcp")


def _is_dcp_folder(path: Path) -> bool:
    """Only what a DCP writer leaves: regular files named .metadata, __R.metadata, __R_N.distcp, a metadata file
    that starts a pickle. --force replaces nothing else."""
    names = os.listdir(path)
    if ".metadata" not in names:
        return False
    for name in names:
        entry = path / name
        if not _DCP_NAME.fullmatch(name) or entry.is_symlink() or not stat.S_ISREG(entry.lstat().st_mode):
            return False
    with open(path / ".metadata", "rb") as f:
        return f.read(1) == b"\x80"


def _overlaps(a: Path, b: Path) -> bool:
    """Whether one path is the other or inside it, after following every symlink and `..`."""
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def check_dcp_destination(output: Path, inputs: tuple[Path, ...], force: bool) -> None:
    if any(_overlaps(output, i) for i in inputs):
        raise WriteError(f"{output}: is, holds or lies inside the input; the input is never modified — write "
                         "elsewhere")
    if output.exists() or output.is_symlink():
        # What --force cannot replace is refused as such, without offering it.
        if not output.is_dir() or output.is_symlink() or not _is_dcp_folder(output):
            raise WriteError(f"{output}: exists and is not a DCP folder (.metadata and .distcp files only); "
                             "ckpt-doctor replaces nothing else, even with --force: write the folder elsewhere")
        if not force:
            raise WriteError(f"{output}: already exists; replace it with {{0}}", reruns=(Rerun(add=("--force",)),))
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.is_dir():
        raise WriteError(f"{output}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise WriteError(f"{output}: folder {parent} is not writable (permission denied)")


_MD = "torch.distributed.checkpoint.metadata"
_VERSION = "1.0.0"  # torch's CURRENT_DCP_VERSION of the layout written here


def _is_terminal(value: Any) -> bool:
    """torch.distributed.checkpoint._traverse.traverse_state_dict's test: a mapping is walked into; a list only when
    it holds a tensor or a container that is walked into; anything else (a tuple too) is one value."""

    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (dict, list)) and not _is_terminal(entry):
            return False
        if isinstance(entry, OutTensor):
            return False
    return True


def _flatten(tree: dict) -> list[tuple[tuple, Any]]:
    """(path, leaf) in torch's traversal order: what DefaultSavePlanner's flatten_state_dict makes of `tree` (keys of
    mappings as str, list indices as int; an empty mapping holds nothing)."""
    out: list[tuple[tuple, Any]] = []
    stack: list[tuple[tuple, Any]] = [((str(k),), v) for k, v in reversed(tree.items())]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend(((*path, str(k)), v) for k, v in reversed(value.items()))
        elif _is_terminal(value):
            out.append((path, value))
        else:
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(value))))
    return out


def _check_value(value: Any, where: str) -> None:
    """A value item holds plain data: no tensor (torch would pickle it into the value's archive) and no object."""
    from ..safepickle.unpickler import Opaque

    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, OutTensor):
            raise PlanError(f"{where} is a tuple holding tensors, which a DCP folder stores as a pickled value; write "
                            "it as another format, or leave it out with --drop")
        if isinstance(v, Opaque) or isinstance(v, type) and issubclass(v, Opaque):
            raise PlanError("a DCP folder holds tensors and plain values; this checkpoint holds objects of other "
                            "classes (write the state_dict alone with --select PATH)")
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)


class _MetaPickle:
    """The pickle FileSystemWriter writes for torch's `Metadata`, opcode by opcode (pickling torch's classes with
    Python's pickler would import torch): NEWOBJ and BUILD of each dataclass, TensorProperties' tuple state."""

    def __init__(self) -> None:

        self.e = Emitter()
        self.w = self.e.out.append

    def new(self, name: str, module: str = _MD) -> None:
        self.e.global_(module, name)
        self.w(b")\x81")

    def size(self, dims: tuple[int, ...]) -> None:

        self.e.global_("torch", "Size")
        self.w(ints_op(tuple(dims)) + b"\x85R")

    def path(self, path: tuple) -> None:

        self.w(b"(" + b"".join(str_op(k) if type(k) is str else int_op(k) for k in path) + b"t")

    def tensor(self, dtype: str, shape: tuple[int, ...]) -> None:

        self.new("TensorStorageMetadata")
        self.w(b"}(" + str_op("properties"))
        self.new("TensorProperties")
        self.w(b"(")
        self.e.global_("torch", dtype)
        self.e.global_("torch.serialization", "_get_layout")
        self.w(str_op("torch.strided") + b"\x85R\x89")
        self.e.global_(_MD, "_MEM_FORMAT_ENCODING")
        self.w(b"K\x00\x85R\x89tb" + str_op("size"))
        self.size(shape)
        self.w(str_op("chunks") + b"]")
        self.new("ChunkStorageMetadata")
        self.w(b"}(" + str_op("offsets"))
        self.size((0,) * len(shape))
        self.w(str_op("sizes"))
        self.size(shape)
        self.w(b"ub" + b"a" + b"ub")

    def index(self, fqn: str, offsets: tuple[int, ...] | None) -> None:

        self.new("MetadataIndex")
        self.w(b"}(" + str_op("fqn") + str_op(fqn) + str_op("index") + b"N" + str_op("offset"))
        if offsets is None:
            self.w(b"N")
        else:
            self.size(offsets)
        self.w(b"ub")

    def info(self, rel: str, offset: int, length: int) -> None:

        self.new("_StorageInfo", "torch.distributed.checkpoint.filesystem")
        self.w(b"}(" + str_op("relative_path") + str_op(rel) + str_op("offset") + int_op(offset)
               + str_op("length") + int_op(length) + b"ub")

    def dump(self, items: list[tuple[str, tuple, Any]], storage: list[tuple[str, tuple | None, tuple]]) -> bytes:
        """`items`: (fqn, path, (dtype, shape) or None for a value); `storage`: (fqn, chunk offsets or None, (file,
        offset, length))."""

        self.new("Metadata")
        self.w(b"}(" + str_op("state_dict_metadata") + b"}")
        for start in range(0, len(items), 1000):
            self.w(b"(")
            for fqn, _path, tensor in items[start:start + 1000]:
                self.w(str_op(fqn))
                if tensor is None:
                    self.new("BytesStorageMetadata")
                else:
                    self.tensor(*tensor)
            self.w(b"u")
        self.w(str_op("planner_data") + b"}")
        for start in range(0, len(items), 1000):
            self.w(b"(")
            for fqn, path, _tensor in items[start:start + 1000]:
                self.w(str_op(fqn))
                self.path(path)
            self.w(b"u")
        self.w(str_op("storage_data") + b"}")
        for start in range(0, len(storage), 1000):
            self.w(b"(")
            for fqn, offsets, where in storage[start:start + 1000]:
                self.index(fqn, offsets)
                self.info(*where)
            self.w(b"u")
        self.w(str_op("storage_meta") + b"N" + str_op("version") + str_op(_VERSION) + b"ub")
        return self.e.getvalue()


def _tensor_item(t, sources) -> tuple[bytes, Any]:
    """The pickle and the one storage of `t`'s archive: the tensor whole and contiguous in its planned dtype, as
    torch's writer saves a chunk (a view is saved as its own elements, not its source's storage)."""

    rec = t.source
    st = rec.storage
    es = element_size(rec.dtype)
    nbytes = rec.numel * element_size(t.dtype)
    same = t.dtype == rec.dtype
    if nbytes == 0:
        out = StorageOut("0", 0, produce=lambda fd, at, progress: 0)
    elif st is None:
        raise PlanError(f"{rec.key} has no stored bytes to write")
    elif not rec.is_contiguous:
        out = StorageOut("0", nbytes, produce=contiguous_producer(rec, t.dtype, t.key))
    elif st.assembly is not None:
        if rec.storage_offset == 0 and rec.numel * es == st.nbytes:
            out = StorageOut("0", nbytes, produce=assembly_producer(st.assembly, rec.key, t.dtype, sources, t.key))
        else:
            out = StorageOut("0", nbytes, produce=contiguous_producer(rec, t.dtype, t.key))
    elif st.deflated:
        convert = (rec.dtype, t.dtype, t.key) if not same else None
        out = StorageOut("0", nbytes, produce=deflated_producer(sources.fd(st.file), st, rec.storage_offset * es,
                                                                 rec.numel * es, rec.key, convert))
    elif not same:
        out = StorageOut("0", nbytes, produce=convert_producer(sources.fd(st.file), rec.file_offset, rec.numel * es,
                                                                rec.dtype, t.dtype, t.key))
    else:
        whole = rec.storage_offset == 0 and nbytes == st.nbytes
        out = StorageOut("0", nbytes, sources.fd(st.file), rec.file_offset, st.crc if whole else None)
    flat = replace(rec, storage_offset=0, stride=contiguous_strides(rec.shape), requires_grad=False,
                   is_parameter=False)
    pickle_bytes = dumps(TensorOut(flat, "0", "cpu", t.dtype, rec.numel))[0]
    return pickle_bytes, out


def _archive(fd: int, pickle_bytes: bytes, storages: list, base: int) -> int:
    """One item at `base` of the rank's file: a torch.save archive (`archive/` as torch.save names one written to a
    stream), with the members and in the order torch_writer.write_torch_zip writes them, without its preallocation
    (freeing what a preallocation overshot cost 3 ms an item in ftruncate, 3 s for 1,000 tensors). Returns its
    length."""

    z = ZipOut(fd, "archive", base)
    z.add_bytes("data.pkl", pickle_bytes)
    z.add_bytes(".format_version", b"1")
    z.add_bytes(".storage_alignment", b"64")
    z.add_bytes("byteorder", b"little")
    for storage in storages:
        z.add_storage(storage, None)
    z.add_bytes("version", b"3\n")
    z.finish()
    return z.pos


def _write_file(folder: Path, name: str, write, *args: Any, sync: bool = False) -> int:
    """A new file of the folder, written by `write(fd, *args)`; returns its size."""
    fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write(fd, *args)
        if sync:
            os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _write_folder(plan, tree: dict, tmp: Path) -> dict[str, tuple[int, tuple, str, tuple]]:
    """Every item into `tmp`, then `.metadata`; returns what each tensor's fqn was written as: (crc32 of its bytes,
    shape, dtype, the path of the fqn whose item holds it)."""

    leaves = _flatten(tree)
    items: list[tuple[str, tuple, Any]] = []
    storage: list[tuple[str, tuple | None, tuple]] = []
    written: dict[str, tuple[int, tuple, str, tuple]] = {}
    owners: dict[tuple, tuple[str, tuple]] = {}  # a source tensor -> the item that holds it (tied names share it)
    seen: set[str] = set()
    name, end = "__0_0.distcp", 0  # every item in one file, end to end as FileSystemWriter lays them (no padding:
    # torch.load of the file, and every reader that splits it into its archives, takes them as torch's own)
    sources = Sources()
    fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for path, leaf in leaves:
            fqn = ".".join(str(k) for k in path)
            if fqn in seen:
                raise PlanError(f"two entries of the checkpoint are both named {fqn} once flattened, which DCP cannot "
                                "save (rename one with --rename)")
            seen.add(fqn)
            base = end
            if isinstance(leaf, OutTensor):
                rec = leaf.source
                ident = (rec.storage.ident if rec.storage is not None else leaf.key, rec.storage_offset, rec.shape,
                         rec.stride, leaf.dtype)
                zeros = (0,) * len(rec.shape)
                items.append((fqn, path, (leaf.dtype, rec.shape)))
                owner = owners.get(ident)
                if owner is not None:  # a tied name: the owner's item again, one tensor on load
                    storage.append((fqn, zeros, owner[1]))
                    written[fqn] = (*written[owner[0]][:3], owner[0])
                    continue
                pickle_bytes, out = _tensor_item(leaf, sources)
                size = _archive(fd, pickle_bytes, [out], base)
                storage.append((fqn, zeros, (name, base, size)))
                owners[ident] = (fqn, (name, base, size))
                written[fqn] = (out.crc if out.crc is not None else 0, rec.shape, leaf.dtype, fqn)
            else:
                _check_value(leaf, fqn)
                pickle_bytes = dumps(leaf, plan.policy)[0]
                size = _archive(fd, pickle_bytes, [], base)
                items.append((fqn, path, None))
                storage.append((fqn, None, (name, base, size)))
            end = base + size
        os.fsync(fd)  # the items are on disk before the metadata that names them
    finally:
        os.close(fd)
        sources.close()
    data = _MetaPickle().dump(items, storage)
    _write_file(tmp, ".metadata.tmp", write_bytes, 0, data, sync=True)  # as FileSystemWriter.finish
    os.rename(tmp / ".metadata.tmp", tmp / ".metadata")
    return written


def dcp_inputs(plan) -> tuple[Path, ...]:
    """Every file the plan reads: none of them may lie inside the folder written."""
    return (*plan.inputs, *{p.file for t in plan.tensors if t.source.storage and t.source.storage.assembly
                             for p in t.source.storage.assembly.pieces})


def check_dcp_plan(plan) -> None:
    """What a DCP folder cannot hold, refused before anything (the destination included) is checked: a root that is
    no dict, values holding tensors or objects of other classes."""
    tree = plan.tree if plan.tree is not None else OrderedDict((t.key, t) for t in plan.tensors)
    if not isinstance(tree, dict):
        raise PlanError("a DCP folder saves a dict; this checkpoint's root is not one (write it with --select PATH)")
    for path, leaf in _flatten(tree):
        if not isinstance(leaf, OutTensor):
            _check_value(leaf, ".".join(map(str, path)))


def write_dcp(plan, verify: bool, force: bool) -> int:
    """Write `plan` as a DCP folder at plan.output; returns its size in bytes."""
    output = plan.output
    check_dcp_plan(plan)
    check_dcp_destination(output, dcp_inputs(plan), force)
    tree = plan.tree if plan.tree is not None else OrderedDict((t.key, t) for t in plan.tensors)
    parent = output.parent if str(output.parent) else Path(".")
    tmp = parent / f".{output.name}.ckpt-doctor-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.mkdir(tmp)
        written = _write_folder(plan, tree, tmp)
        if verify:
            _verify(tmp, plan, written)
        _fsync_dir(tmp)
        if output.exists():
            old = parent / f".{output.name}.ckpt-doctor-old-{os.getpid()}"
            os.rename(output, old)
            os.rename(tmp, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, output)
        _fsync_dir(parent)
    except OSError as exc:
        raise WriteError(f"{output}: write failed ({exc.strerror}); nothing was written") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sum(p.stat().st_size for p in output.iterdir())


def _verify(folder: Path, plan, written: dict[str, tuple[int, tuple, str, tuple]]) -> None:
    """Read the folder back with ckpt-doctor's DCP reader: the same tensors, bit for bit (crc32 of the bytes each
    item holds against the crc32 of what was copied into it from the source), tied names still one tensor."""
    back = {t.key: t for t in read_checkpoint(folder, policy=plan.policy).tensors}
    if set(back) != set(written):
        differ = sorted(set(back) ^ set(written))[:3]
        raise WriteError(f"{plan.output}: verification failed: the folder holds other tensors than planned ({differ}); "
                         "nothing written")
    for key, (crc, shape, dtype, _owner) in written.items():
        got = back[key]
        if got.shape != tuple(shape) or got.dtype != dtype:
            raise WriteError(f"{plan.output}: verification failed for {key}: wrote {got.dtype}{list(got.shape)}; "
                             "nothing written")
        pieces = got.storage.assembly.pieces if got.storage is not None and got.storage.assembly else ()
        if len(pieces) != 1:
            raise WriteError(f"{plan.output}: verification failed for {key}: read back as {len(pieces)} chunks; "
                             "nothing written")
        fd = os.open(pieces[0].file, os.O_RDONLY)
        try:
            got_crc = crc_range(fd, pieces[0].offset, got.nbytes) if got.nbytes else 0
        except EOFError:
            raise WriteError(f"{plan.output}: {key} was cut short while it was read back (another process truncated "
                             "it?); nothing written") from None
        finally:
            os.close(fd)
        if got_crc != crc:
            raise WriteError(f"{plan.output}: verification failed: {key} does not match its source; nothing written")
