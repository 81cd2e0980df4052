"""Files held still while this process maps them.

A mapped page that another process truncates away faults when it is read (SIGBUS), and the process dies: no
exception, no line. A read lease (Linux, `fcntl(F_SETLEASE, F_RDLCK)`) prevents it. Whoever then opens the file
for writing or truncates it waits until the holder lets go (at most /proc/sys/fs/lease-break-time, 45 s by default),
and the holder is told at once by SIGIO. Here that signal raises FileChanged in the main thread: the command
stops reading, unmaps, lets go, and ends in one line naming the file that changed. The truncation happens after.

Where no lease can be had (not Linux; a file open for writing somewhere, this process included; a file of
another user without CAP_LEASE; a filesystem without leases; a thread other than the main one, which cannot set
a signal handler), `hold` answers False and the caller reads that file with pread instead of mapping it.
"""

from __future__ import annotations

import os

from ..errors import ReadError


class FileChanged(ReadError):
    pass


class Holder:
    """Read leases taken file by file, every one let go on leaving the `with` block (after the caller's own
    clean-up: hold the files in a `with` around the code that maps them)."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        self._previous = None
        self._installed = False
        self._leaving = False

    def __enter__(self) -> Holder:
        try:
            import fcntl
            import signal
            import threading

            if threading.current_thread() is not threading.main_thread() or not hasattr(fcntl, "F_SETLEASE"):
                return self
            self._previous = signal.signal(signal.SIGIO, self._broken)
            self._installed = True
        except (ImportError, ValueError, OSError, AttributeError):  # no fcntl (Windows), no SIGIO, no handler here
            pass
        return self

    def hold(self, path: str) -> bool:
        """Whether `path` is now held: mapping it is then safe until the block ends."""
        if path in self.fds:
            return True
        if not self._installed:
            return False
        import fcntl

        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError:  # EAGAIN: open for writing somewhere; EACCES: another user's; EINVAL: no leases here
            os.close(fd)
            return False
        self.fds[path] = fd
        return True

    def _broken(self, signum: int, frame: object) -> None:
        if self._leaving:
            return
        import fcntl

        changed = []
        for path, fd in self.fds.items():
            try:
                if fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK:  # being broken: it shows the breaker's goal
                    changed.append(path)
            except OSError:
                changed.append(path)
        if changed:
            raise FileChanged(f"{', '.join(changed)}: another process opened it for writing or truncated it while "
                              "it was being read; nothing was concluded from it (that process resumes now)")

    def __exit__(self, *exc: object) -> None:
        self._leaving = True  # a break signalled while letting go is answered by letting go
        import fcntl

        for fd in self.fds.values():
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            except OSError:
                pass
            os.close(fd)
        self.fds.clear()
        if self._installed:
            import signal

            signal.signal(signal.SIGIO, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False
