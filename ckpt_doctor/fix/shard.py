"""--max-shard-size: a plan split into shards of whole storages, each written and verified as one file, then the
index naming them (as Hugging Face shards a model)."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

from .._record import replace
from ..errors import PlanError, Rerun, WriteError
from ..records import OutTensor
from ..writers.atomic import atomic_output, check_destination, staged_outputs
from ..writers.stream import write_bytes
from .execute import execute
from .results import FixPlan, FixResult, converted_nbytes

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Callable


def shard_paths(output: Path, count: int) -> tuple[list[Path], Path]:
    """`model.safetensors` -> model-00001-of-00003.safetensors …, and model.safetensors.index.json."""
    stem, suffix = output.name.rsplit(".", 1) if "." in output.name else (output.name, "")
    dot = "." + suffix if suffix else ""
    shards = [output.with_name(f"{stem}-{i:05d}-of-{count:05d}{dot}") for i in range(1, count + 1)]
    return shards, output.with_name(output.name + ".index.json")


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
                              force: bool) -> bool:
    """Each shard's and the index's destination (check_destination), and `output` itself: a file there from before
    would stay beside the index, where a loader that looks for it first (transformers takes model.safetensors
    before model.safetensors.index.json) reads the old weights. It is refused, or with --force replaced (removed
    once the index is written): returns whether it is to be removed."""
    for path in (*shards, index):
        check_destination(path, inputs, force)
    if not (output.is_file() or output.is_symlink()):
        return False
    check_destination(output, inputs, force=True)  # (never an input)
    if not force:
        raise WriteError(f"{output}: already exists, and a sharded write would leave it beside {index.name}, where a "
                         f"loader that looks for {output.name} first reads the old file; replace it with {{0}}",
                         reruns=(Rerun(add=("--force",)),))
    return True


def execute_sharded(plan: FixPlan, max_bytes: int, progress_callback: Callable[[int, int], None] | None = None,
                    verify: bool = True, force: bool = False) -> FixResult:
    """Write shards, each verified, then the index, all renamed into place once every one is written (the index
    last, so an index only ever names whole shards): a failure leaves none of them, and what --force would have
    replaced as it was."""
    parts = split_plan(plan, max_bytes)
    shards, index_path = shard_paths(plan.output, len(parts))
    inputs = (plan.input, *{t.source.storage.file for t in plan.tensors if t.source.storage})
    stale = check_sharded_destination(plan.output, shards, index_path, inputs, force)
    with staged_outputs() as staged:
        results = [execute(part, progress_callback, verify, staged=staged) for part in parts]
        weight_map = {t.key: part.output.name for part in parts for t in part.tensors if t.key not in part.tied}
        total = sum(part.nbytes for part in parts)
        index = json.dumps({"metadata": {"total_size": total, "written_by": "ckpt-doctor"},
                            "weight_map": weight_map}, indent=2).encode()
        with atomic_output(index_path, staged=staged) as (fd, _):
            write_bytes(fd, 0, index)
    if stale:
        plan.output.unlink()  # --force: the old single file goes, once the index names every shard
    return FixResult(replace(plan, output=index_path), sum(r.bytes for r in results) + len(index), verify,
                     tuple(sorted({g for r in results for g in r.unknown_globals})), tuple(shards),
                     tuple(sorted({c for r in results for c in r.dtype_classes})))

