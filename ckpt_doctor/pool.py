"""Reading many files at once: the work is Python (walking pickles, parsing headers), so threads would take turns on
one core; processes forked from this one use every core and start in milliseconds.

Only pure functions of a path are given to `map_paths`, and results come back in the order of the paths, so the
output is the same as one process would give. Where forking is not available (Windows, macOS's default), or for a
handful of files, the work runs here.
"""

from __future__ import annotations

import os

from .errors import CkptDoctorError

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
                                 initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
            return list(pool.map(func, items, chunksize=chunk))
    except BrokenProcessPool:  # a worker was killed (the system out of memory?): said, not an internal error
        raise CkptDoctorError("a worker process reading the files was killed (out of memory?); run again with "
                              "CKPT_DOCTOR_NO_FORK=1 to read them one at a time in this process") from None


def die_with_parent(parent: int) -> None:
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



def openblas_libraries() -> list[str]:
    """The paths of the OpenBLAS libraries this process has loaded (NumPy's, once it is imported); none where there
    is no /proc to tell."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps
                           if "openblas" in line.lower() and line.split()[-1].startswith("/")})
    except OSError:
        return []


class one_blas_thread:
    """NumPy's OpenBLAS held to one thread for the block, then given back what it had.

    diff shares its arithmetic between this process and one forked worker; OpenBLAS's own threads in both (one per
    core each) then spin against each other: the dot products of a 1 GB pair with one tensor in eight changed took
    9-14 s through pread, 0.5-0.7 s with one BLAS thread a process. The setter is found in the OpenBLAS library
    this process has loaded (its name differs between builds); where there is none (another BLAS, no /proc), the
    block runs as it is."""

    _NAMES = (("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
              ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
              ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
              ("openblas_set_num_threads", "openblas_get_num_threads"))

    def __enter__(self) -> one_blas_thread:
        self.restore: list = []
        libraries = openblas_libraries()
        if libraries:
            import ctypes  # only when an OpenBLAS is loaded
        for path in libraries:
            try:
                library = ctypes.CDLL(path)
            except OSError:
                continue
            for set_name, get_name in self._NAMES:
                setter, getter = getattr(library, set_name, None), getattr(library, get_name, None)
                if setter is not None and getter is not None:
                    setter.argtypes, getter.restype = [ctypes.c_int], ctypes.c_int
                    self.restore.append((setter, getter()))
                    setter(1)
                    break
        return self

    def __exit__(self, *exc: object) -> None:
        for setter, threads in self.restore:
            setter(threads)
