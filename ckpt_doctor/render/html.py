"""`--html FILE` for inspect and diff: one self-contained page (inline CSS and SVG, no script, no network).

Charts are drawn here as SVG and Unicode blocks, so the page opens offline from a CI artifact and stays small:
histograms are 16 block characters, and the heat map of a diff has at most HEAT_CELLS cells (each the largest
change of the tensors it covers).
"""

from __future__ import annotations

import html
import math
from collections import OrderedDict
from typing import Any

from ..advice import shell_word
from ..analyze import collapse_labels, human_bytes
from ..report import count_phrase

BLOCKS = " ▁▂▃▄▅▆▇█"
HEAT_CELLS = 1500
MAX_ROWS = 2000

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1200px;color:#1d2433;
background:#fff}h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #dde}
.sub{color:#566}code,pre,.mono{font:12.5px ui-monospace,SFMono-Regular,Menlo,monospace}pre{white-space:pre-wrap}
.verdict{padding:10px 14px;border-radius:6px;font-weight:600;margin:14px 0}.ok{background:#e6f6ec;color:#14532d}
.bad{background:#fdecec;color:#7f1d1d}.warn{background:#fff6e0;color:#713f12}
table{border-collapse:collapse;width:100%}td,th{padding:3px 8px;border-bottom:1px solid #eef;text-align:left;
vertical-align:top}th{background:#f5f6fa;position:sticky;top:0}td.num{text-align:right;font-variant-numeric:tabular-nums}
.flag{color:#b91c1c;font-weight:600}.hist{letter-spacing:-1px;color:#3b5bdb}svg text{font:11px system-ui,sans-serif}
"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _num(x: float | None) -> str:
    if x is None:
        return ""
    if x != x or math.isinf(x):
        return str(x)
    return f"{x:.4g}"


GENERATOR = "<meta name=generator content=ckpt-doctor>"  # how --html knows a page it may replace


def page(title: str, body: list[str]) -> str:
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>" + GENERATOR + "<meta name=viewport "
            "content='width=device-width,initial-scale=1'><title>" + _e(title) + "</title><style>" + CSS +
            "</style></head><body>" + "".join(body) + "</body></html>")


def bars(items: list[tuple[str, float]], unit: str, width: int = 1100) -> str:
    """Horizontal bars, largest first: a label, a bar proportional to the value, the value."""
    if not items:
        return "<p class=sub>(nothing to chart)</p>"
    top = max(v for _, v in items) or 1
    row_h, label_w = 20, 360
    out = [f"<svg role=img width={width} height={row_h * len(items) + 4}>"]
    for i, (label, value) in enumerate(items):
        y = i * row_h + 2
        w = max(1.0, (width - label_w - 120) * value / top)
        out.append(f"<text x=0 y={y + 14}>{_e(label[:60])}</text><rect x={label_w} y={y + 3} width={w:.1f} "
                   f"height={row_h - 6} fill='#4c6ef5'/><text x={label_w + w + 6:.1f} y={y + 14}>{_e(unit(value))}"
                   "</text>")
    out.append("</svg>")
    return "".join(out)


def histogram(counts: tuple[int, ...]) -> str:
    top = max(counts, default=0)
    if not top:
        return ""
    return "".join(BLOCKS[0 if not c else max(1, round(c / top * (len(BLOCKS) - 1)))] for c in counts)


def _modules(tensors, depth: int) -> list[tuple[str, float]]:
    sizes: OrderedDict[str, float] = OrderedDict()
    for t in tensors:
        parts = t.key.split(".")
        name = ".".join(parts[:depth]) if len(parts) > depth else ".".join(parts[:-1]) or t.key
        sizes[name] = sizes.get(name, 0) + t.numel
    return sorted(sizes.items(), key=lambda kv: -kv[1])[:40]


def _params(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{int(n)}"


def inspect_html(report: Any) -> str:
    ckpt = report.checkpoint
    unsafe = ckpt.verdict.value != "safe"
    body = [f"<h1>{_e(ckpt.path)}</h1><p class=sub>{_e(ckpt.format.value)} · {len(ckpt.tensors):,} tensors · "
            f"{_e(count_phrase(report))} · {_e(human_bytes(report.total_bytes))}</p>"]
    if unsafe:
        names = ", ".join(ckpt.finding_names()[:6])
        body.append(f"<p id=verdict class='verdict bad'>UNSAFE: torch.load(weights_only=False) would run code "
                    f"({_e(names)})</p>")
    else:
        body.append("<p id=verdict class='verdict ok'>Safe: every global the file names is on the allow-list</p>")
    c = report.comparison
    if c is not None:  # the words and the fix line the terminal prints, from the same code
        # only with --model: compare_out brings compare, modelspec and transforms, which a page without one never needs
        from .compare_out import comparison_lines, full_verdict, needs_code_text

        needs_code = needs_code_text(ckpt) if report.needs_code else ""
        cls = "ok" if c.ok and not needs_code else "bad"
        body.append(f"<h2>Against the model</h2><p id=comparison class='verdict {cls}'>"
                    f"{_e(full_verdict(c, needs_code))}</p>")
        fixes = [text for label, text in comparison_lines(c, str(ckpt.path), dict(report.suggestions), needs_code)
                 if label == "fix"]
        if fixes:
            body.append("<p>The fix:</p><pre id=fix>" + _e(fixes[0]) + "</pre>")
    body.append("<h2>Parameters per module</h2>" + bars(_modules(ckpt.tensors, 1), _params))
    if len(_modules(ckpt.tensors, 1)) < 6:
        body.append("<h2>One level deeper</h2>" + bars(_modules(ckpt.tensors, 2), _params))
    stats = report.stats or {}
    by_key = {t.key: t for t in ckpt.tensors}
    bad = [k for k, s in stats.items() if s is not None and (s.nan or s.inf)]
    dead = [k for k, s in stats.items() if s is not None and _dead(by_key.get(k), s)]
    if stats:
        parts = []
        if bad:
            parts.append(f"NaN/Inf in {len(bad)} tensors: " + ", ".join(bad[:6]))
        if dead:
            parts.append(f"{len(dead)} weight matrices hold one value throughout (dead): " + ", ".join(dead[:6]))
        cls = "bad" if bad else "warn" if dead else "ok"
        text = "; ".join(parts) or "No NaN, no Inf, no dead weight matrix"
        body.append(f"<h2>Values</h2><p id=values class='verdict {cls}'>{_e(text)}</p>")
    rows = list(report.tensors)
    groups = collapse_labels([t.key for t in rows], [(t.shape, t.dtype) for t in rows])
    body.append("<h2>Tensors</h2><table><tr><th>key</th><th>shape</th><th>dtype</th><th>size</th><th>min</th>"
                "<th>max</th><th>mean</th><th>std</th><th>values</th><th></th></tr>")
    for label, members in groups[:MAX_ROWS]:
        t = rows[members[0]]
        s = stats.get(t.key)
        flags = []
        if s is not None and (s.nan or s.inf):
            flags.append(f"NaN {s.nan} Inf {s.inf}")
        if s is not None and _dead(t, s):
            flags.append("dead (one value)")
        times = f" ×{len(members)}" if len(members) > 1 else ""
        cells = [f"<td class=mono>{_e(label)}</td><td class=mono>{_e(list(t.shape))}</td><td>{_e(t.dtype)}</td>"
                 f"<td class=num>{_e(human_bytes(t.nbytes))}{times}</td>"]
        if s is not None:
            cells.append("".join(f"<td class=num>{_num(v)}</td>" for v in (s.min, s.max, s.mean, s.std)))
            cells.append(f"<td class='mono hist'>{histogram(s.hist)}</td>")
        else:
            cells.append("<td></td>" * 5)
        cells.append(f"<td class=flag>{_e(', '.join(flags))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    body.append("</table>")
    if len(groups) > MAX_ROWS:
        body.append(f"<p class=sub>… {len(groups) - MAX_ROWS:,} more rows (the JSON lists every tensor)</p>")
    return page(f"ckpt-doctor · {ckpt.path}", body)


def _dead(t: Any, s: Any) -> bool:
    """A weight matrix or kernel (2+ dims, floating) whose values are all one: it cannot have learned. Vectors are
    left out: a fresh BatchNorm's weight (all 1) and a bias (all 0) are constant by design."""
    return t is not None and len(t.shape) >= 2 and t.numel > 1 and t.dtype.startswith(("float", "bfloat")) and \
        s.constant


def _color(rel: float | None, top: float) -> str:
    """White for no change, through yellow to dark red for the largest (log scale from 1e-8 of the top)."""
    if rel is None:
        return "#e9ecef"
    if rel != rel or math.isinf(rel):
        return "#5f0f40"
    if rel == 0:
        return "#ffffff"
    lo = math.log10(max(top, 1e-30)) - 8
    x = min(1.0, max(0.0, (math.log10(rel) - lo) / 8)) if top else 0
    r, g, b = 255, int(245 - 200 * x), int(200 - 190 * x)
    return f"#{r:02x}{max(g, 0):02x}{max(b, 0):02x}"


def diff_html(report: Any) -> str:
    rows = list(report.rows)
    paired = [r for r in rows if r.stats is not None]
    cls = "ok" if report.same else "bad"
    verdict = "Identical" + (" within the tolerances" if report.count("close") else "") if report.same else \
        f"The checkpoints differ: {report.count('changed')} changed, {report.count('shape')} reshaped, " \
        f"{report.count('only-a')} only in A, {report.count('only-b')} only in B"
    body = [f"<h1>diff</h1><p class=sub>A: {_e(report.a.path)}<br>B: {_e(report.b.path)}</p>",
            f"<p id=verdict class='verdict {cls}'>{_e(verdict)}</p>"]
    if report.renamed_by:
        source = "by the flags given" if report.names_given else "as <code>inspect A --model B</code> infers"
        body.append(f"<p>Names matched {source}: <code>"
                    f"{_e(' '.join(shell_word(f) for f in report.renamed_by))}</code></p>")
    if report.bn_drift:
        layers = _e(", ".join(report.bn_drift))
        body.append("<p id=bn-drift class='verdict warn'>BatchNorm running stats changed while the weights stayed "
                    f"bit-identical (a frozen BatchNorm left in train mode?): {layers}</p>")
    # only for diff --html, where ckpt_doctor.diff is loaded already: an inspect --html page does not pay for it
    from ..diff import largest_changes

    changed = largest_changes(rows)
    if changed:
        body.append("<h2>Largest changes</h2><ol id=top-changes>")
        for r in changed[:10]:
            body.append(f"<li><code>{_e(r.key)}</code> ‖Δ‖/‖A‖ {_num(r.stats.rel)} · max|Δ| {_num(r.stats.max_abs)}"
                        f" · cosine {_num(r.stats.cosine) or '—'}</li>")
        body.append("</ol>")
    body.append("<h2>Relative change over depth</h2>" + _heat(paired))
    body.append("<h2>Tensors that changed</h2><table><tr><th>key</th><th>status</th><th>shape</th><th>max|Δ|</th>"
                "<th>‖Δ‖/‖A‖</th><th>cosine</th></tr>")
    listed = [r for r in rows if r.status != "identical"]
    for r in listed[:MAX_ROWS]:
        s = r.stats
        body.append(f"<tr><td class=mono>{_e(r.key)}</td><td>{_e(r.status)}</td><td class=mono>"
                    f"{_e(list(r.shape_b or r.shape_a or ()))}</td><td class=num>{_num(s.max_abs if s else None)}</td>"
                    f"<td class=num>{_num(s.rel if s else None)}</td><td class=num>"
                    f"{_num(s.cosine if s else None)}</td></tr>")
    body.append("</table>")
    if not listed:
        body.append("<p class=sub>Every tensor is bit-identical.</p>")
    return page("ckpt-doctor diff", body)


def _heat(paired: list) -> str:
    """One cell per tensor in A's order (or per run of tensors, each cell their largest change), left to right."""
    if not paired:
        return "<p class=sub>(no tensors in both)</p>"
    values = [r.stats.rel for r in paired]
    keys = [r.key for r in paired]
    step = max(1, math.ceil(len(values) / HEAT_CELLS))
    cells = []
    for i in range(0, len(values), step):
        chunk = values[i:i + step]
        worst = max(range(len(chunk)), key=lambda j: chunk[j] if chunk[j] == chunk[j] else math.inf)
        cells.append((keys[i + worst], chunk[worst], keys[i], keys[min(i + step, len(keys)) - 1]))
    finite = [v for _, v, _, _ in cells if v == v and not math.isinf(v)]
    top = max(finite, default=0.0)
    per_row = 100
    size = 11
    height = math.ceil(len(cells) / per_row) * size
    out = [f"<svg id=heatmap role=img width={per_row * size} height={height + 2}>"]
    for n, (key, value, first, last) in enumerate(cells):
        x, y = (n % per_row) * size, (n // per_row) * size
        span = key if first == last else f"{first} … {last} (largest: {key})"
        out.append(f"<rect x={x} y={y} width={size - 1} height={size - 1} fill='{_color(value, top)}' "
                   "stroke='#dee2e6' stroke-width='0.5'>"
                   f"<title>{_e(span)}: {_num(value)}</title></rect>")
    out.append("</svg><p class=sub>Each cell: ‖Δ‖/‖A‖ of a tensor in A's order (left to right, top to bottom), "
               "white = unchanged, dark red = the largest change (log scale), purple = A all zeros.</p>")
    return "".join(out)
