"""draw_table past 120 columns: the last column wraps under itself or becomes numbered notes; nothing is lost."""

from __future__ import annotations

from tabulate import tabulate

from ckpt_doctor.render.columns import draw_table

DETAIL = " ".join(f"word{i}" for i in range(60))


def test_rows_that_fit_are_tabulates_simple_format():
    rows = [["features.0.weight", "matched", "x" * 60]]
    assert draw_table(["key", "verdict", "detail"], rows) == tabulate(rows, headers=["key", "verdict", "detail"],
                                                                       tablefmt="simple", disable_numparse=True)


def test_a_long_last_column_wraps_aligned_under_itself():
    rows = [["single", "PASS", "short"], ["ddp", "FAIL", DETAIL]]
    lines = draw_table(["mode", "status", "detail"], rows).splitlines()
    at = lines[0].index("detail")
    assert max(len(line) for line in lines) <= 120 and len(lines) > 4
    assert lines[2].startswith("single") and lines[3].startswith("ddp")
    assert all(line[:at].strip() == "" for line in lines[4:])  # continuation lines hold the last column only
    assert " ".join(line[at:] for line in lines[3:]).split() == DETAIL.split()



def test_a_table_of_keys_too_wide_puts_each_key_above_its_cells():
    """KEYS tables (max_width None) never cut a key: past 120 columns each key is a line of its own, its cells
    in columns on the next line."""
    key = "encoder.layer.0.attention.self.query." + "weight_of_a_long_name" * 3
    rows = [[key, "matched", "[16, 16]"], ["short", "unexpected", "[2]"]]
    lines = draw_table(["key", "verdict", "shape"], rows, max_width=None).splitlines()
    assert max(map(len, lines)) <= 120
    assert lines[0] == "key" and lines[1].split() == ["verdict", "shape"]
    assert lines[3] == key and lines[4].split() == ["matched", "[16,", "16]"]
    assert lines[5] == "short" and lines[4].index("matched") == lines[6].index("unexpected")
    narrow = draw_table(["key", "verdict"], [["a", "b"]], max_width=None).splitlines()
    assert narrow[2] == "a      b"  # within 120 columns: one line per row, as before


def test_wide_keys_are_never_cut_and_a_cell_without_room_becomes_a_note():
    key = "k" * 110
    rows = [[key, "ok"], [key, DETAIL]]
    lines = draw_table(["key", "detail"], rows).splitlines()
    assert lines[2] == f"{key}  ok" and lines[3] == f"{key}  (note 1)"  # never `[1]`, which reads as a shape
    notes = "\n".join(lines[lines.index("") + 1:])
    assert notes.startswith("notes:\n(1) ") and notes.replace("\n", " ")[11:].split() == DETAIL.split()
    assert all(len(line) <= 120 for line in lines[lines.index(""):])


def test_a_long_rename_goes_on_two_lines_and_keeps_both_names(tmp_path, cli):
    """`inspect --model` of a DataParallel file with long keys: each `old → new` row is two lines within 120
    columns, the old name with its verdict and `→ new` under it; no name is cut."""
    import torch

    deep = torch.nn.Sequential()
    deep.add_module("embeddings_for_the_encoder_of_a_long_named_model", torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))
    (tmp_path / "net.py").write_text(
        "import torch\n\ndef make():\n    net = torch.nn.Sequential()\n"
        "    net.add_module('embeddings_for_the_encoder_of_a_long_named_model', torch.nn.Sequential(\n"
        "        torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))\n    return net\n")
    torch.save(torch.nn.DataParallel(deep).state_dict(), tmp_path / "dp.pt")
    table = cli("inspect", tmp_path / "dp.pt", "--model", f"{tmp_path / 'net.py'}:make").stdout
    lines = table.splitlines()
    assert max(map(len, lines)) <= 120, table
    for key in deep.state_dict():
        old = next(i for i, line in enumerate(lines) if line.startswith(f"module.{key} "))
        assert "renamed by the fix" in lines[old] and lines[old + 1].strip() == f"→ {key}"
