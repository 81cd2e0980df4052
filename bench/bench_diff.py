"""Benchmark: `ckpt-doctor diff A B` of two 1 GB checkpoints, against reading both once (`cat A B > /dev/null`).

    python bench/bench_diff.py [--dir /tmp/ckpt-bench] [--gb 1.0] [--rounds 3]

B is A with one tensor in eight scaled, C is A with every tensor scaled (a full fine-tune; written by torch in a child
process). Targets: diff <= 2x the `cat` of both
files, peak RSS <= 200 MB; `--html` adds <= 1 s for a 20,000-tensor pair. Each figure beside its baseline from the
same interleaved rounds. A vs C is the case diff's forked worker is for (half the float64 arithmetic on the second
core); the peak RSS wait4 reports is the larger of diff's and its worker's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import bench_args, compile_bytecode, figure, make_checkpoint, measure_rounds, record, row  # noqa: E402

CHANGE = """
import sys, torch
state = torch.load(sys.argv[1], mmap=True, weights_only=True)
every = int(sys.argv[3])
out = {k: (v * 1.001 if i % every == 0 else v) for i, (k, v) in enumerate(state.items())}
torch.save(out, sys.argv[2])
"""


def main() -> None:
    args = bench_args(__doc__)
    work = Path(args.dir)
    a = work / f"diff_a_{args.gb}gb.pt"
    b = work / f"diff_b_{args.gb}gb.pt"
    make_checkpoint(a, int(args.gb * 2**30), 1000)
    c = work / f"diff_c_{args.gb}gb.pt"
    for path, every in ((b, 8), (c, 1)):
        if not path.exists():
            subprocess.run([sys.executable, "-c", CHANGE, str(a), str(path), str(every)], check=True)
    many = work / "many_20000.pt"
    make_checkpoint(many, 64 << 20, 20000)
    compile_bytecode()
    exe = shutil.which("ckpt-doctor") or os.path.join(os.path.dirname(sys.executable), "ckpt-doctor")
    page = work / "diff.html"
    cmds = {
        "cat A B > /dev/null": ["sh", "-c", f"cat {a} {b} > /dev/null"],
        "ckpt-doctor diff A B --json": [exe, "diff", str(a), str(b), "--json"],
        "ckpt-doctor diff A C --json": [exe, "diff", str(a), str(c), "--json"],
        "diff, 20,000 tensors": [exe, "diff", str(many), str(many), "--json"],
        "diff, 20,000 tensors, --html": [exe, "diff", str(many), str(many), "--json", "--html", str(page)],
    }
    load_before = os.getloadavg()[0]
    results = measure_rounds(cmds, args.rounds)
    best = {label: (min(times), rss) for label, (times, rss) in results.items()}
    print(f"A {a} and B {b} ({a.stat().st_size / 2**30:.2f} GB each, 1,000 tensors, 125 changed); "
          f"C every tensor changed; best of {args.rounds} interleaved rounds; load average {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    cat_times = results["cat A B > /dev/null"][0]
    t_cat = best["cat A B > /dev/null"][0]
    for label, (seconds, rss) in best.items():
        extra = ""
        if label.startswith("ckpt-doctor diff"):  # each round's ratio to the cat of that round: a slow spell hits both
            ratios = sorted(t / c for t, c in zip(results[label][0], cat_times))
            extra = (f"  {seconds / t_cat:.2f}x cat (same-round ratio: median {ratios[len(ratios) // 2]:.2f}x, "
                     f"best {ratios[0]:.2f}x)")
        print(row(label, seconds, rss) + extra)
    t_diff, rss_diff = best["ckpt-doctor diff A B --json"]
    html_cost = best["diff, 20,000 tensors, --html"][0] - best["diff, 20,000 tensors"][0]
    print(f"--html for 20,000 tensors: +{html_cost:.3f} s, page {page.stat().st_size / 2**20:.2f} MB")
    t_all, rss_all = best["ckpt-doctor diff A C --json"]
    print(f"targets: diff <= 2x cat: {'met' if t_diff <= 2 * t_cat else 'NOT met'} (one in eight changed), "
          f"{'met' if t_all <= 2 * t_cat else 'NOT met'} (all changed); peak RSS <= 200 MB: "
          f"{'met' if max(rss_diff, rss_all) <= 200 else 'NOT met'}; --html <= +1 s: "
          f"{'met' if html_cost <= 1 else 'NOT met'}")
    figures = []
    for label, (times, rss) in results.items():
        mine = label.startswith("ckpt-doctor diff")
        note = None
        if mine:
            ratios = sorted(t / c for t, c in zip(times, cat_times))
            note = f"same-round ratio: median {ratios[len(ratios) // 2]:.2f}x"
        figures.append(figure(label, times, rss, "cat A B > /dev/null" if mine else None, cat_times if mine else None,
                              by="best", note=note))
    record(figures, [("diff A B <= 2x cat (one in eight changed)", t_diff <= 2 * t_cat),
                     ("diff A C <= 2x cat (every tensor changed)", t_all <= 2 * t_cat),
                     ("peak RSS <= 200 MB", max(rss_diff, rss_all) <= 200), ("--html <= +1 s", html_cost <= 1)],
           f"diff of two {args.gb} GB files")


if __name__ == "__main__":
    main()
