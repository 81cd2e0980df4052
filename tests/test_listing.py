"""`inspect DIR` of a folder holding several checkpoints: one line per file, each the verdict `inspect FILE` gives."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from tests.payloads import state_dict_with_payload, torch_zip


def _folder(tmp_path):
    folder = tmp_path / "runs"
    (folder / "run2").mkdir(parents=True)
    torch.manual_seed(0)
    state = {"fc.weight": torch.randn(4, 3), "fc.bias": torch.zeros(4)}
    torch.save(state, folder / "a.pt")
    torch.save({"model": {k: v.half() for k, v in state.items()}, "step": 3}, folder / "run2" / "last.ckpt")
    save_file(state, folder / "b.safetensors")
    (folder / "evil.pt").write_bytes(torch_zip(state_dict_with_payload(tmp_path / "canary"), {"0": b"\0" * 16}))
    (folder / "cut.pt").write_bytes((folder / "a.pt").read_bytes()[:300])
    (folder / "notes.txt").write_text("not a checkpoint")
    return folder


def test_each_file_is_one_line_with_the_verdict_inspect_gives_it(tmp_path, cli):
    folder = _folder(tmp_path)
    result = cli("inspect", folder, "--json")
    assert result.exit_code == 1, result.stderr  # a file would run code: as `inspect evil.pt`
    data = result.json()
    files = {f["path"].split("runs/")[1]: f for f in data["files"]}
    assert sorted(files) == ["a.pt", "b.safetensors", "cut.pt", "evil.pt", "run2/last.ckpt"]
    assert files["a.pt"]["tensors"] == 2 and files["a.pt"]["parameters"] == 16 and files["a.pt"]["verdict"] == "safe"
    assert files["run2/last.ckpt"]["dtypes"] == ["float16"] and files["b.safetensors"]["format"] == "safetensors"
    assert files["evil.pt"]["verdict"] == "dangerous" and any("os.system" in f for f in files["evil.pt"]["findings"])
    assert files["cut.pt"]["error"] and files["cut.pt"]["verdict"] == "safe"
    # evil.pt is read (its tensor counts), and only reported: 2 + 2 + 2 + 1 tensors
    assert data["total"] == {"files": 5, "tensors": 7, "parameters": 52, "bytes": 176, "unsafe": 1, "unreadable": 1}
    assert not (tmp_path / "canary").exists()
    for name, line in files.items():  # the same verdict and error as inspecting the file alone
        alone = cli("inspect", folder / name, "--json")
        assert alone.exit_code == (1 if line["findings"] else 2 if line["error"] else 0), name
        if not line["error"]:
            assert alone.json()["tensor_count"] == line["tensors"], name
        else:
            assert line["error"] in alone.stderr, name
    table = cli("inspect", folder)
    assert table.stdout.count("\n") == 2 + 5 and "cut.pt" in table.stdout and "DANGEROUS" in table.stdout
    assert "total  5 checkpoint file(s)" in table.stderr and "UNSAFE  1 file(s)" in table.stderr


def test_read_in_several_processes_it_is_the_same_listing(tmp_path, cli, monkeypatch):
    import ckpt_doctor.pool as pool

    folder = _folder(tmp_path)
    for i in range(12):
        torch.save({"w": torch.full((2,), float(i))}, folder / f"extra_{i:02d}.pt")
    monkeypatch.setenv("CKPT_DOCTOR_NO_FORK", "1")
    alone = cli("inspect", folder, "--json").json()
    monkeypatch.delenv("CKPT_DOCTOR_NO_FORK")
    monkeypatch.setattr(pool, "MIN_PER_WORKER", 1)
    monkeypatch.setattr(pool, "workers", lambda: 2)
    forked = cli("inspect", folder, "--json").json()
    assert forked == alone and len(forked["files"]) == 17


def test_a_folder_that_is_one_checkpoint_is_still_read_as_one(tmp_path, cli):
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, folder / "model.safetensors")
    torch.save({"w": torch.ones(2)}, folder / "training_args.bin")
    result = cli("inspect", folder, "--json")
    assert result.exit_code == 0 and result.json()["tensor_count"] == 1
    assert cli("fix", tmp_path, "-o", tmp_path / "x.pt").exit_code == 2  # fix needs one: names the choices
