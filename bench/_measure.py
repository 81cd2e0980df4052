"""Runs a command as a child process and reports its wall time and peak RSS (from wait4's rusage)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# A JSON-lines file each script appends its figures and targets to when this names one (bench/figures_table.py sets
# it, then renders what was appended into docs/performance.md); unset, the scripts only print.
FIGURES_ENV = "CKPT_BENCH_FIGURES"

MAKE = """
import sys, torch
path, total, n, prefix = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
per = max(total // n // 4, 1)
side = int(per ** 0.5)
torch.save({f"{prefix}layers.{i // 8}.block{i % 8}.weight": torch.randn(side, per // side) for i in range(n)}, path)
"""


def tensor_shape(total_bytes: int, n_tensors: int) -> tuple[int, int]:
    """The (rows, cols) of every float32 tensor make_checkpoint writes."""
    per = max(total_bytes // n_tensors // 4, 1)
    side = int(per ** 0.5)
    return side, per // side


def make_checkpoint(path: Path, total_bytes: int, n_tensors: int, prefix: str = "") -> None:
    """`layers.{i}.block{j}.weight` float32 tensors; written by a child process, because a parent that held the
    tensors would pass its peak RSS on to every child it forks (wait4 reports the inherited high-water mark)."""
    if not path.exists():
        print(f"writing {path} …", file=sys.stderr)
        subprocess.run([sys.executable, "-c", MAKE, str(path), str(total_bytes), str(n_tensors), prefix], check=True)


def compile_bytecode() -> None:
    """Write ckpt_doctor's .pyc files, as `pip install` of a wheel does and Python does on first import, so
    start-up is measured as users see it. (This machine sets PYTHONDONTWRITEBYTECODE, under which an editable
    install recompiles every module on every run: about 20 ms more per command.)"""
    import compileall

    import ckpt_doctor

    compileall.compile_dir(str(Path(ckpt_doctor.__file__).parent), quiet=1)


def bench_args(doc: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/ckpt-bench")
    parser.add_argument("--gb", type=float, default=1.5)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5, help="runs of each command (the best counts)")
    args = parser.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    return args


def run_once(cmd: list[str]) -> tuple[float, float]:
    """Wall time in seconds and peak RSS in MB of one run of `cmd`."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode not in (0, 1):
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-500:]}")
    return elapsed, usage.ru_maxrss / 1024


def measure(cmd: list[str], repeat: int = 3, before=None) -> tuple[float, float]:
    """Best wall time in seconds over `repeat` runs, and the highest peak RSS in MB among them.

    `before` runs untimed ahead of each run (e.g. remove the last output and flush dirty pages, so every run
    starts from the same state of the page cache).
    """
    times, rss_mb = measure_rounds({"": cmd}, repeat, before)[""]
    return min(times), rss_mb


def measure_rounds(cmds: dict[str, list[str]], rounds: int, before=None) -> dict[str, tuple[list[float], float]]:
    """Every command once per round, in turn, `rounds` times: a slow spell of the machine then hits all of them
    alike instead of whichever ran during it. Returns each command's times and its highest peak RSS in MB."""
    times: dict[str, list[float]] = {label: [] for label in cmds}
    peak: dict[str, float] = dict.fromkeys(cmds, 0.0)
    for _ in range(rounds):
        for label, cmd in cmds.items():
            if before is not None:
                before()
            elapsed, rss_mb = run_once(cmd)
            times[label].append(elapsed)
            peak[label] = max(peak[label], rss_mb)
    return {label: (times[label], peak[label]) for label in cmds}


def figure(label: str, times: list[float], rss: float, peer: str | None = None,
           peer_times: list[float] | None = None, by: str = "median", note: str | None = None) -> dict:
    """One figure as `record` keeps it: its median and best seconds, its peak RSS, and its ratio to its peer from
    the same rounds (`by`: median against median, or best against best)."""
    ratio = None
    if peer_times:
        pick = statistics.median if by == "median" else min
        ratio = pick(times) / pick(peer_times)
    return {"figure": label, "median": statistics.median(times), "best": min(times), "rss_mb": rss, "peer": peer,
            "ratio": ratio, "by": by if peer_times else None, "note": note}


def record(figures: list[dict], targets: list[tuple[str, bool]], title: str | None = None) -> None:
    """Appends this run's figures and targets, with the command that ran and the machine's state, to the file
    FIGURES_ENV names (nothing when it is unset): bench/figures_table.py makes the docs' table of them."""
    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    entry = {"command": " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]]), "title": title,
             "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
             "load": round(os.getloadavg()[0], 2), "figures": figures,
             "targets": [{"target": name, "met": bool(ok)} for name, ok in targets]}
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(entry) + "\n")


def row(label: str, seconds: float, rss: float, base_seconds: float | None = None, base_label: str = "") -> str:
    ratio = f"  {base_seconds / seconds:6.1f}x faster than {base_label}" if base_seconds and seconds else ""
    return f"{label:<44} {seconds:8.3f} s  {rss:8.1f} MB{ratio}"


def consolidation_report(cmds: dict[str, list[str]], rounds: int, before, official: str, copy: str, fix: str,
                         inspect: str, title: str | None = None) -> None:
    """Run `cmds` in interleaved rounds and print each best time beside the official tool's and the copy's, then
    the consolidation targets: fix <= 0.5x the official tool and <= 1.5x the copy, <= 150 MB; inspect <= 0.3 s."""
    results = measure_rounds(cmds, rounds, before=before)
    best = {label: (min(times), rss) for label, (times, rss) in results.items()}
    t_off, t_cp = best[official][0], best[copy][0]
    for label, (seconds, rss) in best.items():
        extra = f"  {seconds / t_off:.2f}x {official.split()[0]}, {seconds / t_cp:.2f}x cp -r" \
            if label.startswith("fix") else ""
        print(row(label, seconds, rss) + extra)
    t_fix, rss_fix = best[fix]
    t_inspect = best[inspect][0]
    checks = [(f"{fix} <= 0.5x {official.split()[0]}", t_fix <= 0.5 * t_off),
              (f"{fix} <= 1.5x cp -r", t_fix <= 1.5 * t_cp), (f"{fix} peak RSS <= 150 MB", rss_fix <= 150),
              ("inspect <= 0.3 s", t_inspect <= 0.3)]
    print(f"targets ({fix}): <= 0.5x {official.split()[0]}: {'met' if checks[0][1] else 'NOT met'}; "
          f"<= 1.5x cp -r: {'met' if checks[1][1] else 'NOT met'}; peak RSS <= 150 MB: "
          f"{'met' if checks[2][1] else 'NOT met'}; inspect <= 0.3 s: {'met' if checks[3][1] else 'NOT met'}")
    record([figure(label, times, rss, official if label.startswith("fix") else None,
                   results[official][0] if label.startswith("fix") else None, by="best")
            for label, (times, rss) in results.items()], checks, title)


# The peers the inspect figures are set beside, each run as `python -c SCRIPT FILE` in a fresh process.
TO_SAFETENSORS = """
import sys, torch
from safetensors.torch import save_file
save_file({k: v.contiguous() for k, v in torch.load(sys.argv[1], mmap=True, weights_only=True).items()}, sys.argv[2])
"""
SAFE_OPEN = """
import sys
from safetensors import safe_open
with safe_open(sys.argv[1], "np") as f:
    print([(k, f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()])
"""
TORCH_LISTING = """
import sys, torch
sd = torch.load(sys.argv[1], mmap=True, weights_only=True)
print([(k, tuple(v.shape), v.dtype) for k, v in sd.items()])
"""
