"""docs/performance.md's table of the latest figures is what bench/figures.jsonl — the bench scripts' own record of
what they measured — gives (bench/figures_table.py), not figures typed by hand; and the record says what a user
must be able to read off it: each figure beside its peer, and whether each target was met."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import figures_table  # noqa: E402


def test_the_docs_table_is_what_the_recorded_figures_give():
    docs = figures_table.DOCS.read_text(encoding="utf-8")
    table = docs.split(figures_table.START, 1)[1].split(figures_table.END, 1)[0]
    assert figures_table.render(figures_table.load()) == figures_table.START + table + figures_table.END
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "figures_table.py"), "check"], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr


def test_every_script_of_the_runs_is_in_the_record_with_its_peers_and_targets():
    entries = figures_table.load()
    scripts = {entry["command"].split()[1].rsplit("/", 1)[-1] for entry in entries}
    assert scripts == set(figures_table.RUNS)
    for entry in entries:
        assert entry["targets"], entry["title"]
        assert any(f["ratio"] is not None and f["peer"] for f in entry["figures"]) \
            or "safety" in entry["command"], entry["title"]


def test_a_target_not_met_and_a_ratio_are_shown(tmp_path):
    record = tmp_path / "figures.jsonl"
    entry = {"command": "python bench/bench_diff.py --gb 1.0", "title": "diff of two files", "finished": "today",
             "cpus": 2, "load": 1.0, "figures": [
                 {"figure": "cat A B", "median": 0.2, "best": 0.19, "rss_mb": 13.0, "peer": None, "ratio": None,
                  "by": None, "note": None},
                 {"figure": "diff A C", "median": 0.5, "best": 0.45, "rss_mb": 47.0, "peer": "cat A B",
                  "ratio": 2.37, "by": "best", "note": "same-round ratio: median 2.4x"}],
             "targets": [{"target": "diff <= 2x cat", "met": False}, {"target": "peak RSS <= 200 MB", "met": True}]}
    older = {**entry, "finished": "yesterday", "targets": [{"target": "diff <= 2x cat", "met": True}]}
    record.write_text(json.dumps(older) + "\n" + json.dumps(entry) + "\n")
    table = figures_table.render(figures_table.load(record))
    assert "yesterday" not in table  # the latest run of a part replaces the earlier one
    assert "| diff A C | 0.500 s | 0.450 s | 47 MB | 2.37× cat A B (best against best); same-round ratio: median " \
           "2.4x |" in table
    assert "diff <= 2x cat: **NOT met**; peak RSS <= 200 MB: met." in table
