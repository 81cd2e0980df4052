"""Reading many files at once: the work is Python (walking pickles, parsing headers), so threads would take turns on
one core; processes forked from this one use every core and start in milliseconds.

Only pure functions of a path are given to `map_paths`, and results come back in the order of the paths, so the
output is the same as one process would give. Where forking is not available (Windows, macOS's default), or for a
handful of files, the work runs here.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
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
    if count < 2 or not can_fork():
        return [func(item) for item in items]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    chunk = max(1, len(items) // (count * 8))  # a few chunks per process: an odd slow file does not hold up the rest
    from concurrent.futures.process import BrokenProcessPool

    try:
        with ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("fork"),
                                 initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
            return list(pool.map(func, items, chunksize=chunk))
    except BrokenProcessPool:  # a worker was killed (the system out of memory?): said, not an internal error
        from .errors import CkptDoctorError

        raise CkptDoctorError("a worker process reading the files was killed (out of memory?); run again with "
                              "CKPT_DOCTOR_NO_FORK=1 to read them one at a time in this process") from None


def _die_with_parent(parent: int) -> None:
    """A worker ends when ckpt-doctor does, however it ends (SIGTERM, SIGKILL): Linux's parent-death signal, and a
    check for a parent that was already gone before it was set."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def can_fork() -> bool:
    """Whether this process may fork a worker: on Linux (elsewhere fork is unsafe with some system libraries, or
    missing), unless CKPT_DOCTOR_NO_FORK is set, and only with no other Python thread (a fork copies the calling
    thread alone, so a lock another one holds could stay locked in the worker forever)."""
    import sys

    if sys.platform != "linux" or os.environ.get("CKPT_DOCTOR_NO_FORK"):
        return False
    threading = sys.modules.get("threading")
    return threading is None or threading.active_count() == 1

