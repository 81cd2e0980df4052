"""Opens any checkpoint path — file or folder — and picks the reader from the bytes, never the extension."""

from __future__ import annotations

import json
import errno
import os
import re
import stat
from ..advice import consolidate
from .._record import replace
from pathlib import Path

from ..errors import NotACheckpoint, ReadError, SeveralCheckpoints
from ..records import Checkpoint, Format
from ..safepickle import limits
from ..sniff import HEAD, Container, describe_other, other_format, what_else
from .survey import Survey, survey_file

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".pkl", ".tar", ".model", ".pth.tar")


def named_as_checkpoint(path: Path, tar_archive: bool) -> bool:
    """Whether a file bears a checkpoint's name, so that something else under it is an error, not skipped (a git-lfs
    pointer as `model.pt`). `.tar` is every tar archive's name too: not a checkpoint's when `tar_archive`."""
    name = path.name.lower()
    return name.endswith(CHECKPOINT_SUFFIXES) and not (
        tar_archive and name.endswith(".tar") and not name.endswith(".pth.tar"))


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint's structure (keys, shapes, dtypes, devices, byte ranges) without loading tensor data."""
    from ..sniff import deep
    from .source import is_url, remote_path

    if is_url(path):  # https://, s3://: read by range requests (readers/source.py)
        return read_file(remote_path(path))
    path = deep(path)  # a path of any length opens (sniff.DeepPath)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            from ..sniff import dangling

            raise ReadError(dangling(path)) from None
        raise ReadError(f"{path}: no such file or directory") from None
    except PermissionError:
        raise ReadError(f"{path}: permission denied") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            from ..sniff import dangling

            raise ReadError(dangling(path)) from None
        raise ReadError(f"{path}: cannot be read ({exc.strerror})") from None
    from ..sniff import kernel_filesystem

    kind = kernel_filesystem(st.st_dev)
    if kind is not None:  # /proc, /sys: files that claim terabytes, or block when read
        raise ReadError(f"{path}: on the kernel's {kind} filesystem, not a checkpoint on disk: not read")
    if stat.S_ISDIR(st.st_mode):
        return read_folder(path)
    if not stat.S_ISREG(st.st_mode):
        raise ReadError(f"{path}: not a regular file")
    return read_file(path)


def read_file(path: Path, survey: Survey | None = None) -> Checkpoint:
    """One checkpoint file. Every pickle in it is walked first (survey.py); what the walk found is the
    checkpoint's globals, and stays known when the file then fails to read: a broken file that names a global
    off the allow-list is reported as unsafe (exit 1), not merely as corrupt."""
    survey = survey or survey_file(path)
    try:
        if survey.refused:
            if survey.container is Container.PICKLE:  # text read as a pickle can ask for a memo of gigabytes
                _check_pickle(path, survey, known_only=True)
            raise ReadError(f"{path}: refused to read it: {survey.refused}")
        ckpt = _read(path, survey)
    except ReadError as exc:
        findings = survey.finding_names()
        if findings and not exc.findings:
            shown = ", ".join(findings[:4]) + (f", … {len(findings) - 4} more" if len(findings) > 4 else "")
            kind = NotACheckpoint if isinstance(exc, NotACheckpoint) else ReadError
            raise kind(f"{exc} — and it would run code: {shown}", findings) from None
        raise
    globals_ = tuple({(g.module, g.name): g for g in [*survey.globals, *ckpt.globals]}.values())
    ckpt = replace(ckpt, globals=globals_, hazards=tuple(survey.hazards),
                   notes=tuple(dict.fromkeys([*ckpt.notes, *survey.notes])))
    if path.name.endswith("_states.pt"):
        from .deepspeed import rank_file_note

        ckpt = rank_file_note(ckpt)
    elif ckpt.format is Format.SAFETENSORS and "DCP_SHARDING_INFO" in ckpt.metadata:
        note = (f"one rank's shard written by torch.distributed.checkpoint's Hugging Face storage writer: shapes are "
                f"its chunks'; inspect or fix the folder for whole tensors: `{consolidate(path.parent)}`")
        ckpt = replace(ckpt, notes=(*ckpt.notes, note),
                       distributed={"format": "torch.distributed.checkpoint", "shard_of": str(path.parent)})
    return ckpt


def _read(path: Path, survey: Survey) -> Checkpoint:
    kind = survey.container
    if kind is Container.EMPTY:
        raise ReadError(f"{path}: file is empty (0 bytes)")
    if kind is Container.ZIP and survey.items:
        from .dcp import read_dcp_shard

        return read_dcp_shard(path, survey)
    if kind is Container.ZIP:
        from .torch_zip import read_torch_zip

        _check_torch_zip(path, survey)
        return read_torch_zip(path, survey)
    if kind is Container.TAR:
        from .torch_tar import MEMBERS, read_torch_tar

        layout = survey.tar
        if layout is not None and not layout.refused and not any(m in layout.members for m in MEMBERS):
            names = list(layout.members)
            raise NotACheckpoint(f"{path}: not a PyTorch checkpoint: a tar archive of {_some(names)}, without the "
                                 f"members {', '.join(MEMBERS)} of torch's pre-0.4 format; extract it and inspect "
                                 "what it holds")
        fd = os.open(path, os.O_RDONLY)  # (never a URL: the survey refuses a remote tar)
        try:
            return read_torch_tar(path, fd, survey.tar, (), ())
        finally:
            os.close(fd)
    if kind is Container.SAFETENSORS:
        from .safetensors_reader import read_safetensors

        from .source import close_source, open_source

        fd = open_source(path)
        try:
            return read_safetensors(path, fd, survey.size)
        finally:
            close_source(fd)
    if kind is Container.PICKLE:
        from .torch_legacy import read_torch_legacy

        _check_pickle(path, survey)
        return read_torch_legacy(path, survey)
    if kind is Container.NUMPY:
        raise NotACheckpoint(f"{path}: not a PyTorch checkpoint: {_npy_kind(survey)}")
    other = what_else(survey.head)
    if other is not None:
        raise _not_a_checkpoint(path, *other)
    if survey.size < 8:
        raise ReadError(f"{path}: only {survey.size} bytes, too short to be a checkpoint (truncated?)")
    why = describe_other(survey.head, survey.size)
    if why.startswith("no "):  # nothing any reader knows: no checkpoint, not a broken one
        raise NotACheckpoint(f"{path}: not a PyTorch checkpoint: {why}")
    raise ReadError(f"{path}: not a checkpoint: {why}")


def _not_a_checkpoint(path: Path, what: str, advice: str) -> NotACheckpoint:
    return NotACheckpoint(f"{path}: not a PyTorch checkpoint: {what}" + (f"; {advice}" if advice else ""))


def _some(names: list[str], shown: int = 3) -> str:
    """`2 files (a.txt, dir/b.txt)`, at most `shown` named."""
    listed = ", ".join(repr(n) if not n.isprintable() else n for n in names[:shown])
    more = ", …" if len(names) > shown else ""
    return f"{len(names)} file{'s' if len(names) != 1 else ''} ({listed}{more})"


def _check_torch_zip(path: Path, survey: Survey) -> None:
    """A zip that holds nothing of torch's layout (no data.pkl, constants.pkl or version record in a folder) is no
    checkpoint, broken or not: NumPy's .npz, or any other archive."""
    index = survey.zip
    if index is None:
        return  # the archive itself is broken: the torch reader says how
    torch_records = {"data.pkl", "constants.pkl", "version", ".data/version"}
    if any("/" in m.name and m.name.split("/", 1)[1].lower() in torch_records for m in index.members):
        return
    names = [m.name for m in index.members if not m.is_dir]
    if names and all(n.lower().endswith(".npy") for n in names):
        arrays = _some([n[:-4] for n in names]).replace("file", "array")
        if survey.findings or survey.hazards:  # what it would run is said after this
            how = "numpy.load(..., allow_pickle=True) unpickles its arrays of Python objects"
        elif survey.globals:
            how = ("load it with numpy.load (allow_pickle=True for its arrays of Python objects: every global their "
                   "pickles name is on the allow-list)")
        else:
            how = "load it with numpy.load"
        raise NotACheckpoint(f"{path}: not a PyTorch checkpoint: a NumPy .npz archive of {arrays}; {how}")
    raise NotACheckpoint(f"{path}: not a PyTorch checkpoint: a zip archive of {_some(names)}, without torch's layout "
                         "(a folder holding data.pkl); extract it and inspect what it holds")


def _check_pickle(path: Path, survey: Survey, known_only: bool = False) -> None:
    """A file whose first byte is a pickle opcode but which CPython's unpickler rejects before it looks up anything
    (text, an image, an HDF5 file) is named as what it is: torch.load reads no pickle from it. A pickle that ends
    early after its first bytes (it starts with PROTO, or the data ran out) is left to the reader: a broken one.
    known_only: only a file whose bytes say what it is (a refused walk of anything else stays refused)."""
    walked = survey.main_walk
    if walked is None or survey.globals or survey.hazards:
        return  # it names globals: a pickle (that may break off later), judged as one
    first_end = walked.pickles[0][1] if walked.pickles else None
    stops = walked.unresolved is not None and (first_end is None or walked.unresolved[0] < first_end)
    if first_end is not None and not stops:
        return  # a whole pickle
    other = what_else(survey.head)
    if other is not None:
        raise _not_a_checkpoint(path, *other)
    if known_only or survey.head[:1] == b"\x80" or walked.truncated and not stops:
        return
    known = describe_other(survey.head, survey.size)
    if not known.startswith("no "):  # a cut safetensors file whose length's first byte is an opcode
        raise ReadError(f"{path}: not a checkpoint: {known}")
    why = walked.unresolved[1] if stops and walked.unresolved else walked.broken
    raise NotACheckpoint(f"{path}: not a PyTorch checkpoint, nor a pickle torch.load could read: "
                         f"{str(why).split(': ', 1)[-1]}")


def _npy_kind(survey: Survey) -> str:
    """`a NumPy array (.npy, float32, shape (2, 3)); load it with numpy.load`, from the header (a Python literal,
    read with ast.literal_eval, which evaluates nothing)."""
    head = survey.head
    dtype, shape = None, None
    try:
        import ast

        size, start = ((int.from_bytes(head[8:10], "little"), 10) if head[6] == 1 else
                       (int.from_bytes(head[8:12], "little"), 12))
        header = ast.literal_eval(head[start:start + size].decode("latin-1"))
        dtype, shape = header.get("descr"), header.get("shape")
    except (ValueError, SyntaxError, MemoryError, RecursionError, UnicodeError, IndexError, AttributeError):
        pass
    if survey.findings or survey.hazards:  # what it would run is said after this
        return "a NumPy array of Python objects (.npy): numpy.load(..., allow_pickle=True) unpickles it"
    if survey.globals:  # an object array: a pickle, walked as one
        return ("a NumPy array of Python objects (.npy), a pickle whose globals are all on the allow-list; load it "
                "with numpy.load(..., allow_pickle=True)")
    parts = [".npy"]
    if isinstance(dtype, str):
        parts.append(_NPY_DTYPES.get(dtype.lstrip("<>|="), dtype))
    if isinstance(shape, tuple):
        parts.append(f"shape {shape}")
    return f"a NumPy array ({', '.join(parts)}); load it with numpy.load"


_NPY_DTYPES = {"f2": "float16", "f4": "float32", "f8": "float64", "i1": "int8", "i2": "int16", "i4": "int32",
               "i8": "int64", "u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64", "b1": "bool",
               "c8": "complex64", "c16": "complex128", "O": "object"}


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
    files = [p for p in entries if _looks_like_checkpoint(p)]
    for preferred in ("model.safetensors", "pytorch_model.bin", "diffusion_pytorch_model.safetensors"):
        for p in files:
            if p.name == preferred:
                return p, files
    # a file named as a checkpoint whose bytes are none and name no other format (a git-lfs pointer, a web page) is
    # never passed over in silence for the one beside it: the folder is listed, that file with its error. One whose
    # bytes say what else it is (Core ML's weight.bin, an HDF5 file) is not a checkpoint gone missing.
    named = [p for p in entries if p not in files and named_as_checkpoint(p, tar_archive=True) and not _other(p)]
    if named and files:
        return None, sorted(files + named)
    return (files[0] if len(files) == 1 else None), files


def _looks_like_checkpoint(path: Path) -> bool:
    """By content (the sniffer), whatever the name: a zip whose first member is in a folder (torch's layout), a
    tar, safetensors, or a pickle — one that starts with PROTO, or any pickle under a checkpoint's usual suffix (text
    files can start with an opcode letter)."""
    from ..sniff import sniff

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return path.name.endswith(CHECKPOINT_SUFFIXES)  # report it when it is opened, do not hide it
    try:
        kind, head = sniff(fd, os.fstat(fd).st_size)
    except OSError:  # unreadable (EIO): report it when it is opened, do not hide it
        return path.name.endswith(CHECKPOINT_SUFFIXES)
    finally:
        os.close(fd)
    if kind is Container.ZIP:  # torch's reader needs its first member in a folder: an .npz or a plain zip is none
        name_length = int.from_bytes(head[26:28], "little")
        return b"/" in head[30:30 + name_length] or len(head) < 30 + name_length
    if kind in (Container.TAR, Container.SAFETENSORS):
        return True
    return kind is Container.PICKLE and (head[:1] == b"\x80" or path.name.endswith(CHECKPOINT_SUFFIXES))


def _other(path: Path) -> bool:
    """Whether a file's first bytes name another format (sniff.other_format)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD)
    except OSError:
        return False  # reported when it is opened
    return other_format(head)


def _accelerate_fsdp_model(folder: Path, names: list[str]) -> Path | None:
    """accelerate's save_state with FSDP's sharded state dict: `pytorch_model_fsdp_0/` (a DCP folder) beside
    `optimizer_0/`, the scheduler and random states. The model's folder, when there is exactly one."""
    from .dcp import is_dcp_folder

    found = [folder / n for n in names if re.fullmatch(r"pytorch_model_fsdp_\d+", n) and (folder / n).is_dir()]
    if len(found) != 1:
        return None
    try:
        return found[0] if is_dcp_folder(os.listdir(found[0])) else None
    except OSError:
        return None


def is_one_checkpoint(folder: Path, names: list[str]) -> bool:
    """Whether read_folder reads `folder` as one checkpoint of several files (a shard index, a DCP, DeepSpeed or
    accelerate FSDP folder), asked with the same tests it uses."""
    from .dcp import hf_shard_files, is_dcp_folder
    from .deepspeed import find_tag_folder

    return (is_dcp_folder(names) or any(n.endswith(".index.json") for n in names)
            or bool(hf_shard_files(folder, names)) or _accelerate_fsdp_model(folder, names) is not None
            or find_tag_folder(folder, names) is not None)


def read_folder(folder: Path) -> Checkpoint:
    from .dcp import is_dcp_folder, read_dcp

    try:
        names = os.listdir(folder)
    except PermissionError:
        raise ReadError(f"{folder}: permission denied (cannot list the folder)") from None
    if is_dcp_folder(names):
        return read_dcp(folder, names)
    from .dcp import hf_shard_files, read_hf_shards

    hf_shards = hf_shard_files(folder, names)
    if hf_shards:
        return read_hf_shards(folder, hf_shards)
    fsdp = _accelerate_fsdp_model(folder, names)
    if fsdp is not None:  # accelerate's save_state under FSDP: the model is a DCP folder of its own
        ckpt = read_dcp(fsdp, os.listdir(fsdp))
        note = (f"accelerate save_state folder (FSDP): the model is read from {fsdp.name}/; the optimizer, "
                "scheduler and random states beside it can be inspected by name")
        return replace(ckpt, notes=(note, *ckpt.notes))
    from .deepspeed import find_tag_folder, read_deepspeed

    tag_dir = find_tag_folder(folder, names)
    if tag_dir is not None:
        return read_deepspeed(folder, tag_dir)
    chosen, candidates = find_in_folder(folder)
    if chosen is None:
        if not candidates:
            from ..listing import checkpoint_paths

            below = []  # checkpoints at any depth (inspect lists them all; the others name them)
            for p in checkpoint_paths(folder)[0]:
                if p.is_dir() or _looks_like_checkpoint(p):
                    below.append(p)
                    if len(below) == 4:
                        break
            if below:
                names = ", ".join(str(p.relative_to(folder)) for p in below)
                raise SeveralCheckpoints(f"{folder}: folder holds no checkpoint at its top level, but its subfolders "
                                         f"do ({names}); name one, e.g. ckpt-doctor inspect {below[0]}", folder)
            raise ReadError(f"{folder}: folder holds no checkpoint (no *.index.json, and no file whose bytes are a "
                            "torch zip, tar, pickle or safetensors)")
        names = ", ".join(p.name for p in candidates[:5])
        raise SeveralCheckpoints(f"{folder}: folder holds {len(candidates)} checkpoints ({names}); name the file to "
                                 "open", folder)
    ckpt = read_sharded(chosen) if chosen.name.endswith(".index.json") else read_file(chosen)
    if "optimizer.bin" in names and any(n.startswith("random_states_") for n in names):
        note = (f"accelerate save_state folder: the model is {chosen.name}; optimizer.bin (an optimizer's "
                "state_dict), the scheduler and random states beside it can be inspected by name")
        ckpt = replace(ckpt, notes=(note, *ckpt.notes))
    return ckpt


def read_json(path: Path, what: str, max_bytes: int) -> object:
    """A JSON file, every failure a ReadError: too big, not UTF-8, not JSON, nested too deep, numbers too long."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise ReadError(f"{path}: {what} of {size:,} bytes, over the {max_bytes >> 20} MB limit")
        return parse_json(path.read_bytes(), path, what)
    except OSError as exc:
        raise ReadError(f"{path}: cannot be read ({exc.strerror})") from None


def parse_json(raw: bytes, path: Path, what: str) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ReadError(f"{path}: {what} is not UTF-8") from None
    depth = _json_depth(text)
    if depth > limits.MAX_JSON_DEPTH:
        raise ReadError(f"{path}: {what} nests {depth} levels deep; JSON readers stop at {limits.MAX_JSON_DEPTH}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReadError(f"{path}: {what} is not valid JSON ({exc.msg} at {exc.pos})") from None
    except (ValueError, RecursionError) as exc:  # an integer of thousands of digits
        raise ReadError(f"{path}: {what} holds a value no JSON reader accepts ({str(exc)[:80]})") from None
    if _has_lone_surrogate(value, text):
        raise ReadError(f"{path}: {what} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which JSON readers refuse")
    return value


def _json_depth(text: str) -> int:
    """How deep brackets nest (strings skipped), without recursion: a 200,000-deep header must not crash the parser.
    The strings and everything but brackets are cut out by one regex, and the depth is the highest running sum."""
    if text.count("[") + text.count("{") <= limits.MAX_JSON_DEPTH:
        return 0
    import re
    from itertools import accumulate

    # a string (an unterminated one runs to the end, as a parser reads it), or any run of other non-bracket text
    brackets = re.sub(r'"[^"\\]*(?:\\(?:.|$)[^"\\]*)*(?:"|$)|[^"\[\]{}]+', "", text, flags=re.S)
    return max(accumulate(1 if ch in "[{" else -1 for ch in brackets), default=0)


def _has_lone_surrogate(value: object, text: str) -> bool:
    """Text decoded from UTF-8 holds no surrogate: one can only come from a \\uD800-\\uDFFF escape, so the values
    are walked only when the text has one (a pair that makes one character is fine)."""
    import re

    if not re.search(r"\\u[dD][89a-fA-F]", text):
        return False
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def read_sharded(index_path: Path) -> Checkpoint:
    index = read_json(index_path, "shard index", limits.MAX_INDEX_BYTES)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ReadError(f"{index_path}: not a shard index (needs a JSON object with a weight_map)")
    folder = index_path.parent
    shards: dict[str, Checkpoint] = {}
    for shard in dict.fromkeys(weight_map.values()):
        if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard.startswith(".."):
            raise ReadError(f"{index_path}: weight_map names shard {str(shard)[:80]!r}, which is not a file name")
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
                      notes=tuple(dict.fromkeys(notes)), files=(index_path, *(c.path for c in shards.values())),
                      hazards=tuple(h for c in shards.values() for h in c.hazards))
