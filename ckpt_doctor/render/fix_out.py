"""Renders a fix: the dry-run listing (old → new for every key) and the JSON result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..analyze import human_bytes
from ..fix import FixPlan, FixResult
from ..readers.source import usage, usage_line


def fix_json(plan: FixPlan, result: FixResult | None,
             sharded: tuple[list[Path], Path] | None = None) -> dict[str, Any]:
    """The result as JSON; a dry run's (`result` None) names the shards and index the write would make."""
    shards = result.shards if result else sharded[0] if sharded else ()
    cast, left = plan.cast
    return {
        "ok": True,  # a fix that could not be done ends in one Error line (exit 2) and no JSON; 1 when --model refuses
        "exit_code": 0,
        "input": str(plan.input),
        "output": str(result.plan.output if result else sharded[1] if sharded else plan.output),
        "format": plan.format.value,
        "applied": list(plan.applied),
        "renamed": {old: new for old, new in plan.renamed.items() if old != new},
        "dropped": list(plan.dropped),
        "tensors": len(plan.tensors) - len(plan.tied),
        "bytes": plan.nbytes,  # the tensors' bytes, as the dry run's "would hold" and the write's "wrote" lines say
        "file_bytes": result.bytes if result else None,  # what the write put on disk (shards and index together)
        "verified": bool(result and result.verified),
        "dry_run": result is None,
        "write_refusal": str(plan.write_refusal) if result is None and plan.write_refusal is not None else None,
        "tied": plan.shared,  # alias -> key: in safetensors written once, in a torch file or DCP folder one storage
        # --dtype: the tensors cast, and the floating ones written as saved (beside the state_dict); null without it
        "dtype": {"to": plan.dtype, "cast": len(cast), "left": len(left)} if plan.dtype else None,
        "notes": list(plan.notes),
        "unknown_globals": list(result.unknown_globals) if result else [],
        "safe_globals": list(result.safe_globals) if result else [],
        **({"shards": [str(p) for p in shards]} if shards else {}),
        "removed": [str(p) for p in result.removed] if result else [],
        **_remote(),
    }


def _remote() -> dict[str, Any]:
    """Bytes and requests used over the network (a URL as the source), when any were."""
    used = usage()
    return {"remote": used} if used is not None else {}


def dry_run_table(plan: FixPlan) -> str:
    rows = []
    marked = set(plan.ambiguous)
    shared = plan.shared  # a tied name → the one it shares a tensor with (safetensors: stored once, as that one)
    how = "stored once, as" if plan.tied else "tied: the tensor of"

    def written(new: str) -> str:
        return f"{new} ({how} {shared[new]})" if new in shared else new

    for old, new in plan.renamed.items():
        rows.append([old, "≈" if old in marked else "→" if old != new else "=", written(new)])
    for key in plan.dropped:
        rows.append([key, "✗", "(dropped)"])
    names = set(plan.renamed.values())
    for alias, key in plan.ties:  # a name --tie added (one it replaced, a copy of the same bytes, has its row)
        if alias not in names:
            rows.append([key, "+", written(alias)])
    from .columns import KEYS, draw_table  # only when a table is drawn: --json does not import the table code

    return draw_table(["key", "", "output key"], rows, max_width=KEYS)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _shortened(step: str) -> str:
    """An applied step for a person: `--plain-data: a (…), b (…), … 7 more` (--json lists every one)."""
    head, colon, items = step.partition(": ")
    parts = items.split("), ")
    if not colon or len(parts) <= 5:
        return step
    return f"{head}: {'), '.join(parts[:5])}), … {len(parts) - 5} more"


def _dropped(plan: FixPlan) -> str:
    """`3 dropped (optimizer, epoch, args)`: what the output lost, named where it is a few entries (a --select or an
    --auto leaves a training checkpoint's optimizer out; a count alone hid which)."""
    tops = list(dict.fromkeys(key.split(".", 1)[0] for key in plan.dropped))
    named = f" ({', '.join(plan.dropped)})" if 0 < len(plan.dropped) <= 6 else \
        f" (under {', '.join(tops)})" if plan.dropped and len(tops) <= 6 else \
        " (--dry-run lists them)" if plan.dropped else ""
    return f"{len(plan.dropped)} dropped{named}"


def _tied(plan: FixPlan) -> str:
    """`, 1 tied (lm_head.weight = embed.weight)`: the names the output holds as another's tensor, as --json `tied`
    lists them (written by --tie or as the file had them; in safetensors stored once)."""
    ties, how = list(plan.shared.items()), "tied, stored once" if plan.tied else "tied"
    if not ties:
        return ""
    shown = ", ".join(f"{alias} = {key}" for alias, key in ties[:4])
    return f", {len(ties)} {how} ({shown}{', …' if len(ties) > 4 else ''})"


def fix_summary(plan: FixPlan, result: FixResult | None,
                sharded: tuple[list[Path], Path] | None = None) -> list[str]:
    renamed = sum(1 for o, n in plan.renamed.items() if o != n)
    lines = []
    what = f"{_n(len(plan.tensors) - len(plan.tied), 'tensor')}, {human_bytes(plan.nbytes)}, {plan.format.value}"
    if result is None:
        output = sharded[1] if sharded else plan.output  # sharded: the index names the shards
        lines.append(f"dry run: {output} would hold {what}; {_n(renamed, 'key')} renamed, "
                     f"{_dropped(plan)}{_tied(plan)}; nothing written")
    else:
        check = "verified: every storage re-read and its crc32 compared with the source" if result.verified else \
            "NOT verified (--no-verify)"
        lines.append(f"wrote {result.plan.output}: {what} ({human_bytes(result.bytes)} on disk); "
                     f"{_n(renamed, 'key')} renamed, {_dropped(plan)}{_tied(plan)}; {check}")
    if plan.applied:
        lines.append("applied: " + "; ".join(_shortened(step) for step in plan.applied))
    shards, index = (result.shards, result.plan.output) if result else sharded or ((), plan.output)
    if shards:
        names = shards[0].name if len(shards) == 1 else f"{shards[0].name} … {shards[-1].name}"
        lines.append(f"{_n(len(shards), 'shard')}: {names}, index {index.name}")
    lines += [f"note: {n}" for n in plan.notes]
    if result and result.removed:  # --force replaced an earlier output of this name: what of it went, said
        names = [p.name for p in result.removed]
        more = f", … {len(names) - 4} more" if len(names) > 4 else ""
        lines.append(f"removed (--force): {', '.join(names[:4])}{more} — what an earlier output of this name left "
                     "beside it")
    if result and result.unknown_globals:
        names = ", ".join(result.unknown_globals)
        classes = f", and builds NumPy dtypes of class {', '.join(result.dtype_classes)}" if result.dtype_classes else ""
        lines.append(f"note: the output names {names}, allowed with --allow-global{classes}; load it with "
                     f"torch.serialization.safe_globals([{', '.join(result.safe_globals)}]) around "
                     "torch.load(weights_only=True)")
    network = usage_line()
    if network is not None:
        lines.append(f"network: {network}")
    return lines
