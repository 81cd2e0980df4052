"""`fix --format dcp`: a torch.distributed.checkpoint folder that `dcp.load` reads into an FSDP2 / DTensor model.

The folder is written by torch's own DCP writer (`dcp.save(..., no_dist=True)`, one rank, each tensor one chunk),
so torch's reader is sure to accept it; what is handed to it is the planned tree with every tensor read from the
source's records (never unpickled). It is written into a temporary folder beside OUT, each file synced, read back
by ckpt-doctor's own DCP reader and compared tensor by tensor (crc32 of the bytes) with the source, and only then
renamed onto OUT. An existing OUT is replaced only with --force, and only when it is itself a DCP folder.
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
from .atomic import fsync_dir as _fsync_dir

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


def _materialize(tree: Any, tensors: dict[str, Any]) -> Any:
    """The planned tree with torch tensors at its leaves (one per source storage, so tied names stay one tensor)."""
    from ..records import OutTensor
    from ..safepickle.unpickler import Opaque, SizeValue

    if isinstance(tree, OutTensor):
        return tensors[tree.key]
    if isinstance(tree, dict):
        return OrderedDict((k, _materialize(v, tensors)) for k, v in tree.items()) if isinstance(tree, OrderedDict) \
            else {k: _materialize(v, tensors) for k, v in tree.items()}
    if isinstance(tree, SizeValue):
        import torch

        return torch.Size(tree)
    if isinstance(tree, (list, tuple)):
        items = [_materialize(v, tensors) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    if isinstance(tree, Opaque) or isinstance(tree, type) and issubclass(tree, Opaque):
        raise PlanError("a DCP folder holds tensors and plain values; this checkpoint holds objects of other classes "
                        "(write the state_dict alone with --select PATH)")
    return tree


def _load(plan) -> dict[str, Any]:
    import torch

    from ..tensordata import load_tensor

    by_storage: dict[Any, Any] = {}
    tensors: dict[str, Any] = {}
    for t in plan.tensors:
        ident = (t.source.storage.ident, t.source.storage_offset, t.source.shape, t.source.stride, t.dtype) \
            if t.source.storage is not None else t.key
        if ident not in by_storage:
            value = load_tensor(t.source)
            by_storage[ident] = value.to(getattr(torch, t.dtype)) if t.dtype != t.source.dtype else value
        tensors[t.key] = by_storage[ident]
    return tensors


def dcp_inputs(plan) -> tuple[Path, ...]:
    """Every file the plan reads: none of them may lie inside the folder written."""
    return (plan.input, *{t.source.storage.file for t in plan.tensors if t.source.storage},
            *{p.file for t in plan.tensors if t.source.storage and t.source.storage.assembly
              for p in t.source.storage.assembly.pieces})


def check_dcp_plan(plan) -> None:
    """What a DCP folder cannot hold, refused before anything (the destination included) is checked: a root that is
    no dict, objects of other classes than tensors and plain values."""
    from ..records import OutTensor
    from ..safepickle.unpickler import Opaque, SizeValue

    if plan.tree is not None and not isinstance(plan.tree, dict):
        raise PlanError("a DCP folder saves a dict; this checkpoint's root is not one (write it with --select PATH)")
    stack = [plan.tree]
    while stack:
        node = stack.pop()
        if isinstance(node, Opaque) or isinstance(node, type) and issubclass(node, Opaque):
            raise PlanError("a DCP folder holds tensors and plain values; this checkpoint holds objects of other "
                            "classes (write the state_dict alone with --select PATH)")
        if isinstance(node, dict):
            stack += list(node.values())
        elif isinstance(node, (list, tuple)) and not isinstance(node, (SizeValue, OutTensor)):
            stack += list(node)


def write_dcp(plan, verify: bool, force: bool) -> int:
    """Write `plan` as a DCP folder at plan.output; returns its size in bytes."""
    output = plan.output
    check_dcp_plan(plan)
    check_dcp_destination(output, dcp_inputs(plan), force)
    tensors = _load(plan)
    tree = _materialize(plan.tree, tensors) if plan.tree is not None else \
        OrderedDict((t.key, tensors[t.key]) for t in plan.tensors)
    if not isinstance(tree, dict):
        raise PlanError("a DCP folder saves a dict; this checkpoint's root is not one (write it with --select PATH)")
    parent = output.parent if str(output.parent) else Path(".")
    tmp = parent / f".{output.name}.ckpt-doctor-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        import warnings

        ties = _untie(tree)
        with warnings.catch_warnings():  # "torch.distributed is … uninitialized, assuming … a single process": yes
            warnings.simplefilter("ignore")
            meta = dcp.save(tree, storage_writer=FileSystemWriter(str(tmp), sync_files=True), no_dist=True)
        if ties:
            _record_ties(tmp, meta, ties)
        if verify:
            _verify(tmp, plan, tensors)
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


def _leaves(tree: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(tree, list):
        return [leaf for i, v in enumerate(tree) for leaf in _leaves(v, (*path, i))]
    return [(path, tree)]


def _untie(tree: dict) -> list[tuple[tuple, tuple]]:
    """Take every second name of a tied tensor out of the tree (DCP would save it twice, and read back two tensors);
    returns (alias path, owner path) pairs, written into the metadata by _record_ties."""
    import torch

    owners: dict[int, tuple] = {}
    ties = []
    for path, value in _leaves(tree):
        if isinstance(value, torch.Tensor):
            owner = owners.setdefault(id(value), path)
            if owner != path:
                ties.append((path, owner))
    for path, _ in ties:
        parent = tree
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict):
            del parent[path[-1]]
        else:  # a list keeps its length: the slot is filled from the owner's item on load
            parent[path[-1]] = None
    return ties


def _record_ties(folder: Path, meta: Any, ties: list[tuple[tuple, tuple]]) -> None:
    """Name each alias in the folder's metadata as a second name of its owner's chunks (its own planner path, the
    owner's storage entries): dcp.load fills it from the same bytes, and a reader sees one tensor under two names.
    `meta` is the Metadata dcp.save returned for this folder (nothing is read back and unpickled); it is written
    again over the .metadata torch just wrote."""
    import pickle

    from torch.distributed.checkpoint.metadata import MetadataIndex

    def fqn(p: tuple) -> str:
        return ".".join(str(k) for k in p)

    for alias, owner in ties:
        a, o = fqn(alias), fqn(owner)
        meta.state_dict_metadata[a] = meta.state_dict_metadata[o]
        meta.planner_data[a] = alias
        for index, info in list(meta.storage_data.items()):
            if index.fqn == o:
                meta.storage_data[MetadataIndex(a, index.offset, index.index)] = info
    path = folder / ".metadata"
    tmp = path.with_name(".metadata.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(meta, f, protocol=4)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _verify(folder: Path, plan, tensors: dict[str, Any]) -> None:
    """Read the folder back with ckpt-doctor's DCP reader: the same tensors, bit for bit (crc32 of the bytes)."""
    import zlib

    from ..readers import read_checkpoint
    from ..tensordata import read_bytes, tensor_bytes

    written = {t.key: t for t in read_checkpoint(folder).tensors}
    if set(written) != set(tensors):
        differ = sorted(set(written) ^ set(tensors))[:3]
        raise WriteError(f"{plan.output}: verification failed: the folder holds other tensors than planned ({differ}); "
                         "nothing written")
    for key, value in tensors.items():
        got = written[key]
        if got.shape != tuple(value.shape) or got.dtype != str(value.dtype).removeprefix("torch."):
            raise WriteError(f"{plan.output}: verification failed for {key}: wrote {got.dtype}{list(got.shape)}; "
                             "nothing written")
        if zlib.crc32(read_bytes(got)) != zlib.crc32(tensor_bytes(value.contiguous())):
            raise WriteError(f"{plan.output}: verification failed: {key} does not match its source; nothing written")
