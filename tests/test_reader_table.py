"""A new input format is one reader module and one row of readers/table.py: the toy format of docs/development.md
("Adding an input format"), its module and its row taken from that page and added at run time, is inspected,
scanned, fixed and diffed like any other, with torch as the oracle of its tensors."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
import torch
from torch import nn

from tests.conftest import ROOT


def _section(title: str) -> str:
    text = (ROOT / "docs" / "development.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def _docs_code() -> tuple[str, str]:
    """The reader module and the table row the page shows, as written there."""
    blocks = re.findall(r"^```python\n(.*?)^```", _section("Adding an input format"), re.DOTALL | re.MULTILINE)
    module = [b for b in blocks if b.startswith("# ckpt_doctor/readers/toy.py\n")]
    row = [b for b in blocks if b.startswith("# ckpt_doctor/readers/table.py")]
    assert len(module) == 1 and len(row) == 1, blocks
    lines = [line for line in row[0].splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(lines) == 1, lines  # the one line a new format adds to the table
    return module[0], lines[0].strip().removesuffix(",")


@pytest.fixture
def toy_format(tmp_path, monkeypatch):
    """The page's toy.py as ckpt_doctor.readers.toy, and its row in READERS where the page puts it (above the
    pickle's row); nothing else of the package is changed."""
    from ckpt_doctor.readers import table
    from ckpt_doctor.sniff import Container

    source, row = _docs_code()
    folder = tmp_path / "module"
    folder.mkdir()
    (folder / "toy.py").write_text(source)
    spec = importlib.util.spec_from_file_location("ckpt_doctor.readers.toy", folder / "toy.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    rows = list(table.READERS)
    rows.insert(rows.index(table.reader(Container.PICKLE)), eval(row, vars(table)))
    monkeypatch.setattr(table, "READERS", tuple(rows))
    return module


def _state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_toy(path, tensors: dict[str, torch.Tensor]) -> None:
    header = json.dumps({"names": list(tensors), "dtypes": [str(t.dtype).removeprefix("torch.") for t in
                                                          tensors.values()],
                         "shapes": [list(t.shape) for t in tensors.values()]}).encode()
    body = b"".join(t.contiguous().numpy().tobytes() for t in tensors.values())
    path.write_bytes(b"TOYCKPT1" + len(header).to_bytes(8, "little") + header + body)


def test_a_toy_format_added_as_the_docs_say_is_inspected_scanned_fixed_and_diffed(toy_format, tmp_path, cli):
    from safetensors.torch import load_file

    state = _state_dict()
    path = tmp_path / "model.toy"
    write_toy(path, state)

    inspect = cli("inspect", path, "--json")
    assert inspect.exit_code == 0, inspect.stderr
    out = inspect.json()
    assert out["format"] == "toy" and out["verdict"] == "safe" and out["notes"] == []
    assert [(t["key"], t["shape"], t["dtype"]) for t in out["tensors"]] == \
        [(k, list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]

    table = cli("inspect", path)
    assert table.exit_code == 0 and "running_mean" in table.stdout and "toy" in table.stderr, table.stderr

    scan = cli("scan", path, "--json")
    assert scan.exit_code == 0, scan.stderr
    [scanned] = scan.json()["files"]
    assert (scanned["container"], scanned["format"], scanned["verdict"]) == ("toy", "toy", "safe")

    folder = cli("inspect", tmp_path, "--json")  # a model folder's one checkpoint, found by its bytes
    assert folder.exit_code == 0 and folder.json()["format"] == "toy", folder.stderr

    fixed = tmp_path / "model.safetensors"
    fix = cli("fix", path, "-o", fixed)
    assert fix.exit_code == 0, fix.stderr
    back = load_file(str(fixed))  # every tensor's bytes were where the toy reader said: torch reads them back
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], v) for k, v in state.items())

    diff = cli("diff", path, fixed, "--json")
    assert diff.exit_code == 0, diff.stderr


def test_a_broken_toy_file_is_one_error_line_and_exit_2(toy_format, tmp_path, cli):
    state = _state_dict()
    path = tmp_path / "cut.toy"
    write_toy(path, state)
    path.write_bytes(path.read_bytes()[:-5])
    need = sum(t.numel() * t.element_size() for t in state.values())
    result = cli("inspect", path)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip() == f"Error: {path}: toy tensors need {need} bytes after the header, the file holds " \
        f"{need - 5}"
    header_cut = tmp_path / "header.toy"
    header_cut.write_bytes(b"TOYCKPT1" + (1000).to_bytes(8, "little") + b'{"names": [')
    result = cli("inspect", header_cut)
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"Error: {header_cut}: toy header runs past the end of the file (truncated?)"


def test_without_its_row_the_toy_file_is_no_checkpoint(tmp_path, cli):
    """The row is what makes the format read: the same bytes without it are a pickle that breaks off."""
    path = tmp_path / "model.toy"
    write_toy(path, _state_dict())
    result = cli("inspect", path, "--json")
    assert result.exit_code == 2 and "toy" not in result.stderr.removeprefix(f"Error: {path}")
    assert result.stderr.startswith(f"Error: {path}: ")
