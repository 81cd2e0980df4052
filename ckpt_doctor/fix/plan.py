"""Plans a repair: a checkpoint's structure and the options → a FixPlan (which tensors, under which names, in which
format, and what is left out). Pure: it reads no tensor bytes and writes nothing; `--dry-run` prints what it returns.

`plan_fix` is a sequence of steps, each a function with one job, in the order their lines are shown to the user."""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

from .._record import field, record, replace
from ..advice import shell_word
from ..devices import missing_devices
from ..dtypes import FLOATING, QUANTIZED, TORCH_TO_SAFETENSORS
from ..errors import CkptDoctorError, PlanError, Rerun, UsageError
from ..readers.survey import NPY_PICKLE
from ..records import (
    Checkpoint,
    DcpFolder,
    DeepSpeedFolder,
    DistributedShard,
    Format,
    OutTensor,
    TensorRecord,
    ancestors,
    integer_keys_note,
    relative_to_root,
)
from ..safepickle.plain import PLAIN_NAMES
from ..safepickle.policy import Policy, resolve
from ..safepickle.unpickler import Opaque, RawTensor, SizeValue
from ..transforms import Op, Transform, drop, exact_keys_regex, plan_keys, well_formed
from ..tree import join
from .keys import device_for, map_by_order, module_versions, note_idle_devices, tie
from .options import FixOptions, OutputFormat, output_format
from .rebuild import (
    MISSING,
    PlainState,
    beside,
    check_writable,
    in_source_order,
    is_dropped,
    is_module_root,
    left_out,
    out_tensors,
    rebuild,
    refuse_unwritable,
    subtree,
    tensors_under,
    unlisted_tensors,
)
from .results import FixPlan, cast_keys, tied_duplicates

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Any, Callable


@record(frozen=False)
class Draft:
    """What the steps gather for the user as they go: the steps applied, notes, and what the output leaves out."""

    applied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    ambiguous: list[str] = field(default_factory=list)  # --map-by-order: keys another of their shape could take
    problems: list = field(default_factory=list)  # (path, global, …) of objects the output could not hold


@record
class Scope:
    """Which part of the checkpoint the output holds, and in what shape."""

    select: str | None  # the part asked for (--select, or the one --auto found); None: the state_dict
    root: str  # the part whose keys the renames act on
    nested_format: bool  # the output format holds a tree (torch, DCP), not only tensors
    whole_tree: bool  # every tensor where it was saved: none is taken out as the state_dict
    optimizer_select: bool  # an optimizer's state_dict, written whole (only loadable so)
    selected: Any  # the value at `select` (MISSING without one)
    flat_output: bool  # the output is the state_dict: keys → tensors (and a few plain entries)

    @property
    def prefix(self) -> str:
        return self.root + "." if self.root else ""

    def keeps_extras(self, ckpt: Checkpoint) -> bool:
        """A flat state_dict at the file's root written whole: its few plain entries (a version) are kept."""
        return self.flat_output and self.root == "" and self.select is None and self.nested_format and \
            isinstance(ckpt.root, dict)


def plan_fix(ckpt: Checkpoint, output: Path, opts: FixOptions) -> FixPlan:
    """The repair `opts` asks of `ckpt`, written to `output`: checked (PlanError, UsageError, CheckFailed with
    --model) before anything is written."""
    refuse_unplannable(ckpt, output)
    fmt = output_format(output, opts.format)
    check_option_needs(opts)
    policy = opts.policy
    draft = Draft()
    if opts.plain_data:
        from .plain import with_plain_data  # only with --plain-data

        ckpt, converted = with_plain_data(ckpt)
        if converted:
            steps = ", ".join(f"{path} ({was} → {now})" for path, was, now in converted)
            draft.applied.append(f"--plain-data: {steps}")  # (fix_summary shortens it for stderr)
        else:
            draft.notes.append("--plain-data converted nothing: no argparse.Namespace, NumPy scalar or pathlib path "
                               "in the file")
    user_ties = set(opts.ties)  # --tie as given: checked strictly; those --auto infers fit by construction
    auto_select = False
    if opts.auto:
        opts, auto_select = resolve_auto(ckpt, opts, draft)
    scope = choose_scope(ckpt, fmt, opts, auto_select, draft)
    if opts.max_shard_size is not None and fmt is OutputFormat.TORCH and not scope.flat_output and scope.root \
            and not scope.whole_tree:  # shards of a state_dict (as Hugging Face writes them), not of a whole file
        raise PlanError(f"--max-shard-size writes a state_dict in shards, not a whole training checkpoint: write the "
                        f"one at {scope.root} with {{0}}", reruns=(Rerun(add=("--select", scope.root), remove=(
                            ("--select", opts.select) if opts.select is not None else ())),))
    drops = [t for t in opts.transforms if t.op is Op.DROP]
    renames = [t for t in opts.transforms if t.op is not Op.DROP]
    kept = kept_tensors(ckpt, scope, drops, draft)
    refuse_same_keys(ckpt, kept if scope.flat_output else ckpt.tensors)
    mapping, idle = key_mapping(kept, renames, opts, draft)
    versions = None if opts.map_by_order or fmt is not OutputFormat.TORCH else module_versions(ckpt, scope.root,
                                                                                                renames)

    # --dtype casts the model's weights, the state_dict written; what lies beside it (an optimizer's moments and
    # step, a scheduler, RNG state) is written as saved, unless --select '' asks for all of the file (or --select
    # names an optimizer: the part written is then that)
    cast_all = opts.select == "" or scope.whole_tree

    def out_tensor(key: str, record: TensorRecord) -> OutTensor:
        dtype = opts.dtype if opts.dtype and record.dtype in FLOATING else record.dtype
        return OutTensor(key, record, dtype, device_for(record.device, opts.map_location))

    def beside_tensor(key: str, record: TensorRecord) -> OutTensor:
        return out_tensor(key, record) if cast_all else \
            OutTensor(key, record, record.dtype, device_for(record.device, opts.map_location))

    by_key = {t.key: t for t in kept}
    out_prefix = "" if scope.flat_output else scope.prefix  # nested output: the state_dict keeps its place
    node = subtree(ckpt.root, scope.root) if scope.root else ckpt.root
    kind = PlainState if type(node) is dict and versions is None else OrderedDict
    state = kind((new, out_tensor(out_prefix + new, by_key[old])) for old, new in mapping.items())
    if versions is not None:
        state._metadata = versions  # type: ignore[attr-defined]
    recorded = recorded_ties(ckpt, scope.root, mapping, renames, drops, opts)
    ties = tie(state, opts.ties + recorded, out_prefix, draft.notes, draft.applied, user_ties, scope.prefix)
    if recorded and fmt is not OutputFormat.SAFETENSORS:
        header = set(recorded)
        restored = [f"{alias} = {key}" for alias, key in ties if (alias, key) in header]
        more = f", … {len(restored) - 4} more" if len(restored) > 4 else ""
        draft.notes.append("the ties the safetensors header records (ckpt_doctor.tied, written by fix) are written "
                           f"as one storage again: {', '.join(restored[:4])}{more}")
    extra_renamed: dict[str, str] = {}  # state_dict entries that are no tensors, renamed with the tensors
    if scope.flat_output:
        tree, outs, mapping, extra_renamed, written = flat_tree(ckpt, scope, state, mapping, drops, renames,
                                                                versions, opts.reorder, out_tensor, policy, draft)
    else:
        if scope.whole_tree:  # every tensor where it was saved: none is taken out as the state_dict
            if renames or opts.model is not None:
                raise PlanError(f"--select {scope.select or chr(39) * 2} writes that part as it was saved; renames "
                                "and --model apply to a model's state_dict: name it with --select PATH")
            state.clear()
            mapping = {}
        tree, outs, written = nested_tree(ckpt, scope, state, drops, beside_tensor, policy, draft)
    if extra_renamed:  # a transform that renamed only an entry of no tensor (an `_extra_state`) renamed a key
        idle = tuple(t for t in idle if t in plan_keys(list(extra_renamed), renames).idle)
    note_idle(idle, renames, len(kept), draft)
    note_idle_drops(ckpt, scope, drops, draft)
    refuse_unwritable(draft.problems, plain_data_plans(ckpt, output, opts) if draft.problems else None)
    if not scope.whole_tree:  # the state_dict's keys are written as text, nested in place or not
        note_odd_keys(ckpt, scope, draft)
    if opts.model is not None:
        check_against_model(ckpt, scope, state, tree, opts, draft)
    list_left_out(ckpt, scope, draft)
    written.update(scope.prefix + old for old in mapping)
    draft.dropped += unlisted_tensors(ckpt.tensors, written, draft.dropped, scope.prefix)
    list_non_persistent(ckpt, draft)
    tied, metadata = safetensors_sharing(ckpt, outs, draft) if fmt is OutputFormat.SAFETENSORS else ({}, {})
    in_state = {id(o) for o in state.values()}  # keyed relative to the part (kept_tensors); the rest by full path
    paths = [scope.prefix + o.source.key if id(o) in in_state else o.source.key for o in outs]
    note_unwritten(ckpt, fmt, paths, draft)
    refuse_unwritable_tensors(outs, fmt, [k for k in paths if k in ckpt.value_bits] if ckpt.value_bits else [])
    note_idle_devices(sorted({t.source.device for t in outs}), opts.map_location, draft.notes)
    note_devices(fmt, outs, draft)
    note_held_findings(ckpt, paths, fmt, draft)
    if opts.dtype:
        note_dtype(opts.dtype, [t for t in outs if t.key not in tied], draft)
    return FixPlan(ckpt.path, output, fmt, tuple(draft.applied), {**mapping, **extra_renamed},
                   tuple(draft.dropped), tuple(outs), tree, tuple(draft.notes), tied, metadata,
                   tuple(draft.ambiguous), policy, dtype=opts.dtype, ties=tuple(ties))


def recorded_ties(ckpt: Checkpoint, root: str, mapping: dict[str, str], renames: list[Transform],
                  drops: list[Transform], opts: FixOptions) -> tuple[tuple[str, str], ...]:
    """The ties a safetensors header fix wrote records (`ckpt_doctor.tied`: alias=key, the alias stored once as
    key) under the state_dict written (`root`), under the output's names, to be written as ties again: a round trip
    through safetensors keeps both names. A chain (b=a, a=y) is followed; none of an alias the drops leave out, of
    a name no module could have (a header is the file's word), or where names are placed by position."""
    if opts.map_by_order:
        return ()
    found = []
    names = dict(mapping)  # the file's names → the output's, the aliases written so far among them
    for alias, key in ckpt.recorded_ties(root):
        if key not in names or alias in names or not well_formed(alias) or is_dropped(alias, drops) \
                or root and is_dropped(f"{root}.{alias}", drops):
            continue
        try:
            new = plan_keys([alias], renames).mapping.get(alias)
        except CkptDoctorError:  # a name the renames would make malformed: left as the header records it
            continue
        if new is not None:
            found.append((new, names[key]))
            names[alias] = new
    return tuple(found)


def refuse_unplannable(ckpt: Checkpoint, output: Path) -> None:
    """Files no output can be planned from: plain values only, or one rank's part of a distributed checkpoint."""
    ckpt.refuse_values("rewrite it")
    if isinstance(ckpt.distributed, DistributedShard):
        raise PlanError(f"{ckpt.path}: one rank's shard of a distributed checkpoint holds only parts of its tensors; "
                        f"consolidate the folder: ckpt-doctor fix {ckpt.distributed.shard_of} -o {output}")


def check_option_needs(opts: FixOptions) -> None:
    """Options that mean something only with --model."""
    if (opts.auto or opts.map_by_order or opts.reorder) and opts.model is None:
        raise UsageError("--auto, --map-by-order and --reorder need --model SPEC")
    if (opts.allow_missing or opts.allow_unexpected) and opts.model is None:
        raise UsageError("--allow-missing and --allow-unexpected need --model SPEC (what the output must load into)")


def resolve_auto(ckpt: Checkpoint, opts: FixOptions, draft: Draft) -> tuple[FixOptions, bool]:
    """--auto: the options of the fix `inspect --model` infers, made explicit; and whether it chose the part."""
    from ..compare import compare_checkpoint  # compare: ~40 ms of imports, only with --auto

    assert opts.model is not None
    comparison = compare_checkpoint(ckpt, opts.model, select=opts.select)
    select = opts.select
    auto_select = select is None and bool(comparison.fix_root or comparison.state_dict_root)
    if auto_select:
        select = comparison.fix_root or comparison.state_dict_root
    if comparison.paired and comparison.ambiguous and not (opts.force or opts.dry_run):
        raise PlanError(f"--auto: {len(comparison.ambiguous)} of the renames it infers pair keys of one shape by "
                        f"their order (first: {comparison.ambiguous[0]}), so a swap would go unnoticed; see the "
                        "mapping with {0}, and write it, once checked, with {1}",
                        reruns=(Rerun(add=("--dry-run",)), Rerun(add=("--force",))))
    # A new head's keys stay missing: accepted only by an explicit --allow-missing (the line inspect prints holds
    # it), never silently by --auto.
    opts = replace(opts, select=select, transforms=opts.transforms + tuple(comparison.transforms),
                   map_by_order=opts.map_by_order or comparison.fix_kind == "map-by-order",
                   ties=opts.ties + comparison.ties, closest=comparison.suggested_fix)
    if comparison.missing_devices and not opts.map_location:
        opts = replace(opts, map_location=(("*", "cpu"),))
    shown = list(comparison.suggested_fix)
    if "--map-location" in shown:  # listed once, as its own step, below
        at = shown.index("--map-location")
        del shown[at:at + 2]
    draft.applied.append("--auto → " + (" ".join(shown) or "(nothing to change)"))
    return opts, auto_select


def choose_scope(ckpt: Checkpoint, fmt: OutputFormat, opts: FixOptions, auto_select: bool, draft: Draft) -> Scope:
    """The part written (--select, the state_dict, or all of it) and whether the output is flat or nested."""
    select = opts.select
    nested_format = fmt in (OutputFormat.TORCH, OutputFormat.DCP)  # formats that hold a tree, not only tensors
    if select is not None:
        check_select(ckpt, select)
        if not (opts.auto and auto_select):  # --auto's own --select is already in its line
            draft.applied.append(f"--select {select or chr(39) * 2}")
    # `--select ''` is all of the file. A format that holds a tree keeps it nested as saved: a training checkpoint
    # exactly as without --select (its state_dict renamed in place); a distributed one, or a file without a
    # state_dict, whole as saved (what dcp_to_torch_save writes). A tensors-only format gets every tensor.
    everything = select == "" and nested_format
    if everything and ckpt.distributed is None and ckpt.state_dict_root is not None and isinstance(ckpt.root, dict):
        select = None
    root = select if select is not None else ckpt.state_dict_root
    if root is None:
        tops = ", ".join(sorted({t.key.split(".", 1)[0] for t in ckpt.tensors})[:8])
        raise PlanError(f"{ckpt.path}: no state_dict found to repair (no container holds mostly tensors); name the "
                        f"part to write with --select PATH (entries with tensors: {tops or 'none'}), or write all of "
                        "it with --select ''")
    whole_tree = everything and select == ""
    # An optimizer's state_dict ({"state", "param_groups"}) is only loadable whole: selected, it keeps its nesting.
    selected = subtree(ckpt.root, select) if select else MISSING
    optimizer_select = isinstance(selected, dict) and "state" in selected and "param_groups" in selected
    if optimizer_select and fmt is OutputFormat.SAFETENSORS:
        draft.notes.append(f"{select!r} is an optimizer's state_dict: safetensors holds its tensors only (no "
                           "param_groups), which Optimizer.load_state_dict cannot take; write a .pt to keep it whole")
        optimizer_select = False
    whole_tree = whole_tree or optimizer_select
    flat_output = not whole_tree and (select is not None or fmt is OutputFormat.SAFETENSORS or root == ""
                                      or is_module_root(ckpt, root) or ckpt.distributed is not None)
    if ckpt.distributed is not None:
        draft.notes += ckpt.distributed.fix_notes
        # optimizer states given integer keys again: said of those the output holds as a tree (not flattened)
        written = select if optimizer_select else "" if whole_tree else root
        keys = ckpt.distributed.integer_state_keys if isinstance(ckpt.distributed, DcpFolder) else ()
        restored = [p for p in keys if written == "" or p == written or p.startswith(written + ".")]
        if restored and not flat_output:
            draft.notes.append(integer_keys_note(restored))
    others = beside(ckpt.root, root) if ckpt.distributed is not None and select is None and root else []
    if others:  # --select names one part only where it holds tensors (a part without any is refused)
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        tensors = next((o for o in others if holds_tensors(ckpt, o)), None)
        how = f"--select {shell_word(tensors)} writes {tensors} alone, --select '' all of it" if tensors else \
            "--select '' writes all of it"
        draft.notes.append(f"a distributed checkpoint: wrote the model's state_dict at {root!r}, as load_state_dict "
                           f"takes it; beside it: {shown} ({how})")
    elif fmt is OutputFormat.SAFETENSORS and select is None and root:
        draft.notes.append(f"safetensors holds tensors only: wrote the state_dict at {root!r}; the rest of the "
                           "checkpoint (optimizer, metadata) is left out")
    return Scope(select, root, nested_format, whole_tree, optimizer_select, selected, flat_output)


def check_select(ckpt: Checkpoint, select: str) -> None:
    """A --select that names tensors (or '' for all of the file)."""
    if select == "" and ckpt.tensors:
        return  # the whole checkpoint
    if not holds_tensors(ckpt, select):
        if isinstance(ckpt.distributed, DeepSpeedFolder) and select == "module":
            raise PlanError(f"{ckpt.path}: ZeRO-3 saves only 0-element placeholders in module; the weights are "
                            "fp32_weights (the default)")
        tops = sorted({t.key.split(".", 1)[0] for t in ckpt.tensors})[:8]
        raise PlanError(f"{ckpt.path}: --select {select!r} holds no tensors; the file's top-level entries with "
                        f"tensors are: {', '.join(tops)}")


def holds_tensors(ckpt: Checkpoint, path: str) -> bool:
    """Whether the container at `path` holds tensors: what --select accepts (a tensor alone is no part to write)."""
    return any(t.key.startswith(path + ".") for t in ckpt.tensors)


def kept_tensors(ckpt: Checkpoint, scope: Scope, drops: list[Transform], draft: Draft) -> list[TensorRecord]:
    """The part's tensors (keyed relative to it) that --drop leaves in; the others go to draft.dropped."""
    kept = []
    # A --drop that names the state_dict itself, or a container above it, drops all of it.
    whole = any(is_dropped(path, drops) for path in ancestors(scope.root))
    for t in relative_to_root(ckpt.tensors, scope.root):
        if whole or is_dropped(t.key, drops) or is_dropped(scope.prefix + t.key, drops):
            draft.dropped.append(t.key)
        else:
            kept.append(t)
    return kept


def refuse_same_keys(ckpt: Checkpoint, tensors: list[TensorRecord] | tuple[TensorRecord, ...]) -> None:
    """Two tensors whose dotted keys are one string could not be told apart in the output."""
    seen: set[str] = set()
    for t in tensors:
        if t.key in seen:
            raise PlanError(f"{ckpt.path}: two tensors are both named {t.key!r} once their nesting is joined with "
                            "dots ({'a.b': {'c': x}} and {'a': {'b.c': y}}); ckpt-doctor cannot tell them apart in "
                            "its output: write one of them with --select PATH")
        seen.add(t.key)


def key_mapping(kept: list[TensorRecord], renames: list[Transform], opts: FixOptions,
                draft: Draft) -> tuple[dict[str, str], tuple[Transform, ...]]:
    """Old key → new key for every kept tensor, in output order: the renames, --map-by-order, --reorder; and the
    user's renames that changed none of their keys."""
    keys = plan_keys([t.key for t in kept], renames)
    mapping = dict(keys.mapping)
    draft.applied += [" ".join(t.flags()) for t in opts.transforms if not opts.auto]
    if opts.map_by_order:
        mapping = map_by_order(kept, mapping, opts.model, opts.force, draft.notes, opts.dry_run, draft.ambiguous)
        draft.applied.append("--map-by-order")
    if opts.reorder:
        assert opts.model is not None
        rank = {e.key: i for i, e in enumerate(opts.model.entries)}
        mapping = dict(sorted(mapping.items(), key=lambda kv: rank.get(kv[1], len(rank))))
        draft.applied.append("--reorder")
    if opts.dtype:
        draft.applied.append(f"--dtype {opts.dtype}")
    if opts.map_location:
        draft.applied.append("--map-location " + ",".join(f"{a}={b}" if a != "*" else b
                                                          for a, b in opts.map_location))
    return mapping, keys.idle if kept and not opts.auto else ()


def note_idle(idle: tuple[Transform, ...], renames: list[Transform], count: int, draft: Draft) -> None:
    """A typo in a prefix: said, not a silent no-op. A --rename acts on the names the stripped prefixes leave (a
    pattern written for the file's own names matches none of those): said too."""
    stripped = [" ".join(shell_word(f) for f in t.flags()) for t in renames
                if t.op is Op.STRIP_PREFIX and t not in idle]
    for t in idle:
        flags = " ".join(shell_word(f) for f in t.flags())
        if t.op is Op.STRIP_PREFIX:
            why = f"none of the {count:,} names starts with {t.arg!r}"
        elif stripped:
            why = f"the pattern matches none of the {count:,} names once {' and '.join(stripped)} has renamed them " \
                  "(--rename acts on the names after the prefixes are stripped)"
        else:
            why = f"the pattern matches none of the {count:,} names"
        draft.notes.append(f"{flags} renamed no key: {why}")


def note_idle_drops(ckpt: Checkpoint, scope: Scope, drops: list[Transform], draft: Draft) -> None:
    """A --drop whose pattern matches no path a drop is tried on (an entry of the file, a tensor's key from the root
    or relative to the state_dict) left nothing out: said, as a rename that renamed nothing is."""
    if not drops:
        return
    paths = {t.key for t in ckpt.tensors} | {t.key for t in relative_to_root(ckpt.tensors, scope.root)}
    paths.update(ancestors(scope.root))
    todo: list[tuple[str, Any, bool]] = [("", ckpt.root, False)]  # a list, not recursion: nesting can be deep
    inside: set[int] = set()  # the containers being walked: one met again within itself is a cycle, not walked
    while todo:
        at, node, leaving = todo.pop()
        if leaving:
            inside.discard(id(node))
            continue
        if isinstance(node, dict):
            entries = [(join(at, k), v) for k, v in node.items()]
        elif isinstance(node, (list, tuple)) and type(node) is not SizeValue:
            entries = [(join(at, i), v) for i, v in enumerate(node)]
        else:
            continue
        if id(node) in inside:
            continue
        paths.update(path for path, _ in entries)
        inside.add(id(node))
        todo.append((at, node, True))
        todo += [(path, value, False) for path, value in entries]
    for t in drops:
        if not any(is_dropped(path, [t]) for path in paths):  # (the rule the drop itself is made by)
            draft.notes.append(f"{' '.join(shell_word(f) for f in t.flags())} dropped nothing: the pattern matches "
                               "none of the file's keys and entries")


def plain_data_plans(ckpt: Checkpoint, output: Path, opts: FixOptions) -> tuple[str, ...] | None:
    """The flags that make the same fix plan with --plain-data: ("--plain-data",) when every object refused is data
    it writes as such, with one --drop of what is left when some are not; None when no such command plans (then
    the refusal does not offer it: what it prints runs)."""
    if opts.plain_data or not any(".".join(resolve(g.module, g.name)) in PLAIN_NAMES for g in ckpt.globals):
        return None
    added = with_a_drop(lambda more: plan_fix(ckpt, output, replace(opts, plain_data=True,
                                                                    transforms=opts.transforms + tuple(more))))
    return None if added is None else ("--plain-data", *added)


def with_a_drop(attempt: Callable[[list[Transform]], object]) -> list[str] | None:
    """The flags that make `attempt` (a planning, given transforms to add) plan: none, or the one --drop its refusal
    names (the `drop` of refuse_unwritable's PlanError); None when neither does."""
    added: list[str] = []
    for _ in range(2):
        try:
            attempt([drop(pattern) for pattern in added[1::2]])
        except CkptDoctorError as exc:
            pattern = getattr(exc, "drop", None)
            if not pattern or added:
                return None
            added = ["--drop", pattern]
            continue
        return added
    return None


def flat_tree(ckpt: Checkpoint, scope: Scope, state: OrderedDict[str, OutTensor], mapping: dict[str, str],
              drops: list[Transform], renames: list[Transform], versions: Any, reorder: bool,
              out_tensor: Callable[[str, TensorRecord], OutTensor], policy: Policy,
              draft: Draft) -> tuple[Any, list[OutTensor], dict[str, str], dict[str, str], set[str]]:
    """The output as a state_dict; a flat state_dict at the file's root keeps its few plain entries beside the
    tensors. Returns the tree, its tensors, the mapping, the plain entries renamed, and the source tensors held."""
    tree: Any = state
    outs = list(state.values())
    extra_renamed: dict[str, str] = {}
    written: set[str] = set()
    if scope.keeps_extras(ckpt):
        full_records = {t.key: t for t in ckpt.tensors}
        nested: set[str] = set()
        cut: set[str] = set()
        for key, value in ckpt.root.items():
            path = join("", key)
            if isinstance(value, RawTensor):
                continue
            if isinstance(key, Opaque) or isinstance(key, type) and issubclass(key, Opaque):
                check_writable(key, path, draft.problems, policy)
            if is_dropped(path, drops):
                cut.add(path)
                continue
            extra: list[OutTensor] = []
            # (with root "" every tensor is in the state_dict, so kept_tensors has listed the dropped ones)
            # a state_dict entry that is no tensor (an `_extra_state`) is renamed as the tensors beside it are
            name = plan_keys([key], renames).mapping[key] if isinstance(key, str) and renames else key
            if name != key:
                if name in state or name in tree:
                    raise PlanError(f"{key!r} would be renamed {name!r}, which the output already holds; "
                                    "nothing written")
                extra_renamed[key] = name
            tree[name] = rebuild(value, path, "\0", state, full_records, drops, extra, out_tensor, cut,
                                 draft.problems, policy)
            nested.update(o.source.key for o in extra)
        draft.dropped += [p for p in cut if not any(k == p or k.startswith(p + ".") for k in draft.dropped)]
        if nested:  # tensors inside such an entry stay there, and are not written a second time as keys
            for new in [k for k, o in state.items() if isinstance(o, OutTensor) and o.source.key in nested]:
                del state[new]
            mapping = {old: new for old, new in mapping.items() if old not in nested}
        if not reorder:  # the entries in the file's order, tensors and the rest as they were interleaved
            tree = in_source_order(tree, ckpt.root, {**mapping, **extra_renamed})
            if versions is not None:
                tree._metadata = versions
        outs = out_tensors(tree)
        written |= nested
    if is_module_root(ckpt, scope.root) and scope.select is None:
        draft.notes.append(f"whole-model pickle of {ckpt.model_class}: written as its state_dict")
    return tree, outs, mapping, extra_renamed, written


def nested_tree(ckpt: Checkpoint, scope: Scope, state: OrderedDict[str, OutTensor], drops: list[Transform],
                out_tensor: Callable[[str, TensorRecord], OutTensor], policy: Policy,
                draft: Draft) -> tuple[Any, list[OutTensor], set[str]]:
    """The output as the source's tree (or the selected optimizer's), the state_dict replaced by `state` in its
    place. Returns the tree, its tensors, and the source tensors it holds where they were saved."""
    outs: list[OutTensor] = []
    full_records = {t.key: t for t in ckpt.tensors}
    cut: set[str] = set()
    select = scope.select
    base, base_path = (scope.selected, select) if scope.optimizer_select else (ckpt.root, "")
    cut_prefix = len(select) + 1 if scope.optimizer_select and select else 0  # keys are the selected part's own

    def maker(key: str, record: TensorRecord) -> OutTensor:
        return out_tensor(key[cut_prefix:], record)

    tree = rebuild(base, base_path, "\0" if scope.whole_tree else scope.root, state, full_records, drops, outs,
                   maker, cut, draft.problems, policy)
    written = {o.source.key for o in outs}  # rebuilt where they were saved: full paths
    outs = list(state.values()) + outs
    under = tensors_under(cut - {scope.root}, full_records, scope.prefix)
    draft.dropped += under + sorted(cut - {scope.root} - set(under))  # the tensors, and the entries around them
    return tree, outs, written


def note_odd_keys(ckpt: Checkpoint, scope: Scope, draft: Draft) -> None:
    """A state_dict's keys are written as the strings its tensors are named by: say so for keys that are none."""
    node = subtree(ckpt.root, scope.root) if scope.root else ckpt.root
    odd = [k for k in node if not isinstance(k, str)] if isinstance(node, dict) else []
    if odd:
        draft.notes.append(f"{len(odd)} keys of the state_dict are no strings ({', '.join(repr(k) for k in odd[:3])}"
                           f"{', …' if len(odd) > 3 else ''}): written as the text they are listed by "
                           f"({', '.join(repr(join('', k)) for k in odd[:3])})")


def check_against_model(ckpt: Checkpoint, scope: Scope, state: OrderedDict[str, OutTensor], tree: Any,
                        opts: FixOptions, draft: Draft) -> None:
    """With --model: the output must load strictly into it (torch's own loading code decides)."""
    from .loadcheck import check_loads  # compare and the model check: ~40 ms of imports, only with --model

    beside = [k for k, v in tree.items() if not isinstance(v, OutTensor)] \
        if scope.flat_output and isinstance(tree, dict) else []
    extras = {k for k in beside if isinstance(k, str) and k.endswith("_extra_state")}
    # load_state_dict(strict=True) counts every key of the state_dict it is given: a plain entry written beside the
    # tensors (a config, a version) is a key the model does not take, as a tensor of no place is.
    others = [k if isinstance(k, str) else join("", k) for k in beside if k not in extras]
    check_loads(state, opts, draft.notes, str(ckpt.path), extras, others)


def list_left_out(ckpt: Checkpoint, scope: Scope, draft: Draft) -> None:
    """Nothing leaves without being listed: what lies beside the written part, and what a tensors-only output (or
    the state_dict's place in a nested one) cannot hold."""
    if scope.optimizer_select:  # the optimizer alone: the rest of the file is left out
        listed = set(draft.dropped)
        draft.dropped += [p for p in left_out(ckpt.root, scope.select or "", beside=True, inside=False)
                          if p not in listed]
    elif not scope.whole_tree and isinstance(ckpt.root, (dict, list, tuple)):
        part = scope.root if scope.flat_output else None
        listed = set(draft.dropped)
        for path in left_out(ckpt.root, part if part is not None else scope.root, beside=part is not None,
                             inside=not scope.keeps_extras(ckpt)):
            if path not in listed:  # a --drop naming it too leaves it as left out (and listed) as before
                draft.dropped.append(path)


def list_non_persistent(ckpt: Checkpoint, draft: Draft) -> None:
    """A whole pickled model's buffers its state_dict() leaves out: its storages are not written."""
    if not ckpt.non_persistent:
        return
    listed = set(draft.dropped)
    left = [k for k in ckpt.non_persistent if k not in listed]
    draft.dropped += left
    if left:
        draft.notes.append(f"{len(left)} non-persistent buffer(s) of the pickled model left out, as its state_dict() "
                           f"leaves them out ({', '.join(left[:3])}{', …' if len(left) > 3 else ''})")


def safetensors_sharing(ckpt: Checkpoint, outs: list[OutTensor], draft: Draft) -> tuple[dict[str, str],
                                                                                          dict[str, str]]:
    """safetensors cannot share storage: each tied duplicate → the key written once; and the header's metadata."""
    metadata: dict[str, str] = {}
    if ckpt.format is Format.SAFETENSORS:  # (its own ckpt_doctor.tied is made again below, under the output's names)
        metadata.update({k: v for k, v in ckpt.metadata.items() if isinstance(v, str) and k != "ckpt_doctor.tied"})
    tied = tied_duplicates(outs)
    if tied:
        draft.notes.append("safetensors cannot share storage: " + ", ".join(f"{d} is written once as {k}"
                                                                            for d, k in tied.items())
                           + "; re-tie after loading (e.g. model.tie_weights()), and load with strict=False or "
                             "copy the kept tensor into the tied name")
        metadata["ckpt_doctor.tied"] = ",".join(f"{d}={k}" for d, k in tied.items())
    metadata.setdefault("format", "pt")
    return tied, metadata


def refuse_unwritable_tensors(outs: list[OutTensor], fmt: OutputFormat | None = None,
                              lazy: list[str] | tuple[str, ...] = ()) -> None:
    """Tensors whose data the output could not hold as they are: meta tensors, quantized ones, a dtype safetensors
    has no code for (complex128) in a .safetensors output, lazy conjugate or negative views (`lazy`, by their paths
    in the file: fix copies bytes, torch.load of the source gives their conjugate or negation)."""
    for t in outs:
        if t.source.storage is None:
            raise PlanError(f"{t.source.key}: has no data in the file (a meta tensor); drop it with --drop")
        if fmt is OutputFormat.SAFETENSORS and t.dtype not in TORCH_TO_SAFETENSORS:
            raise PlanError(f"{t.key}: dtype {t.dtype} has no safetensors code; write a .pt file instead")
    quantized = [t.key for t in outs if t.source.dtype in QUANTIZED]
    if quantized:
        _refuse_tensors(quantized, "quantized tensors", "ckpt-doctor does not read their scale and zero point, so it "
                        "would write them without; nothing written", "; leave them out with")
    if lazy:
        _refuse_tensors(lazy, f"tensor{'s' if len(lazy) > 1 else ''} saved as lazy conjugate or negative views",
                        "torch.load gives the conjugate (or negation) of their bytes, and fix copies bytes, so the "
                        "output would hold other values; nothing written. Save them with .resolve_conj().resolve_neg()",
                        "; or leave them out with")


def _refuse_tensors(keys: list[str], what: str, why: str, leave: str) -> None:
    """PlanError `N what (k1, k2, k3, …): why`, and `leave` the --drop of them all where it is short enough to print
    (50 keys at most)."""
    pattern = exact_keys_regex(keys) if len(keys) <= 50 else None
    raise PlanError(f"{len(keys)} {what} ({', '.join(keys[:3])}{', …' if len(keys) > 3 else ''}): {why}"
                    + (f"{leave} {{0}}" if pattern else ""),
                    reruns=(Rerun(add=("--drop", pattern)),) if pattern else ())


def note_unwritten(ckpt: Checkpoint, fmt: OutputFormat, paths: list[str], draft: Draft) -> None:
    """What the output cannot hold of what it is written from, said: the Python attributes of its tensors (`paths`,
    theirs in the file), a safetensors header's __metadata__ in a torch or DCP output."""
    with_attributes = [k for k in paths if k in ckpt.tensor_attrs] if ckpt.tensor_attrs else []
    if with_attributes:
        names = sorted({a for k in with_attributes for a in ckpt.tensor_attrs[k]})
        draft.notes.append(f"{len(with_attributes)} tensors carry Python attributes ({', '.join(names[:4])}"
                           f"{', …' if len(names) > 4 else ''}: on {', '.join(with_attributes[:2])}"
                           f"{', …' if len(with_attributes) > 2 else ''}), which are not written: the output holds "
                           "their values, and code that reads the attributes must set them again")
    told = sorted(k for k in ckpt.metadata if k not in ("format", "ckpt_doctor.tied")) \
        if ckpt.format is Format.SAFETENSORS else []  # (ckpt_doctor.tied: written as ties, recorded_ties)
    if told and fmt is not OutputFormat.SAFETENSORS:  # ("format": "pt" is safetensors.torch's own mark on every file)
        draft.notes.append(f"the safetensors header's __metadata__ ({', '.join(told[:4])}"
                           f"{', …' if len(told) > 4 else ''}) is not kept: a {fmt.value} output has no place for it")


def note_dtype(dtype: str, outs: list[OutTensor], draft: Draft) -> None:
    """How many tensors --dtype casts (`outs`: those the output holds, a tied name written once counted once), in its
    `applied` line; the floating tensors beside the state_dict it leaves as saved, said with the way to cast them
    too; an optimizer's step it casts to a 16-bit dtype."""
    cast, left = cast_keys(outs, dtype)
    at = draft.applied.index(f"--dtype {dtype}")
    draft.applied[at] += f" ({len(cast)} tensor{'' if len(cast) == 1 else 's'})"
    if left:
        entries = sorted({k.split(".", 1)[0] for k in left})
        shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
        which = "1 floating tensor beside it keeps its dtype" if len(left) == 1 else \
            f"{len(left)} floating tensors beside it keep their dtype"
        draft.notes.append(f"--dtype casts the model's weights, the state_dict: {which} ({shown}); --select '' casts "
                           "all of the file")
    steps = [t.key for t in outs if t.dtype != t.source.dtype and t.source.numel == 1 and STEP.search(t.key)]
    if steps and dtype in ("float16", "bfloat16"):  # float32 counts exactly to 2**24, float64 to 2**53
        draft.notes.append(f"{', '.join(steps[:2])}{', …' if len(steps) > 2 else ''}: an optimizer's step cast to "
                           f"{dtype} stops counting at {2048 if dtype == 'float16' else 256} (step + 1 rounds back), "
                           "and Optimizer.load_state_dict keeps its dtype: to resume training, write the optimizer "
                           "without --dtype")


STEP = re.compile(r"(^|\.)state\..+\.step$")  # an optimizer's per-parameter step (Adam's, AdamW's: a tensor)


def note_devices(fmt: OutputFormat, outs: list[OutTensor], draft: Draft) -> None:
    """What becomes of the saved device tags in this format, and tags this machine lacks."""
    if fmt is OutputFormat.DCP and any(t.device != "cpu" for t in outs):
        draft.notes.append("a DCP folder holds CPU tensors: the saved devices are not kept (dcp.load fills the "
                           "tensors of the model it is given, wherever they are)")
    if fmt is OutputFormat.TORCH:
        absent = missing_devices(sorted({t.device for t in outs}))
        if absent:
            draft.notes.append(f"the output keeps the device tags {', '.join(absent)}, which this machine lacks: "
                               "torch.load here needs map_location; add --map-location cpu to rewrite them for good")


def holding_findings(ckpt: Checkpoint) -> list[str]:
    """Keys of the tensors whose bytes hold a finding (an .npy object array saved as a uint8 tensor, whose pickle
    np.load(allow_pickle=True) would run): fix copies a tensor's bytes as they are, so only leaving the tensor out
    leaves out what its pickle names."""
    members = {place.rpartition(NPY_PICKLE)[0] for place in ckpt.finding_places if NPY_PICKLE in place}
    if not members:
        return []
    return [t.key for t in ckpt.tensors if t.storage is not None and t.storage.entry in members]


def held_entries(ckpt: Checkpoint, keys: list[str]) -> list[str]:
    """The entries that leave out these tensors: a list's or tuple's item goes with its container (the outermost of
    nested ones, as fix's advice on a refused value), since leaving one item out shifts the ones after it, which
    fix refuses."""
    entries: dict[str, None] = {}
    for key in keys:
        entry = key
        while "." in entry and isinstance(subtree(ckpt.root, entry.rpartition(".")[0]), (list, tuple)):
            entry = entry.rpartition(".")[0]
        entries[entry] = None
    return list(entries)


def drop_pattern(entries: list[str], keys: list[str]) -> str:
    """The --drop regex of `entries` (held_entries of `keys`): a container with every key under it (a flat
    state_dict's tensors in a list are keys of their own)."""
    parts = [re.escape(e) + ("" if e in keys else r"(\..*)?") for e in entries]
    return "^" + (parts[0] if len(parts) == 1 else "(" + "|".join(parts) + ")") + "$"


def with_whole(whole: list[str]) -> str:
    """What a --drop of held_entries leaves out besides the tensors: the lists and tuples they are items of."""
    return f" with all of {', '.join(whole)} (a list or tuple: an item left out would shift the ones after it)" \
        if whole else ""


def note_held_findings(ckpt: Checkpoint, paths: list[str], fmt: OutputFormat, draft: Draft) -> None:
    """Said when the output keeps such a tensor (fix --allow-unsafe without --drop): its bytes, copied as they are
    into a torch zip's member, hold the same pickle, and scan flags the output as it flagged the input ("verified"
    is of the bytes). A safetensors file or DCP folder holds them where no loader unpickles them. `paths`: the
    output's tensors' paths in the file."""
    held = set(holding_findings(ckpt))
    if not held or fmt is not OutputFormat.TORCH:
        return
    kept = [k for k in paths if k in held]
    if kept:
        entries = held_entries(ckpt, kept)
        whole = [e for e in entries if e not in kept]
        draft.notes.append(f"{', '.join(kept[:3])}{', …' if len(kept) > 3 else ''}: "
                           f"{'its bytes hold' if len(kept) == 1 else 'their bytes hold'} a pickle np.load"
                           "(allow_pickle=True) would unpickle, copied as it is: scan flags the output as it flagged "
                           f"the input; --drop {shell_word(drop_pattern(entries, kept))} leaves "
                           f"{'it' if len(kept) == 1 else 'them'} out{with_whole(whole)}")

