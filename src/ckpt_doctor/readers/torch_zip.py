"""Reads `torch.save` zip archives and TorchScript archives from their central directory and data.pkl."""

from __future__ import annotations

import io
import re
from pathlib import Path

from ..dtypes import element_size
from ..errors import ReadError
from ..records import Checkpoint, Format, GlobalRef, StorageRecord, fast_new
from ..unpickler import SafeUnpickler, StorageRef
from ._pickled import build_checkpoint, run_unpickler
from .zipindex import ZipMember, read_member, read_zip_index

_CLASS_RE = re.compile(r"^class (\w+)\(([\w.]+)\):\n((?:  .*\n|\n)*)", re.MULTILINE)
_LIST_RE = re.compile(r"^  (__parameters__|__buffers__) = \[(.*?)\]", re.MULTILINE)


def read_torch_zip(path: Path, fd: int, size: int) -> Checkpoint:
    members = read_zip_index(fd, size, str(path))
    pickles = sorted(n for n in members if n == "data.pkl" or n.endswith("/data.pkl") and n.count("/") == 1)
    if len(pickles) != 1:
        found = "no data.pkl" if not pickles else f"{len(pickles)} data.pkl files"
        raise ReadError(f"{path}: zip archive with {found}; not a torch.save checkpoint")
    pkl = pickles[0]
    prefix = pkl[: -len("data.pkl")]
    is_script = any(n.startswith(prefix + "code/") for n in members) or prefix + "constants.pkl" in members
    byteorder = members.get(prefix + "byteorder")
    notes: list[str] = []
    if byteorder is not None and read_member(fd, byteorder, str(path)).strip() == b"big":
        notes.append("saved on a big-endian machine: tensor bytes are big-endian")

    def resolve(ref: StorageRef) -> None:
        name = f"{prefix}data/{ref.key}"
        member = members.get(name)
        if member is None:
            raise ReadError(f"{path}: data.pkl names storage {ref.key} but the archive has no {name}")
        nbytes = ref.numel * element_size(ref.dtype)
        if nbytes > member.size or member.method != 0:
            raise ReadError(f"{path}: storage {name} holds {member.size} bytes but {nbytes} are needed "
                            "(the file is corrupt)")
        ref.resolved = fast_new(StorageRecord, key=ref.key, dtype=ref.dtype, nbytes=nbytes, device=ref.location,
                                file=path, offset=member.offset, entry=name,
                                crc=member.crc if member.size == nbytes else None)

    raw = read_member(fd, members[pkl], str(path))
    stream = io.BytesIO(raw)
    unpickler = SafeUnpickler(stream, pkl, resolve)
    unpicklers = [unpickler]
    root = run_unpickler(unpickler, path)
    extra: list[GlobalRef] = []
    if stream.tell() < len(raw):
        from ..scan import static_globals

        after = static_globals(raw[stream.tell():], f"{pkl} after its STOP")
        extra += after.globals
        notes.append(f"{pkl} holds {len(raw) - stream.tell()} bytes after its end, which torch ignores")
        notes += after.notes
    ts_members = None
    if is_script:
        notes.append("TorchScript archive: its code/ is executable content and was not run")
        ts_members = _script_members(fd, members, prefix, path)
        constants = members.get(prefix + "constants.pkl")
        if constants is not None:
            cup = SafeUnpickler(io.BytesIO(read_member(fd, constants, str(path))), constants.name, resolve)
            run_unpickler(cup, path)
            unpicklers.append(cup)
    return build_checkpoint(path, Format.TORCHSCRIPT if is_script else Format.TORCH_ZIP, root, unpicklers,
                            ts_members=ts_members, notes=tuple(notes), extra_globals=tuple(extra) + _extra_pickles(
                                fd, members, prefix, pkl, path, resolve))


def _extra_pickles(fd, members: dict[str, ZipMember], prefix: str, pkl: str, path: Path, resolve) -> tuple:
    """Globals named by any other pickle member (a payload hidden beside data.pkl)."""
    found: list[GlobalRef] = []
    for name, member in members.items():
        if name.endswith(".pkl") and name not in (pkl, prefix + "constants.pkl") and "debug_pkl" not in name:
            up = SafeUnpickler(io.BytesIO(read_member(fd, member, str(path))), name, resolve)
            run_unpickler(up, path)
            found.extend(up.globals)
    return tuple(found)


def _script_members(fd: int, members: dict[str, ZipMember], prefix: str, path: Path):
    """Parse (never run) code/ to learn which attributes of each class are parameters and buffers."""
    classes: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool]] = {}
    code_prefix = prefix + "code/"
    for name, member in members.items():
        if not (name.startswith(code_prefix) and name.endswith(".py")):
            continue
        module = name[len(code_prefix):-3].replace("/", ".")
        text = read_member(fd, member, str(path), check_crc=False).decode("utf-8", "replace")
        for match in _CLASS_RE.finditer(text):
            cls, base, body = match.group(1), match.group(2), match.group(3)
            lists = {k: tuple(re.findall(r'"([^"]+)"', v)) for k, v in _LIST_RE.findall(body)}
            classes[f"{module}.{cls}"] = (lists.get("__parameters__", ()), lists.get("__buffers__", ()),
                                         base == "Module")
    return classes.get
