"""The figures table of docs/performance.md, made from what the bench scripts measured — never typed by hand.

    python bench/figures_table.py run [SCRIPT ...]   # run the scripts (all of RUNS, or those named), then write
    python bench/figures_table.py write              # write the table from the figures already measured
    python bench/figures_table.py check              # exit 1 when the docs' table is not what the figures give

Each script, run with CKPT_BENCH_FIGURES naming a file (`run` names bench/figures.jsonl), appends what it measured
there: every figure (the median and best of its rounds, its peak RSS, its ratio to its peer from the same rounds)
and every target, met or not, with the command line, the time and the load average. The table holds the latest
run of each script's each part; `write` puts it between the markers in docs/performance.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIGURES = HERE / "figures.jsonl"
DOCS = HERE.parent / "docs" / "performance.md"
START, END = "<!-- figures:start (bench/figures_table.py writes this part) -->", "<!-- figures:end -->"
# The runs behind the docs' figures, in the order they are shown (each script's own defaults otherwise).
RUNS = {
    "bench_inspect.py": ["--rounds", "7"],
    "bench_startup.py": ["--rounds", "11"],
    "bench_diff.py": ["--gb", "1.0", "--rounds", "7"],
    "bench_fix.py": ["--gb", "1.0", "--rounds", "3"],
    "bench_dcp.py": ["--chunks", "1000000", "--fix-gb", "1.0", "--rounds", "3"],
    "bench_deepspeed.py": ["--ranks", "8,64", "--rounds", "1"],
    "safety_figures.py": [],
}


def load(path: Path = FIGURES) -> list[dict]:
    """The latest entry of each part (a script's title) measured, in the order of RUNS, then of first appearance."""
    latest: dict[tuple[str, str], dict] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                entry = json.loads(line)
                script = Path(entry["command"].split()[1]).name
                latest.pop((script, entry["title"]), None)  # a newer run of the same part replaces it, and goes last
                latest[(script, entry["title"])] = entry
    order = list(RUNS)
    return [latest[k] for k in sorted(latest, key=lambda k: order.index(k[0]) if k[0] in order else len(order))]


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.3f} s"


def render(entries: list[dict]) -> str:
    """The markdown between the markers: a table for each part, its targets under it."""
    out = [START, ""]
    for entry in entries:
        out += [f"**{entry['title']}**: `{entry['command']}`, {entry['finished']}, {entry['cpus']} CPUs, load "
                f"average {entry['load']:.2f} at its end", "",
                "| figure | median | best | peak RSS | beside its peer, same rounds |",
                "| --- | --- | --- | --- | --- |"]
        for f in entry["figures"]:
            against = ""
            if f["ratio"] is not None:
                by = "medians" if f["by"] == "median" else "best against best"
                against = f"{f['ratio']:.2f}× {f['peer']} ({by})"
            if f.get("note"):
                against = f"{against}; {f['note']}" if against else f["note"]
            out.append(f"| {f['figure']} | {_seconds(f['median'])} | {_seconds(f['best'])} "
                       f"| {f['rss_mb']:.0f} MB | {against} |")
        targets = "; ".join(f"{t['target']}: {'met' if t['met'] else '**NOT met**'}" for t in entry["targets"])
        out += ["", f"Targets: {targets}.", ""]
    out.append(END)
    return "\n".join(out)


def docs_with(table: str, docs: str) -> str:
    if START not in docs or END not in docs:
        raise SystemExit(f"{DOCS} has no {START} … {END} markers to write between")
    before, rest = docs.split(START, 1)
    return before + table + rest.split(END, 1)[1]


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if len(sys.argv) > 1 else 2)
    verb, names = sys.argv[1], sys.argv[2:]
    if verb not in ("run", "write", "check"):
        sys.exit(f"no such verb: {verb} (run, write or check; --help says what each does)")
    if verb == "run":
        unknown = [n for n in names if n not in RUNS]
        if unknown:
            raise SystemExit(f"no such script in RUNS: {', '.join(unknown)} (one of {', '.join(RUNS)})")
        for script in names or RUNS:
            print(f"== {script} {' '.join(RUNS[script])}", file=sys.stderr)
            subprocess.run([sys.executable, str(HERE / script), *RUNS[script]], check=True,
                           env={**os.environ, "CKPT_BENCH_FIGURES": str(FIGURES)})
    docs = DOCS.read_text(encoding="utf-8")
    wanted = docs_with(render(load()), docs)
    if verb == "check":
        if wanted != docs:
            raise SystemExit(f"{DOCS}: its figures table is not what {FIGURES.name} gives; run "
                             "`python bench/figures_table.py write`")
        return
    DOCS.write_text(wanted, encoding="utf-8")
    print(f"wrote the figures of {len(load())} runs into {DOCS}", file=sys.stderr)


if __name__ == "__main__":
    main()
