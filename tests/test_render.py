"""The table renderer against the one it replaces: tabulate's "simple" format, cell for cell."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tabulate import tabulate

from ckpt_doctor.render.columns import simple_table

_cell = st.text(alphabet="abcXYZ019 .[]{}=→×", max_size=14).map(str.strip)  # tabulate strips cells; keys never
# start or end with blanks


@settings(max_examples=400, deadline=None, derandomize=True)
@given(data=st.data(), ncol=st.integers(1, 7))
def test_simple_table_prints_what_tabulate_prints(data, ncol):
    headers = data.draw(st.lists(st.text(alphabet="abc ", max_size=6), min_size=ncol, max_size=ncol))
    rows = data.draw(st.lists(st.lists(_cell, min_size=ncol, max_size=ncol), min_size=1, max_size=6))
    assert simple_table(headers, rows) == tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def test_numbers_are_written_as_text():
    assert simple_table(["a", "b"], [[1, "x"], ["yy", 2.5]]).splitlines()[2:] == ["1    x", "yy   2.5"]
