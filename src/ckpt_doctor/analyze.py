"""Reads meaning out of a Checkpoint: wrapper prefixes, shared storages, repeated blocks, devices."""

from __future__ import annotations

import re
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

from .records import Checkpoint, SharedGroup, TensorRecord

# Components that wrappers insert into keys: DataParallel/DDP, torch.compile, Lightning, FSDP, EMA helpers.
WRAPPER_TOKENS = ("module", "_orig_mod", "model", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


@dataclass(frozen=True)
class PrefixFinding:
    prefix: str  # the wrapper token with its dot, e.g. "module."
    where: str  # the key part before it ("" for a leading prefix, "features." in the middle)
    count: int
    total: int

    @property
    def leading(self) -> bool:
        return self.where == ""


def find_prefixes(keys: list[str]) -> list[PrefixFinding]:
    """Wrapper tokens found in keys, outermost first. A leading `model.` counts only if every key has it."""
    total = len(keys)
    if not total:
        return []
    findings: list[PrefixFinding] = []
    # Leading prefixes, peeled repeatedly: `_orig_mod.module.fc.weight` gives `_orig_mod.` then `module.`.
    rest = list(keys)
    where = ""
    while True:
        for token in WRAPPER_TOKENS:
            head = token + "."
            if all(k.startswith(head) for k in rest) and all(len(k) > len(head) for k in rest):
                findings.append(PrefixFinding(head, where, total, total))
                rest = [k[len(head):] for k in rest]
                where += head
                break
        else:
            break
    # Wrapper tokens in the middle (features.module.0.weight), only for tokens that are never real layer names.
    middle: dict[tuple[str, str], int] = defaultdict(int)
    for key in rest:
        parts = key.split(".")
        for i in range(1, len(parts) - 1):
            if parts[i] in ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"):
                middle[(".".join(parts[:i]) + ".", parts[i] + ".")] += 1
    for (before, token), count in middle.items():
        findings.append(PrefixFinding(token, where + before, count, total))
    if not findings:
        # A prefix most (not all) keys share is still worth saying: a partial wrap, or a Lightning `model.`.
        for token in WRAPPER_TOKENS:
            count = sum(k.startswith(token + ".") for k in rest)
            if count and count * 2 >= total:
                findings.append(PrefixFinding(token + ".", "", count, total))
    return findings


def shared_groups(tensors: tuple[TensorRecord, ...] | list[TensorRecord]) -> list[SharedGroup]:
    """Tensors reading one storage: tied weights (same bytes) or views (different parts)."""
    by_storage: "OrderedDict[tuple, list[TensorRecord]]" = OrderedDict()
    for t in tensors:
        if t.storage is not None:
            by_storage.setdefault((str(t.storage.file), t.storage.key), []).append(t)
    groups = []
    for (_, key), members in by_storage.items():
        if len(members) > 1:
            first = members[0]
            same = all((m.storage_offset, m.shape, m.stride, m.dtype) ==
                       (first.storage_offset, first.shape, first.stride, first.dtype) for m in members)
            groups.append(SharedGroup(key, tuple(m.key for m in members), same))
    return groups


_NUM = re.compile(r"(?<![^.])(\d+)(?=\.|$)")


@dataclass(frozen=True)
class Row:
    """One line of the table: a tensor, or a block of tensors that differ only by one index."""

    label: str
    tensors: tuple[TensorRecord, ...]

    @property
    def first(self) -> TensorRecord:
        return self.tensors[0]


def collapse(tensors: list[TensorRecord]) -> list[Row]:
    """`layers.{0..23}.attn.q.weight`: rows equal but for one index (same shape, dtype, device) become one."""
    rows = [Row(t.key, (t,)) for t in tensors]
    while True:
        merged = _collapse_once(rows)
        if len(merged) == len(rows):
            return merged
        rows = merged


def _collapse_once(rows: list[Row]) -> list[Row]:
    groups: "OrderedDict[tuple, list[tuple[int, int]]]" = OrderedDict()  # key -> [(index value, row position)]
    for pos, row in enumerate(rows):
        matches = list(_NUM.finditer(row.label))
        if not matches:
            continue
        m = matches[0]
        pattern = row.label[:m.start()] + "\0" + row.label[m.end():]
        t = row.first
        groups.setdefault((pattern, t.shape, t.dtype, t.device, len(row.tensors)), []).append((int(m.group(1)), pos))
    merged_at: dict[int, Row] = {}
    absorbed: set[int] = set()
    for key, members in groups.items():
        if len(members) < 3:
            continue
        label = key[0].replace("\0", "{" + _index_range([i for i, _ in members]) + "}")
        merged_at[members[0][1]] = Row(label, tuple(t for _, pos in members for t in rows[pos].tensors))
        absorbed.update(pos for _, pos in members[1:])
    return [merged_at.get(pos, row) for pos, row in enumerate(rows) if pos not in absorbed]


def _index_range(indices: list[int]) -> str:
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return f"{indices[0]}..{indices[-1]}"
    return ",".join(map(str, indices))


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def parameter_count(ckpt: Checkpoint) -> int:
    """Elements in floating tensors of the state_dict (what people mean by "parameters")."""
    from .dtypes import FLOATING

    tensors = ckpt.state_dict_tensors() or ckpt.tensors
    return sum(t.numel for t in tensors if t.dtype in FLOATING or t.dtype.startswith("complex"))
