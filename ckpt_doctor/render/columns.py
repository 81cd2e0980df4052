"""A plain-text table in tabulate's "simple" style, without tabulate: a 500,000-row listing must not cost a
second or double the memory, and `inspect` should not pay its import."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Sequence


_CONTROL = None


def printable(text: str) -> str:
    """Control characters (an escape sequence, a newline) shown escaped, as repr shows them: a key or a file name
    from a hostile file must not recolour or hide a table's rows, or fake one, on a terminal."""
    global _CONTROL
    if text.isprintable():
        return text
    if _CONTROL is None:
        import re

        _CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def simple_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns two spaces apart, a dashed rule under the headers (each at least two wider than its
    header), trailing blanks trimmed — what tabulate(tablefmt="simple", disable_numparse=True) prints."""
    widths = [len(h) + 2 for h in headers]
    rows = [[c if type(c) is str and c.isprintable() else printable(str(c)) for c in row] for row in rows]
    for row in rows:
        for i, cell in enumerate(row):
            if len(cell) > widths[i]:
                widths[i] = len(cell)
    last = len(headers) - 1

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(widths[i]) if i < last else cell for i, cell in enumerate(cells)).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out.extend(line(row) for row in rows)
    return "\n".join(out)
