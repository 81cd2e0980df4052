"""Reads meaning out of a Checkpoint: wrapper prefixes, shared storages, repeated blocks, devices."""

from __future__ import annotations

import re
from collections import defaultdict
from itertools import chain, compress, count, islice, repeat
from operator import add, itemgetter
from ._record import record

from .records import SharedGroup, TensorRecord, TensorTable
from .units import human_bytes  # noqa: F401  (re-exported for the renderers)

# Components that wrappers insert into keys: DataParallel/DDP, torch.compile, Lightning, FSDP, EMA helpers.
WRAPPER_TOKENS = ("module", "_orig_mod", "model", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
MAX_WRAPPERS = 8


@record
class PrefixFinding:
    prefix: str  # the wrapper token with its dot, e.g. "module."
    where: str  # the key part before it ("" for the outermost, "features." in the middle)
    count: int
    total: int
    leading: bool  # part of the run of prefixes every key starts with (`_orig_mod.module.`)
    # A wrapper's prefix: every key under `where` goes through it, nothing sits beside it (DataParallel, DDP,
    # torch.compile and FSDP wrap a whole module and hold nothing else). False: a possible one only, a component
    # most keys carry but not all (a partial wrap, or a real submodule of that name beside its siblings).
    certain: bool = True


# A wrapper token that is neither the first nor the last component of a key; one regex pass per key.
_MIDDLE_TOKEN = re.compile(r"\.(module|_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)(?=\.)")


def find_prefixes(keys: list[str], model_keys: list[str] | None = None) -> list[PrefixFinding]:
    """Wrapper tokens found in keys, outermost first.

    A wrapper's prefix covers every key under its parent: DataParallel/DDP put `module.` on every key, torch.compile
    `_orig_mod.` on every key of the compiled module, a wrapped submodule `features.module.` on every key under
    `features.`. A component of that name with siblings beside it (`self.module = net` next to `self.head`) is a
    real submodule: in the middle of keys it is not reported; leading, on most keys, it is reported as possible
    only. With `model_keys`, a component the model holds itself at that place is real and not reported."""
    total = len(keys)
    if not total:
        return []
    findings: list[PrefixFinding] = []
    # Leading prefixes, peeled repeatedly: `_orig_mod.module.fc.weight` gives `_orig_mod.` then `module.`. Real
    # wrappers stack a few deep; a file that nests `module.` hundreds of times is not peeled past MAX_WRAPPERS.
    where = ""
    for _ in range(MAX_WRAPPERS):
        for token in WRAPPER_TOKENS:
            head = where + token + "."
            if all(k.startswith(head) and len(k) > len(head) for k in keys):
                findings.append(PrefixFinding(token + ".", where, total, total, True))
                where = head
                break
        else:
            break
    cut = len(where)
    # The keys as one text, each after a line break, when none holds one: a count of "\nmodule." in it is the count
    # of keys that start with `module.`, at the speed of a scan.
    joined = "\n" + "\n".join(keys)
    if joined.count("\n") != total:
        joined = None
    # Wrapper tokens in the middle (features.module.0.weight), only for tokens that are never real layer names:
    # the first few of each key, in keys of a sensible length.
    middle: dict[tuple[str, str], int] = defaultdict(int)
    for key in keys if joined is None or "mod" in joined else ():  # every token holds "mod"
        if len(key) - cut > 1024 or key.find("mod", cut) < 0:  # every token holds "mod": most keys need no regex
            continue
        for i, m in enumerate(_MIDDLE_TOKEN.finditer(key, cut)):
            if i == 4:
                break
            middle[(key[cut:m.start() + 1], m.group(1) + ".")] += 1
        if len(middle) > 10_000:
            break
    if middle:
        under = _keys_under(keys, {where + before for before, _ in middle})
        for (before, token), count in middle.items():
            if count == under[where + before]:  # nothing beside it under its parent: a wrapper's
                findings.append(PrefixFinding(token, where + before, count, total, False))
    if not findings:
        # A prefix most (not all) keys share may be a partial wrap or a Lightning `model.` beside a loss's weight,
        # or a submodule of that name: possible, not certain.
        for token in WRAPPER_TOKENS:
            count = joined.count("\n" + token + ".") if joined is not None else \
                sum(map(str.startswith, keys, repeat(token + ".")))  # keys whose first component it is
            if count and count * 2 >= total:
                findings.append(PrefixFinding(token + ".", "", count, total, True, certain=False))
    if model_keys and findings:
        findings = [f for f in findings if not _held_by(f, keys, model_keys)]
    return findings


def _held_by(finding: PrefixFinding, keys: list[str], model_keys: list[str]) -> bool:
    """Whether the model has this component itself: some of its keys hold it at that place, and the keys that carry
    it match the model's at least as well as they are as with it taken out (`module.module.fc.weight` against a
    model with `module.fc.weight`: the outer one is the wrapper)."""
    head = finding.where + finding.prefix
    if not _keys_under(model_keys, {head})[head]:
        return False
    names = set(model_keys)
    cut = len(finding.where)
    under = [k for k in keys if k.startswith(head)]
    as_they_are = sum(k in names for k in under)
    without = sum((k[:cut] + k[len(head):]) in names for k in under)
    return as_they_are >= without


def _keys_under(keys: list[str], parents: set[str]) -> dict[str, int]:
    """How many keys start with each of these prefixes (each ending in a dot; "" for all): one sort, two bisections
    a prefix."""
    from bisect import bisect_left

    ordered = sorted(keys)
    # The keys starting with `p.` sit together in sorted order, before `p/` (the character after the dot).
    return {p: (bisect_left(ordered, p[:-1] + "/") - bisect_left(ordered, p)) if p else len(keys) for p in parents}


def shared_groups(tensors: tuple[TensorRecord, ...] | list[TensorRecord] | TensorTable) -> list[SharedGroup]:
    """Tensors reading one storage: tied weights (same bytes) or views (different parts)."""
    table = TensorTable.of(tensors)
    if not table.shares_storages():
        return []
    by_storage: dict[tuple, list[int]] = {}
    for i, ident in enumerate(table.storage_idents()):
        if ident is not None:
            members = by_storage.get(ident)
            if members is None:
                by_storage[ident] = [i]
            else:
                members.append(i)
    groups = []
    keys = table.keys
    for (_, key), members in by_storage.items():
        if len(members) > 1:
            shapes, strides, offsets, dtypes = table.shapes, table.strides, table.offsets, table.dtypes
            first = members[0]
            same = all((offsets[m], shapes[m], strides[m], dtypes[m]) ==
                       (offsets[first], shapes[first], strides[first], dtypes[first]) for m in members)
            groups.append(SharedGroup(key, tuple(keys[m] for m in members), same))
    return groups


_NUM = re.compile(r"(?<![^.])(\d+)(?=\.|$)")


@record
class Row:
    """One line of the table: a tensor, or a block of tensors that differ only by one index."""

    label: str
    tensors: tuple[TensorRecord, ...]

    @property
    def first(self) -> TensorRecord:
        return self.tensors[0]


def collapse(tensors: list[TensorRecord]) -> list[Row]:
    """`layers.{0..23}.attn.q.weight`: rows equal but for one index (same shape, dtype, device) become one."""
    groups = collapse_labels([t.key for t in tensors], [(t.shape, t.dtype, t.device) for t in tensors])
    return [Row(label, tuple(tensors[i] for i in members)) for label, members in groups]


def collapse_labels(labels: list[str], signatures: list[tuple]) -> list[tuple[str, list[int]]]:
    """Groups of positions whose labels differ by one numeric component and whose signatures are equal.

    Applied until nothing changes, so `blocks.{0..3}.layers.{0..2}.w` comes out of two passes. A group of
    fewer than three stays as separate rows, in place.
    """
    labels, signatures = list(labels), list(signatures)
    n = min(len(labels), len(signatures))
    del labels[n:], signatures[n:]
    rows = _merged(labels, None, signatures)  # the first pass, on the columns: each row a position of its own
    if rows is None:
        return [(label, [i]) for i, label in enumerate(labels)]
    while True:
        merged = _collapse_once(rows)
        if len(merged) == len(rows):
            return [(label, members) for label, members, _ in merged]
        rows = merged


def _collapse_once(rows: list[tuple[str, list[int], tuple]]) -> list[tuple[str, list[int], tuple]]:
    labels, memberships, signatures = (list(map(itemgetter(i), rows)) for i in range(3))  # not zip(*rows): an
    # iterator per row
    return _merged(labels, memberships, signatures) or rows


def _merged(labels: list[str], memberships: list[list[int]] | None,
            signatures: list[tuple]) -> list[tuple[str, list[int], tuple]] | None:
    """One pass of collapse_labels over its rows as columns (memberships None: row i is position i alone): the rows
    after it, or None when nothing merges."""
    n = len(labels)
    joined = "\n".join(labels)
    found_in = _FIRST_NUM.findall(joined) if joined.count("\n") == n - 1 else ()
    if len(found_in) != n:  # a label with a line break: each searched on its own
        rows = list(zip(labels, memberships or ([i] for i in range(n)), signatures))
        merged = _collapse_each(rows)
        return None if len(merged) == n else merged
    # Each label's first numeric component, by one pass over them all: (what is before it, its digits, what is after
    # it), ("", "", "") for a label without one. The label with it cut out, its signature and its row's size make
    # its group's key. Every step a loop in C but the grouping.
    heads, digits, tails = (list(map(itemgetter(i), found_in)) for i in range(3))
    del found_in
    numbered = list(map(bool, digits))
    patterns = map(add, map(add, heads, repeat("\0")), tails)
    keys = zip(patterns, signatures) if memberships is None else \
        zip(patterns, signatures, map(len, memberships))
    groups: dict[tuple, list[int]] = {}  # key -> row positions, in order of first row
    for key, pos in zip(compress(keys, numbered), compress(count(), numbered)):
        found = groups.get(key)
        if found is None:
            groups[key] = [pos]
        else:
            found.append(pos)
    merged_at: dict[int, tuple[str, list[int], tuple]] = {}
    absorbed: set[int] = set()
    for key, found in groups.items():
        if len(found) < 3:
            continue
        label = key[0].replace("\0", "{" + _index_range(list(map(int, map(digits.__getitem__, found)))) + "}")
        members = found if memberships is None else list(chain.from_iterable(map(memberships.__getitem__, found)))
        merged_at[found[0]] = (label, members, key[1])
        absorbed.update(islice(found, 1, None))
    if not merged_at:
        return None
    return [merged_at.get(pos) or (labels[pos], [pos] if memberships is None else memberships[pos], signatures[pos])
            for pos in sorted(set(range(n)).difference(absorbed))]


# A label's first numeric component (one whole component of digits), found for every label of a joined text at once:
# the components before it, lazily, its digits up to a dot or the label's end, the rest of the label; else the empty
# match.
_FIRST_NUM = re.compile(r"^((?:[^.\n]*\.)*?)(\d+)((?![^.\n])[^\n]*)|^", re.MULTILINE)


def _collapse_each(rows: list[tuple[str, list[int], tuple]]) -> list[tuple[str, list[int], tuple]]:
    """_collapse_once with a search of each label (one holds a line break, which the joined text cannot)."""
    groups: dict[tuple, list[tuple[int, int]]] = {}  # key -> [(index value, row position)], in order of first row
    search = _NUM.search
    for pos, (label, members, sig) in enumerate(rows):
        m = search(label)
        if m is None:
            continue
        start, end = m.span()
        key = (label[:start] + "\0" + label[end:], sig, len(members))
        found = groups.get(key)
        if found is None:
            groups[key] = [(int(label[start:end]), pos)]
        else:
            found.append((int(label[start:end]), pos))
    merged_at: dict[int, tuple[str, list[int], tuple]] = {}
    absorbed: set[int] = set()
    for (pattern, sig, _), found in groups.items():
        if len(found) < 3:
            continue
        label = pattern.replace("\0", "{" + _index_range([i for i, _ in found]) + "}")
        merged_at[found[0][1]] = (label, [m for _, pos in found for m in rows[pos][1]], sig)
        absorbed.update(pos for _, pos in found[1:])
    if not merged_at:
        return rows
    return [merged_at.get(pos, row) for pos, row in enumerate(rows) if pos not in absorbed]


def _index_range(indices: list[int]) -> str:
    """`0..23`, `0,2,4`, or for long irregular runs the first three and the last: a label stays short however
    many rows it stands for (an ever longer label would widen every row of the table)."""
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return f"{indices[0]}..{indices[-1]}"
    if len(indices) <= 6:
        return ",".join(map(str, indices))
    return f"{indices[0]},{indices[1]},{indices[2]},…,{indices[-1]}"
