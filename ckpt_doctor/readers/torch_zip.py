"""Reads `torch.save` zip archives and TorchScript archives: the data.pkl torch would pick, and its storages."""

from __future__ import annotations

import io
import re
import zlib
from operator import attrgetter, le, mul
from pathlib import Path

from .._record import replace
from ..dtypes import ELEMENT_SIZE
from ..errors import ReadError
from ..records import Checkpoint, Format, StorageColumns, StorageRecord, fast_new
from ..safepickle import limits
from ..safepickle.unpickler import RawTensor, SafeUnpickler, StorageRef
from ._pickled import build_checkpoint, resolve_columns, run_unpickler, tensor_table
from .source import close_source, open_source
from .survey import ItemCache, Survey
from .zipindex import ZipIndex, read_member

_RECORDS_TORCH_READS = (".data/serialization_id", ".format_version", ".storage_alignment", "byteorder")
# TorchScript source, parsed (never run) only for a TorchScript archive: compiled then (re caches them)
_CLASS_RE = r"(?m)^class (\w+)\(([\w.]+)\):\n((?:  .*\n|\n)*)"
_LIST_RE = r"(?m)^  (__parameters__|__buffers__) = \[(.*?)\]"


def read_torch_zip(path: Path, survey: Survey) -> Checkpoint:
    if survey.zip_error is not None:
        raise survey.zip_error
    index = survey.zip
    assert index is not None
    if index.torch_problem:
        raise ReadError(f"{path}: a zip archive torch.load cannot read: {index.torch_problem}")
    prefix = index.prefix + "/"
    pkl = index.find(prefix + "data.pkl")
    if pkl is None:
        raise ReadError(f"{path}: zip archive with no {prefix}data.pkl; not a torch.save checkpoint")
    if pkl.size > limits.MAX_UNPICKLE_BYTES:
        raise ReadError(f"{path}: {pkl.name} is {pkl.size:,} bytes, over the {limits.MAX_UNPICKLE_BYTES >> 20} MB "
                        "ckpt-doctor unpickles (it was walked: what it would run is reported)")
    version = index.find(prefix + ".data/version") or index.find(prefix + "version")
    is_script = index.has_record("constants.pkl")
    fd = open_source(path)  # a descriptor, or the remote object the survey read (its blocks kept)
    try:
        if version is None and not is_script:
            raise ReadError(f"{path}: zip archive without a version record; torch.load refuses it")
        if version is not None:
            text = read_member(fd, version, str(path), check_crc=False)[:32].strip()
            if not text.isdigit() or int(text) > 10:
                raise ReadError(f"{path}: zip archive of serialization version {text[:16]!r}, which torch.load "
                                "refuses (it reads 1 to 10)")
        for record in _RECORDS_TORCH_READS:  # torch reads these when present: a broken one fails its load
            member = index.find(prefix + record)
            if member is not None:
                read_member(fd, member, str(path), check_crc=False)
        notes: list[str] = []
        compressed: list[str] = []  # storages deflated in the archive
        longer: list[str] = []  # storages whose member holds more bytes than the pickle gives them (torch refuses)
        byteorder = index.find(prefix + "byteorder")
        if byteorder is not None and read_member(fd, byteorder, str(path)).strip() == b"big":
            notes.append("saved on a big-endian machine: tensor bytes are big-endian")

        find = index.find

        def resolve(ref: StorageRef) -> None:
            name = f"{prefix}data/{ref.key}"
            member = find(name)
            if member is None:
                raise ReadError(f"{path}: data.pkl names storage {ref.key} but the archive has no {name}")
            nbytes = ref.numel * ELEMENT_SIZE[ref.dtype]
            if member.offset < 0 or member.is_dir or member.flags & 1 or member.method not in (0, 8):
                raise ReadError(f"{path}: storage {name} cannot be read as torch's reader reads it: "
                                + ("it has no local header where the directory says" if member.offset < 0 else
                                   "it is marked as a folder" if member.is_dir else "it is encrypted"
                                   if member.flags & 1 else f"zip compression method {member.method}")
                                + " (the file is corrupt)")
            if nbytes > member.size:
                raise ReadError(f"{path}: storage {name} holds {member.size} bytes but {nbytes} are needed "
                                "(the file is corrupt)")
            if member.size != nbytes:
                longer.append(name)
            deflated = 0
            if member.method == 8:  # re-zipped: torch.load inflates it; so does every read of its bytes here
                if member.size > max(member.compressed_size, 1) * limits.MAX_DEFLATE_RATIO:
                    raise ReadError(f"{path}: storage {name} claims to inflate to {member.size:,} bytes from "
                                    f"{member.compressed_size:,}, more than deflate can (a zip bomb?)")
                deflated = max(member.compressed_size, 1)
                compressed.append(name)
            key = f"{survey.base}:{ref.key}" if survey.base else ref.key  # a DCP item: one storage "0" each
            ref.resolved = fast_new(StorageRecord, key=key, dtype=ref.dtype, nbytes=nbytes, device=ref.location,
                                    file=path, offset=member.offset, entry=member.name,
                                    crc=member.crc if member.size == nbytes else None, assembly=None,
                                    deflated=deflated)

        # The walked bytes, CRC checked (torch does not check it, but the structure of a corrupt file is not trusted)
        raw = survey.main_pickle if survey.main_pickle is not None else read_member(fd, pkl, str(path))
        if zlib.crc32(raw) != pkl.crc:
            raise ReadError(f"{path}: zip member {pkl.name} fails its CRC check (the file is corrupt)")
        fast = survey.main_read if raw is survey.main_pickle and not is_script else None
        cache = survey.cache if fast is None and not is_script and len(raw) <= ItemCache.MAX_BYTES else None
        tree_key = (survey.policy, raw)  # a tree is unpickled under a policy: never served under another
        known = cache.trees.get(tree_key) if cache is not None else None
        if fast is not None:  # walked and unpickled in one pass by the survey: its storages placed in the archive
            refs = list(fast.storages.values())
            placed = _resolve_all(refs, index, prefix, path, survey.base)
            if placed is None:
                for ref in refs:  # one a storage: where one cannot be read, the error names it
                    resolve(ref)
            else:
                longer += placed
            unpickler, root = fast, fast.root
        elif known is not None:  # an item alike an earlier one (a DCP chunk): its tensor again, on this item's storage
            unpickler, tensor, built = known
            first = tensor.storage
            ref = StorageRef(first.key, first.dtype, first.numel, first.location)
            resolve(ref)
            root = RawTensor(ref, tensor.dtype, tensor.offset, tensor.shape, tensor.stride, tensor.requires_grad,
                             tensor.is_parameter, tensor.device, tensor.note)
        else:
            unpickler = SafeUnpickler(io.BytesIO(raw), pkl.name, resolve, policy=survey.policy)
            root = run_unpickler(unpickler, path)
            if cache is not None and type(root) is RawTensor and root.storage is not None \
                    and root.storage.view_of is None and list(unpickler.storages.values()) == [root.storage]:
                # what build_checkpoint reads of the unpickler, not the unpickler (its memo stays with it)
                cache.keep(cache.trees, tree_key, [_Unpickled(unpickler), root, None], len(raw))
        unpicklers = [unpickler]
        if longer:
            shown = ", ".join(longer[:3]) + (f" and {len(longer) - 3} more" if len(longer) > 3 else "")
            many = len(longer) > 1
            notes.append(f"{len(longer)} storage{'s' if many else ''} ({shown}) hold{'' if many else 's'} more bytes "
                         f"than the pickle gives {'them' if many else 'it'}: torch.load refuses the file (it checks "
                         "each record's size against its storage's); ckpt-doctor fix writes each storage at its size")
        if compressed:
            notes.append(f"{len(compressed)} storage{'s are' if len(compressed) > 1 else ' is'} compressed (deflated) "
                         "in the archive, which torch.save never does: torch.load inflates them, torch.load(mmap=True) "
                         "refuses the file; ckpt-doctor fix writes them stored")
        ts_members = None
        if is_script:
            notes.append("TorchScript archive: its code/ is executable content and was not run")
            ts_members = _script_members(fd, index, prefix, path)
            constants = index.find(prefix + "constants.pkl")
            if constants is not None:
                cup = SafeUnpickler(io.BytesIO(read_member(fd, constants, str(path))), constants.name, resolve,
                                    policy=survey.policy)
                run_unpickler(cup, path)
                unpicklers.append(cup)
    finally:
        close_source(fd)
    if known is not None and built is not None and built.notes == tuple(notes):
        # what build_checkpoint made of the same tree, with this item's tensor (its reach checked on its storage)
        return replace(built, path=path, files=(path,), root=root, tensors=tensor_table(path, [(built.tensors.keys[0],
                                                                                                root)]))
    ckpt = build_checkpoint(path, Format.TORCHSCRIPT if is_script else Format.TORCH_ZIP, root, unpicklers,
                            ts_members=ts_members, notes=tuple(notes))
    if longer:
        ckpt = replace(ckpt, longer_storages=tuple(longer))
    entry = cache.trees.get(tree_key) if cache is not None else None
    if entry is not None and entry[2] is None and len(ckpt.tensors) == 1 and ckpt.notes == tuple(notes):
        entry[2] = ckpt
    return ckpt


def _resolve_all(refs: list[StorageRef], index: ZipIndex, prefix: str, path: Path, base: str) -> list[str] | None:
    """What resolve() does for each of `refs`, a column at a time: their members found at once, checked at once,
    held as StorageColumns (a StorageRecord made for one only when asked for); returns the members longer than
    their storage.
    None, with nothing set, when one is not plainly a stored member that holds its bytes (missing, deflated, odd):
    resolve() then reads them one by one, and says what is wrong with the one that is."""
    if not refs:
        return []
    keys = list(map(attrgetter("key"), refs))
    names = list(map(f"{prefix}data/".__add__, keys))
    found = index.find_all(names)
    if None in found:
        return None
    sizes = list(map(index.column("size").__getitem__, found))
    offsets = list(map(index.column("offset").__getitem__, found))
    dtypes = list(map(attrgetter("dtype"), refs))
    nbytes = list(map(mul, map(attrgetter("numel"), refs), map(ELEMENT_SIZE.__getitem__, dtypes)))
    # stored, not encrypted, no folder: asked of every member's column at once (the archive's few records alike), and
    # of the storages' members alone only where some member is not
    checked = ("method", "flags", "is_dir")
    methods, flags, dirs = (set(index.column(f)) for f in checked)
    if methods != {0} or any(f & 1 for f in flags) or True in dirs:
        methods, flags, dirs = (set(map(index.column(f).__getitem__, found)) for f in checked)
    if methods != {0} or any(f & 1 for f in flags) or True in dirs or min(offsets) < 0 \
            or not all(map(le, nbytes, sizes)):
        return None
    crcs = list(map(index.column("crc").__getitem__, found))
    longer = []
    if sizes != nbytes:  # a member longer than its storage: its CRC is of more than the storage's bytes
        crcs = [crc if size == n else None for crc, size, n in zip(crcs, sizes, nbytes)]
        longer = [name for name, size, n in zip(names, sizes, nbytes) if size != n]
    entries = list(map(index.names.__getitem__, found))
    columns = StorageColumns(list(map(f"{base}:".__add__, keys)) if base else keys, dtypes, nbytes,
                             list(map(attrgetter("location"), refs)), path, offsets, entries, crcs)
    resolve_columns(refs, columns)  # each StorageRecord made only where one is asked for
    return longer


class _Unpickled:
    """What build_checkpoint reads of an unpickler that has run: the globals it looked up, its notes, its length."""

    __slots__ = ("globals", "notes", "length", "source")

    def __init__(self, unpickler: SafeUnpickler) -> None:
        self.globals, self.notes = list(unpickler.globals), list(unpickler.notes)
        self.length, self.source = unpickler.length, unpickler.source


def _script_members(fd: int, index: ZipIndex, prefix: str, path: Path):
    """Parse (never run) code/ to learn which attributes of each class are parameters and buffers."""
    classes: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool]] = {}
    code_prefix = prefix + "code/"
    for member in index.members:
        name = member.name
        if not (name.startswith(code_prefix) and name.endswith(".py")) or member.size > 64 << 20:
            continue
        module = name[len(code_prefix):-3].replace("/", ".")
        text = read_member(fd, member, str(path), check_crc=False).decode("utf-8", "replace")
        for match in re.finditer(_CLASS_RE, text):
            cls, base, body = match.group(1), match.group(2), match.group(3)
            lists = {k: tuple(re.findall(r'"([^"]+)"', v)) for k, v in re.findall(_LIST_RE, body)}
            classes[f"{module}.{cls}"] = (lists.get("__parameters__", ()), lists.get("__buffers__", ()),
                                         base == "Module")
    return classes.get
