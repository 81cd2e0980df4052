"""A line for the person (stderr) that carries its severity: the terminal colours it by that, never by its words."""

from __future__ import annotations

import enum


class Severity(enum.Enum):
    INFO = "info"  # what was found, said plainly
    PROBLEM = "problem"  # one of the reasons the exit code is not 0


COLOR = {Severity.INFO: None, Severity.PROBLEM: "red"}


class Line(str):
    """A summary line: the text as printed, and its severity (plain strings are INFO)."""

    severity: Severity

    def __new__(cls, text: str, severity: Severity = Severity.INFO) -> Line:
        line = super().__new__(cls, text)
        line.severity = severity
        return line


def color_of(line: str) -> str | None:
    """The colour a summary line is drawn in on a terminal, from its severity."""
    return COLOR[getattr(line, "severity", Severity.INFO)]
