"""Opens any checkpoint path — file or folder — and picks the reader from the bytes, never the extension."""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import replace
from pathlib import Path

from ..errors import ReadError
from ..records import Checkpoint, Format
from .safetensors_reader import looks_like_safetensors, read_safetensors
from .torch_legacy import read_torch_legacy
from .torch_zip import read_torch_zip

# First bytes of files people mistake for checkpoints, for a precise error.
_OTHER_KINDS = [
    (b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
    (b"\x1f\x8b", "a gzip archive"), (b"\x89HDF", "an HDF5 file (Keras/TensorFlow?)"), (b"GGUF", "a GGUF model"),
    (b"\x93NUMPY", "a NumPy .npy array"), (b"%PDF", "a PDF document"), (b"BZh", "a bzip2 archive"),
    (b"\xfd7zXZ", "an xz archive"), (b"PK\x05\x06", "an empty zip archive"), (b"\x7fELF", "an executable"),
    (b"<", "text (HTML/XML?) — a download that returned a web page?"), (b"{", "JSON text"),
    (b"version https://git-lfs", "a Git LFS pointer, not the file itself — run `git lfs pull`"),
]
PICKLE_FIRST = frozenset(b"(}])cIJKLNSVXUFGd\x80\x95")
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".pkl", ".tar", ".model", ".pth.tar")


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint's structure (keys, shapes, dtypes, devices, byte ranges) without loading tensor data."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise ReadError(f"{path}: symlink points to {os.readlink(path)}, which does not exist") from None
        raise ReadError(f"{path}: no such file or directory") from None
    except PermissionError:
        raise ReadError(f"{path}: permission denied") from None
    except OSError as exc:
        raise ReadError(f"{path}: cannot be read ({exc.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        return read_folder(path)
    if not stat.S_ISREG(st.st_mode):
        raise ReadError(f"{path}: not a regular file")
    return read_file(path)


def read_file(path: Path, *, report_payloads: bool = True) -> Checkpoint:
    """One checkpoint file. A file that fails to read is scanned statically for the payload it may carry
    past the point where reading stopped; one that names a dangerous global is reported as unsafe (exit 1).
    """
    try:
        return _read_file(path)
    except ReadError as exc:
        if not report_payloads:
            raise
        from ..records import Verdict
        from ..scan import file_globals

        try:
            refs = file_globals(path)[0]
        except OSError:
            raise exc from None
        dangerous = tuple(dict.fromkeys(g.qualname for g in refs if g.verdict is Verdict.DANGEROUS))
        if dangerous:
            raise ReadError(f"{exc} — and it names dangerous globals: {', '.join(dangerous)}", dangerous) from None
        raise


def _read_file(path: Path) -> Checkpoint:
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        raise ReadError(f"{path}: permission denied (cannot open for reading)") from None
    except OSError as exc:
        raise ReadError(f"{path}: cannot be opened ({exc.strerror})") from None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 64, 0)
        if size == 0:
            raise ReadError(f"{path}: file is empty (0 bytes)")
        if head[:4] == b"PK\x03\x04":
            return read_torch_zip(path, fd, size)
        if looks_like_safetensors(head, size):
            return read_safetensors(path, fd, size)
        if head[0] in PICKLE_FIRST and not head.startswith(b"{"):
            return read_torch_legacy(path, size)
        if size < 8:
            raise ReadError(f"{path}: only {size} bytes, too short to be a checkpoint (truncated?)")
        for magic, kind in _OTHER_KINDS:
            if head.startswith(magic):
                raise ReadError(f"{path}: not a checkpoint — the bytes are {kind}")
        if len(head) >= 8 and int.from_bytes(head[:8], "little") > size:
            raise ReadError(f"{path}: not a checkpoint (no torch, pickle or safetensors signature; if it is "
                            "safetensors, its header length runs past the end of the file)")
        raise ReadError(f"{path}: not a checkpoint (no torch zip, pickle or safetensors signature)")
    except OSError as exc:
        if exc.errno == errno.EISDIR:
            raise ReadError(f"{path}: is a directory") from None
        raise ReadError(f"{path}: read failed ({exc.strerror})") from None
    finally:
        os.close(fd)


def find_in_folder(folder: Path) -> tuple[Path | None, list[Path]]:
    """The index file or the single checkpoint a model folder holds, and the other candidates seen."""
    try:
        entries = sorted(p for p in folder.iterdir() if p.is_file())
    except PermissionError:
        raise ReadError(f"{folder}: permission denied (cannot list the folder)") from None
    indexes = [p for p in entries if p.name.endswith(".index.json")]
    for preferred in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        for p in indexes:
            if p.name == preferred:
                return p, indexes
    if len(indexes) == 1:
        return indexes[0], indexes
    if len(indexes) > 1:
        return None, indexes
    files = [p for p in entries if p.name.endswith(CHECKPOINT_SUFFIXES)]
    for preferred in ("model.safetensors", "pytorch_model.bin", "diffusion_pytorch_model.safetensors"):
        for p in files:
            if p.name == preferred:
                return p, files
    return (files[0] if len(files) == 1 else None), files


def read_folder(folder: Path) -> Checkpoint:
    chosen, candidates = find_in_folder(folder)
    if chosen is None:
        if not candidates:
            raise ReadError(f"{folder}: folder holds no checkpoint (no *.index.json, .safetensors, .pt, .pth, "
                            ".bin or .ckpt file)")
        names = ", ".join(p.name for p in candidates[:5])
        raise ReadError(f"{folder}: folder holds {len(candidates)} checkpoints ({names}); name the file to open")
    if chosen.name.endswith(".index.json"):
        return read_sharded(chosen)
    return read_file(chosen)


def read_sharded(index_path: Path) -> Checkpoint:
    try:
        index = json.loads(index_path.read_text("utf-8"))
        weight_map = index["weight_map"]
        assert isinstance(weight_map, dict)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AssertionError):
        raise ReadError(f"{index_path}: not a shard index (needs a JSON object with a weight_map)") from None
    folder = index_path.parent
    shards: dict[str, Checkpoint] = {}
    for shard in dict.fromkeys(weight_map.values()):
        if not isinstance(shard, str) or "/" in shard or shard.startswith(".."):
            raise ReadError(f"{index_path}: weight_map names shard {shard!r}, which is not a file name")
        shard_path = folder / shard
        if not shard_path.is_file():
            raise ReadError(f"{index_path}: shard {shard} is missing from {folder}")
        shards[shard] = read_file(shard_path)
    by_key = {}
    for name, ckpt in shards.items():
        for t in ckpt.state_dict_tensors():
            by_key[(name, t.key)] = t
    tensors = []
    for key, shard in weight_map.items():
        record = by_key.get((shard, key))
        if record is None:
            raise ReadError(f"{index_path}: {key} should be in {shard}, which does not hold it")
        tensors.append(replace(record, key=key))
    formats = sorted({c.format.value for c in shards.values()})
    metadata = index.get("metadata") if isinstance(index.get("metadata"), dict) else {}
    notes = [f"{len(shards)} shards ({', '.join(formats)})"] + [n for c in shards.values() for n in c.notes]
    return Checkpoint(path=index_path, format=Format.SHARDED, tensors=tuple(tensors), metadata=dict(metadata),
                      globals=tuple(g for c in shards.values() for g in c.globals), state_dict_root="",
                      notes=tuple(dict.fromkeys(notes)), files=(index_path, *(c.path for c in shards.values())))
