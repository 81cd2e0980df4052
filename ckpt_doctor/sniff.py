"""The one sniffer: what container a file is, from its bytes, in the order torch.load tries them.

torch.load takes a file for a zip when its first four bytes are a zip local header, then tries Python's tarfile
(the pre-0.4 format), then unpickles from byte 0 (the legacy format, or any pickle). safetensors files and NumPy
arrays are recognised too, for a precise answer; whatever the verdict, a file that is not a zip or a tar is also
walked as a pickle from byte 0 (readers/survey.py), as torch.load would read it under another name.
"""

from __future__ import annotations

import enum
import errno
import os
import stat
import struct
from pathlib import Path

from .safepickle import limits
from .safepickle.walker import starts_pickle

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Callable


class Container(str, enum.Enum):
    ZIP = "zip"  # torch.save (≥ 1.6), TorchScript, or another zip
    TAR = "tar"  # torch's pre-0.4 format, or any archive Python's tarfile opens
    SAFETENSORS = "safetensors"
    NUMPY = "npy"
    PICKLE = "pickle"  # the legacy torch format or a bare pickle: its first byte is a pickle opcode
    EMPTY = "empty"
    OTHER = "other"


# First bytes of files people mistake for checkpoints: what they are, and what reads them instead.
OTHER_KINDS = [
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras/h5py)", "load it with h5py.File or keras.models.load_model"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image", ""), (b"\xff\xd8\xff", "a JPEG image", ""), (b"GIF87a", "a GIF image", ""),
    (b"GIF89a", "a GIF image", ""), (b"II*\0", "a TIFF image", ""), (b"MM\0*", "a TIFF image", ""),
    (b"\x1f\x8b", "a gzip archive", "decompress it (gunzip) and inspect what it holds"),
    (b"BZh", "a bzip2 archive", "decompress it (bunzip2) and inspect what it holds"),
    (b"\xfd7zXZ\0", "an xz archive", "decompress it (unxz) and inspect what it holds"),
    (b"\x28\xb5\x2f\xfd", "a zstd archive", "decompress it (unzstd) and inspect what it holds"),
    (b"7z\xbc\xaf\x27\x1c", "a 7z archive", "extract it (7z x) and inspect what it holds"),
    (b"Rar!\x1a\x07", "a RAR archive", "extract it and inspect what it holds"),
    (b"PK\x05\x06", "an empty zip archive", ""), (b"%PDF", "a PDF document", ""),
    (b"\x7fELF", "an executable (ELF)", ""), (b"SQLite format 3\0", "an SQLite database", ""),
    (b"GGUF", "a GGUF model (llama.cpp)", "read it with the gguf package or llama.cpp"),
]
# Not the file itself: what a checkpoint's place holds when its download never happened. An error, never skipped.
LFS_POINTER = b"version https://git-lfs"

HEAD = 512  # enough for a tar header


def sniff_bytes(head: bytes, size: int) -> Container:
    """The container of a file whose first bytes are `head` (at least 512 of them when the file is that long)."""
    if size == 0:
        return Container.EMPTY
    if head[:4] == b"PK\x03\x04":
        return Container.ZIP
    if is_tar_header(head):
        return Container.TAR
    if looks_like_safetensors(head, size):
        return Container.SAFETENSORS
    if head[:6] == b"\x93NUMPY":
        return Container.NUMPY
    if starts_pickle(head):
        return Container.PICKLE
    return Container.OTHER


def sniff(fd: int, size: int) -> tuple[Container, bytes]:
    """The container of an open file, and its first bytes."""
    head = os.pread(fd, HEAD, 0)
    kind = sniff_bytes(head, size)
    # (a first header whose metadata tarfile would read into memory, hundreds of MB, is left to the tar reader,
    # which refuses it; tarfile is not asked)
    if kind is Container.TAR and tar_metadata_too_big(head) is None and not _tarfile_opens(fd):
        kind = _after_tar(head, size)
    return kind, head


def _after_tar(head: bytes, size: int) -> Container:
    if looks_like_safetensors(head, size):
        return Container.SAFETENSORS
    return Container.PICKLE if starts_pickle(head) else Container.OTHER


def is_tar_header(block: bytes) -> bool:
    """Python's tarfile accepts a first block when its checksum matches (signed or unsigned byte sum, the checksum
    field counted as spaces) — or when it is all zeros (an empty archive). No 'ustar' magic is needed. The field is
    parsed as tarfile's nti() parses it: cut at NUL, ASCII, str.strip() (which also strips \x1c-\x1f), octal."""
    if len(block) < 512:
        return False
    block = block[:512]
    if block.count(0) == 512:
        return True
    field = block[148:156]
    if field[:1] in (b"\x80", b"\xff"):
        return True  # a base-256 checksum: let tarfile itself decide
    try:
        stored = int(field.split(b"\0", 1)[0].decode("ascii").strip() or "0", 8)
    except ValueError:
        return False
    unsigned = 256 + sum(block[:148]) + sum(block[156:512])
    signed = 256 + sum(struct.unpack("148b", block[:148])) + sum(struct.unpack("356b", block[156:512]))
    return stored in (unsigned, signed)


def tar_field_number(field: bytes) -> int | None:
    """A numeric tar header field as tarfile reads it (octal text, or base-256 when it starts with 0x80/0xff)."""
    if field[:1] in (b"\x80", b"\xff"):
        value = int.from_bytes(field[1:], "big")
        return value if field[0] == 0x80 else value - (256 ** (len(field) - 1))
    try:
        return int(field.split(b"\0", 1)[0].decode("ascii").strip() or "0", 8)
    except ValueError:
        return None


# Member types whose data tarfile reads into memory as metadata (PAX and GNU long names).
TAR_METADATA_TYPES = frozenset(b"xgLK")
MAX_TAR_METADATA = 1 << 20


def tar_metadata_too_big(block: bytes) -> int | None:
    """The size of a tar header's metadata payload when it is over what tarfile should be asked to hold in memory."""
    if len(block) >= 512 and block[156] in TAR_METADATA_TYPES:
        size = tar_field_number(block[124:136])
        if size is not None and size > MAX_TAR_METADATA:
            return size
    return None


def _tarfile_opens(fd: int) -> bool:
    """Whether tarfile.open(mode="r:") — what torch.load calls — accepts the file; it reads only the first header."""
    import tarfile

    with os.fdopen(os.dup(fd), "rb") as f:
        f.seek(0)  # a dup shares the file position, which an earlier read may have moved
        try:
            tarfile.open(fileobj=f, mode="r:", format=tarfile.PAX_FORMAT).close()
        except tarfile.TarError:
            return False
        except (OSError, ValueError, UnicodeError, OverflowError):
            return False
    return True


def looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 0 < n <= min(limits.MAX_SAFETENSORS_HEADER, size - 8) and head[8:9] == b"{"


def describe_other(head: bytes, size: int) -> str:
    """Why a file that no reader opens is no checkpoint, for an error message."""
    if head.startswith(LFS_POINTER):
        return "the bytes are a Git LFS pointer, not the file itself — run `git lfs pull` in its repository"
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") > size:
        return "its safetensors header length runs past the end of the file (truncated?)"
    return "no torch zip, tar, pickle or safetensors signature"


def what_else(head: bytes) -> tuple[str, str] | None:
    """What a file that is no PyTorch checkpoint is, from its first bytes, and what reads it (or ""): an image, an
    archive, an HDF5 file, text (JSON, YAML, CSV, HTML...). None when the bytes say nothing (or say Git LFS pointer:
    a checkpoint that is missing, not something else)."""
    for magic, kind, advice in OTHER_KINDS:
        if head.startswith(magic):
            return kind, advice
    if head[4:8] == b"TFL3":
        return "a TensorFlow Lite model", "load it with tf.lite.Interpreter"
    if head[:4] == b"RIFF" and head[8:12] in (b"WEBP", b"WAVE", b"AVI "):
        return {b"WEBP": "a WebP image", b"WAVE": "a WAV recording", b"AVI ": "an AVI video"}[head[8:12]], ""
    if head.startswith(LFS_POINTER):
        return None
    text = text_kind(head)
    if text is not None:
        return text, ""
    if len(head) >= 3 and head[0] == 0x08 and head[1] < 0x80 and head[2] in (0x12, 0x1a, 0x3a):
        # protobuf: field 1 a small varint (ONNX's ir_version, SavedModel's schema version), then a length field
        return "a protobuf message (an ONNX model or a TensorFlow graph?)", "load it with onnx.load or TensorFlow"
    return None


def text_kind(head: bytes) -> str | None:
    """What text the first bytes are (JSON, YAML, CSV, HTML/XML, Python source, plain text), or None when they are
    not text: UTF-8 (a character cut by the end of `head` allowed) without control characters but tab, newline,
    carriage return and form feed."""
    body = head[3:] if head.startswith(b"\xef\xbb\xbf") else head
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(body) - 3 or exc.reason != "unexpected end of data":
            return None
        text = body[:exc.start].decode("utf-8")
    if not text.strip() or not (text.replace("\t", " ").replace("\n", " ").replace("\r", " ").replace("\f", " ")
                                 .isprintable()):
        return None
    import re

    start = text.lstrip()
    lines = text.splitlines()
    if start.startswith("<"):
        return "HTML or XML text (a download that returned a web page?)"
    if re.fullmatch(r"\[[^\]]+\]\s*", lines[0].strip()) and not _is_json(lines[0]):  # `[console_scripts]`
        return "INI text"
    if start.startswith(("{", "[")):
        return "JSON text"
    if re.match(r"[^\n,]+,sha256=[\w-]+,\d*\r?$", lines[0]):
        return "CSV text (a wheel's RECORD)"
    if re.match(r"(#!.*\n)?(import \w|from [\w.]+ import |class \w|def \w|\"\"\"|@\w)", text):
        return "Python source"
    if start.startswith(("---", "%YAML")) or re.match(r"(#.*\n|\s*\n)*[a-z_][\w.]*:(\s|$)", text):
        return "YAML text"
    if len(lines) >= 2 and lines[0].count(",") >= 1 and lines[0].count(",") == lines[1].count(","):
        return "CSV text"
    return "text"


def _is_json(text: str) -> bool:
    import json

    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def dangling(path: Path | str) -> str:
    """Why a symlink leads nowhere: its target is missing, or the links loop."""
    target = os.readlink(path)
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{path}: symlinks loop ({path} -> {target} -> …)"
    return f"{path}: symlink points to {target}, which does not exist"


def folder_files(folder: Path, *, whole: Callable[[Path, list[str]], bool] | None = None,
                 once: bool = False) -> tuple[list[Path], list[str]]:
    """Every regular file under `folder`, at any depth, in os.walk's order (a folder's own files, then each
    subfolder's), symlinks followed and loops cut; and the paths that could not be read. The walk is iterative:
    a folder nested thousands deep is no RecursionError.

    whole: a subfolder for which whole(path, names) is true is given itself, not its files (a checkpoint of
    several files). once: each real file once (a Hugging Face cache links every snapshot file into blobs/)."""
    found: list[Path] = []
    problems: list[str] = []
    seen_dirs: set[str] = set()
    seen_files: set[str] = set()
    stack = [folder]
    while stack:
        here = stack.pop()
        real = os.path.realpath(here)
        if real in seen_dirs:  # a symlinked folder loop
            continue
        seen_dirs.add(real)
        try:
            names = sorted(os.listdir(here))
        except OSError as exc:
            problems.append(f"{here}: cannot be listed ({exc.strerror})")
            continue
        if whole is not None and here != folder and whole(here, names):
            found.append(here)
            continue
        subfolders = []
        for name in names:
            path = here / name
            try:
                mode = os.stat(path).st_mode  # follows symlinks: a Hugging Face snapshot is all links into blobs/
            except FileNotFoundError:
                problems.append(dangling(path) if os.path.islink(path) else
                                f"{path}: vanished while the folder was read")
                continue
            except OSError as exc:
                problems.append(dangling(path) if exc.errno == errno.ELOOP else
                                f"{path}: cannot be read ({exc.strerror})")
                continue
            if stat.S_ISDIR(mode):
                subfolders.append(path)
            elif stat.S_ISREG(mode):
                if once:
                    key = os.path.realpath(path)
                    if key in seen_files:
                        continue
                    seen_files.add(key)
                found.append(path)
            if len(found) > limits.MAX_FOLDER_FILES:
                problems.append(f"{folder}: more than {limits.MAX_FOLDER_FILES:,} files; the rest were not read")
                return found, problems
        stack.extend(reversed(subfolders))
    return found, problems
    return found, problems
