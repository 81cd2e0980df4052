"""A plain-text table in tabulate's "simple" style, without tabulate: a 500,000-row listing must not cost a
second or double the memory, and `inspect` should not pay its import."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Sequence


def simple_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns two spaces apart, a dashed rule under the headers (each at least two wider than its
    header), trailing blanks trimmed — what tabulate(tablefmt="simple", disable_numparse=True) prints."""
    widths = [len(h) + 2 for h in headers]
    rows = [row if all(type(c) is str for c in row) else [str(c) for c in row] for row in rows]
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
