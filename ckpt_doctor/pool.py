"""Reading many files at once: the work is Python (walking pickles, parsing headers), so threads would take turns on
one core; processes forked from this one use every core and start in milliseconds.

Only pure functions of a path are given to `map_paths`, and results come back in the order of the paths, so the
output is the same as one process would give. Where forking is not available (Windows, macOS's default), or for a
handful of files, the work runs here.
"""

from __future__ import annotations

import os
from typing import Callable, TypeVar

T = TypeVar("T")
R = TypeVar("R")

MIN_PER_WORKER = 8  # fewer files than this per process: starting processes costs more than it saves


def workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def map_paths(func: Callable[[T], R], items: list[T]) -> list[R]:
    """[func(item) for item in items], spread over forked processes when there are enough items and cores."""
    count = min(workers(), len(items) // MIN_PER_WORKER)
    if count < 2 or not _can_fork():
        return [func(item) for item in items]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    chunk = max(1, len(items) // (count * 8))  # a few chunks per process: an odd slow file does not hold up the rest
    with ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(func, items, chunksize=chunk))


def _can_fork() -> bool:
    import sys

    if sys.platform != "linux" or os.environ.get("CKPT_DOCTOR_NO_FORK"):
        return False
    import threading

    return threading.active_count() == 1  # forking a process with threads can copy a held lock into the child
