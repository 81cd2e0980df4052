"""Renders a VerifyReport: the per-mode table, the module summary, the lines for stderr and the JSON of docs/cli.md."""

from __future__ import annotations

from typing import Any

from ..advice import Promise, Suggestion, fix_suggestions, shell_path
from ..analyze import human_bytes
from ..transforms import exact_keys_regex
from ..errors import percent
from ..verify import RunResult, Status, VerifyReport
from .columns import draw_table
from .compare_out import comparison_json, comparison_lines


def verify_advice(report: VerifyReport, rerun: Any = None) -> list[tuple[str, Any]]:
    """The commands a refused verify suggests (label, Suggestion): the fix line that makes the file load; or, when
    the file already holds all it can and only the model's own values for keys it lacks remain (a new head), this
    verify again with the --allow-missing that accepts them — `rerun(flags)` makes that command from the user's."""
    c = report.comparison
    if c is None or not report.refused or c.strict_ok:
        return []
    if c.fix_kind == "allowed" and not c.renames and not c.dropped and c.left_missing and rerun is not None:
        argv = rerun(("--allow-missing", exact_keys_regex(c.left_missing)))
        if argv is not None:
            return [("verify", Suggestion(tuple(argv), Promise.SHOWS, "accepts that the model keeps its own values "
                                                                      "for the keys the file lacks"))]
    return fix_suggestions(report.checkpoint, c)


def verify_json(report: VerifyReport, advice: list[tuple[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ok": report.ok,
        "exit_code": report.exit_code,
        "problems": list(report.problems),
        "suggested_commands": [dict(s.json(), label=label) for label, s in advice or []],
        "checkpoint": report.checkpoint,
        "model": report.model,
        "loaded_fraction": report.loaded_fraction,
        "required_fraction": report.required_fraction,
        "lazy_modules": list(report.lazy),
        "torch_load_refuses": report.torch_load or None,
        "tolerance": {"rtol": report.tolerance.rtol, "atol": report.tolerance.atol,
                      "default": "torch.testing.assert_close's for each output's dtype, x16 where the batch was "
                                 "split" if report.tolerance.rtol is None or report.tolerance.atol is None else None},
        "runs": [{"mode": r.mode.value, "world_size": r.world_size, "backend": r.backend, "devices": list(r.devices),
                  "status": r.status.value, "max_abs_diff": r.max_abs_diff, "rtol": r.rtol, "atol": r.atol,
                  "seconds": round(r.seconds, 3), "detail": r.detail, "peak_memory": r.peak_memory,
                  **({"ranks": [_rank_json(k) for k in r.ranks]} if r.ranks else {})} for r in report.runs],
    }
    if report.refused:  # the load's verdict is why nothing ran: all of it
        out["comparison"] = comparison_json(report.comparison)
    if report.summary:
        out["summary"] = [{"module": m.name, "type": m.kind, "output_shape": m.output_shape, "params": m.params}
                          for m in report.summary]
    if report.compared_to is not None:
        out["compared_to"] = report.compared_to
        out["compare_model"] = report.compare_model
        out["first_difference"] = report.first_difference
    return out


def _rank_json(rank: Any) -> dict[str, Any]:
    """One DDP rank: its device, the batch rows it ran (DistributedSampler's split), its verdict and memory."""
    return {"rank": rank.rank, "device": rank.device, "status": rank.status, "samples": rank.samples,
            "max_abs_diff": rank.max_abs_diff, "rtol": rank.rtol, "atol": rank.atol, "error": rank.error or None,
            "where": rank.where or None, "peak_memory": rank.peak_memory}


def verify_table(report: VerifyReport, tablefmt: str = "simple") -> str:
    """One row per run; what each device or rank used is in the JSON, the table shows the largest."""
    rows = [[r.mode.value, r.status.value.upper(), _devices(r), r.backend,
             "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.3g}", f"{r.seconds:.2f}", _peak(r), r.detail]
            for r in report.runs]
    text = draw_table(["mode", "status", "devices", "backend", "max|diff|", "seconds", "peak memory", "detail"],
                      rows, tablefmt)
    if report.summary:
        text += "\n\n" + draw_table(["module", "type", "output shape", "params"],
                                     [[m.name, m.kind, m.output_shape, f"{m.params:,}"] for m in report.summary],
                                     tablefmt)
    return text


def _devices(run: RunResult) -> str:
    """`cpu`, `cpu ×2` for two ranks on the CPU, `cuda:0-3` for four GPUs in a row."""
    devices = list(run.devices)
    if len(devices) > 1 and len(set(devices)) == 1:
        return f"{devices[0]} ×{len(devices)}"
    if len(devices) > 2 and all(d.startswith("cuda:") and d[5:].isdigit() for d in devices):
        ids = [int(d[5:]) for d in devices]
        if ids == list(range(ids[0], ids[0] + len(ids))):
            return f"cuda:{ids[0]}-{ids[-1]}"
    return ",".join(devices)


def _peak(run: RunResult) -> str:
    """The largest peak of the run's devices or ranks (`/rank` when there are several)."""
    if not run.peak_memory:
        return "-"
    most = human_bytes(max(run.peak_memory.values()))
    return f"{most}/rank" if len(run.peak_memory) > 1 else most


def verify_lines(report: VerifyReport, advice: list[tuple[str, Any]] | None = None) -> list[tuple[str, bool]]:
    """The lines for stderr, each with whether it tells of a problem (shown red): the share loaded, the load's
    verdict when it stopped verify, the comparison with --compare-to, and the verdict, from `report.problems`."""
    lines: list[tuple[str, bool]] = []
    if report.torch_load:  # verify reads the tensors itself: a pass says nothing of torch.load(path)
        lines.append((f"torch.load  FAILS with torch's defaults here ({report.torch_load}); verify read the tensors "
                      f"itself: `ckpt-doctor inspect {shell_path(report.checkpoint)}` prints the fix that writes a "
                      "file it loads", False))
    if report.lazy:
        lines.append((f"lazy        {', '.join(report.lazy)}: parameters created by one forward on the inputs "
                      "before the load, as torch creates them", False))
    if report.loaded_fraction is not None:
        required = report.required_fraction
        low = report.refused and report.comparison.strict_ok
        lines.append((f"loaded      {percent(report.loaded_fraction)} of the model's parameters (by elements) came from "
                      f"{report.checkpoint}" + (f"; {percent(required)} required" if required is not None else ""), low))
    if report.refused:
        given = dict(advice or [])
        for label, text in comparison_lines(report.comparison, report.checkpoint, given):
            lines.append((f"{label:<10}  {text}", False))
        if "verify" in given:
            lines.append((f"{'accept':<10}  `{given['verify'].command}`   ({given['verify'].why})", False))
        if report.comparison.strict_ok:
            lines.append(("verify did not pass — " + "; ".join(report.problems) + " (is --model the model "
                          "this file was saved from? --min-loaded sets the share required)", True))
        else:
            how = ("accept the model's own values there: the accept line" if "verify" in given else
                   "repair the file first: the fix line; or accept intended differences with --allow-missing / "
                   "--allow-unexpected" if "fix" in given else
                   "no fix was found: is --model the model this file was saved from? --allow-missing / "
                   "--allow-unexpected accept intended differences")
            lines.append(("verify did not pass — " + "; ".join(report.problems) + f" ({how})", True))
        return lines
    if report.compared_to:
        where = f"{report.compared_to} in {report.compare_model}" if report.compare_model else report.compared_to
        if report.first_difference:
            lines.append((f"first module whose output differs from {where}: {report.first_difference}", True))
        else:
            lines.append((f"every module's output agrees with {where}", False))
    if report.problems:
        lines.append(("verify did not pass — " + "; ".join(report.problems), True))
        return lines
    passed = [r.mode.value for r in report.runs if r.status is Status.PASS]
    skipped = ", ".join(report.skipped)
    if not skipped:
        lines.append((f"verify: every requested mode passed ({', '.join(passed)})", False))
    elif passed:
        lines.append((f"verify passed: {', '.join(passed)}; skipped for lack of hardware, accepted by --allow-skip: "
                      f"{skipped}", False))
    else:
        lines.append((f"verify passed on the load and the reference forward alone: {skipped} skipped for lack of "
                      "hardware, accepted by --allow-skip", False))
    return lines
