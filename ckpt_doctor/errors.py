"""The one error hierarchy: every failure a user can cause is a CkptDoctorError with a message that says the way out."""

from __future__ import annotations

from ._record import record

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Callable


@record
class Rerun:
    """A way out of an error that is the user's own command, changed: flags added, flags (with their values) taken
    out. The command line renders it as the whole command to paste; `str()` of the error (the Python API, a log)
    as the flags to add."""

    add: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()

    def describe(self) -> str:
        """Without the command it changes: `with --force`, `with --rename 'a=b' instead of --rename 'a='`."""
        import shlex

        text = "the same command with " + " ".join(shlex.quote(a) for a in self.add) if self.add else \
            "the same command"
        if self.remove:
            text += " instead of " + " ".join(shlex.quote(a) for a in self.remove)
        return text


class CkptDoctorError(Exception):
    """Base class. The CLI prints `Error: <message>` and exits 2 (could not do what was asked).

    `reruns` are ways out that change the user's command; the message names them `{0}`, `{1}`, … where they go. The
    command line puts the whole command there (`ckpt-doctor fix a.pt -o b.pt --force`), in backticks."""

    exit_code = 2

    def __init__(self, message: str = "", *args: object, reruns: tuple[Rerun, ...] = ()) -> None:
        super().__init__(message, *args)
        self.reruns = tuple(reruns)

    def render(self, command: "Callable[[Rerun], str] | None" = None) -> str:
        """The message with each way out written by `command` (the CLI's: the whole command line), or described."""
        message = str(self.args[0]) if self.args else ""
        if not self.reruns:
            return message
        import re

        texts = [command(r) if command is not None else r.describe() for r in self.reruns]
        return re.sub(r"\{(\d)\}", lambda m: texts[int(m.group(1))] if int(m.group(1)) < len(texts) else m.group(),
                      message)

    def __str__(self) -> str:
        return self.render()


class UsageError(CkptDoctorError):
    """The arguments do not make sense together."""


class ReadError(CkptDoctorError):
    """A checkpoint is missing, unreadable, corrupt or of a kind no reader opens.

    `findings` names what the file would run (`os.system (dangerous)`), found before it broke off: a broken file
    that also names a global off the allow-list is reported as unsafe (exit 1), not merely as corrupt (exit 2).
    """

    def __init__(self, message: str, findings: tuple[str, ...] = (), *, reruns: tuple[Rerun, ...] = ()) -> None:
        super().__init__(message, reruns=reruns)
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


def one_line(text: object, limit: int = 300) -> str:
    """An exception or message as one line of plain text: escape sequences (torch colours its hints) and line
    breaks out, cut at a word with an ellipsis — never in the middle of one."""
    import re

    plain = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", str(text))
    plain = " ".join(plain.split()) or (type(text).__name__ if isinstance(text, BaseException) else "")
    if len(plain) > limit:
        plain = plain[:limit].rsplit(" ", 1)[0] + " …"
    return plain


def percent(share: float | None) -> str:
    """A share as a percentage people read right: one decimal, but never 0.0% for something nor 100.0% for less than
    all (0.05% of a model loaded is not nothing)."""
    if share is None:
        return "?"
    if 0 < share < 0.001:
        return f"{share * 100:.2g}%"
    digits = 1
    while share < 1 and round(share * 100, digits) >= 100 and digits < 12:
        digits += 1
    return f"{share * 100:.{digits}f}%"
