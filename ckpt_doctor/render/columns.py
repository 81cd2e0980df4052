"""Every table, drawn by tabulate: the terminal's in its "simple" format, held to 120 columns here (the last column
wrapped or moved to notes below, a key too long for a row put on a line of its own), and its github, grid and tsv
formats (--format) with every row whole.

tabulate is imported only by a command that prints a table (`--json` never imports it): ~35 ms with tabulate 0.9.
tabulate 0.10 imports importlib.metadata to set its __version__, ~70 ms more on this machine's Python 3.11, which
made a table slower to print than safetensors' own `safe_open` lists the file: pyproject.toml holds it below 0.10,
and this module works with either.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Sequence



def printable(text: str) -> str:
    """Control and format characters (an escape sequence, a newline, a right-to-left override) shown escaped, as
    repr shows them: a key or a file name from a hostile file must not recolour, reorder or hide a table's rows, or
    fake one, on a terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


MAX_WIDTH = 120  # a table wider than this wraps its last column
# Tables of keys (inspect, the comparison, diff, a dry run) have no detail to wrap: a key is data to copy and is never
# cut. Wider than MAX_WIDTH, each key goes on a line of its own with its cells under it (_keys_above).
KEYS = None
MIN_LAST = 24  # narrower than this, a long last cell goes below the table as a numbered note
SHORT = 8  # a cell no longer than this stays in its row (a note's marker would save nothing)


def draw_table(headers: Sequence[str], rows: Sequence[Sequence[object]], tablefmt: str = "simple",
               max_width: int | None = MAX_WIDTH, overflow: str = "wrap") -> str:
    """The table drawn by tabulate in its format `tablefmt`, every cell as text (no number parsing, blanks kept).
    "simple", the terminal's, is held to 120 columns as follows; the other formats (github, grid, tsv: for a page
    or a program) have every row whole.

    Rows wider than `max_width` (None: no limit) have their LAST column wrapped at word boundaries, continuation
    lines aligned under it (cells of several lines, which tabulate aligns); the other columns (keys, names) are
    never cut. Where the other columns leave the last fewer than MIN_LAST characters, a cell that does not fit (and
    is longer than SHORT) is replaced by `(note n)` and printed below the table as note n. `overflow="notes"`
    keeps every row on one line: a last cell that does not fit always goes below as a note. With `max_width=None`
    (tables of keys), a table wider than MAX_WIDTH puts each key on a line of its own with its cells under it
    (_keys_above)."""
    rows = [[c if type(c) is str and c.isprintable() else printable(str(c)) for c in row] for row in rows]
    if tablefmt != "simple":
        if tablefmt == "github":  # a | in a cell (the header max|Δ|) would end a markdown cell
            rows = [[c.replace("|", "\\|") for c in row] for row in rows]
            headers = [h.replace("|", "\\|") for h in headers]
        return _tabulate(headers, rows, tablefmt)
    # The widths tabulate's simple format gives: each column as wide as its widest cell, and two wider than its header.
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
        return _fitted(headers, rows, indent, max_width, overflow == "wrap")
    if max_width is None and last > 0 and indent + widths[last] > MAX_WIDTH:
        return _keys_above(headers, rows)
    return _tabulate(headers, rows, "simple")


def _tabulate(headers: Sequence[str], rows: list[list[str]], tablefmt: str) -> str:
    """tabulate's table in `tablefmt`, cells as given (no number parsing, no blanks stripped)."""
    # Imported here, by a command that prints a table: ~35 ms with tabulate 0.9 (0.10 imports importlib.metadata as
    # well, ~70 ms more here: pyproject.toml holds tabulate below 0.10 for that).
    import tabulate

    # tsv is for a program (a spreadsheet, cut, csv.reader): cells as they are, no blanks padding the columns
    align = {"stralign": None} if tablefmt == "tsv" else {}
    if "preserve_whitespace" in tabulate.tabulate.__code__.co_varnames:  # 0.10
        return tabulate.tabulate(rows, headers, tablefmt=tablefmt, disable_numparse=True, preserve_whitespace=True,
                                 **align)
    kept, tabulate.PRESERVE_WHITESPACE = tabulate.PRESERVE_WHITESPACE, True  # 0.9: the same switch, module-wide
    try:
        return tabulate.tabulate(rows, headers, tablefmt=tablefmt, disable_numparse=True, **align)
    finally:
        tabulate.PRESERVE_WHITESPACE = kept


def _keys_above(headers: Sequence[str], rows: list[list[str]]) -> str:
    """A table of keys too wide for MAX_WIDTH: each key whole on a line of its own, its other cells on the next line,
    indented, in columns tabulate draws (a key is data to copy and is never cut); a last cell that would still pass
    MAX_WIDTH there goes below the table as a numbered note."""
    pad = " " * 4
    widths = [len(h) + 2 for h in headers[1:]]
    for row in rows:
        for i, cell in enumerate(row[1:-1]):
            widths[i] = max(widths[i], len(cell))
    room = MAX_WIDTH - len(pad) - sum(widths[:-1]) - 2 * (len(widths) - 1)
    notes: list[str] = []
    rest = [list(row[1:]) for row in rows]
    for cells in rest:
        cell = cells[-1] if cells else ""
        if len(headers) > 1 and len(cell) > max(room, SHORT):  # the same text in many rows is one note
            if cell not in notes:
                notes.append(cell)
            cells[-1] = f"(note {notes.index(cell) + 1})"
    if len(headers) == 1:
        lines = [headers[0], "", "-" * min(MAX_WIDTH, len(headers[0]) + 2)]
        for row in rows:
            lines.append(row[0])
        return "\n".join(lines + _notes(notes, MAX_WIDTH))
    # the cells' columns as tabulate draws them: the header's line, its rule, then a line for each row
    drawn = _tabulate(list(headers[1:]), rest, "simple").split("\n")
    out = [headers[0], (pad + drawn[0]).rstrip()]
    out.append("-" * min(MAX_WIDTH, max(len(out[1]), len(headers[0]) + 2)))
    for row, line in zip(rows, drawn[2:]):
        out.append(row[0])
        if any(row[1:]):
            out.append((pad + line).rstrip())
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


def _fitted(headers: Sequence[str], rows: list[list[str]], indent: int, max_width: int, wrap: bool = True) -> str:
    """The simple table with the last column held to what `max_width` leaves it: wrapped (a cell of several lines,
    which tabulate aligns under the column), or as notes."""
    import textwrap

    last = len(headers) - 1
    room = max_width - indent
    notes: list[str] = []
    fitted = []
    for row in rows:
        cell = row[last]
        if len(cell) <= max(room, 0 if room >= MIN_LAST else SHORT):
            pass
        elif room >= MIN_LAST and wrap:
            cell = "\n".join(textwrap.wrap(cell, room, break_on_hyphens=False) or [""])
        else:  # the same text in many rows is one note
            if cell not in notes:
                notes.append(cell)
            cell = f"(note {notes.index(cell) + 1})"
        fitted.append([*row[:last], cell or (" " if not any(row) else "")])  # tabulate drops a row of no lines
    return "\n".join([_tabulate(headers, fitted, "simple"), *_notes(notes, max_width)])
