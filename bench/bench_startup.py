"""Benchmark: whole-process `ckpt-doctor inspect` / `scan` / `--help`, each beside its peer from the same run.

    python bench/bench_startup.py [--dir /tmp/ckpt-bench] [--gb 1.0] [--rounds 11]

Peers: `python -c pass`; `python -c "import click"` (the command line's own package); listing the same safetensors
file's keys, shapes and dtypes with the safetensors library's `safe_open` (framework "np") in a fresh Python;
listing the same torch file with `torch.load(mmap=True)`. Every command runs once per round, in turn (a slow spell
hits all alike); the median and the best of the rounds are printed, with peak RSS, and each figure as a ratio to its
peer. Targets (issues 16 and 25): inspect of a 1-2 GB safetensors file, table and --json, faster than the
`safe_open` listing; `--help` <= 2x `python -c pass` + the import of click (that is, <= `python -c pass` +
`python -c "import click"`); inspect --json and the table of a 1-2 GB file <= 0.05 s, <= 30 MB; 20,000 tensors
<= 0.2 s; `inspect DIR` of 500 checkpoints of a few MB <= 2 s. What `inspect FILE` imports, with the table and
with --json, and what each import costs (python -X importtime), is listed last, so a regression shows.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import (SAFE_OPEN, TO_SAFETENSORS, TORCH_LISTING, bench_args, compile_bytecode,  # noqa: E402
                      figure, make_checkpoint, measure_rounds, record)

IMPORT_CLICK = "import click"
MAKE_FOLDER = """
import os, sys, torch
from safetensors.torch import save_file
folder, count = sys.argv[1], int(sys.argv[2])
os.makedirs(folder, exist_ok=True)
torch.manual_seed(0)
names = ("q.weight", "k.weight", "v.weight", "o.weight")
state = {f"layers.{i}.{n}": torch.randn(128, 128) for i in range(8) for n in names}
state.update({f"layers.{i}.norm.weight": torch.ones(128) for i in range(8)})
for j in range(count):
    path = os.path.join(folder, f"step_{j:04d}" + (".safetensors" if j % 4 == 0 else ".pt"))
    save_file(state, path) if j % 4 == 0 else torch.save({"model": state, "step": j}, path)
"""


def main() -> None:
    args = bench_args(__doc__)
    rounds = args.rounds if args.rounds != 5 else 11
    work = Path(args.dir)
    pt = work / f"big_{args.gb}gb_{args.tensors}.pt"
    st = work / f"big_{args.gb}gb_{args.tensors}.safetensors"
    many = work / "many_20000.pt"
    folder = work / "folder500"
    make_checkpoint(pt, int(args.gb * 2**30), args.tensors)
    make_checkpoint(many, 20_000 * 64, 20_000)
    if not st.exists():
        subprocess.run([sys.executable, "-c", TO_SAFETENSORS, str(pt), str(st)], check=True)
    if not folder.is_dir() or len(os.listdir(folder)) < 500:
        subprocess.run([sys.executable, "-c", MAKE_FOLDER, str(folder), "500"], check=True)
    compile_bytecode()
    py = sys.executable
    exe = shutil.which("ckpt-doctor") or os.path.join(os.path.dirname(py), "ckpt-doctor")
    os.system(f"cat {pt} {st} {many} > /dev/null")  # both sides read from the page cache
    cmds = {
        "python -c pass": [py, "-c", "pass"],
        "python -c 'import click'": [py, "-c", IMPORT_CLICK],
        "ckpt-doctor --help": [exe, "--help"],
        "ckpt-doctor inspect --help": [exe, "inspect", "--help"],
        "safe_open listing (safetensors)": [py, "-c", SAFE_OPEN, str(st)],
        "inspect --json (safetensors)": [exe, "inspect", str(st), "--json"],
        "inspect, table (safetensors)": [exe, "inspect", str(st)],
        "inspect --format github (safetensors)": [exe, "inspect", str(st), "--format", "github"],
        "scan (safetensors)": [exe, "scan", str(st)],
        "torch.load(mmap=True) listing (torch zip)": [py, "-c", TORCH_LISTING, str(pt)],
        "inspect --json (torch zip)": [exe, "inspect", str(pt), "--json"],
        "inspect, table (torch zip)": [exe, "inspect", str(pt)],
        "scan (torch zip)": [exe, "scan", str(pt)],
        "inspect --json (20,000 tensors)": [exe, "inspect", str(many), "--json"],
        "inspect DIR (500 checkpoints)": [exe, "inspect", str(folder), "--json"],
    }
    results = measure_rounds(cmds, rounds)
    med = {label: statistics.median(times) for label, (times, _) in results.items()}
    t_pass, t_click = med["python -c pass"], med["python -c 'import click'"]
    help_limit = t_pass + t_click  # 2x `python -c pass` + the import of click (t_click - t_pass)
    peers = {  # each command's peer in this run: (its label, the figure the ratio is against)
        "python -c 'import click'": ("python -c pass", t_pass),
        "ckpt-doctor --help": ("2x pass + import click", help_limit),
        "ckpt-doctor inspect --help": ("2x pass + import click", help_limit),
    }
    for label in cmds:
        if "(safetensors)" in label and "safe_open" not in label:
            peers[label] = ("safe_open", med["safe_open listing (safetensors)"])
        elif "(torch zip)" in label and "torch.load" not in label:
            peers[label] = ("torch.load(mmap)", med["torch.load(mmap=True) listing (torch zip)"])
        elif label.startswith("inspect"):
            peers[label] = ("python -c pass", t_pass)
    print(f"safetensors {st} and torch zip {pt} ({pt.stat().st_size / 2**30:.2f} GB, {args.tensors} tensors); "
          f"{many} (20,000 tensors); {folder} (500 files); {rounds} interleaved rounds")
    print(f"{'command':<44} {'median':>8}   {'best':>8}   {'peak RSS':>9}   ratio of medians to its peer")
    for label, (times, rss) in results.items():
        peer = peers.get(label)
        ratio = f"   {med[label] / peer[1]:5.2f}x {peer[0]}" if peer else ""
        print(f"{label:<44} {med[label]:8.3f} s {min(times):8.3f} s {rss:8.1f} MB{ratio}")
    peer_st = med["safe_open listing (safetensors)"]
    checks = [
        ("inspect table and --json faster than safe_open", max(med["inspect --json (safetensors)"],
                                                              med["inspect, table (safetensors)"]) < peer_st),
        ("--help <= 2x pass + import click", max(med["ckpt-doctor --help"], med["ckpt-doctor inspect --help"])
         <= help_limit),
        ("1-2 GB file, inspect/scan <= 0.05 s", all(med[k] <= 0.05 for k in cmds if k.startswith(
            ("inspect --json (s", "inspect --json (t", "inspect, table", "scan")))),
        ("peak RSS <= 30 MB", all(results[k][1] <= 30 for k in cmds if "(safetensors)" in k and "safe_open" not in k
                                  or "(torch zip)" in k and "torch.load" not in k)),
        ("20,000 tensors <= 0.2 s", med["inspect --json (20,000 tensors)"] <= 0.2),
        ("500 files <= 2 s", med["inspect DIR (500 checkpoints)"] <= 2),
    ]
    print("targets: " + "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in checks))
    figures = []
    for label, (times, rss) in results.items():
        peer = peers.get(label)
        if peer is not None and peer[0] == "2x pass + import click":  # a sum of two figures, not one command
            pair = [a + b for a, b in zip(results["python -c pass"][0], results["python -c 'import click'"][0])]
            figures.append(figure(label, times, rss, "python -c pass + python -c 'import click'", pair))
        else:
            names = {"safe_open": "safe_open listing (safetensors)",
                     "torch.load(mmap)": "torch.load(mmap=True) listing (torch zip)"}
            name = names.get(peer[0], peer[0]) if peer else None
            figures.append(figure(label, times, rss, name, results[name][0] if name else None))
    record(figures, checks, f"start-up, and inspect of a {args.gb} GB file")
    print_imports(exe, st, "--json")
    print_imports(exe, st)


def print_imports(exe: str, path: Path, *flags: str) -> None:
    """What `inspect FILE [flags]` imports, the costliest first (cumulative µs of each top-level import)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", exe, "inspect", str(path), *flags],
                          capture_output=True, text=True)
    rows = []  # (name indented by depth, self µs, cumulative µs)
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        self_us, cumulative, name = line[len("import time:"):].split("|")
        if cumulative.strip().isdigit():  # not the header
            rows.append((name[1:].rstrip(), int(self_us), int(cumulative)))
    print(f"modules imported by `ckpt-doctor inspect FILE{''.join(' ' + f for f in flags)}`: {len(rows)}, "
          f"{sum(s for _, s, _ in rows) / 1000:.1f} ms in all (self times, under -X importtime)")
    top = [r for r in rows if not r[0].startswith(" ")]  # imported by the program itself, not by a module
    for name, _, cumulative in sorted(top, key=lambda r: -r[2]):
        print(f"  {cumulative / 1000:6.2f} ms  {name}")
    print("  every module: " + ", ".join(r[0].strip() for r in rows))


if __name__ == "__main__":
    main()
