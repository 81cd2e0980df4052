"""Opens any checkpoint path — file or folder — and picks the reader from the bytes, never the extension."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from .._record import replace
from ..advice import Promise, Suggestion, consolidate, shell_path
from ..errors import ReadError, SeveralCheckpoints
from ..records import Checkpoint, DistributedShard, Format
from ..safepickle import limits
from ..safepickle.policy import DEFAULT_POLICY, Policy
from ..sniff import HEAD, Container, dangling, deep, kernel_filesystem, other_format, walk_folder
from .files import CHECKPOINT_SUFFIXES, read_container, read_surveyed
from .hfcache import is_hf_ref
from .hfcache import resolve as resolve_hf
from .jsonfile import parse_json, read_json  # noqa: F401  (re-exported: the folder readers' JSON)
from .source import (RemoteError, RemotePath, exists, is_url, list_folder, open_source, pread, real_url, redact,
                     remote_path, sibling)
from .survey import Survey, survey_file
from .table import is_checkpoint_in_folder, sniff_file


def named_as_checkpoint(path: Path, tar_archive: bool) -> bool:
    """Whether a file bears a checkpoint's name, so that something else under it is an error, not skipped (a git-lfs
    pointer as `model.pt`). `.tar` is every tar archive's name too: not a checkpoint's when `tar_archive`."""
    name = path.name.lower()
    return name.endswith(CHECKPOINT_SUFFIXES) and not (
        tar_archive and name.endswith(".tar") and not name.endswith(".pth.tar"))


def read_checkpoint(path: str | os.PathLike[str], *, policy: Policy = DEFAULT_POLICY) -> Checkpoint:
    """Read a checkpoint's structure (keys, shapes, dtypes, devices, byte ranges) without loading tensor data.
    `policy`: the allow-list its globals are judged by (`Policy.allowing([...])` adds names to the defaults)."""
    if is_url(path):  # https://, s3://: read by range requests (readers/source.py)
        return read_url(str(path) if isinstance(path, str) else real_url(path), policy=policy)
    if is_hf_ref(path):  # hf://org/name: the local cache's snapshot, resolved offline (readers/hfcache.py)
        path = resolve_hf(str(path))
    path = deep(path)  # a path of any length opens (sniff.DeepPath)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise ReadError(dangling(path)) from None
        raise ReadError(f"{path}: no such file or directory") from None
    except PermissionError:
        raise ReadError(f"{path}: permission denied") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ReadError(dangling(path)) from None
        raise ReadError(f"{path}: cannot be read ({exc.strerror})") from None

    kind = kernel_filesystem(st.st_dev)
    if kind is not None:  # /proc, /sys: files that claim terabytes, or block when read
        raise ReadError(f"{path}: on the kernel's {kind} filesystem, not a checkpoint on disk: not read")
    if stat.S_ISDIR(st.st_mode):
        return read_folder(path, policy=policy)
    if not stat.S_ISREG(st.st_mode):
        raise ReadError(f"{path}: not a regular file")
    if path.name.endswith(".index.json"):  # a shard index: the checkpoint of its shards, as its folder is read
        return read_sharded(path, policy=policy)
    return read_file(path, policy=policy)


def read_file(path: Path, survey: Survey | None = None, *, policy: Policy = DEFAULT_POLICY) -> Checkpoint:
    """One checkpoint file as a user names it: read by its container's reader (files.py), a DCP shard by the DCP
    reader, and said what it is when it is one rank's file of a distributed checkpoint. Its globals are judged by
    `policy` (a survey given carries the policy it was made under)."""
    survey = survey or survey_file(path, policy=policy)
    if survey.container is Container.ZIP and survey.items:
        from .dcp import read_dcp_shard  # the DCP reader, a big module: only for a DCP shard

        ckpt = read_surveyed(path, survey, read_dcp_shard)
    else:
        ckpt = read_surveyed(path, survey, read_container)
    if path.name.endswith("_states.pt"):
        from .deepspeed import rank_file_note  # the DeepSpeed reader: only for a file named as a rank's states

        ckpt = rank_file_note(ckpt)
    elif ckpt.format is Format.SAFETENSORS and "DCP_SHARDING_INFO" in ckpt.metadata:
        whole = consolidate(path.parent)
        note = (f"one rank's shard written by torch.distributed.checkpoint's Hugging Face storage writer: shapes are "
                f"its chunks'; inspect or fix the folder for whole tensors: `{whole.command}`")
        ckpt = replace(ckpt, notes=(*ckpt.notes, note), advice=(*ckpt.advice, ("folder", whole)),
                       distributed=DistributedShard("torch.distributed.checkpoint", str(path.parent)))
    elif ckpt.format is Format.PICKLE and path.name.endswith(".metadata") and not isinstance(path, RemotePath) \
            and _is_dcp_metadata(path, ckpt):  # (over HTTP a folder is named by its .metadata: read as the folder)
        listing = Suggestion(("inspect", shell_path(path.parent)), Promise.SHOWS, "lists the folder's whole tensors")
        note = ("the metadata of a torch.distributed.checkpoint folder (its tensors' names, global shapes and places; "
                f"their bytes are in the .distcp files beside it): inspect or fix the folder: `{listing.command}`")
        ckpt = replace(ckpt, notes=(*ckpt.notes, note), advice=(*ckpt.advice, ("folder", listing)))
    return ckpt


def _is_dcp_metadata(path: Path, ckpt: Checkpoint) -> bool:
    """Whether a bare pickle is a DCP folder's metadata: named as the DCP reader names it, torch's Metadata inside."""
    from .dcp import METADATA, RANK_METADATA  # the DCP reader, a big module: only for a file named *.metadata

    return (path.name == METADATA or RANK_METADATA.fullmatch(path.name) is not None) \
        and any(g.module == "torch.distributed.checkpoint.metadata" and g.name == "Metadata" for g in ckpt.globals)


def checkpoint_paths(folder: Path) -> tuple[list[Path], list[str], list[tuple[Path, str]]]:
    """What to list under `folder`, at any depth, walked as scan walks it (sniff.walk_folder: file links followed,
    folder links only inside the folder, special files skipped): every regular file (each is judged by
    inspect_line, which keeps the checkpoints and whatever a loader would unpickle, as scan does), every subfolder
    that is one checkpoint (a Hugging Face shard index, a DCP or DeepSpeed folder: one line, not one per shard),
    each real file once; in path order. Also the paths that could not be read, and what the walk skipped, with why."""

    walked = walk_folder(folder, whole=is_one_checkpoint, once=True)
    return sorted(walked.files, key=lambda p: p.parts), list(walked.problems), list(walked.skipped)


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
    """By content (the sniffer), whatever the name: what its container's row of readers/table.py says of a model
    folder's file (a zip whose first member is in a folder, a tar, safetensors, a pickle that starts with PROTO or
    bears a checkpoint's suffix)."""

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return path.name.endswith(CHECKPOINT_SUFFIXES)  # report it when it is opened, do not hide it
    try:
        kind, head = sniff_file(fd, os.fstat(fd).st_size)
    except OSError:  # unreadable (EIO): report it when it is opened, do not hide it
        return path.name.endswith(CHECKPOINT_SUFFIXES)
    finally:
        os.close(fd)
    return is_checkpoint_in_folder(kind, path, head)


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


# What accelerate's save_state writes beside the model: the optimizers' and schedulers' state_dicts, the samplers',
# the random states of each process, and objects registered with register_for_checkpointing
_ACCELERATE_STATES = re.compile(r"(optimizer|scheduler|sampler)(_\d+)?(\.bin)?|random_states_\d+\.pkl"
                                r"|custom_checkpoint_\d+\.pkl")


def _accelerate_states(names: list[str]) -> str:
    """`optimizer.bin, random_states_0.pkl`: the states of an accelerate save_state folder, as the folder holds them."""
    found = sorted(n for n in names if _ACCELERATE_STATES.fullmatch(n))
    return ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")


def is_one_checkpoint(folder: Path, names: list[str]) -> bool:
    """Whether read_folder reads `folder` as one checkpoint of several files (a shard index, a DCP, DeepSpeed or
    accelerate FSDP folder), asked with the same tests it uses."""
    from .dcp import hf_shard_files, is_dcp_folder  # the DCP and DeepSpeed readers: ~100 ms, only for a folder
    from .deepspeed import find_tag_folder

    return (is_dcp_folder(names) or any(n.endswith(".index.json") for n in names)
            or bool(hf_shard_files(folder, names)) or _accelerate_fsdp_model(folder, names) is not None
            or find_tag_folder(folder, names) is not None)


def read_folder(folder: Path, *, policy: Policy = DEFAULT_POLICY) -> Checkpoint:
    from .dcp import is_dcp_folder, read_dcp  # the DCP and DeepSpeed readers: ~100 ms, only for a folder

    try:
        names = os.listdir(folder)
    except PermissionError:
        raise ReadError(f"{folder}: permission denied (cannot list the folder)") from None
    if is_dcp_folder(names):
        return read_dcp(folder, names, policy=policy)
    from .dcp import hf_shard_files, read_hf_shards  # only for a folder

    hf_shards = hf_shard_files(folder, names)
    if hf_shards:
        return read_hf_shards(folder, hf_shards)
    fsdp = _accelerate_fsdp_model(folder, names)
    if fsdp is not None:  # accelerate's save_state under FSDP: the model is a DCP folder of its own
        ckpt = read_dcp(fsdp, os.listdir(fsdp), policy=policy)
        note = (f"accelerate save_state folder (FSDP): the model is read from {fsdp.name}/; beside it "
                f"{_accelerate_states(names)}, each can be inspected by name")
        return replace(ckpt, notes=(note, *ckpt.notes))
    from .deepspeed import find_tag_folder, read_deepspeed  # only for a folder

    tag_dir = find_tag_folder(folder, names)
    if tag_dir is not None:
        return read_deepspeed(folder, tag_dir, names if tag_dir == folder else None, policy=policy)
    chosen, candidates = find_in_folder(folder)
    if chosen is None:
        if not candidates:
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
    ckpt = read_sharded(chosen, policy=policy) if chosen.name.endswith(".index.json") \
        else read_file(chosen, policy=policy)
    if "optimizer.bin" in names and any(n.startswith("random_states_") for n in names):
        note = (f"accelerate save_state folder: the model is {chosen.name}; beside it {_accelerate_states(names)}, "
                "each can be inspected by name")
        ckpt = replace(ckpt, notes=(note, *ckpt.notes))
    return ckpt


# What a remote folder is read by: its shard index, else its one checkpoint file (by name: a listing says no more).
_MODEL_FILES = ("model.safetensors", "pytorch_model.bin", "diffusion_pytorch_model.safetensors")


def read_url(url: str, *, policy: Policy = DEFAULT_POLICY) -> Checkpoint:
    """A checkpoint behind a URL: a file, a shard index with its shards beside it (https:// or s3://), a DCP folder
    by its `.metadata`, a DeepSpeed folder by its `latest` or rank 0's model states, or an s3:// folder holding one
    (listed once). Only headers and directories are fetched, by range requests."""
    shown = redact(url)
    if shown.endswith(".index.json"):
        return read_sharded(remote_path(url), policy=policy)
    if shown.endswith("/.metadata"):  # a DCP folder by its metadata (https:// lists no folder): readers/dcp.py
        from .dcp import read_remote_dcp  # the DCP reader, a big module: only for a DCP folder

        return read_remote_dcp(url, policy=policy)
    if shown.endswith(("/latest", "_model_states.pt")):  # maybe a DeepSpeed folder by one of its files
        from .deepspeed import names_folder, read_remote_deepspeed  # the DeepSpeed reader: only for such a name

        if names_folder(shown):  # by its `latest` or rank 0's model states (https:// lists no folder)
            return read_remote_deepspeed(url, policy=policy)
    if not _remote_folder(shown):
        try:
            return read_file(remote_path(url), policy=policy)
        except RemoteError as exc:
            # s3://bucket/prefix: no object of that name, but maybe a folder
            if not shown.startswith("s3://") or "not found (404)" not in str(exc) or not list_folder(url + "/"):
                raise
        url, shown = url.split("?", 1)[0] + "/", shown + "/"
    names = list_folder(url)
    if not names:
        raise RemoteError(f"{shown}: not found (404): no object under this prefix")
    from .dcp import is_dcp_folder, read_remote_dcp  # the DCP reader: ~100 ms, only for a remote folder

    if is_dcp_folder(names):  # its metadata and pickled items, by range requests
        return read_remote_dcp(url, names, policy=policy)
    if "latest" in names or any(n.endswith("_states.pt") for n in names):  # a save folder or a tag folder
        from .deepspeed import read_remote_deepspeed  # the DeepSpeed reader: only for a DeepSpeed folder

        return read_remote_deepspeed(url, names, policy=policy)
    indexes = [n for n in names if n.endswith(".index.json")]
    chosen = next((n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json") if n in indexes),
                  indexes[0] if len(indexes) == 1 else None)
    if chosen is None and not indexes:
        files = [n for n in names if n.endswith(CHECKPOINT_SUFFIXES)]
        chosen = next((n for n in _MODEL_FILES if n in files), files[0] if len(files) == 1 else None)
    if chosen is None:
        some = ", ".join(names[:5]) + (", …" if len(names) > 5 else "")
        raise ReadError(f"{shown}: holds {len(names)} objects ({some}) and no one checkpoint to read (no "
                        "shard index, no model.safetensors or pytorch_model.bin); name the one to open, e.g. "
                        f"{shown}{(indexes or names)[0]}")
    path = remote_path(url + chosen)
    return read_sharded(path, policy=policy) if chosen.endswith(".index.json") else read_file(path, policy=policy)


def _remote_folder(shown: str) -> bool:
    """Whether a URL names a folder: it ends with `/` after a host or bucket (`s3://bucket/prefix/`), or it is a
    bucket alone (`s3://bucket`)."""
    rest = shown.split("://", 1)[1]
    return bool(rest.strip("/")) and not rest.startswith("/") and (
        shown.endswith("/") or shown.startswith("s3://") and "/" not in rest.strip("/"))


def remote_members(url: str, *, policy: Policy = DEFAULT_POLICY) -> list[RemotePath] | None:
    """The objects a URL stands for when scanned as a folder: a shard index's shards, a DCP or DeepSpeed folder's
    files (named by its `.metadata`, `latest` or rank 0's model states), an s3:// folder's objects (one level, and
    a DeepSpeed save folder's tag); None for a URL of one file."""
    shown = redact(url)
    if shown.endswith(".index.json"):
        index_path = remote_path(url)
        return [sibling(index_path, shard) for shard in _shard_names(index_path, _remote_index(index_path))]
    if shown.endswith("/.metadata"):  # a DCP folder by its metadata: the item files its storage_data names
        from .dcp import remote_dcp_members  # the DCP reader: only for a DCP folder

        return remote_dcp_members(url, policy=policy)
    if shown.endswith(("/latest", "_model_states.pt")):  # maybe a DeepSpeed folder by one of its files
        from .deepspeed import names_folder, remote_deepspeed_members  # the DeepSpeed reader: only for such a name

        if names_folder(shown):  # its rank files, named from rank 0's model states
            return remote_deepspeed_members(url, policy=policy)
    if _remote_folder(shown):
        base = url.split("?", 1)[0].rstrip("/") + "/"
        names = list_folder(base)
        if not names:
            raise RemoteError(f"{shown}: not found (404): no object under this prefix")
        if "latest" in names:  # a DeepSpeed save folder: its tag's objects too (S3 lists one level)
            from .deepspeed import remote_tag_names  # the DeepSpeed reader: only for a DeepSpeed folder

            names = names + remote_tag_names(remote_path(base.rstrip("/")), names)
        return [remote_path(base + name) for name in names]
    if shown.startswith("s3://") and not _object_there(url):  # s3://bucket/prefix: no object of that name, but
        base = url.split("?", 1)[0] + "/"  # maybe a folder, as read_url reads it
        if list_folder(base):
            return remote_members(base, policy=policy)
    return None  # one object (a missing one: its scan says so, in its words)


def _object_there(url: str) -> bool:
    """Whether the URL's object answers (its first request, kept for the scan); False only for a 404."""
    try:
        return exists(remote_path(url))
    except RemoteError:
        return True  # a 403, a refused connection: the scan of the object says which


def index_members(index_path: Path) -> list[Path]:
    """The shard files a local shard index names, each beside it (present or not: a missing one is reported when it
    is opened)."""
    index = read_json(index_path, "shard index", limits.MAX_INDEX_BYTES)
    return [index_path.parent / shard for shard in _shard_names(index_path, index)]


def _shard_names(index_path: Path, index: object) -> list[str]:
    """The shard files a shard index names, each a plain file name beside it."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ReadError(f"{index_path}: not a shard index (needs a JSON object with a weight_map)")
    for shard in weight_map.values():  # (each: a list or dict among them would make dict.fromkeys fail, unhashable)
        if not isinstance(shard, str) or "/" in shard or "\\" in shard or "\0" in shard or shard.startswith(".."):
            raise ReadError(f"{index_path}: weight_map names shard {str(shard)[:80]!r}, which is not a file name")
    return list(dict.fromkeys(weight_map.values()))


def _remote_index(index_path: RemotePath) -> object:
    """A shard index behind a URL, fetched whole (usually in the first request), within the same size limit."""

    src = open_source(index_path)
    if src.size > limits.MAX_INDEX_BYTES:
        raise ReadError(f"{index_path}: shard index of {src.size:,} bytes, over the "
                        f"{limits.MAX_INDEX_BYTES >> 20} MB limit")
    raw = bytearray()
    while len(raw) < src.size:
        part = pread(src, src.size - len(raw), len(raw))
        if not part:
            break
        raw += part
    return parse_json(bytes(raw), index_path, "shard index")


def read_sharded(index_path: Path, *, policy: Policy = DEFAULT_POLICY) -> Checkpoint:
    remote = isinstance(index_path, RemotePath)
    index = _remote_index(index_path) if remote else read_json(index_path, "shard index", limits.MAX_INDEX_BYTES)
    names = _shard_names(index_path, index)
    assert isinstance(index, dict)  # _shard_names checked it
    weight_map = index["weight_map"]
    folder = index_path.parent
    shards: dict[str, Checkpoint] = {}
    for shard in names:
        shard_path = sibling(index_path, shard) if remote else folder / shard
        if not shard_path.is_file():
            raise ReadError(f"{index_path}: shard {shard} is missing from {folder}")
        shards[shard] = read_file(shard_path, policy=policy)
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
    notes = [f"{len(shards)} shard{'s' if len(shards) != 1 else ''} ({', '.join(formats)})"] + [n for c in shards.values() for n in c.notes]
    return Checkpoint(path=index_path, format=Format.SHARDED, tensors=tuple(tensors), metadata=dict(metadata),
                      globals=tuple(g for c in shards.values() for g in c.globals), state_dict_root="",
                      notes=tuple(dict.fromkeys(notes)), files=(index_path, *(c.path for c in shards.values())),
                      hazards=tuple(h for c in shards.values() for h in c.hazards))
