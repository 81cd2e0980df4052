"""Human renderings: the tensor table for stdout and the summary lines for stderr."""

from __future__ import annotations

from ..analyze import collapse_labels, human_bytes
from ..readers.source import usage_line
from ..records import DcpFolder, TensorTable, relative_to_root
from ..report import InspectReport, count_phrase
from .columns import KEYS, draw_table
from .lines import Line, Severity

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from ..advice import Suggestion
    from ..default_load import DefaultLoad


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.4g}"


def inspect_table(report: InspectReport, full: bool = False, tablefmt: str = "simple") -> str:
    if report.comparison is not None:
        return comparison_table(report, tablefmt)
    table = TensorTable.of(report.tensors)
    keys, shapes, dtypes, devices = table.keys, table.shapes, table.dtypes, table.devices
    rows = [(k, [i]) for i, k in enumerate(keys)] if full else \
        collapse_labels(keys, list(zip(shapes, dtypes, devices)))
    headers = ["key", "shape", "dtype", "device", "size"]
    layouts = report.checkpoint.layouts
    if layouts:
        headers.append("layout (as saved)")
    with_stats = report.stats is not None
    if with_stats:
        headers += ["min", "max", "mean", "std", "nan/inf"]
    nbytes = table.nbytes()
    body = []
    for label, members in rows:
        i = members[0]
        size = human_bytes(nbytes[i])
        if len(members) > 1:
            size = f"{len(members)} × {size}"
        line = [label, str(list(shapes[i])), dtypes[i], devices[i], size]
        if layouts:
            line.append(layouts.get(keys[i], ""))
        if with_stats:
            stats = [report.stats.get(keys[m]) for m in members]  # type: ignore[union-attr]
            s = stats[0]
            if s is None:
                line += ["", "", "", "", ""]
            else:
                lo = min((x.min for x in stats if x and x.min is not None), default=None)
                hi = max((x.max for x in stats if x and x.max is not None), default=None)
                bad = sum(x.nan + x.inf for x in stats if x)
                mean, std = (s.mean, s.std) if len(stats) == 1 else (None, None)
                line += [_fmt(lo), _fmt(hi), _fmt(mean), _fmt(std), str(bad) if bad else ""]
        body.append(line)
    if not body and tablefmt == "simple":  # a person's terminal; a program given --format gets the empty table
        return "(no tensors)" if not report.filter else f"(no tensor key matches --filter {report.filter!r})"
    return draw_table(headers, body, tablefmt, max_width=KEYS)


def comparison_table(report: InspectReport, tablefmt: str = "simple") -> str:
    # only with --model: compare_out brings compare, modelspec and transforms, which plain inspect never pays for
    from ..transforms import compile_regex
    from .compare_out import fix_prefix, renames_on_two_lines, verdict_rows

    c = report.comparison
    shapes = {t.key: t.shape for t in relative_to_root(report.checkpoint.tensors, c.state_dict_root)}
    if c.fix_root is not None:  # the part the fix selects, spelled as the rows spell it
        at = fix_prefix(c)
        shapes.update({at + t.key: t.shape for t in relative_to_root(report.checkpoint.tensors, c.fix_root)})
    body = verdict_rows(report.comparison, shapes, report.model_shapes)
    if report.filter:
        pattern = compile_regex(report.filter, "--filter")
        body = [row for row in body if pattern.search(row[0])]
    headers = ["key", "verdict", "checkpoint", "model"]
    if tablefmt == "simple":  # two lines for a rename too wide for the terminal's table; other formats keep rows whole
        body = renames_on_two_lines(headers, body)
    return draw_table(headers, body, tablefmt, max_width=KEYS)


def inspect_summary(report: InspectReport, full: bool = False) -> list[str]:
    """Lines for stderr, each `label  text`, a PROBLEM where its row says why the exit code is 1."""
    ckpt = report.checkpoint
    lines: list[tuple[str, str]] = []
    kind = "whole-model pickle of " + ckpt.model_class if ckpt.model_class else None
    lines.append(("format", ckpt.format.value + (f" ({kind})" if kind else "")))
    shown = f" ({len(report.tensors)} shown by --filter)" if report.filter else ""
    lines.append(("tensors", f"{len(ckpt.tensors):,}{shown} in {report.storage_count:,} storages · "
                             f"{count_phrase(report)} · {human_bytes(report.total_bytes)}"))
    chosen = report.comparison.state_dict_root if report.comparison is not None else ckpt.state_dict_root
    if chosen is not None and chosen != ckpt.state_dict_root:
        found = ckpt.state_dict_root or "(the file's root)"
        lines.append(("state_dict", f"{chosen or '(the file root)'} (selected; the one found: {found})"))
    elif ckpt.state_dict_root is not None:
        root = ckpt.state_dict_root or "(the file's root)"
        others = ckpt.other_state_dicts
        shown = others if full or len(others) <= 8 else (*others[:8], f"… {len(others) - 8} more (--full)")
        lines.append(("state_dict", root + (f" (other state_dicts: {', '.join(shown)})" if others else "")))
    elif ckpt.tensors:
        lines.append(("state_dict", "not found (no container holds mostly tensors)"))
    if isinstance(ckpt.distributed, DcpFolder) and ckpt.distributed.contents:
        lines.append(("contents", " · ".join(ckpt.distributed.contents)))
    for p in report.prefixes:
        where = ("leading" if not p.where else f"leading, after {p.where}") if p.leading else f"after {p.where!r}"
        lines.append(("prefix", f"{p.prefix} ({where}) on {p.count:,} of {p.total:,} keys" if p.certain else
                      f"{p.prefix} on {p.count:,} of {p.total:,} keys: possibly a wrapper's, or a submodule named "
                      f"{p.prefix[:-1]} (not every key carries it)"))
    devices = ckpt.devices
    if devices:
        from collections import Counter

        counts = Counter(TensorTable.of(ckpt.tensors).devices)
        shown = devices if full or len(devices) <= 8 else devices[:8]
        more = f", … {len(devices) - len(shown)} more devices" if len(shown) < len(devices) else ""
        lines.append(("saved on", ", ".join(f"{d} ({counts[d]:,} tensors)" for d in shown) + more))
    if ckpt.metadata:
        # The file's own values (epoch, step, args) before those nested deeper (an optimizer's param_groups), which
        # would otherwise fill the line's 8 places in a {"model", "optimizer", "epoch", "args"} checkpoint
        items = sorted(ckpt.metadata.items(), key=lambda item: item[0].count("."))
        limit = len(items) if full else 8
        text = ", ".join(f"{k}={v!r}" if not isinstance(v, str) else f"{k}={v}" for k, v in items[:limit])
        if len(items) > limit:
            text += f", … {len(items) - limit} more (--json or --full lists all)"
        lines.append(("metadata", text))
    for g in report.shared[: None if full else 5]:
        how = "tied, same bytes" if g.same_bytes else "views of one storage"
        keys = " = ".join(g.keys if full or len(g.keys) <= 6 else (*g.keys[:6], f"… {len(g.keys) - 6} more"))
        lines.append(("shared", f"{keys} ({how})"))
    if not full and len(report.shared) > 5:
        lines.append(("shared", f"… {len(report.shared) - 5} more groups (--full)"))
    if ckpt.non_persistent:
        lines.append(("non-persistent", ", ".join(ckpt.non_persistent) + " (in the pickle, not in state_dict)"))
    lines += safety_lines(ckpt, full, report.default_load, dict(report.suggestions).get("rescue"))
    if report.default_load is not None:
        lines += default_load_lines(report)
    for layer in report.batchnorm_at_init:
        lines.append(("batchnorm", f"{layer}: running stats at their initial values (mean 0, var 1, never updated)"))
    if report.stats:
        bad = [k for k, s in report.stats.items() if s is not None and (s.nan or s.inf)]
        if bad:
            lines.append(("values", f"NaN/Inf in {len(bad)} tensors: {', '.join(bad[:5])}"))
    for note in ckpt.notes + report.extra_notes:
        lines.append(("note", note))
    if report.comparison is not None:
        from .compare_out import comparison_lines, needs_code_text  # only with --model, as in comparison_table

        lines += comparison_lines(report.comparison, str(ckpt.path), dict(report.suggestions),
                                  needs_code=needs_code_text(ckpt) if report.needs_code else "")
        others = [_EXIT_REASONS[p] for p in report.problems if p in _EXIT_REASONS]
        if report.comparison.ok and others:  # a load that succeeds, in a run that fails: said where "OK" is read
            lines = [(label, f"{text}; exit 1 all the same: {', '.join(others)}" if label == "verdict" else text)
                     for label, text in lines]
    if report.value_diffs:
        worst = sorted(report.value_diffs.items(), key=lambda kv: -kv[1])[:3]
        lines.append(("values", f"max |diff| over {len(report.value_diffs)} common tensors: "
                                + ", ".join(f"{k} {v:.3g}" for k, v in worst)))
    elif report.value_diffs is not None:
        lines.append(("values", "no common tensors of the same shape to compare"))
    network = usage_line()
    if network is not None:
        lines.append(("network", network))
    width = max(len(label) for label, _ in lines)
    problems = summary_problems(report)
    return [Line(f"{label:<{width}}  {text}", Severity.PROBLEM if label in problems else Severity.INFO)
            for label, text in lines]


# What else than the comparison makes inspect --model exit 1, as the verdict line says it (the line above names it).
_EXIT_REASONS = {"default-load": "torch.load fails with torch's defaults (--require-default-load)",
                 "values": "NaN/Inf values (--stats)", "batchnorm": "BatchNorm statistics never updated"}


def summary_problems(report: InspectReport) -> set[str]:
    """The labels of the summary lines that say why the exit code is 1 (coloured on a terminal)."""
    labels = set()
    for problem in report.problems:
        labels |= {"unsafe": {"DANGEROUS", "CODE", "safety", "torch.load"}, "values": {"values"},
                   "batchnorm": {"batchnorm"}, "comparison": {"verdict"}, "default-load": {"torch.load"}}[problem]
    if "unsafe" in report.problems and report.comparison is not None:
        labels.add("verdict")  # it says the file needs code to load
    return labels


def default_load_lines(report: InspectReport) -> list[tuple[str, str]]:
    """What torch.load(path) with torch's defaults does with the file here, and the ways out when it fails."""
    loads = report.default_load
    if loads is None or not loads.applies:
        return []
    what = str(report.checkpoint.path)  # the file torch.load opens (a model folder's weights file, named)
    if loads.ok:
        return [("torch.load", f"{what} loads with torch's defaults here (weights_only=True, no map_location)")]
    ways = []
    if loads.trusted_way_out:
        names = ", ".join(loads.trusted_way_out)
        mapped = ", map_location='cpu'" if loads.missing_devices else ""
        ways.append(f"for code you trust, torch.serialization.add_safe_globals([{names}]) before "
                    f"torch.load(path{mapped})")
    elif loads.missing_devices and not loads.refused and not loads.format_reason:
        ways.append("torch.load(path, map_location='cpu')")
    suggestions = dict(report.suggestions)
    if "torch.load" in suggestions:
        ways.append(f"a file that loads everywhere: `{suggestions['torch.load'].command}`")
    elif "fix" in suggestions:
        trusted = suggestions["fix"].safe_globals
        ways.append(f"the fix line below writes one that loads within torch.serialization.safe_globals("
                    f"[{', '.join(trusted)}])" if trusted else "the fix line below writes one that does")
    text = f"{what} FAILS with torch's defaults here: " + "; ".join(loads.reasons())
    if ways:
        text += ". Ways out: " + "; or ".join(ways)
    if report.require_default_load:
        text += " (--require-default-load: exit 1)"
    return [("torch.load", text)]


def safety_lines(ckpt, full: bool = False, loads: DefaultLoad | None = None,
                 rescue: Suggestion | None = None) -> list[tuple[str, str]]:
    """What the file would run under torch.load(weights_only=False): one line per finding, then the verdict.
    `loads`: the report's torch.load verdict (its line follows); `rescue`: the fix that writes a copy without the
    findings, for a file torch.load loads with its defaults."""
    lines: list[tuple[str, str]] = []
    findings = sorted(ckpt.unsafe_globals, key=lambda g: -g.verdict.rank)
    shown = findings if full else findings[:8]
    for g in shown:
        lines.append((g.verdict.value.upper(), f"{g.qualname} in {g.source}: {g.reason}"))
    if len(findings) > len(shown):
        lines.append((findings[-1].verdict.value.upper(), f"… {len(findings) - len(shown)} more (--full lists all)"))
    for h in ckpt.hazards:
        lines.append((h.verdict.value.upper(), h.what))
    if findings or any(not h.beside for h in ckpt.hazards):
        from ..default_load import met_by_torch

        met = {(g.module, g.name) for g in met_by_torch(ckpt)}
        if not findings or any((g.module, g.name) in met for g in findings):  # (a hazard has its own line)
            risk = "torch.load(weights_only=False) would import and run the above; never load this file that way"
        else:  # only in pickles torch never reads (a member np.load would unpickle, one no loader of torch's reads)
            risk = ("unpickling the pickles named above (pickle.load, np.load(allow_pickle=True)) would import and "
                    "run what they name, though torch.load reads none of them; never unpickle them")
        way_out = "" if loads is None or not loads.applies else "; the torch.load line says how to rescue its " \
            "tensors" if not loads.ok else "; torch.load with its defaults loads them (the torch.load line)"
        if rescue is not None:
            way_out += f"; a copy without what they name: `{rescue.command}`"
        lines.append(("safety", f"UNSAFE: {risk}. Its tensors are listed{way_out}"))
    elif ckpt.hazards:  # only the files beside it: this one is clean, the folder is not
        lines.append(("safety", f"UNSAFE folder: {ckpt.path.name} itself names nothing off the allow-list, but the "
                                "file(s) above would run code when loaded; never load them with pickle (scan of the "
                                "folder gives each file's verdict)"))
    return lines
