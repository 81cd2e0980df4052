"""--max-shard-size: a plan split into shards of whole storages, each written and verified as one file, then the
index naming them (as Hugging Face shards a model)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections import OrderedDict
from pathlib import Path

from .._record import replace
from ..errors import PlanError, ReadError, Rerun, WriteError
from ..readers.jsonfile import read_json
from ..records import OutTensor
from ..safepickle import limits
from ..writers.atomic import atomic_output, check_destination, check_folder, is_input, staged_outputs
from ..writers.stream import write_bytes
from .execute import execute
from .results import FixPlan, FixResult, converted_nbytes

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Callable


def shard_paths(output: Path, count: int) -> tuple[list[Path], Path]:
    """`model.safetensors` -> model-00001-of-00003.safetensors …, and model.safetensors.index.json."""
    stem, dot = _stem_and_dot(output)
    shards = [output.with_name(f"{stem}-{i:05d}-of-{count:05d}{dot}") for i in range(1, count + 1)]
    return shards, index_path_of(output)


def index_path_of(output: Path) -> Path:
    """`model.safetensors` -> model.safetensors.index.json."""
    return output.with_name(output.name + ".index.json")


def _stem_and_dot(output: Path) -> tuple[str, str]:
    stem, suffix = output.name.rsplit(".", 1) if "." in output.name else (output.name, "")
    return stem, "." + suffix if suffix else ""


def named_shards(output: Path, index: Path, inputs: tuple[Path, ...]) -> list[Path]:
    """The files an existing index of `output`'s name names that are shards of it: in its folder, named as
    shard_paths names them (NAME-0000k-of-0000N.EXT), not an input. Anything else it names (another folder,
    `../../etc/passwd`, another name) is left alone; an index that cannot be read names none."""
    return [p for p in _index_shards(output, index) if not is_input(p, inputs)]


def _index_shards(output: Path, index: Path) -> list[Path]:
    stem, dot = _stem_and_dot(output)
    pattern = re.compile(re.escape(stem) + r"-\d{5,}-of-\d{5,}" + re.escape(dot))
    try:
        index_json = read_json(index, "shard index", limits.MAX_INDEX_BYTES)
    except ReadError:
        return []
    weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
    names = {n for n in weight_map.values() if isinstance(n, str)} if isinstance(weight_map, dict) else set()
    paths = [output.with_name(n) for n in sorted(names) if pattern.fullmatch(n)]
    return [p for p in paths if _file_or_link(p)]


def _file_or_link(path: Path) -> bool:
    """Whether `path` is there and not a folder (a link goes itself, never what it points to); a name too long to
    exist is not there."""
    try:
        return not stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def check_index_beside(output: Path, inputs: tuple[Path, ...], force: bool) -> list[Path]:
    """A single file written where an index of its name (NAME.EXT.index.json, an earlier sharded output) exists: a
    loader that follows the index (inspect of the folder does) reads its old shards, not the new file. It is
    refused, or with --force replaced: returns the index and its shards (named_shards), to be removed once the file
    is written, the index first."""
    index = index_path_of(output)
    if not _file_or_link(index):  # anything there but a folder (a FIFO, a link to /dev/zero): named, never read
        return []
    if is_input(index, inputs):
        raise WriteError(f"{output}: {index.name} beside it is the input, which a loader that follows it would read "
                         "instead of the new file; the input is never modified — write elsewhere")
    shards = _index_shards(output, index)
    if any(is_input(p, inputs) for p in shards):  # the input's own model, not an earlier output
        raise WriteError(f"{output}: {index.name} beside it names the input as one of its shards: it is the model the "
                         "input belongs to, which --force would take apart; the input is never modified — write "
                         "elsewhere")
    if not force:
        raise WriteError(f"{output}: {index.name} already exists beside it (an earlier sharded output), and a loader "
                         f"that follows the index reads its shards, not {output.name}; replace them with {{0}}",
                         reruns=(Rerun(add=("--force",)),))
    return [index, *shards]  # (none of them an input: named_shards's, read once)


def remove_stale(paths: list[Path]) -> tuple[Path, ...]:
    """--force: what an earlier output left that the new one, now written, replaces (in the order given); what was
    there to remove, for the summary to name."""
    removed = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return tuple(removed)


def split_plan(plan: FixPlan, max_bytes: int) -> list[FixPlan]:
    """Consecutive groups of tensors under `max_bytes` each; tensors sharing a storage stay in one shard."""
    if not isinstance(plan.tree, OrderedDict) or any(t.key not in plan.tree for t in plan.tensors):
        raise PlanError("--max-shard-size writes a state_dict: add --select (e.g. --select state_dict)")
    groups: list[list[OutTensor]] = []
    where: dict[tuple[str, str], int] = {}
    size = 0
    for t in plan.tensors:
        st = t.source.storage
        ident = st.ident if st else ("", t.key)
        if ident in where:
            groups[where[ident]].append(t)
            continue
        nbytes = converted_nbytes(st.nbytes, t.source.dtype, t.dtype) if st else 0
        if not groups or (size + nbytes > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(t)
        where[ident] = len(groups) - 1
        size += nbytes
    shards, _ = shard_paths(plan.output, len(groups))
    plans = []
    for path, members in zip(shards, groups):
        keys = {t.key for t in members}
        plans.append(replace(plan, output=path, tensors=tuple(members),
                             tree=OrderedDict((k, v) for k, v in plan.tree.items() if k in keys),
                             tied={d: k for d, k in plan.tied.items() if d in keys and k in keys}))
    return plans


def check_sharded_destination(output: Path, shards: list[Path], index: Path, inputs: tuple[Path, ...],
                              force: bool) -> list[Path]:
    """Each shard's and the index's destination (check_destination), and `output` itself: a file there from before
    would stay beside the index, where a loader that looks for it first (transformers takes model.safetensors
    before model.safetensors.index.json) reads the old weights. It is refused, or with --force replaced. Returns
    what is to be removed once the index is written: that file, and the shards an earlier index of this name names
    (named_shards) that the new ones do not replace."""
    check_folder(output)  # said of the OUT given, not of a shard name the user never typed
    for path in (*shards, index):
        check_destination(path, inputs, force)
    stale = [p for p in named_shards(output, index, inputs) if p not in shards] if index.is_file() else []
    if not (output.is_file() or output.is_symlink()):
        return stale
    check_destination(output, inputs, force=True)  # (never an input)
    if not force:
        raise WriteError(f"{output}: already exists, and a sharded write would leave it beside {index.name}, where a "
                         f"loader that looks for {output.name} first reads the old file; replace it with {{0}}",
                         reruns=(Rerun(add=("--force",)),))
    return [output, *stale]


def execute_sharded(plan: FixPlan, max_bytes: int, progress_callback: Callable[[int, int], None] | None = None,
                    verify: bool = True, force: bool = False) -> FixResult:
    """Write shards, each verified, then the index, all renamed into place once every one is written (the index
    last, so an index only ever names whole shards): a failure leaves none of them, and what --force would have
    replaced as it was."""
    parts = split_plan(plan, max_bytes)
    shards, index_path = shard_paths(plan.output, len(parts))
    inputs = plan.inputs
    stale = check_sharded_destination(plan.output, shards, index_path, inputs, force)
    with staged_outputs() as staged:
        results = [execute(part, progress_callback, verify, staged=staged) for part in parts]
        weight_map = {t.key: part.output.name for part in parts for t in part.tensors if t.key not in part.tied}
        total = sum(part.nbytes for part in parts)
        index = json.dumps({"metadata": {"total_size": total, "written_by": "ckpt-doctor"},
                            "weight_map": weight_map}, indent=2).encode()
        with atomic_output(index_path, staged=staged) as (fd, _):
            write_bytes(fd, 0, index)
    removed = remove_stale(stale)  # --force: the old single file and old shards go, once the index names the new
    return FixResult(replace(plan, output=index_path), sum(r.bytes for r in results) + len(index), verify,
                     tuple(sorted({g for r in results for g in r.unknown_globals})), tuple(shards),
                     tuple(sorted({c for r in results for c in r.dtype_classes})), removed)

