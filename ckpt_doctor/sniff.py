"""What a file is, from its bytes: the tests on its first bytes that readers/table.py tries in the order torch.load
tries formats, and what a file no reader opens is instead.

torch.load takes a file for a zip when its first four bytes are a zip local header, then tries Python's tarfile
(the pre-0.4 format), then unpickles from byte 0 (the legacy format, or any pickle). safetensors files and NumPy
arrays are recognised too, for a precise answer; whatever the verdict, a file that is not a zip or a tar is also
walked as a pickle from byte 0 (readers/survey.py), as torch.load would read it under another name.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

from ._record import record
from .errors import CkptDoctorError
from .records import OpenEnum
from .safepickle import limits
from .safepickle.walker import starts_pickle

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Callable


class Container(OpenEnum):
    """What a file's bytes are (scan's `container`); a format added in readers/table.py declares its own."""

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


# The tests readers/table.py tries in its order, each on a file's first HEAD bytes (fewer when the file is shorter)
# and its size.

def is_empty(head: bytes, size: int) -> bool:
    return size == 0


def is_zip(head: bytes, size: int) -> bool:
    return head[:4] == b"PK\x03\x04"


def is_tar(head: bytes, size: int) -> bool:
    return is_tar_header(head)


def tarfile_opens(fd: int, head: bytes) -> bool:
    """The second look at a local file whose first block is a tar header: whether tarfile, which torch.load calls,
    opens it. (A first header whose metadata tarfile would read into memory, hundreds of MB, is left to the tar
    reader, which refuses it; tarfile is not asked.)"""
    return tar_metadata_too_big(head) is not None or _tarfile_opens(fd)


def is_npy(head: bytes, size: int) -> bool:
    """NumPy's magic; a first block that is a tar header tarfile refused is read on as torch reads it (a pickle)."""
    return head[:6] == b"\x93NUMPY" and not is_tar_header(head)


def is_pickle(head: bytes, size: int) -> bool:
    return starts_pickle(head)


def anything(head: bytes, size: int) -> bool:
    return True


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
    return 0 < n <= min(limits.MAX_SAFETENSORS_HEADER, size - 8) and _json_object_starts(head[8:])


def _json_object_starts(text: bytes) -> bool:
    """A JSON object's `{`, after any JSON whitespace: the safetensors library reads a header that starts with
    spaces (its format text says `{` comes first, but the library is what loads the file)."""
    return text.lstrip(b" \t\r\n")[:1] == b"{"


def describe_other(head: bytes, size: int) -> str:
    """Why a file that no reader opens is no checkpoint, for an error message."""
    if head.startswith(LFS_POINTER):
        return "the bytes are a Git LFS pointer, not the file itself — run `git lfs pull` in its repository"
    if len(head) >= 9 and _json_object_starts(head[8:]) and int.from_bytes(head[:8], "little") > size:
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
    if head[4:8] == b"\x02\0\0\0" and head[64:68] == b"\xef\xbe\xad\xde":  # MIL blob storage v2: a sentinel per blob
        return "a Core ML weight file (an .mlpackage's weight.bin)", "load it with coremltools"
    if head.startswith(LFS_POINTER):
        return None
    text = text_kind(head)
    if text is not None:
        return text, ""
    if len(head) >= 3 and head[0] == 0x08 and head[1] < 0x80 and head[2] in (0x12, 0x1a, 0x3a):
        # protobuf: field 1 a small varint (ONNX's ir_version, SavedModel's schema version), then a length field
        return "a protobuf message (an ONNX model or a TensorFlow graph?)", "load it with onnx.load or TensorFlow"
    return None


def other_format(head: bytes) -> bool:
    """Whether the bytes name a format other than a checkpoint's (NumPy, HDF5, Core ML, an image, JSON...), and not
    what a failed download leaves in a checkpoint's place (a git-lfs pointer, a web page): in a folder, such a file
    is skipped whatever its name."""
    if head.startswith(b"\x93NUMPY"):
        return True
    other = what_else(head)
    return other is not None and not other[0].startswith("HTML")


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


# --- folders -------------------------------------------------------------------------------------------------------
# A folder is walked with directory file descriptors (each entry looked up relative to its folder's descriptor, as
# openat does), so that no path is too long to walk, and each entry's type is known from lstat/stat before anything
# is opened: a named pipe is never opened (it would block), nor a device, a socket, or a file of a kernel filesystem
# (/proc, /sys: /proc/kcore claims terabytes, a tracefs pipe blocks). File links are followed wherever they point, to
# a regular file; folder links only when the folder they lead to is inside the folder walked (where it is walked
# once, under its own name) or, for a Hugging Face cache snapshot, inside its repository's cache folder.

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_ANY_DIR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)  # no read right
_SHORT_PATH = 3072  # a path of more bytes is opened through its folder's descriptor (PATH_MAX is 4096 on Linux)
_STEP_BYTES = 2048  # components opened at once when a long path's folder is opened
_HELD_FOLDERS = 64  # folder descriptors kept for long paths
_KERNEL_FILESYSTEMS = frozenset({
    "proc", "sysfs", "debugfs", "tracefs", "securityfs", "cgroup", "cgroup2", "configfs", "bpf", "pstore", "efivarfs",
    "fusectl", "devpts", "mqueue", "binfmt_misc", "rpc_pipefs", "nsfs", "selinuxfs", "autofs"})
_HF_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


class DeepPath(type(Path())):  # type: ignore[misc]
    """A path that opens however long it is: as a string (str(), messages, JSON) the path itself; to the system
    (os.fspath, as os.open, os.stat and open() ask for it) the same path when it is short, and otherwise
    /proc/self/fd/N/name, N a descriptor of its folder opened a few components at a time. Paths derived from one
    (`/`, .parent) are DeepPaths too, so every reader opens files found in a deep folder as it opens any other."""

    __slots__ = ()

    def __fspath__(self) -> str:
        text = str(self)
        if len(text) < _SHORT_PATH // 4 or len(os.fsencode(text)) < _SHORT_PATH:
            return text
        return _short_alias(text)


_held: dict[str, int] = {}  # a long path's folder -> its descriptor, oldest first
_proc_fd: list[str | None] = []


def _short_alias(text: str) -> str:
    if not _proc_fd:
        _proc_fd.append("/proc/self/fd" if os.path.isdir("/proc/self/fd") else None)
    parent, name = os.path.split(text)
    if _proc_fd[0] is None or not name or not parent:
        return text  # no /proc: the system says the name is too long, and that is the error reported
    fd = _held.pop(parent, None)
    if fd is None:
        fd = open_folder(parent)
        if len(_held) >= _HELD_FOLDERS:
            os.close(_held.pop(next(iter(_held))))
    _held[parent] = fd
    return f"{_proc_fd[0]}/{fd}/{name}"


def open_folder(text: str, flags: int = _DIR_FLAGS) -> int:
    """A descriptor of the folder at `text`, however long the path: opened a few components at a time, each step
    relative to the last (symlinks followed, as the system follows them)."""
    fd = os.open(os.sep if text.startswith(os.sep) else os.curdir, flags)
    step: list[str] = []
    size = 0
    try:
        for part in text.split(os.sep):
            if not part:
                continue
            n = len(os.fsencode(part)) + 1
            if step and size + n > _STEP_BYTES:
                fd = _step(fd, step, flags)
                step, size = [], 0
            step.append(part)
            size += n
        if step:
            fd = _step(fd, step, flags)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd


def _step(fd: int, parts: list[str], flags: int) -> int:
    try:
        return os.open(os.sep.join(parts), flags, dir_fd=fd)
    finally:
        os.close(fd)


def deep(path: Path | str) -> Path:
    """`path` as a DeepPath (one that opens however long it is); a URL as a readers.source.RemotePath."""
    if isinstance(path, str) and path.startswith(("https://", "http://", "s3://")):
        from .readers.source import remote_path  # only when a URL is given (the readers package imports sniff)

        return remote_path(path)
    return path if isinstance(path, DeepPath) or type(path).__name__ == "RemotePath" else DeepPath(path)


def link_target(path: Path) -> str | None:
    """Where the symlink at `path` points; None when it is no symlink (or is gone, or is a URL)."""
    if type(path).__name__ == "RemotePath":
        return None
    try:
        return os.readlink(deep(path))
    except (OSError, ValueError):
        return None


def dangling(path: Path | str) -> str:
    """Why a symlink leads nowhere: its target is missing, or the links loop."""
    target = link_target(Path(path))
    if target is None:
        return f"{path}: vanished while it was read"
    try:
        os.stat(deep(path))
    except OSError as exc:
        return _broken_link(path, target, exc)
    return f"{path}: symlink points to {target}, which does not exist"


def _broken_link(path: Path | str, target: str, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return f"{path}: symlinks loop ({path} -> {target} -> …)"
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return f"{path}: symlink points to {target}, which does not exist"
    return f"{path}: symlink to {target} cannot be followed ({exc.strerror})"


_kernel: dict[int, str] = {}
_kernel_read: list[bool] = []


def kernel_filesystem(dev: int) -> str | None:
    """The kernel filesystem (proc, sysfs, ...) device `dev` is, from /proc/self/mountinfo; None for any other."""
    if os.major(dev) != 0:  # a disk's device: every kernel filesystem has an anonymous one (major 0)
        return None
    if not _kernel_read:
        _kernel_read.append(True)
        lines = []
        try:
            fd = os.open("/proc/self/mountinfo", os.O_RDONLY)
            try:
                data = b""
                while len(data) < 1 << 22:
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        break
                    data += chunk
            finally:
                os.close(fd)
            lines = data.decode("utf-8", "replace").splitlines()
        except OSError:
            pass
        for line in lines:
            fields, _, after = line.partition(" - ")
            numbers, kind = fields.split(" ")[2:3], after.split(" ", 1)[0]
            if kind in _KERNEL_FILESYSTEMS and numbers and numbers[0].count(":") == 1:
                major, minor = numbers[0].split(":")
                if major.isdigit() and minor.isdigit():
                    _kernel[os.makedev(int(major), int(minor))] = kind
        if not lines:  # no mountinfo (not Linux): the usual mount points, where they exist
            for where, kind in (("/proc", "proc"), ("/sys", "sysfs")):
                try:
                    _kernel[os.stat(where).st_dev] = kind
                except OSError:
                    pass
    return _kernel.get(dev)


def _special(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "no regular file"


@record
class FolderWalk:
    """What a folder holds, as scan and inspect see it."""

    files: tuple[Path, ...]  # regular files (file links followed) and, with `whole`, folders that are one checkpoint
    problems: tuple[str, ...]  # what could not be read: broken links, folders that cannot be listed (exit 2)
    skipped: tuple[tuple[Path, str], ...]  # not read, with why: special files, links that leave the folder


def walk_folder(folder: Path, *, whole: Callable[[Path, list[str]], bool] | None = None,
                once: bool = False) -> FolderWalk:
    """Every regular file under `folder`, at any depth, in os.walk's order (a folder's own files, then each
    subfolder's), names sorted; see the comment above for what is followed. The walk is iterative and holds a
    descriptor only for folders with subfolders still to walk: a folder nested thousands deep is no RecursionError,
    and no path is too long.

    whole: a subfolder for which whole(path, names) is true is given itself, not its files (a checkpoint of
    several files). once: each real file once (a Hugging Face cache links every snapshot file into blobs/)."""
    root = deep(folder)
    files: list[Path] = []
    problems: list[str] = []
    skipped: list[tuple[Path, str]] = []
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        problems.append(f"{root}: cannot be listed ({exc.strerror})")
        return FolderWalk((), tuple(problems), ())
    st = os.fstat(root_fd)
    kind = kernel_filesystem(st.st_dev)
    if kind is not None:
        os.close(root_fd)
        return FolderWalk((), (f"{root}: a folder of the kernel's {kind} filesystem, not files on disk: not read",), ())
    bounds = {(st.st_dev, st.st_ino)}  # where folder links may lead
    cache = _hf_repo(root)
    if cache is not None:
        bounds.add(cache)
    walk = _Walk(root, whole, once, bounds, files, problems, skipped)
    walk.run(root_fd)
    return FolderWalk(tuple(files), tuple(problems), tuple(skipped))


class _Open:
    """A folder's descriptor, held while subfolders of it are still to be opened."""

    __slots__ = ("fd", "pending")

    def __init__(self, fd: int, pending: int) -> None:
        self.fd, self.pending = fd, pending

    def done_one(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            os.close(self.fd)


class _Walk:
    def __init__(self, root: Path, whole: Callable[[Path, list[str]], bool] | None, once: bool,
                 bounds: set[tuple[int, int]], files: list[Path], problems: list[str],
                 skipped: list[tuple[Path, str]]) -> None:
        self.root, self.whole, self.once, self.bounds = root, whole, once, bounds
        self.files, self.problems, self.skipped = files, problems, skipped
        self.seen_dirs: set[tuple[int, int]] = set()
        self.seen_files: set[tuple[int, int]] = set()
        # folder links inside the bounds, walked last (their folders are usually walked under their own names)
        self.later: list[tuple[Path, tuple[int, int]]] = []

    def full(self) -> bool:
        return len(self.files) + len(self.skipped) > limits.MAX_FOLDER_FILES

    def run(self, root_fd: int) -> None:
        # each entry: (the open parent, the name in it, the path shown) or, for a folder link, (None, its identity,
        # the path shown)
        stack: list[tuple[_Open | None, object, Path]] = []
        fd: int | None = root_fd
        here = self.root
        try:
            while True:
                if fd is not None:
                    self._folder(fd, here, stack)
                    fd = None
                if self.full():
                    self.problems.append(f"{self.root}: more than {limits.MAX_FOLDER_FILES:,} files; the rest were "
                                         "not read")
                    break
                if not stack and self.later:
                    path, ident = self.later.pop(0)
                    stack.append((None, ident, path))
                if not stack:
                    break
                parent, key, here = stack.pop()
                fd = self._enter(parent, key, here)
        finally:
            for parent, _, _ in stack:  # a walk cut short: what is still held is let go
                if parent is not None:
                    parent.done_one()

    def _enter(self, parent: _Open | None, key: object, here: Path) -> int | None:
        """The descriptor of the next folder, or None when it is not to be walked (seen, gone, a link swapped)."""
        try:
            if parent is not None:
                fd = os.open(key, _DIR_FLAGS, dir_fd=parent.fd)  # type: ignore[arg-type]
            else:  # a folder link, reopened by its path: walked only if it is still the folder judged inside
                fd = open_folder(str(here))
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != key:
                    os.close(fd)
                    return None
        except OSError as exc:
            self.problems.append(f"{here}: vanished while the folder was read" if exc.errno == errno.ENOENT else
                                 f"{here}: cannot be listed ({exc.strerror})")
            return None
        finally:
            if parent is not None:
                parent.done_one()
        return fd

    def _folder(self, fd: int, here: Path, stack: list) -> None:
        """Lists one folder: its files found, its subfolders pushed on `stack` (the descriptor kept for them)."""
        subfolders: list[str] = []
        try:
            st = os.fstat(fd)
            ident = (st.st_dev, st.st_ino)
            if ident in self.seen_dirs:  # a loop (a bind mount), or a folder link walked already
                return
            self.seen_dirs.add(ident)
            try:
                names = sorted(_entries(fd))
            except OSError as exc:
                self.problems.append(f"{here}: cannot be listed ({exc.strerror})")
                return
            looked = [self._look(fd, here, name) for name in names]
            # what makes a folder one checkpoint is asked of its files and folders only: a reader opens them by name
            if self.whole is not None and here is not self.root and self._is_whole(
                    here, [name for name, st, _, _ in looked
                           if st is not None and (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))]):
                self.files.append(here)
                return
            for name, st, target, problem in looked:
                if problem is not None:
                    self.problems.append(problem)
                elif st is not None:
                    self._entry(fd, here / name, name, st, target, subfolders)
                if self.full():
                    return
        finally:
            if subfolders:
                held = _Open(fd, len(subfolders))
                stack.extend((held, name, here / name) for name in reversed(subfolders))
            else:
                os.close(fd)

    def _is_whole(self, here: Path, names: list[str]) -> bool:
        assert self.whole is not None
        try:
            return self.whole(here, names)
        except CkptDoctorError:
            return True  # a checkpoint folder that is broken: its reader says how
        except OSError:
            return False

    @staticmethod
    def _look(fd: int, here: Path, name: str) -> tuple[str, os.stat_result | None, str | None, str | None]:
        """(name, its stat with links followed, the link's target, why it cannot be looked at); nothing is opened."""
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError as exc:
            return name, None, None, (f"{here / name}: vanished while the folder was read" if exc.errno == errno.ENOENT
                                      else f"{here / name}: cannot be read ({exc.strerror})")
        if not stat.S_ISLNK(st.st_mode):
            return name, st, None, None
        target = None
        try:
            target = os.readlink(name, dir_fd=fd)
            return name, os.stat(name, dir_fd=fd), target, None
        except OSError as exc:
            return name, None, target, (f"{here / name}: vanished while the folder was read" if target is None else
                                        _broken_link(here / name, target, exc))

    def _entry(self, fd: int, path: Path, name: str, st: os.stat_result, target: str | None,
               subfolders: list[str]) -> None:
        link = f" (a link to {target})" if target is not None else ""
        kind = kernel_filesystem(st.st_dev)
        if kind is not None:
            what = "folder" if stat.S_ISDIR(st.st_mode) else "file"
            self.skipped.append((path, f"a {what} of the kernel's {kind} filesystem{link}, not on disk: not read"))
        elif stat.S_ISDIR(st.st_mode):
            if target is None:
                subfolders.append(name)
            elif self._inside(fd, name):
                self.later.append((path, (st.st_dev, st.st_ino)))
            else:
                self.skipped.append((path, f"a link to a folder outside {self.root} ({target}): not followed"))
        elif stat.S_ISREG(st.st_mode):
            if self.once:
                ident = (st.st_dev, st.st_ino)
                if ident in self.seen_files:
                    return
                self.seen_files.add(ident)
            self.files.append(path)
        else:
            self.skipped.append((path, f"{_special(st.st_mode)}{link}, not a file: not read"))

    def _inside(self, fd: int, name: str) -> bool:
        """Whether the folder the link `name` leads to is inside the bounds: climbed by `..` from it, descriptor by
        descriptor (no path is built), to a bound or to the root of the file system."""
        try:
            here = os.open(name, _ANY_DIR_FLAGS, dir_fd=fd)
        except OSError:
            return False
        try:
            for _ in range(limits.MAX_FOLDER_FILES):
                st = os.fstat(here)
                ident = (st.st_dev, st.st_ino)
                if ident in self.bounds:
                    return True
                up = os.open("..", _ANY_DIR_FLAGS, dir_fd=here)
                os.close(here)
                here = up
                above = os.fstat(here)
                if (above.st_dev, above.st_ino) == ident:
                    return False  # the root of the file system
            return False
        except OSError:
            return False
        finally:
            os.close(here)


def _entries(fd: int) -> list[str]:
    """The names in an open folder."""
    return os.listdir(fd)


def _hf_repo(root: Path) -> tuple[int, int] | None:
    """When `root` is inside a Hugging Face cache snapshot (…/models--org--name/snapshots/<revision>/…), the
    identity of the repository's cache folder (…/models--org--name, which holds blobs/): a folder link may lead
    anywhere inside it."""
    for resolve in (os.path.abspath, os.path.realpath):
        try:
            parts = resolve(str(root)).split(os.sep)
        except (OSError, ValueError):
            continue
        for i, part in enumerate(parts[:-2]):
            if part.startswith(_HF_REPO_PREFIXES) and parts[i + 1] == "snapshots":
                try:
                    st = os.stat(deep(os.sep.join(parts[:i + 1])))
                except OSError:
                    return None
                return st.st_dev, st.st_ino
    return None
