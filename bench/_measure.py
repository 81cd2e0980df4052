"""Runs a command as a child process and reports its wall time and peak RSS (from wait4's rusage)."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def measure(cmd: list[str], repeat: int = 3, before=None) -> tuple[float, float]:
    """Best wall time in seconds over `repeat` runs, and the peak RSS in MB of the last run.

    `before` runs untimed ahead of each run (e.g. remove the last output and flush dirty pages, so every run
    starts from the same state of the page cache).
    """
    best = float("inf")
    rss_mb = 0.0
    for _ in range(repeat):
        if before is not None:
            before()
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err = proc.stderr.read().decode() if proc.stderr else ""
        if proc.returncode not in (0, 1):
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-500:]}")
        best = min(best, elapsed)
        rss_mb = usage.ru_maxrss / 1024
    return best, rss_mb


def row(label: str, seconds: float, rss: float, base_seconds: float | None = None, base_label: str = "") -> str:
    ratio = f"  {base_seconds / seconds:6.1f}x faster than {base_label}" if base_seconds and seconds else ""
    return f"{label:<44} {seconds:8.3f} s  {rss:8.1f} MB{ratio}"
