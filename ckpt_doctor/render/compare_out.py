"""Renders a Comparison: the per-key verdict table, the summary lines, and the `comparison` JSON object."""

from __future__ import annotations

from typing import Any

from ..analyze import collapse_labels
from ..compare import Comparison, fix_command


def comparison_json(c: Comparison) -> dict[str, Any]:
    return {
        "ok": c.ok,
        "strict_load_ok": c.strict_ok,
        "model": c.model,
        "state_dict_root": c.state_dict_root,
        "matched": len(c.matched),
        "missing": list(c.missing),
        "unexpected": list(c.unexpected),
        "mismatched": [{"key": m.key, "checkpoint_shape": list(m.checkpoint_shape), "model_shape": list(m.model_shape)}
                       for m in c.mismatched],
        "dtype_differs": [{"key": k, "checkpoint_dtype": a, "model_dtype": b} for k, a, b in c.dtype_differs],
        "non_persistent": list(c.non_persistent),
        "bn_stats_missing": list(c.bn_stats_missing),
        "allowed_missing": list(c.allowed_missing),
        "allowed_unexpected": list(c.allowed_unexpected),
        "loaded_fraction": c.loaded_fraction,
        "suggested_fix": list(c.suggested_fix),
        "fix_kind": c.fix_kind,
        "fix_loaded_fraction": c.fix_loaded_fraction,
        "ambiguous": list(c.ambiguous),
    }


def verdict_rows(c: Comparison, shapes: dict[str, tuple], model_shapes: dict[str, tuple]) -> list[list[str]]:
    """[key, verdict, checkpoint shape, model shape] rows, repeated blocks collapsed."""
    mismatched = {m.key for m in c.mismatched}
    dtypes = {k for k, _, _ in c.dtype_differs}
    entries: list[tuple[str, str]] = []
    for key in model_shapes:
        if key in mismatched:
            verdict = "shape mismatch"
        elif key in c.missing:
            verdict = "missing (BatchNorm stats)" if key in c.bn_stats_missing else "missing"
        elif key in c.allowed_missing:
            verdict = "missing (allowed)"
        elif key in dtypes:
            verdict = "dtype differs"
        else:
            verdict = "matched"
        entries.append((key, verdict))
    entries += [(k, "unexpected") for k in c.unexpected]
    entries += [(k, "unexpected (allowed)") for k in c.allowed_unexpected]
    entries += [(k, "non-persistent buffer") for k in c.non_persistent]
    sigs = [(v, shapes.get(k), model_shapes.get(k)) for k, v in entries]
    rows = []
    for label, members in collapse_labels([k for k, _ in entries], sigs):
        key, verdict = entries[members[0]]
        ck = shapes.get(key)
        md = model_shapes.get(key)
        count = f" ×{len(members)}" if len(members) > 1 else ""
        rows.append([label, verdict + count, "" if ck is None else str(list(ck)), "" if md is None else str(list(md))])
    return rows


def comparison_lines(c: Comparison, path: str) -> list[tuple[str, str]]:
    total = len(c.matched) + len(c.missing) + len(c.mismatched) + len(c.allowed_missing)
    lines = [("verdict", ("strict load OK" if c.strict_ok else "strict load FAILS") +
              f": {len(c.matched)} of {total} model keys match; {len(c.missing)} missing, {len(c.unexpected)} "
              f"unexpected, {len(c.mismatched)} shape mismatches")]
    lines.append(("loaded", f"{c.loaded_fraction:.1%} of the model's parameters would be filled by this file"
                            + (f" (minimum {c.min_loaded:.1%})" if c.min_loaded is not None else "")))
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
    if c.allowed_missing or c.allowed_unexpected:
        lines.append(("allowed", f"{len(c.allowed_missing)} missing/mismatched and {len(c.allowed_unexpected)} "
                                 "unexpected keys accepted by --allow-missing/--allow-unexpected"))
    if c.suggested_fix:
        if c.fix_kind == "rename":
            how = "makes a strict load succeed"
        elif c.fix_kind == "map-by-order":
            how = "maps tensors by position: names differ, the shapes agree"
        elif c.fix_kind == "partial":
            how = "the closest match found; a strict load still fails"
        elif c.strict_ok:
            how = "writes the state_dict alone"
        elif c.non_persistent and not (c.missing or c.unexpected or c.mismatched):
            how = "drops the non-persistent buffers; then a strict load succeeds"
        else:
            how = (f"a strict load still fails: {len(c.mismatched)} shape mismatches, {len(c.missing)} missing — "
                   "accept an intended change with --allow-missing")
        if c.fix_loaded_fraction is not None:
            how += f"; it would fill {c.fix_loaded_fraction:.1%} of the parameters"
        lines.append(("fix", f"{fix_command(path, c)}   ({how})"))
    for pos in c.ambiguous[:10]:
        lines.append(("ambiguous", f"position {pos} has a neighbour of the same shape: check it (verify "
                                   "--summary --compare-to)"))
    if len(c.ambiguous) > 10:
        lines.append(("ambiguous", f"… {len(c.ambiguous) - 10} more"))
    return lines
