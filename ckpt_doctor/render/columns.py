"""Every table: the terminal's (tabulate's "simple" look, kept to 120 columns) drawn here, and tabulate's github,
grid and tsv formats (--format) drawn by tabulate.

Why the simple look is drawn here and not by tabulate (measured with bench/bench_startup.py, issue 25): tabulate 0.10
imports importlib.metadata to set its __version__, and its import costs ~45 ms in all (~34 ms of them that), which
made `ckpt-doctor inspect` of a 1 GB safetensors file as slow as listing it with safetensors' own `safe_open`
(0.99x, against 0.72x for --json in the same run); and it costs ~100 µs a row (type detection of every cell) where
this costs ~10 (20,000 rows: 2.0 s against 0.19 s). tests/test_render.py checks that this prints what
tabulate(tablefmt="simple", disable_numparse=True, preserve_whitespace=True) prints, cell for cell.
"""

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


MAX_WIDTH = 120  # a table wider than this wraps its last column
# Tables of keys (inspect, the comparison, diff, a dry run) have no detail to wrap: a key is data to copy and is never
# cut. Wider than MAX_WIDTH, each key goes on a line of its own with its cells under it (_keys_above).
KEYS = None
MIN_LAST = 24  # narrower than this, a long last cell goes below the table as a numbered note
SHORT = 8  # a cell no longer than this stays in its row (a note's marker would save nothing)


def draw_table(headers: Sequence[str], rows: Sequence[Sequence[object]], tablefmt: str = "simple",
               max_width: int | None = MAX_WIDTH, overflow: str = "wrap") -> str:
    """The table in tabulate's format `tablefmt`. "simple", the terminal's: left-aligned columns two spaces apart, a
    dashed rule under the headers (each at least two wider than its header), trailing blanks trimmed — what
    tabulate(tablefmt="simple", disable_numparse=True, preserve_whitespace=True) prints — held to 120 columns as
    follows. The other formats (github, grid, tsv: for a page or a program) are drawn by tabulate, every row whole.

    Rows wider than `max_width` (None: no limit) have their LAST column wrapped at word boundaries, continuation
    lines aligned under it; the other columns (keys, names) are never cut. Where the other columns leave the last
    fewer than MIN_LAST characters, a cell that does not fit (and is longer than SHORT) is replaced by `(note n)`
    and printed below the table as note n. `overflow="notes"` keeps every row on one line: a last cell that does not
    fit always goes below as a note. With `max_width=None` (tables of keys), a table wider than MAX_WIDTH puts each
    key on a line of its own with its cells under it (_keys_above)."""
    rows = [[c if type(c) is str and c.isprintable() else printable(str(c)) for c in row] for row in rows]
    if tablefmt != "simple":
        return _tabulate(headers, rows, tablefmt)
    widths = [len(h) + 2 for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            if len(cell) > widths[i]:
                widths[i] = len(cell)
    last = len(headers) - 1
    indent = sum(widths[:last]) + 2 * last  # where the last column starts
    if max_width is not None and last > 0 and indent + widths[last] > max_width:
        if indent + SHORT > max_width and max_width == MAX_WIDTH:  # not even a note's marker fits beside the first (a
            return _keys_above(headers, rows)  # long path): each first cell on a line of its own, the rest under it
        return _fitted(headers, rows, widths, indent, max_width, overflow == "wrap")
    if max_width is None and last > 0 and indent + widths[last] > MAX_WIDTH:
        return _keys_above(headers, rows)

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(widths[i]) if i < last else cell for i, cell in enumerate(cells)).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out.extend(line(row) for row in rows)
    return "\n".join(out)


def _tabulate(headers: Sequence[str], rows: list[list[str]], tablefmt: str) -> str:
    """tabulate's table in `tablefmt`, cells as given (no number parsing, no blanks stripped)."""
    # Imported here, for --format github/grid/tsv only: ~45 ms (see the top of this module).
    from tabulate import tabulate

    if tablefmt == "github":  # a | in a cell (the header max|Δ|) would end a markdown cell
        rows = [[c.replace("|", "\\|") for c in row] for row in rows]
        headers = [h.replace("|", "\\|") for h in headers]
    # tsv is for a program (a spreadsheet, cut, csv.reader): cells as they are, no blanks padding the columns
    align = {"stralign": None} if tablefmt == "tsv" else {}
    return tabulate(rows, headers, tablefmt=tablefmt, disable_numparse=True, preserve_whitespace=True, **align)


def _keys_above(headers: Sequence[str], rows: list[list[str]]) -> str:
    """A table of keys too wide for MAX_WIDTH: each key whole on a line of its own, its other cells on the next line,
    indented and in columns of their own (a key is data to copy and is never cut); a last cell that would still
    pass MAX_WIDTH there goes below the table as a numbered note."""
    pad = " " * 4
    widths = [len(h) + 2 for h in headers[1:]]
    for row in rows:
        for i, cell in enumerate(row[1:-1]):
            widths[i] = max(widths[i], len(cell))
    room = MAX_WIDTH - len(pad) - sum(widths[:-1]) - 2 * (len(widths) - 1)
    notes: list[str] = []
    rows = [list(row) for row in rows]
    for row in rows:
        cell = row[-1]
        if len(headers) > 1 and len(cell) > max(room, SHORT):  # the same text in many rows is one note
            if cell not in notes:
                notes.append(cell)
            row[-1] = f"(note {notes.index(cell) + 1})"
        widths[-1] = max(widths[-1], len(row[-1]))

    def rest(cells: Sequence[str]) -> str:
        return (pad + "  ".join(c.ljust(w) for c, w in zip(cells, widths))).rstrip()

    out = [headers[0], rest(headers[1:])]
    out.append("-" * min(MAX_WIDTH, max(len(out[1]), len(headers[0]) + 2)))
    for row in rows:
        out.append(row[0])
        if any(row[1:]):
            out.append(rest(row[1:]))
    return "\n".join(out + _notes(notes, MAX_WIDTH))


def _notes(notes: list[str], max_width: int) -> list[str]:
    """The numbered notes below a table, each wrapped to `max_width`."""
    import textwrap

    out = ["", "notes:"] if notes else []
    for n, note in enumerate(notes, 1):
        mark = f"({n}) "
        out.extend(textwrap.wrap(note, max_width, initial_indent=mark, subsequent_indent=" " * len(mark),
                                 break_on_hyphens=False) or [mark.strip()])
    return out


def _fitted(headers: Sequence[str], rows: list[list[str]], widths: list[int], indent: int, max_width: int,
            wrap: bool = True) -> str:
    """simple_table's layout with the last column held to what `max_width` leaves it: wrapped, or as notes."""
    import textwrap

    last = len(headers) - 1
    room = max_width - indent
    notes: list[str] = []
    body: list[list[str]] = []  # each row's lines of the last column
    for row in rows:
        cell = row[last]
        if len(cell) <= max(room, 0 if room >= MIN_LAST else SHORT):
            body.append([cell])
        elif room >= MIN_LAST and wrap:
            body.append(textwrap.wrap(cell, room, break_on_hyphens=False) or [""])
        else:  # the same text in many rows is one note
            if cell not in notes:
                notes.append(cell)
            body.append([f"(note {notes.index(cell) + 1})"])
    widths = widths[:last] + [max(len(headers[last]) + 2, *(len(x) for lines in body for x in lines))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(widths[i]) if i < last else cell for i, cell in enumerate(cells)).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    for row, lines in zip(rows, body):
        out.append(line([*row[:last], lines[0]]))
        out.extend((" " * indent + more).rstrip() for more in lines[1:])
    return "\n".join(out + _notes(notes, max_width))
