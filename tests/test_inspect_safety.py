"""inspect lists what a hostile file would run, runs none of it, and still lists the tensors."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.payloads import state_dict_with_payload, torch_zip


def test_payload_in_zip_is_reported_not_run(tmp_path, cli):
    canary = tmp_path / "canary"
    path = tmp_path / "evil.pt"
    path.write_bytes(torch_zip(state_dict_with_payload(canary), {"0": b"\0" * 16}))
    result = cli("inspect", path, "--json")
    assert result.exit_code == 1
    data = result.json()
    assert data["unsafe_globals"] == ["os.system"]
    assert [t["key"] for t in data["tensors"]] == ["fc.weight"]
    assert not canary.exists()
    # The same file really is a working payload: torch itself refuses it only because of weights_only.
    assert path.read_bytes().count(b"os\nsystem") == 1


def test_payload_in_legacy_object_pickle(tmp_path, cli):
    canary = tmp_path / "canary"
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    from tests.corpus import _legacy_with_payload
    from tests.payloads import call

    path = tmp_path / "evil_legacy.pt"
    # The object pickle (the 4th of five) is replaced by one with a payload; the rest of the file is kept.
    path.write_bytes(_legacy_with_payload(legacy.read_bytes(), call("os", "system", f"touch {canary}")))
    result = cli("inspect", path)
    assert result.exit_code == 1
    assert "os.system" in result.stderr
    assert not canary.exists()


def test_human_output_warns(tmp_path, cli):
    path = tmp_path / "evil.pt"
    path.write_bytes(torch_zip(state_dict_with_payload(tmp_path / "c"), {"0": b"\0" * 16}))
    result = cli("inspect", path)
    assert result.exit_code == 1
    assert "UNSAFE" in result.stderr and "os.system" in result.stderr
    assert "fc.weight" in result.stdout


def test_inspect_does_not_import_torch(fixtures):
    code = ("import sys\nfrom ckpt_doctor.cli import main\n"
            "try:\n    main(['inspect', sys.argv[1], '--json'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    for name in ("plain", "legacy", "safetensors", "torchscript", "whole_model", "sharded_bin"):
        proc = subprocess.run([sys.executable, "-c", code, str(fixtures[name]["path"])], capture_output=True,
                              text=True, timeout=60)
        assert proc.stderr.strip().splitlines()[-1] == "False", (name, proc.stderr)


def _payload(canary):
    """An object whose pickle runs `touch canary` (only ever written here: a file holding it is never unpickled)."""
    import os

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {canary}",)

    return Payload()


def _every_suggestion_writes_a_clean_file(cli, data: dict) -> None:
    """Each command a JSON report suggests runs (exit 0) and writes a file scan calls clean."""
    for suggestion in data["suggested_commands"]:
        assert cli(*suggestion["argv"][1:]).exit_code == 0
        out = suggestion["argv"][suggestion["argv"].index("-o") + 1]
        assert cli("scan", out).exit_code == 0, suggestion["command"]


def _canary_pickle(canary) -> bytes:
    from tests.payloads import call

    return b"\x80\x02" + call("os", "system", f"touch {canary}") + b"."


def test_torch_loads_verdict_counts_only_the_pickles_torch_reads(tmp_path, cli):
    """A pickle np.load would find in an .npy storage, and a member torch never reads, are findings (or notes) of
    the file, not reasons torch.load fails: the torch.load line agrees with torch.load itself."""
    import io
    import zipfile

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    npy = tmp_path / "npy_storage.pt"
    torch.save({"w": torch.ones(3), "blob": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).clone()},
               npy)
    extra = tmp_path / "extra_member.pt"
    torch.save({"w": torch.ones(3)}, extra)
    canary = tmp_path / "CANARY"
    with zipfile.ZipFile(extra, "a") as archive:
        archive.writestr("extra_member/extra.pkl", _canary_pickle(canary))
    for path in (npy, extra):
        torch.load(path, weights_only=True)  # the oracle: torch's defaults load both
        data = cli("inspect", path, "--json").json()
        assert data["default_load"]["ok"] and data["default_load"]["refused_globals"] == [], path
        assert "loads with torch's defaults" in cli("inspect", path).stderr
    assert cli("scan", npy).exit_code == 0
    # The member with a payload is still a finding (exit 1); its way out is a copy without it, printed and run
    table, data = cli("inspect", extra), cli("inspect", extra, "--json").json()
    assert table.exit_code == data["exit_code"] == 1 and data["unsafe_globals"] == ["os.system"]
    assert "torch.load reads none of them" in table.stderr
    [rescue] = data["suggested_commands"]
    assert rescue["label"] == "rescue" and f"`{rescue['command']}`" in table.stderr
    assert cli(*rescue["argv"][1:]).exit_code == 0
    out = tmp_path / "extra_member_fixed.pt"
    assert rescue["argv"][rescue["argv"].index("-o") + 1] == str(out)
    assert set(torch.load(out, weights_only=True)) == {"w"}
    assert "extra.pkl" not in "".join(zipfile.ZipFile(out).namelist())
    assert cli("scan", out).exit_code == 0 and not canary.exists()


def test_a_payload_in_the_pickle_torch_reads_still_fails_its_verdict(tmp_path, cli):
    path = tmp_path / "evil.pt"
    path.write_bytes(torch_zip(state_dict_with_payload(tmp_path / "c"), {"0": b"\0" * 16}))
    data = cli("inspect", path, "--json").json()
    assert not data["default_load"]["ok"] and "os.system" in data["default_load"]["refused_globals"]
    assert "torch.load(weights_only=False) would import and run the above" in cli("inspect", path).stderr


def test_the_rescue_of_a_pickle_in_a_tensors_bytes_leaves_that_tensor_out(tmp_path, cli):
    """A NumPy object array saved as a uint8 tensor keeps its pickle in the tensor's own bytes: a copy of the tensors
    would copy the pickle too, so the printed rescue leaves that tensor out (and says so), and its output scans
    clean and loads with torch's defaults, every other tensor equal."""
    import io
    import os

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.array([os.system], dtype=object), allow_pickle=True)
    path = tmp_path / "npy_func.pt"
    saved = {"w": torch.randn(4, 4), "meta": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).clone()}
    torch.save(saved, path)
    table, data = cli("inspect", path), cli("inspect", path, "--json").json()
    assert table.exit_code == data["exit_code"] == 1 and data["default_load"]["ok"]
    [rescue] = data["suggested_commands"]
    assert f"`{rescue['command']}`" in table.stderr and "meta" in rescue["why"]
    assert cli(*rescue["argv"][1:]).exit_code == 0
    out = rescue["argv"][rescue["argv"].index("-o") + 1]
    assert cli("scan", out).exit_code == 0
    loaded = torch.load(out, weights_only=True)
    assert set(loaded) == {"w"} and torch.equal(loaded["w"], saved["w"])


def test_no_rescue_is_printed_that_would_copy_a_pickle_held_as_bytes(tmp_path, cli):
    """A byte string of data.pkl that is itself a pickle (torch.load loads the file: it never unpickles it) is plain
    data that fix writes as it is: a 'copy without what they name' would hold the same payload, so none is printed."""
    canary = tmp_path / "CANARY"
    path = tmp_path / "nested.pt"
    torch.save({"w": torch.ones(3), "blob": _canary_pickle(canary)}, path)
    torch.load(path, weights_only=True)  # the oracle: torch's defaults load it
    table, data = cli("inspect", path), cli("inspect", path, "--json").json()
    assert data["exit_code"] == 1 and data["default_load"]["ok"] and data["unsafe_globals"] == ["os.system"]
    _every_suggestion_writes_a_clean_file(cli, data)  # whatever is printed writes a file with no payload
    assert "a copy without what they name" not in table.stderr and not canary.exists()


def test_what_torch_refuses_names_the_telling_global_and_an_npy_note_its_tensor(tmp_path, cli):
    """A training checkpoint's torch.load line names the argparse.Namespace before NumPy's five or so globals
    (which hid it behind '… 1 more'), and a note about an .npy held in a tensor's bytes names that tensor."""
    import argparse
    import io

    import numpy as np

    path = tmp_path / "train.pt"
    torch.save({"model": {"w": torch.ones(2)}, "rng": np.random.get_state(), "step": np.float64(3),
                "args": argparse.Namespace(lr=0.1)}, path)
    for command in ("inspect", "scan"):
        [line] = [line for line in cli(command, path).stderr.splitlines() if "torch.load" in line and "FAILS" in line]
        assert "refuses argparse.Namespace, numpy." in line, line
    assert "argparse.Namespace" in cli("inspect", path, "--json").json()["default_load"]["refused_globals"]
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    npy = tmp_path / "npy_storage.pt"
    torch.save({"w": torch.ones(3), "blob": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).clone()},
               npy)
    assert "npy_storage/data/1 (tensor blob): a NumPy array whose data np.load(allow_pickle=True) would unpickle" \
        in cli("inspect", npy).stderr


def test_a_payload_in_the_copy_of_data_pkl_torch_does_not_pick_is_not_torch_loads(tmp_path, cli):
    """Two members named data.pkl but for case: torch's reader picks the clean one, so torch.load runs nothing and
    loads the file; the payload in the other copy is a finding whose safety line does not blame torch.load."""
    import zipfile

    clean, path = tmp_path / "clean.pt", tmp_path / "dup.pt"
    torch.save({"w": torch.ones(3)}, clean)
    canary = tmp_path / "CANARY"
    with zipfile.ZipFile(clean) as src, zipfile.ZipFile(path, "w") as out:
        out.writestr("clean/DATA.PKL", _canary_pickle(canary))  # first: the copy torch passes over
        for info in src.infolist():
            out.writestr(info.filename, src.read(info.filename))
    assert set(torch.load(path, weights_only=True)) == {"w"} and not canary.exists()  # the oracle
    table, data = cli("inspect", path), cli("inspect", path, "--json").json()
    assert data["exit_code"] == 1 and data["default_load"]["ok"] and data["unsafe_globals"] == ["os.system"]
    assert "torch.load reads none of them" in table.stderr
    assert "torch.load(weights_only=False) would import and run" not in table.stderr


def _npy_tensor(obj) -> torch.Tensor:
    """A NumPy object array holding `obj`, saved as a uint8 tensor: its pickle is in the tensor's own bytes."""
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.array([obj], dtype=object), allow_pickle=True)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).clone()


def _run_rescue(cli, path):
    """The rescue inspect prints (table and JSON alike), run as printed: its output, loaded with torch's defaults."""
    table, data = cli("inspect", path), cli("inspect", path, "--json").json()
    [rescue] = data["suggested_commands"]
    assert f"`{rescue['command']}`" in table.stderr
    assert cli(*rescue["argv"][1:]).exit_code == 0, rescue["command"]
    out = rescue["argv"][rescue["argv"].index("-o") + 1]
    assert cli("scan", out).exit_code == 0, rescue["command"]
    return rescue, torch.load(out, weights_only=True)


def test_the_rescue_leaves_out_every_tensor_whose_npy_names_one_global(tmp_path, cli):
    """Several .npy tensors naming the same os.system (and the same global in data.pkl beside them): the findings
    list the global once, but the rescue leaves out every tensor whose bytes hold it, not the one whose place the
    list kept, so its copy scans clean."""
    canary = tmp_path / "CANARY"
    w = torch.randn(3, 3)
    same = tmp_path / "same.pt"
    torch.save({"w": w, "n1": _npy_tensor(_payload(canary)), "n2": _npy_tensor(_payload(canary))}, same)
    rescue, loaded = _run_rescue(cli, same)
    assert set(loaded) == {"w"} and torch.equal(loaded["w"], w) and "n1" in rescue["why"]
    beside = tmp_path / "beside.pt"
    torch.save({"w": w, "npy": _npy_tensor(_payload(canary)), "evil": _payload(canary)}, beside)
    rescue, loaded = _run_rescue(cli, beside)
    assert set(loaded) == {"w"} and "npy" in rescue["why"] and not canary.exists()


def test_no_rescue_when_a_byte_string_pickle_names_what_an_npy_tensor_names(tmp_path, cli):
    """A pickle held as a byte string is written as it is: with an .npy tensor naming the same global (the one place
    the findings list keeps), no 'copy without what they name' is printed either."""
    import pickle

    canary = tmp_path / "CANARY"
    path = tmp_path / "both.pt"
    torch.save({"w": torch.ones(3), "npy": _npy_tensor(_payload(canary)), "blob": pickle.dumps(_payload(canary), protocol=2)}, path)
    torch.load(path, weights_only=True)  # the oracle: torch's defaults load it
    table, data = cli("inspect", path), cli("inspect", path, "--json").json()
    assert data["exit_code"] == 1 and data["default_load"]["ok"]
    _every_suggestion_writes_a_clean_file(cli, data)  # whatever is printed writes a file with no payload
    assert "a copy without what they name" not in table.stderr and not canary.exists()


def test_the_rescue_of_an_npy_tensor_in_a_list_leaves_out_the_list(tmp_path, cli):
    """An .npy tensor that is an item of a list or tuple: --drop of the item alone fails fix's check (the items after
    it shift), so the rescue leaves out the list with it and says so; every other tensor is kept equal."""
    canary = tmp_path / "CANARY"
    w = torch.randn(3, 3)
    nested = tmp_path / "nested.pt"
    torch.save({"state_dict": {"w": w}, "extras": [_npy_tensor(_payload(canary)), torch.ones(2)]}, nested)
    rescue, loaded = _run_rescue(cli, nested)
    assert set(loaded) == {"state_dict"} and torch.equal(loaded["state_dict"]["w"], w)
    assert "extras.0" in rescue["why"] and "with all of extras" in rescue["why"]
    flat = tmp_path / "flat.pt"
    torch.save({"w": w, "extras": ([_npy_tensor(_payload(canary)), torch.ones(2)], torch.zeros(2)), "v": torch.ones(1)}, flat)
    rescue, loaded = _run_rescue(cli, flat)
    assert set(loaded) == {"w", "v"} and torch.equal(loaded["w"], w) and "with all of extras" in rescue["why"]
    assert not canary.exists()


def test_the_rescue_finds_an_npy_tensor_of_a_file_whose_name_holds_a_colon(tmp_path, cli):
    """torch.save names the archive after the file: in `evil: x.pt` the member is `evil: x/data/1`, which the place
    of its finding (`evil: x/data/1: the pickle after …`) was cut at its first ': ', so the rescue kept the tensor."""
    canary = tmp_path / "CANARY"
    w = torch.randn(3, 3)
    path = tmp_path / "evil: x.pt"
    torch.save({"w": w, "npy": _npy_tensor(_payload(canary))}, path)
    rescue, loaded = _run_rescue(cli, path)
    assert set(loaded) == {"w"} and torch.equal(loaded["w"], w) and not canary.exists()
