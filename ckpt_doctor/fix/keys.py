"""The output's keys and tags: renames by position (--map-by-order), tied names (--tie), module versions carried
over the renames, and device tags rewritten (--map-location)."""

from __future__ import annotations

from collections import Counter, OrderedDict

from ..errors import PlanError, Rerun, UsageError
from ..records import OutTensor, TensorRecord, tied_names
from ..tensordata import same_values
from ..transforms import Transform, exact_keys_regex, key_problem, ordered, well_formed
from ..tree import state_dict_metadata

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Any

    from ..modelspec import ModelKeys
    from ..records import Checkpoint


def device_rule(saved: str, table: tuple[tuple[str, str], ...]) -> int | None:
    """Which --map-location rule a saved device tag follows: the first that names it (None: kept as saved)."""
    for i, (old, _) in enumerate(table):
        if old == "*" or old == saved or (old == "cuda" and saved.startswith("cuda")):
            return i
    return None


def device_for(saved: str, table: tuple[tuple[str, str], ...]) -> str:
    rule = device_rule(saved, table)
    return saved if rule is None else table[rule][1]


def note_idle_devices(saved: list[str], table: tuple[tuple[str, str], ...], notes: list[str]) -> None:
    """A --map-location rule that rewrote no tag (cuda:3=cuda:0 of a file saved on cuda:1, cpu of one saved on cpu)
    did nothing: said, naming the tags the output's tensors are saved with."""
    used = {device_rule(device, table) for device in saved if device_for(device, table) != device}
    for i, (old, new) in enumerate(table):
        if i not in used:
            notes.append(f"--map-location {new if old == '*' else f'{old}={new}'} rewrote no device tag: the output's "
                         f"tensors are saved on {', '.join(saved) or 'no device'}")


def tie(state: "OrderedDict[str, OutTensor]", ties: tuple[tuple[str, str], ...], out_prefix: str, notes: list[str],
        applied: list[str], given: set | None = None, source_prefix: str = "") -> list[tuple[str, str]]:
    """Write each tied alias as the same tensor as the key it shares a Parameter with (one storage in a torch
    file), so that load_state_dict(strict=True) finds both names. The (alias, key) pairs written. `source_prefix`:
    where the state_dict's keys are in the file (`model.`), which a --drop printed here names them by."""
    done = []
    for alias, key in ties:
        if (alias, key) not in (given or ()):
            if alias in state or key not in state:
                continue
        elif not well_formed(alias):
            raise UsageError(f"--tie {alias}={key}: {alias!r} is {key_problem(alias)}, which no module has")
        elif key not in state:
            raise UsageError(f"--tie {alias}={key}: the output has no tensor {key!r} to share (its keys after the "
                             "renames are the ones --dry-run lists)")
        elif alias in state:
            own, kept = state[alias].source, state[key].source
            if own == kept or tied_names([(alias, own), (key, kept)]):
                continue  # already one tensor under both names
            if not same_values(own, kept):  # a tie keeps one of the two: which one is the user's to say
                raise _keep_which(alias, key, source_prefix + own.key, source_prefix + kept.key, ties)
            notes.append(f"{alias} held a copy of {key} (the same bytes): written as that tensor, the tie losing "
                         "nothing")
        source = state[key]
        state[alias] = OutTensor(out_prefix + alias, source.source, source.dtype, source.device)
        done.append((alias, key))
    listed = [f"{alias}={key}" for alias, key in done if given is None or (alias, key) in given]
    if listed:  # (the ties --auto inferred are listed in its own line)
        applied.append("--tie " + " --tie ".join(listed))
    return done  # (in safetensors each is stored once: said with the output's other ties, safetensors_sharing)


def _keep_which(alias: str, key: str, own: str, kept: str, ties: tuple[tuple[str, str], ...]) -> UsageError:
    """--tie ALIAS=KEY where the output holds other values under ALIAS (the file's `own`; KEY's are the file's
    `kept`): the user's command with the --drop that keeps KEY's, and the reversed tie that keeps ALIAS's, where no
    other --tie names either of the two (it would lose its tensor)."""
    ways = [Rerun(add=("--drop", exact_keys_regex([own])))]
    if not any(t != (alias, key) and (alias in t or key in t) for t in ties):
        value = f"{key}={alias}"  # (a value that starts with a dash is joined to its flag: it is no option)
        reversed_tie = (f"--tie={value}",) if value.startswith("-") else ("--tie", value)
        ways.append(Rerun(add=(*reversed_tie, "--drop", exact_keys_regex([kept])), remove=("--tie", f"{alias}={key}")))
    also = f", or {alias}'s with {{1}}" if len(ways) > 1 else ""
    return UsageError(f"--tie {alias}={key}: the output already holds a tensor named {alias!r} (the file's {own}), "
                      f"whose values differ from {key}'s, and a tie keeps one of them: {key}'s with {{0}}{also}",
                      reruns=tuple(ways))


def module_versions(ckpt: Checkpoint, root: str | None, renames: list[Transform]) -> Any:
    """The state_dict's `_metadata` (each module's version, which its loading code reads: BatchNorm fills a
    counter files of version 1 lack) under the module names the renames give: written back, so that the repaired
    file loads as the original did. None when the file has none, or a rename leaves a module without a name."""
    source = state_dict_metadata(ckpt.root, root)
    if not source:
        return None
    leaf = "\0leaf"
    out: OrderedDict[str, Any] = OrderedDict()
    for module, version in source.items():
        if not isinstance(module, str):
            return None
        new = module + "." + leaf if module else leaf
        for step in ordered(renames):
            new = step.apply(new) or ""
        if not new.endswith(leaf):
            continue  # the rename reached into the leaf: that module's name is gone, and so is its version
        name = new[:-len(leaf)].rstrip(".")
        out.setdefault(name, version)
    return out


def map_by_order(kept: list[TensorRecord], mapping: dict[str, str], model: ModelKeys | None, force: bool,
                  notes: list[str], dry_run: bool = False, marked: list[str] | None = None) -> dict[str, str]:
    assert model is not None
    entries = list(model.entries)
    olds = list(mapping)
    if len(olds) != len(entries):
        raise PlanError(f"--map-by-order: the checkpoint has {len(olds)} tensors, the model {len(entries)}; "
                        "drop the extra ones first (--drop)")
    by_key = {t.key: t for t in kept}
    for i, (old, entry) in enumerate(zip(olds, entries)):
        shape = by_key[old].shape
        if tuple(shape) != tuple(entry.shape):
            raise PlanError(f"--map-by-order: position {i}: {old} {list(shape)} cannot become {entry.key} "
                            f"{list(entry.shape)}; the layers do not line up")
    from ..compare import ambiguous_positions  # compare: ~40 ms of imports, only with --map-by-order

    ambiguous = ambiguous_positions([by_key[old] for old in olds], [e.key for e in entries])
    if marked is not None:
        counts = Counter(tuple(by_key[old].shape) for old in olds)
        marked += [old for old in olds if by_key[old].numel > 1 and counts[tuple(by_key[old].shape)] > 1]
    if ambiguous and not (force or dry_run):
        raise PlanError(f"--map-by-order: {len(ambiguous)} positions have a neighbour of the same shape (first: "
                        f"{ambiguous[0]}), so a swap would go unnoticed; see the mapping with {{0}}, and write it, "
                        "once checked, with {1}", reruns=(Rerun(add=("--dry-run",)), Rerun(add=("--force",))))
    if ambiguous and force:
        notes.append(f"--map-by-order with --force: {len(ambiguous)} ambiguous positions mapped by order")
    elif ambiguous:
        notes.append(f"--map-by-order: {len(ambiguous)} positions share their shape with another (marked ≈): a swap "
                     "among them would go unnoticed; writing this mapping needs --force")
    return {old: entry.key for old, entry in zip(olds, entries)}

