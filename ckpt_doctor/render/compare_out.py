"""Renders a Comparison: the per-key verdict table, the summary lines, and the `comparison` JSON object."""

from __future__ import annotations

from typing import Any

from ..advice import fix_suggestions, has_fix_line, under_safe_globals
from ..analyze import collapse_labels
from ..compare import Comparison
from ..errors import one_line, percent
from .columns import MAX_WIDTH


def comparison_json(c: Comparison, needs_code: str = "") -> dict[str, Any]:
    return {
        "ok": c.ok and not needs_code,
        "strict_load_ok": c.plain_strict_ok,
        "verdict": full_verdict(c, needs_code),
        "model": c.model,
        "state_dict_root": c.state_dict_root,
        "fix_root": c.fix_root,
        "oracle": "torch load_state_dict" if c.oracle else "names and shapes (a reference checkpoint)",
        "matched": len(c.matched),
        "missing": list(c.missing),
        "unexpected": list(c.unexpected),
        "mismatched": [{"key": m.key, "checkpoint_shape": list(m.checkpoint_shape), "model_shape": list(m.model_shape)}
                       for m in c.mismatched],
        "tied": [{"key": alias, "filled_by": source} for alias, source in c.tied],
        "tie_conflicts": [{"kept": kept, "overwritten": lost} for kept, lost in c.tie_conflicts],
        "errors": list(c.errors),
        "dtype_differs": [{"key": k, "checkpoint_dtype": a, "model_dtype": b} for k, a, b in c.dtype_differs],
        "non_persistent": list(c.non_persistent),
        "bn_stats_missing": list(c.bn_stats_missing),
        "missing_devices": list(c.missing_devices),
        "allowed_missing": list(c.allowed_missing),
        "allowed_unexpected": list(c.allowed_unexpected),
        "loaded_fraction": c.loaded_fraction,
        "suggested_fix": list(c.suggested_fix),
        "fix_kind": c.fix_kind,
        "fix_loaded_fraction": c.fix_loaded_fraction,
        "renames": [{"old": old, "new": new} for old, new in c.renames],
        "dropped": list(c.dropped),
        "dropped_parameters": c.leftover_elements,
        "left_missing": list(c.left_missing),
        "after_fix": None if c.after is None else {
            "missing": list(c.after.missing), "unexpected": list(c.after.unexpected),
            "mismatched": [m.key for m in c.after.mismatched], "errors": list(c.after.errors)},
        "ambiguous": list(c.ambiguous),
        "paired": [{"old": old, "new": new} for old, new in c.paired],
        "required_fraction": c.required_fraction,
    }


def verdict_rows(c: Comparison, shapes: dict[str, tuple], model_shapes: dict[str, tuple]) -> list[list[str]]:
    """[key, verdict, checkpoint shape, model shape] rows: keys the fix renames shown once as `old → new`, repeated
    blocks collapsed."""
    mismatched = {m.key for m in c.mismatched}
    matched = set(c.matched)
    dtypes = {k for k, _, _ in c.dtype_differs}
    at = fix_prefix(c)
    renamed = {new: at + old for old, new in c.renames}
    renamed_old = set(renamed.values())
    tied = dict(c.tied)
    entries: list[tuple[str, str, tuple | None]] = []
    for key in model_shapes:
        ck = shapes.get(key)
        if key in mismatched:
            verdict = "shape mismatch"
        elif key in renamed and key not in matched:  # missing, or filled by the model's code (a BN counter)
            how = "selected by the fix" if renamed[key] == at + key else "renamed by the fix"
            entries.append((f"{renamed[key]} → {key}", how, shapes.get(renamed[key])))
            continue
        elif key in tied:
            verdict = f"tied: filled by {tied[key]}"
        elif key in c.missing:
            verdict = "missing (BatchNorm stats)" if key in c.bn_stats_missing else "missing"
        elif ck is None and key not in c.allowed_missing and c.oracle:
            verdict = "filled by the model's loading code"  # e.g. BatchNorm's num_batches_tracked
        elif key in c.allowed_missing:
            verdict = "missing, allowed"
        elif key in dtypes:
            verdict = "dtype differs"
        else:
            verdict = "matched"
        entries.append((key, verdict, ck))
    entries += [(k, "unexpected", shapes.get(k)) for k in c.unexpected
                if k not in renamed_old and k not in set(c.non_persistent)]
    entries += [(k, "unexpected, allowed", shapes.get(k)) for k in c.allowed_unexpected]
    entries += [(k, "non-persistent buffer", shapes.get(k)) for k in c.non_persistent]
    model_of = {label: label.split(" → ")[-1] for label, _, _ in entries}
    sigs = [(v, ck, model_shapes.get(model_of[k])) for k, v, ck in entries]
    rows = []
    for label, members in collapse_labels([k for k, _, _ in entries], sigs):
        key, verdict, ck = entries[members[0]]
        md = model_shapes.get(model_of[key])
        count = f" ×{len(members)}" if len(members) > 1 else ""
        rows.append([label, verdict + count, "" if ck is None else str(list(ck)), "" if md is None else str(list(md))])
    return rows


def renames_on_two_lines(headers: list[str], rows: list[list[str]]) -> list[list[str]]:
    """`old → new` keys as two rows, `old` with its cells and `→ new` under it, when one line would be wider than
    MAX_WIDTH (keys are never cut; `module.bert.….weight → bert.….weight` made rows of 165 columns)."""
    others = [max([len(h) + 2, *(len(r[i]) for r in rows)]) for i, h in enumerate(headers) if i]
    room = MAX_WIDTH - sum(others) - 2 * len(others)
    if all(len(r[0]) <= room for r in rows):
        return rows
    out = []
    for row in rows:
        old, arrow, new = row[0].partition(" → ")
        if arrow:  # every rename alike, once one is too wide
            out += [[old, *row[1:]], [f"  → {new}", *("" for _ in others)]]
        else:
            out.append(row)
    return out


def fix_prefix(c: Comparison) -> str:
    """How the keys of the part the fix selects are spelled among the compared ones (relative to
    `state_dict_root`, else from the file's root): `model.` for a fix that selects `state_dict.model`."""
    if c.fix_root is None:
        return ""
    root = c.state_dict_root
    if root is not None and (root == "" or c.fix_root.startswith(root + ".")):
        return c.fix_root[len(root) + 1 if root else 0:] + "."
    return c.fix_root + "."


def verdict_text(c: Comparison) -> str:
    """One line that says what the exit code says: OK, OK only with the allowances given, or FAILS and why."""
    total = c.model_key_count or len(c.matched) + len(c.missing) + len(c.mismatched) + len(c.allowed_missing)
    matched = min(len(c.matched), total)  # a key the model's loading code consumes (a scale) fills none of its own
    filled = f"{percent(c.loaded_fraction)} of parameters filled"
    at = f" (the state_dict at {c.state_dict_root})" if c.state_dict_root else ""
    problems = []
    if c.missing:
        problems.append(f"{len(c.missing)} missing")
    if c.unexpected:
        n = len([k for k in c.unexpected if k in set(c.non_persistent)])
        problems.append(f"{len(c.unexpected)} unexpected" + (f" ({n} of them non-persistent buffers of the model)"
                                                              if n else ""))
    if c.mismatched:
        problems.append(f"{len(c.mismatched)} of another shape")
    if c.errors:
        problems.append(f"{len(c.errors)} errors from the model's loading code")
    n = len(c.tied)
    tied = (f"; {n} tied name{'s' if n > 1 else ''} filled by the Parameter {'they share' if n > 1 else 'it shares'} "
            f"(a plain load_state_dict(strict=True) calls {'them' if n > 1 else 'it'} missing until the fix line "
            f"writes {'them' if n > 1 else 'it'})") if c.tied else ""
    accepted = []
    if c.allowed_missing:
        accepted.append(f"{len(c.allowed_missing)} missing or reshaped keys accepted by --allow-missing")
    if c.allowed_unexpected:
        accepted.append(f"{len(c.allowed_unexpected)} extra keys accepted by --allow-unexpected")
    if problems:
        return (f"strict load FAILS{at}: {', '.join(problems)}; {matched} of {total} model keys match; "
                f"{filled}")
    if c.short and c.min_loaded is not None:
        return f"FAILS --min-loaded {percent(c.min_loaded)}{at}: only {filled}" + \
            (f" ({'; '.join(accepted)})" if accepted else "")
    if c.short:
        return (f"FAILS{at}: only {percent(c.loaded_fraction)} of the model's parameters come from the checkpoint "
                f"(required: {percent(c.required_fraction)}: {c.required_reason})")
    if accepted:
        return f"OK with the allowances given{at}: {'; '.join(accepted)}; {filled}{tied}"
    if c.tied:
        return f"loads{at}: {matched} of {total} model keys from the file{tied}; {filled}"
    return f"strict load OK{at}: {matched} of {total} model keys loaded; {filled}"


def needs_code_text(ckpt: Any) -> str:
    """What makes loading the file need code, for full_verdict: a TorchScript archive, a whole pickled model (and of
    which class), or the globals off the allow-list it names."""
    if ckpt.format.value == "torchscript":
        return "a TorchScript archive" + (f" of {ckpt.model_class}" if ckpt.model_class else "")
    if ckpt.model_class:
        return f"a whole pickled model of {ckpt.model_class}"
    names = [g.qualname for g in ckpt.unsafe_globals]
    return "a file naming " + ", ".join(names[:3]) + (f", … {len(names) - 3} more" if len(names) > 3 else "")


def full_verdict(c: Comparison, needs_code: str = "") -> str:
    """The verdict line: the strict load's, after what loading the file at all needs (its code, for a whole pickled
    model or TorchScript) when it does."""
    if not needs_code:
        return verdict_text(c)
    rescued = "by the fix line" if has_fix_line(c) else "by the command on the torch.load line"
    return (f"needs code to load: {needs_code}, which torch.load refuses with its defaults and would import and run "
            f"with weights_only=False; rescued {rescued}, its state_dict: {verdict_text(c)}")


def comparison_lines(c: Comparison, path: str, suggestions: dict[str, Any] | None = None,
                     needs_code: str = "") -> list[tuple[str, str]]:
    lines = [("verdict", full_verdict(c, needs_code))]
    if not c.oracle:
        lines.append(("compared", "names and shapes with a reference checkpoint (no model: torch's loading code "
                                  "was not asked)"))
    for alias, source in c.tied[:5]:
        lines.append(("tied", f"{alias} is the same Parameter as {source}: filled by it (torch output from `fix` "
                              "writes both names)"))
    for kept, lost in c.tie_conflicts[:5]:
        lines.append(("tied", f"WARNING: {kept} and {lost} are two tensors in the file but one Parameter in the "
                              f"model: torch loads both into it and keeps {kept}'s values; {lost}'s are lost if they "
                              "differ (two storages: ckpt-doctor cannot tell without reading the data)"))
    for message in c.errors[:5]:
        lines.append(("error", f"from the model's own loading code: {one_line(message)}"))
    if c.non_persistent:
        lines.append(("non-persistent", f"{', '.join(c.non_persistent)}: the model keeps these as non-persistent "
                                         "buffers; harmless to drop, but a strict load rejects them"))
    if c.bn_stats_missing:
        lines.append(("batchnorm", f"running stats missing for {len(c.bn_stats_missing)} keys "
                                   f"({', '.join(c.bn_stats_missing[:3])}…): the model would run with initial "
                                   "statistics"))
    if c.dtype_differs:
        k, a, b = c.dtype_differs[0]
        lines.append(("dtype", f"{len(c.dtype_differs)} tensors differ in dtype (e.g. {k}: {a} vs {b}); "
                               "load_state_dict casts them"))
    if suggestions is None and c.suggested_fix:
        suggestions = dict(fix_suggestions(path, c))
    suggestions = suggestions or {}
    if "fix" in suggestions:
        trusted = suggestions["fix"].safe_globals
        loads = f"loads {under_safe_globals(trusted)} where it keeps them" if trusted else "loads with its defaults"
        how = _fix_reason(c) if c.suggested_fix else f"writes its state_dict as a file torch.load {loads}; " \
            "nothing the file names is run" + ("" if trusted else " or written")
        if trusted and c.suggested_fix:
            how += f"; torch.load loads its output {under_safe_globals(trusted)} where it keeps them"
        if c.fix_loaded_fraction is not None:
            how += f"; it would fill {percent(c.fix_loaded_fraction)} of the parameters"
        lines.append(("fix", f"`{suggestions['fix'].command}`   ({how})"))
    if "accept" in suggestions:
        lines.append(("accept", f"`{suggestions['accept'].command}`   ({suggestions['accept'].why})"))
    if c.after is not None and not c.after.ok and c.fix_kind == "partial":
        left = [*c.after.missing[:3], *c.after.unexpected[:3], *(m.key for m in c.after.mismatched[:3])]
        lines.append(("remains", f"after that fix: {len(c.after.missing)} missing, {len(c.after.unexpected)} "
                                 f"unexpected, {len(c.after.mismatched)} of another shape ({', '.join(left[:5])}…)"))
    if c.ambiguous:
        check = f"; see the whole mapping with `{suggestions['dry run'].command}`" if "dry run" in suggestions else ""
        lines.append(("ambiguous", f"{len(c.ambiguous)} positions share their shape with another (e.g. "
                                   f"{c.ambiguous[0]}): any permutation of them fits{check}"))
    return lines


def _fix_reason(c: Comparison) -> str:
    parts = []
    if c.renames:
        by_shape = ""
        if c.paired:
            guessed = (f"; {len(c.ambiguous)} of them by position among keys of one shape, listed as ambiguous"
                       if c.ambiguous else "")
            by_shape = f" ({len(c.paired)} paired by shape alone{guessed})"
        parts.append(f"renames {len(c.renames)} keys onto the model's{by_shape}")
    leftovers = [k for k in c.dropped if k not in set(c.replaced)]
    if leftovers:
        parts.append(f"drops {len(leftovers)} the model has no place for ({', '.join(leftovers[:3])}"
                     f"{'…' if len(leftovers) > 3 else ''}; {c.leftover_elements:,} parameters)")
    if c.replaced:
        parts.append(f"drops {len(c.replaced)} whose shape differs from the model's ({', '.join(c.replaced[:3])}"
                     f"{'…' if len(c.replaced) > 3 else ''}: a new head?)")
    if c.dropped_entries:
        many = len(c.dropped_entries) > 1
        parts.append(f"leaves out {len(c.dropped_entries)} entr{'ies' if many else 'y'} beside the tensors that "
                     f"hold{'' if many else 's'} no tensor ({', '.join(c.dropped_entries[:3])}"
                     f"{'…' if len(c.dropped_entries) > 3 else ''}): key{'s' if many else ''} the model does not "
                     "take")
    if c.fix_kind == "allowed":
        parts.append(f"the model keeps its own {len(c.left_missing)} there, accepted by the --allow-missing in the "
                     "line")
    elif c.fix_kind == "map-by-order":
        parts.append("maps tensors by position: names differ, the shapes agree")
        if c.ambiguous:
            parts.append(f"--force accepts {len(c.ambiguous)} ambiguous positions (below): check the mapping first")
    elif c.fix_kind == "partial":
        parts.append("the closest fix found; a strict load still fails")
    if c.missing_devices:
        parts.append(f"re-tags {', '.join(c.missing_devices)}")
    if c.ties:
        parts.append(f"writes {len(c.ties)} tied name{'s' if len(c.ties) > 1 else ''} as the tensor "
                     f"{'they share' if len(c.ties) > 1 else 'it shares'} ({c.ties[0][0]})")
    if not parts:
        root = c.fix_root or c.state_dict_root
        parts.append(f"writes the state_dict at {root} alone, as the file to hand to load_state_dict" if root else
                     "writes the state_dict alone")
    if c.fix_kind in ("rename", "allowed", "retag", "none"):
        parts.append("then a strict load succeeds" if c.fix_kind != "allowed" else "then it loads")
    return "; ".join(parts)
