"""The tables against tabulate itself: every cell reaches it as given (no number parsed, no blank stripped, nothing
reordered) in every format, and within 120 columns the terminal's table is tabulate's "simple" table unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import tabulate as tabulate_module

from ckpt_doctor.render.columns import draw_table


def tabulate(rows, headers, tablefmt, **options):
    """tabulate's own table of cells taken as text with their blanks kept (a keyword in tabulate 0.10, a module
    setting in 0.9)."""
    if "preserve_whitespace" in tabulate_module.tabulate.__code__.co_varnames:
        return tabulate_module.tabulate(rows, headers, tablefmt=tablefmt, preserve_whitespace=True, **options)
    kept, tabulate_module.PRESERVE_WHITESPACE = tabulate_module.PRESERVE_WHITESPACE, True
    try:
        return tabulate_module.tabulate(rows, headers, tablefmt=tablefmt, **options)
    finally:
        tabulate_module.PRESERVE_WHITESPACE = kept

_cell = st.text(alphabet="abcXYZ019 .[]{}=→×|", max_size=14)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(data=st.data(), ncol=st.integers(1, 7))
def test_the_terminals_table_is_what_tabulate_prints(data, ncol):
    """Blanks inside, before or after a cell are kept (`  → new` under a long rename is indented on purpose)."""
    headers = data.draw(st.lists(st.text(alphabet="abc ", max_size=6), min_size=ncol, max_size=ncol))
    rows = data.draw(st.lists(st.lists(_cell, min_size=ncol, max_size=ncol), min_size=0, max_size=6))
    expected = tabulate(rows, headers, "simple", disable_numparse=True)
    if max(map(len, expected.splitlines())) > 120:
        return  # past 120 columns the layout changes (test_columns.py)
    assert draw_table(headers, rows) == expected


@pytest.mark.parametrize("fmt", ["grid", "tsv"])
def test_the_other_formats_are_tabulates(fmt):
    headers = ["key", "shape", "size"]
    rows = [["layers.{0..23}.attn.q.weight", "[64, 64]", "24 × 16.0 KB"], ["  → head.weight", "[2]", "8 B"]]
    unpadded = {"stralign": None} if fmt == "tsv" else {}  # tsv is for programs: cells without blanks around them
    assert draw_table(headers, rows, fmt) == tabulate(rows, headers, fmt, disable_numparse=True, **unpadded)


def test_github_escapes_a_bar_that_would_end_a_markdown_cell():
    text = draw_table(["key", "max|Δ|"], [["a|b", "0.5"]], "github")
    assert text.splitlines()[0] == "| key   | max\\|Δ\\|   |"
    assert text.splitlines()[2] == "| a\\|b  | 0.5        |"
    assert all(line.count("|") - line.count("\\|") == 3 for line in text.splitlines())


def test_rows_are_kept_whole_in_formats_for_programs():
    """Only the terminal's table is held to 120 columns; a markdown or tsv row is never wrapped or cut."""
    detail = " ".join(f"word{i}" for i in range(60))
    for fmt in ("github", "grid", "tsv"):
        assert any(detail in line for line in draw_table(["mode", "detail"], [["ddp", detail]], fmt).splitlines())
    assert max(map(len, draw_table(["mode", "detail"], [["ddp", detail]]).splitlines())) <= 120


def test_numbers_are_written_as_text():
    assert draw_table(["a", "b"], [[1, "x"], ["yy", 2.5]]).splitlines()[2:] == ["1    x", "yy   2.5"]
    assert draw_table(["a"], [["007"], ["1e3"]]).splitlines()[2:] == ["007", "1e3"]  # not parsed as numbers
