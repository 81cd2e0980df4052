"""The one error hierarchy: every failure a user can cause is a CkptDoctorError with a message that says the way out."""

from __future__ import annotations


class CkptDoctorError(Exception):
    """Base class. The CLI prints `Error: <message>` and exits 2 (could not do what was asked)."""

    exit_code = 2


class UsageError(CkptDoctorError):
    """The arguments do not make sense together."""


class ReadError(CkptDoctorError):
    """A checkpoint is missing, unreadable, corrupt or of a kind no reader opens.

    `findings` names what the file would run (`os.system (dangerous)`), found before it broke off: a broken file
    that also names a global off the allow-list is reported as unsafe (exit 1), not merely as corrupt (exit 2).
    """

    def __init__(self, message: str, findings: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.findings = findings

    @property
    def exit_code(self) -> int:  # type: ignore[override]
        return 1 if self.findings else 2


class CheckFailed(CkptDoctorError):
    """The check found a problem that stops the command (exit 1): the output would not load into the model."""

    exit_code = 1


class ModelSpecError(CkptDoctorError):
    """A --model SPEC cannot be imported or built."""


class PlanError(CkptDoctorError):
    """A requested transform cannot be applied safely (e.g. two keys would collide)."""


class WriteError(CkptDoctorError):
    """The output cannot be written, or did not read back identical."""


class VerifyError(CkptDoctorError):
    """verify could not be run at all (as opposed to running and failing)."""


class SeveralCheckpoints(ReadError):
    """A folder that is not one checkpoint but holds several (a run's saves, a model zoo): `inspect` lists them,
    one line each; commands that need one checkpoint report this message."""

    def __init__(self, message: str, folder: object) -> None:
        super().__init__(message)
        self.folder = folder


class NotACheckpoint(ReadError):
    """The file reads fine but is something else — an HDF5 file, a NumPy array, text, an image, an archive — and
    the message names it and what opens it. `inspect DIR` and `scan DIR` skip such a file (a line says so) unless
    it also names a global off the allow-list (`findings`): then it is a finding like any unsafe pickle."""
