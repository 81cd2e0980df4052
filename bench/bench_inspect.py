"""Benchmark: `ckpt-doctor inspect` by tensor count — 1,000, 20,000 and 200,000 tensors, safetensors and torch zip —
each beside the peers from the same run.

    python bench/bench_inspect.py [--dir /tmp/ckpt-bench] [--rounds 7] [--counts 1000,20000,200000]

For each count N, one torch zip of N float32 tensors (`layers.{i}.block{j}.weight`, 64 bytes each) and the same
tensors as a safetensors file. Peers: the safetensors library's `safe_open(path, "np")` listing (keys, and each
`get_slice`'s shape and dtype) of the safetensors file, in a fresh Python; `torch.load(mmap=True, weights_only=True)`
and a listing of the torch zip. Every command runs once per round, in turn (a slow spell hits all alike); the median
of the rounds is printed with the best and peak RSS, and as a ratio to `safe_open` of the same tensors. The machine's
load average is printed before and after: on a shared machine compare ratios from one run, not seconds across runs.
At 20,000 tensors, also a training checkpoint of that many (a model of 5,000 parameters and its Adam state: a step
and two moments each, under int keys), beside the same peers.

Targets (issue 27): `inspect --json` and the table of a safetensors file ahead of `safe_open` at 1,000 and 20,000
tensors; a torch zip of 20,000 tensors within 1.5x `safe_open` of the same tensors; 200,000 tensors linear from
there (time / 10 ≤ the 20,000 figure, with 10% slack, and the same ratio to the peer).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import (SAFE_OPEN, TO_SAFETENSORS, TORCH_LISTING, compile_bytecode, figure,  # noqa: E402
                      make_checkpoint, measure_rounds, record)

TRAINING = """
import sys, torch
net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(int(sys.argv[2]) // 8)])
opt = torch.optim.Adam(net.parameters())
net(torch.randn(1, 4)).sum().backward()
opt.step()
torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, sys.argv[1])
"""
TRAINING_LISTING = """
import sys, torch
ckpt = torch.load(sys.argv[1], mmap=True, weights_only=True)
print([(k, tuple(v.shape)) for k, v in ckpt["model"].items()],
      [(i, k, tuple(v.shape)) for i, s in ckpt["optimizer"]["state"].items() for k, v in s.items()])
"""



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/ckpt-bench")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--counts", default="1000,20000,200000")
    parser.add_argument("--baseline-code", metavar="DIR", help="also time `inspect` with the ckpt_doctor package in "
                        "DIR (a checkout of an earlier commit), in the same rounds: before and after from one run")
    args = parser.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    counts = [int(c) for c in args.counts.split(",")]
    files = {}
    for n in counts:
        pt, st = folder / f"many_{n}.pt", folder / f"many_{n}.safetensors"
        make_checkpoint(pt, n * 64, n)
        if not st.exists():
            subprocess.run([sys.executable, "-c", TO_SAFETENSORS, str(pt), str(st)], check=True)
        files[n] = (pt, st)
    compile_bytecode()
    py = sys.executable
    exe = shutil.which("ckpt-doctor") or os.path.join(os.path.dirname(py), "ckpt-doctor")
    os.system("cat " + " ".join(str(p) for pair in files.values() for p in pair) + " > /dev/null")
    if args.baseline_code:
        import compileall

        compileall.compile_dir(str(Path(args.baseline_code) / "ckpt_doctor"), quiet=1)
    cmds: dict[str, list[str]] = {"python -c pass": [py, "-c", "pass"]}
    for n, (pt, st) in files.items():
        cmds[f"{n}: safe_open listing (safetensors)"] = [py, "-c", SAFE_OPEN, str(st)]
        cmds[f"{n}: inspect --json (safetensors)"] = [exe, "inspect", str(st), "--json"]
        cmds[f"{n}: inspect, table (safetensors)"] = [exe, "inspect", str(st)]
        cmds[f"{n}: torch.load(mmap=True) listing (torch zip)"] = [py, "-c", TORCH_LISTING, str(pt)]
        cmds[f"{n}: inspect --json (torch zip)"] = [exe, "inspect", str(pt), "--json"]
        cmds[f"{n}: inspect, table (torch zip)"] = [exe, "inspect", str(pt)]
        if n == 20_000:
            training = folder / "training_20000.pt"
            if not training.exists():
                subprocess.run([sys.executable, "-c", TRAINING, str(training), str(n)], check=True)
            cmds[f"{n}: torch.load(mmap=True) listing (model + Adam)"] = [py, "-c", TRAINING_LISTING, str(training)]
            cmds[f"{n}: inspect --json (model + Adam)"] = [exe, "inspect", str(training), "--json"]
        if args.baseline_code:
            base = ["env", f"PYTHONPATH={Path(args.baseline_code).resolve()}", exe, "inspect"]
            cmds[f"{n}: baseline inspect --json (safetensors)"] = [*base, str(st), "--json"]
            cmds[f"{n}: baseline inspect --json (torch zip)"] = [*base, str(pt), "--json"]
    load_before = os.getloadavg()
    results = measure_rounds(cmds, args.rounds)
    load_after = os.getloadavg()
    med = {label: statistics.median(times) for label, (times, _) in results.items()}
    print(f"{os.cpu_count()} CPUs; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
          f"{args.rounds} interleaved rounds; files in {folder}")
    print(f"{'command':<50} {'median':>8}   {'best':>8}   {'peak RSS':>9}   median / safe_open of the same tensors")
    for label, (times, rss) in results.items():
        n = label.split(":")[0]
        peer = med.get(f"{n}: safe_open listing (safetensors)")
        ratio = f"   {med[label] / peer:5.2f}x" if peer and "safe_open" not in label else ""
        print(f"{label:<50} {med[label]:8.3f} s {min(times):8.3f} s {rss:8.1f} MB{ratio}")

    def ratio(n: int, what: str) -> float:
        return med[f"{n}: {what}"] / med[f"{n}: safe_open listing (safetensors)"]

    checks = []
    for n in (c for c in counts if c <= 20_000):
        checks.append((f"{n:,} safetensors --json and table ahead of safe_open",
                       max(ratio(n, "inspect --json (safetensors)"), ratio(n, "inspect, table (safetensors)")) < 1))
    if 20_000 in counts:
        checks.append(("20,000 torch zip within 1.5x safe_open", ratio(20_000, "inspect --json (torch zip)") <= 1.5))
    if 20_000 in counts and 200_000 in counts:
        for kind in ("safetensors", "torch zip"):
            what = f"inspect --json ({kind})"
            t20, t200 = med[f"20000: {what}"], med[f"200000: {what}"]
            print(f"{what}: 200,000 / 20,000 tensors = {t200 / t20:.1f}x the time (linear: 10x); ratio to safe_open "
                  f"{ratio(20_000, what):.2f} -> {ratio(200_000, what):.2f}")
            checks.append((f"200,000 {kind} linear", t200 <= 11 * t20))
    print("targets: " + "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in checks))
    figures = []
    for label, (times, rss) in results.items():
        peer = f"{label.split(':')[0]}: safe_open listing (safetensors)"
        mine = peer in results and label != peer
        figures.append(figure(label, times, rss, peer if mine else None, results[peer][0] if mine else None))
    record(figures, checks, "inspect of many tensors")


if __name__ == "__main__":
    main()
