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
    rows, _, notes = table.stdout.partition("\n\n")  # a detail too long for 120 columns is a note below
    assert rows.count("\n") == 2 + 4 and "cut.pt" in rows and "DANGEROUS" in table.stdout
    assert all(len(line) <= 120 for line in table.stdout.splitlines())
    assert not notes or notes.startswith("notes:\n(1) ")
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


def test_what_scan_flags_is_listed_wherever_it_hides(tmp_path, cli):
    """A pickle with no checkpoint name or PROTO byte that would run code, files two levels down, an empty .pt:
    all listed, and the exit code is the worst of them (found by a hostile review)."""
    from tests.payloads import call

    folder = tmp_path / "runs"
    (folder / "a" / "b").mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, folder / "a" / "b" / "deep.pt")
    (folder / "helper.dat").write_bytes(call("os", "system", f"touch {tmp_path / 'canary'}") + b".")
    (folder / "empty.pt").write_bytes(b"")
    (folder / "README.md").write_text("# notes\n")
    result = cli("inspect", folder, "--json")
    files = {f["path"].split("runs/")[1]: f for f in result.json()["files"]}
    assert sorted(files) == ["a/b/deep.pt", "empty.pt", "helper.dat"], files
    assert files["helper.dat"]["verdict"] == "dangerous" and result.exit_code == 1
    assert files["empty.pt"]["error"] and files["a/b/deep.pt"]["tensors"] == 1
    assert cli("scan", folder).exit_code == 1 and not (tmp_path / "canary").exists()


def test_a_checkpoint_folder_inside_is_one_line_and_links_count_once(tmp_path, cli):
    from safetensors.torch import save_file as save

    folder = tmp_path / "zoo"
    sharded = folder / "model_a"
    sharded.mkdir(parents=True)
    save({"x": torch.ones(2)}, sharded / "model-00001-of-00002.safetensors")
    save({"y": torch.ones(3)}, sharded / "model-00002-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"x": "model-00001-of-00002.safetensors", '
        '"y": "model-00002-of-00002.safetensors"}}')
    blobs, snapshot = folder / "hub" / "blobs", folder / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    torch.save({"z": torch.ones(4)}, blobs / "1234")
    (snapshot / "pytorch_model.bin").symlink_to(blobs / "1234")
    (folder / "bad\x1b[8mname.pt").write_bytes((blobs / "1234").read_bytes())
    (folder / "other.pt").write_bytes((blobs / "1234").read_bytes())
    data = cli("inspect", folder, "--json").json()
    lines = {f["path"].split("zoo/")[1]: f for f in data["files"]}
    assert lines["model_a"]["tensors"] == 2 and lines["model_a"]["format"] == "sharded"
    assert len([k for k in lines if k.startswith("hub/")]) == 1  # the blob and its link: one file
    assert data["total"]["tensors"] == 2 + 1 + 1 + 1
    table = cli("inspect", folder).stdout
    assert "\x1b" not in table and "bad\\x1b[8mname.pt" in table  # a name cannot recolour or hide a row


def test_html_never_overwrites_a_file_it_did_not_write(tmp_path, cli):
    path = tmp_path / "a.pt"
    torch.save({"w": torch.ones(2)}, path)
    precious = tmp_path / "precious.pt"
    precious.write_bytes(path.read_bytes())
    refused = cli("inspect", path, "--html", precious)
    assert refused.exit_code == 2 and "not a page ckpt-doctor wrote" in refused.stderr
    assert precious.read_bytes() == path.read_bytes()
    page = tmp_path / "page.html"
    assert cli("inspect", path, "--html", page).exit_code == 0
    assert cli("diff", path, path, "--html", page).exit_code == 0  # its own page is replaced (a CI job re-runs)
