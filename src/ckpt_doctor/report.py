"""Builds the inspect report — everything `inspect` says about a checkpoint — as one frozen result object."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .analyze import PrefixFinding, find_prefixes, parameter_count, shared_groups
from .errors import UsageError
from .readers import read_checkpoint
from .records import Checkpoint, SharedGroup, TensorRecord
from .stats import TensorStats, batchnorm_at_init, tensor_stats


@dataclass(frozen=True)
class InspectReport:
    checkpoint: Checkpoint
    tensors: tuple[TensorRecord, ...]  # after --filter
    prefixes: tuple[PrefixFinding, ...]
    shared: tuple[SharedGroup, ...]
    parameter_count: int
    total_bytes: int
    stats: dict[str, TensorStats | None] | None = None
    batchnorm_at_init: tuple[str, ...] = ()
    comparison: Any = None  # a Comparison when --model is given
    missing_devices: tuple[str, ...] = ()  # saved devices this machine lacks (known only when torch is loaded)
    filter: str | None = None
    extra_notes: tuple[str, ...] = field(default=())

    @property
    def has_problems(self) -> bool:
        bad_values = bool(self.stats) and any(s is not None and (s.nan or s.inf) for s in self.stats.values())
        return bool(self.checkpoint.unsafe_globals) or bad_values or bool(self.batchnorm_at_init)


def inspect_checkpoint(path: str | Path, *, stats: bool = False, filter: str | None = None,
                       checkpoint: Checkpoint | None = None) -> InspectReport:
    ckpt = checkpoint or read_checkpoint(path)
    tensors = ckpt.tensors
    if filter:
        try:
            pattern = re.compile(filter)
        except re.error as exc:
            raise UsageError(f"--filter {filter!r} is not a valid regular expression ({exc})") from None
        tensors = tuple(t for t in tensors if pattern.search(t.key))
    root_keys = [t.key for t in ckpt.state_dict_tensors()]
    table_stats = None
    bn: list[str] = []
    if stats:
        table_stats = {t.key: tensor_stats(t) for t in tensors}
        bn = batchnorm_at_init(list(tensors), table_stats)
    seen_storages: set[tuple[str, str]] = set()
    total = 0
    for t in ckpt.tensors:
        if t.storage is not None and (str(t.storage.file), t.storage.key) not in seen_storages:
            seen_storages.add((str(t.storage.file), t.storage.key))
            total += t.storage.nbytes
    return InspectReport(
        checkpoint=ckpt, tensors=tensors, prefixes=tuple(find_prefixes(root_keys)),
        shared=tuple(shared_groups(ckpt.tensors)), parameter_count=parameter_count(ckpt), total_bytes=total,
        stats=table_stats, batchnorm_at_init=tuple(bn), filter=filter)
