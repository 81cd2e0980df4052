"""Lists every global every pickle in a file names — read statically, opcode by opcode — with a verdict each."""

from __future__ import annotations

import io
import os
import pickletools
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CkptDoctorError, ReadError
from .readers import PICKLE_FIRST, read_file
from .readers.safetensors_reader import looks_like_safetensors
from .readers.zipindex import read_member, read_zip_index
from .records import GlobalRef, Verdict
from .safety import classify_global

MAX_NESTED = 4  # pickles inside pickles (bytes handed to pickle.loads) are scanned this deep
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
               "STRING"}


@dataclass(frozen=True)
class FileScan:
    path: Path
    format: str | None
    globals: tuple[GlobalRef, ...]
    executable_code: tuple[str, ...] = ()  # TorchScript code/ members
    error: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def dangerous(self) -> tuple[GlobalRef, ...]:
        return tuple(g for g in self.globals if g.verdict is Verdict.DANGEROUS)


@dataclass(frozen=True)
class ScanReport:
    files: tuple[FileScan, ...]
    skipped: tuple[str, ...] = field(default=())

    @property
    def dangerous(self) -> int:
        return sum(len(f.dangerous) for f in self.files)

    @property
    def errors(self) -> int:
        return sum(1 for f in self.files if f.error)


@dataclass(frozen=True)
class PickleScan:
    globals: list[GlobalRef]
    notes: list[str]
    zip_at: int | None = None  # where a zip archive starts after the last pickle (a pickle with a zip appended)


def static_globals(data: bytes, source: str, depth: int = 0) -> PickleScan:
    """Every GLOBAL / STACK_GLOBAL / INST in a run of pickles, found without executing any of them.

    Strings are tracked through the memo so `STACK_GLOBAL` after `BINGET`s resolves; bytes that are
    themselves pickles (handed to `pickle.loads` by a payload) are scanned too; scanning goes on after
    STOP, so concatenated pickles cannot hide a second payload.
    """
    found: list[GlobalRef] = []
    notes: list[str] = []
    zip_at = None
    stream = io.BytesIO(data)
    index = 0
    while stream.tell() < len(data):
        start = stream.tell()
        if data[start:start + 4] == b"PK\x03\x04":
            notes.append(f"{source}: a zip archive follows the pickle at byte {start}")
            zip_at = start
            break
        if index and data[start] != 0x80:
            break  # not another pickle (a legacy file's raw storages follow its five pickles)
        strings: list[str] = []
        memo: dict[int, str] = {}
        label = source if index == 0 and start == 0 else f"{source} (pickle at byte {start})"
        try:
            for opcode, arg, _ in pickletools.genops(stream):
                name = opcode.name
                if name in _STRING_OPS:
                    strings.append(arg if isinstance(arg, str) else str(arg))
                elif name in ("GLOBAL", "INST"):
                    module, _, attr = str(arg).partition(" ")
                    found.append(_ref(module, attr, label))
                elif name == "STACK_GLOBAL":
                    if len(strings) >= 2:
                        found.append(_ref(strings[-2], strings[-1], label))
                    else:
                        found.append(GlobalRef("?", "?", Verdict.DANGEROUS,
                                               "STACK_GLOBAL whose name is computed at load time", label))
                elif name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE") and strings:
                    memo[arg if name != "MEMOIZE" else len(memo)] = strings[-1]
                elif name in ("BINGET", "LONG_BINGET", "GET") and arg in memo:
                    strings.append(memo[arg])
                elif name in ("BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8") and depth < MAX_NESTED:
                    if isinstance(arg, (bytes, bytearray)) and arg[:1] == b"\x80" and len(arg) > 2:
                        inner = static_globals(bytes(arg), f"{label} → nested pickle", depth + 1)
                        found.extend(inner.globals)
                        notes.extend(inner.notes)
                if name == "STOP":
                    break
        except (ValueError, EOFError, KeyError, IndexError, UnicodeDecodeError, OverflowError) as exc:
            notes.append(f"{label}: the pickle breaks off at byte {stream.tell()} ({str(exc)[:80]})")
            break
        index += 1
        if stream.tell() == start:
            break
    return PickleScan(found, notes, zip_at)


def _ref(module: str, name: str, source: str) -> GlobalRef:
    verdict, reason = classify_global(module, name)
    return GlobalRef(module, name, verdict, reason, source)


MAX_PICKLE_SCAN = 256 << 20  # a bare pickle is scanned up to this many bytes


def file_globals(path: Path) -> tuple[list[GlobalRef], tuple[str, ...], list[str]]:
    """(globals every pickle in the file names, TorchScript code members, notes), found statically.

    Works on files no reader can open, so a broken file still shows the payload it carries.
    """
    notes: list[str] = []
    with open(path, "rb") as f:
        head = f.read(64)
        size = os.fstat(f.fileno()).st_size
        if head[:4] == b"PK\x03\x04":
            refs, code = _scan_zip(f.fileno(), size, path, notes)
            return refs, code, notes
        if not head or head[0] not in PICKLE_FIRST or looks_like_safetensors(head, size):
            return [], (), notes
        f.seek(0)
        data = f.read(MAX_PICKLE_SCAN)
    result = static_globals(data, "pickle")
    notes += result.notes
    refs = list(result.globals)
    if result.zip_at is not None:
        refs += _scan_embedded_zip(data[result.zip_at:], path, notes)
    return refs, (), notes


def scan_file(path: Path) -> FileScan:
    """Globals of every pickle in the file. A file no reader opens still gets its pickles scanned."""
    fmt: str | None = None
    error: str | None = None
    try:
        fmt = read_file(path, report_payloads=False).format.value  # the payloads are what this scan reports
    except ReadError as exc:
        error = str(exc)
    try:
        refs, code, notes = file_globals(path)
    except OSError as exc:
        return FileScan(path, fmt, (), (), error or f"{path}: cannot be read ({exc.strerror})")
    return FileScan(path, fmt, tuple(_dedupe(refs)), code, error, tuple(dict.fromkeys(notes)))


def _scan_zip(fd: int, size: int, path: Path, notes: list[str]) -> tuple[list[GlobalRef], tuple[str, ...]]:
    try:
        members = read_zip_index(fd, size, str(path))
    except CkptDoctorError:
        return [], ()
    refs: list[GlobalRef] = []
    code = tuple(sorted(n for n in members if "/code/" in f"/{n}" and n.endswith(".py")))
    for name, member in members.items():
        if name.endswith(".pkl") and not name.endswith(".debug_pkl"):
            try:
                data = read_member(fd, member, str(path), check_crc=False)
            except CkptDoctorError as exc:
                notes.append(str(exc))
                continue
            result = static_globals(data, name)
            refs += result.globals
            notes += result.notes
    return refs, code


def _scan_embedded_zip(data: bytes, path: Path, notes: list[str]) -> list[GlobalRef]:
    import tempfile

    with tempfile.TemporaryFile() as tmp:
        tmp.write(data)
        tmp.flush()
        refs, _ = _scan_zip(tmp.fileno(), len(data), path, notes)
    return refs


def scan_file_tail(f, at: int) -> tuple[str, list[GlobalRef], list[str]]:
    """What follows the last pickle a reader used: (kind, globals named there, notes)."""
    f.seek(at)
    data = f.read(MAX_PICKLE_SCAN)
    notes: list[str] = []
    if data[:4] == b"PK\x03\x04":
        return "a zip archive", _scan_embedded_zip(data, Path(getattr(f, "name", "?")), notes), notes
    if data[:1] and data[0] in PICKLE_FIRST:
        result = static_globals(data, f"pickle after byte {at}")
        return "more pickle data", result.globals, result.notes
    return "bytes", [], notes


def _dedupe(refs: list[GlobalRef]) -> list[GlobalRef]:
    seen: dict[tuple[str, str, str], GlobalRef] = {}
    for ref in refs:
        seen.setdefault((ref.module, ref.name, ref.source), ref)
    return list(seen.values())


def files_to_scan(paths: list[str]) -> tuple[list[Path], list[str]]:
    """Files named, and every regular file under folders named (recursively); errors for missing paths."""
    files: list[Path] = []
    problems: list[str] = []
    for raw in paths:
        path = Path(raw)
        if path.is_symlink() and not path.exists():
            problems.append(f"{path}: symlink points to {os.readlink(path)}, which does not exist")
        elif path.is_dir():
            found = [p for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink() and _looks_scannable(p)]
            if not found:
                problems.append(f"{path}: folder holds nothing to scan (no pickle, zip or safetensors file)")
            files += found
        elif path.exists():
            if not stat.S_ISREG(path.stat().st_mode):
                problems.append(f"{path}: not a regular file")
            else:
                files.append(path)
        else:
            problems.append(f"{path}: no such file or directory")
    return files, problems


def _looks_scannable(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return True  # report it, do not hide it
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80" or head[:1] in (b"(", b"c", b"}", b"]"):
        return True
    from .readers.safetensors_reader import looks_like_safetensors

    return looks_like_safetensors(head, path.stat().st_size) or path.suffix in (".pt", ".pth", ".bin", ".ckpt", ".pkl")


def scan(paths: list[str]) -> tuple[ScanReport, list[str]]:
    files, problems = files_to_scan(paths)
    return ScanReport(tuple(scan_file(p) for p in files)), problems
