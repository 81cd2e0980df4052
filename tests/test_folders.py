"""Issue 24: a folder scan stays inside the folder. File links are followed to regular files wherever they point
(and said to be links); folder links only inside the folder walked (or, for a Hugging Face cache snapshot, inside its
repository's cache folder); special files are skipped with a line; no path length, link loop or vanishing file is an
internal error; and `scan DIR` and `inspect DIR` give each file the same verdict.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from tests.payloads import os_system_pickle

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux: /proc, FIFOs, long paths")


def _clean(path) -> None:
    torch.save({"w": torch.ones(2)}, path)


def _verdicts(command_json: dict) -> dict[str, str]:
    return {f["path"]: f["verdict"] for f in command_json["files"]}


def _scan_and_inspect(cli, folder):
    """Both commands on the folder, JSON; neither ends in an internal error."""
    scan, inspect = cli("scan", folder, "--json"), cli("inspect", folder, "--json")
    for result in (scan, inspect):
        assert "internal error" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    return scan, inspect


def _hostile_tree(tmp_path, monkeypatch):
    """Two clean checkpoints, one that would run code, and every kind of entry a walk must not follow or open."""
    folder = tmp_path / "run"
    (folder / "sub").mkdir(parents=True)
    _clean(folder / "a.pt")
    _clean(folder / "b.pt")
    canary = tmp_path / "canary"
    (folder / "sub" / "evil.pkl").write_bytes(os_system_pickle(canary))
    (tmp_path / "elsewhere.pt").write_bytes(os_system_pickle(canary))
    os.symlink(tmp_path / "elsewhere.pt", folder / "linked.pt")  # a file link out of the folder: followed
    os.symlink("/proc/self", folder / "proc")
    os.symlink("/proc/self/environ", folder / "environ")
    os.symlink("/", folder / "root")
    os.symlink("/usr", folder / "usr")
    os.symlink("/dev/null", folder / "null")
    os.symlink("..", folder / "up")
    os.symlink("..", folder / "sub" / "loop")  # a folder link back inside: a loop, cut
    os.symlink("b_link", folder / "a_link")
    os.symlink("a_link", folder / "b_link")  # a symlink loop
    os.symlink("gone.pt", folder / "dangling.pt")
    os.mkfifo(folder / "fifo.pt")
    for pipe in ("pipe.safetensors", "sub/pipe.safetensors"):  # safetensors files are opened to tell a layout
        os.mkfifo(folder / pipe)
    monkeypatch.chdir(folder)  # a socket's path is at most 108 bytes: bound by its short relative name
    server = socket.socket(socket.AF_UNIX)
    server.bind("sock.pt")
    monkeypatch.chdir(tmp_path)
    return folder, canary, server


def test_a_hostile_folder_is_walked_inside_itself_only(tmp_path, monkeypatch, cli):
    folder, canary, server = _hostile_tree(tmp_path, monkeypatch)
    with server:
        scan, inspect = _scan_and_inspect(cli, folder)
    assert scan.exit_code == 1 and inspect.exit_code == 1  # what would run code decides, in both
    expected = {str(folder / n): v for n, v in [("a.pt", "safe"), ("b.pt", "safe"), ("linked.pt", "dangerous"),
                                                ("sub/evil.pkl", "dangerous")]}
    assert _verdicts(scan.json()) == expected and _verdicts(inspect.json()) == expected
    links = {f["path"]: f["link"] for f in scan.json()["files"] if f["link"]}
    assert links == {str(folder / "linked.pt"): str(tmp_path / "elsewhere.pt")}
    assert {f["path"]: f["link"] for f in inspect.json()["files"] if f["link"]} == links
    for data in (scan.json(), inspect.json()):
        skipped = {s["path"][len(str(folder)) + 1:]: s["reason"] for s in data["skipped"]}
        assert set(skipped) == {"proc", "environ", "root", "usr", "null", "up", "fifo.pt", "pipe.safetensors",
                                "sub/pipe.safetensors", "sock.pt"}, skipped
        assert "kernel's proc filesystem" in skipped["proc"] and "kernel's proc filesystem" in skipped["environ"]
        assert all("outside" in skipped[n] and "not followed" in skipped[n] for n in ("root", "usr", "up"))
        assert "named pipe" in skipped["fifo.pt"] and "socket" in skipped["sock.pt"]
        assert "character device" in skipped["null"]
        problems = "\n".join(data["problems"])
        assert "dangling.pt: symlink points to gone.pt, which does not exist" in problems
        assert "a_link: symlinks loop" in problems and "b_link: symlinks loop" in problems
        # nothing of the host was walked: every path named is in the folder, none below its links
        paths = [f["path"] for f in data["files"]] + [s["path"] for s in data["skipped"]]
        assert all(p.startswith(str(folder) + "/") for p in paths)
        assert not any(p.startswith(str(folder / n) + "/") for p in paths for n in ("proc", "root", "usr", "up"))
    table = cli("scan", folder)
    assert f"skipped {folder / 'usr'}: a link to a folder outside {folder} (/usr): not followed" in table.stderr
    assert f"{folder / 'linked.pt'} (→ {tmp_path / 'elsewhere.pt'})" in table.stderr
    assert not canary.exists()


def test_special_files_named_alone_are_refused_without_waiting(tmp_path, cli):
    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    for command in ("scan", "inspect"):
        result = cli(command, fifo)
        assert result.exit_code == 2 and "not a regular file" in result.stderr, result.stderr
    result = cli("scan", "/proc/self/environ")
    assert result.exit_code == 2 and "kernel's proc filesystem" in result.stderr


def test_a_folder_on_a_kernel_filesystem_is_not_walked(cli):
    for command in ("scan", "inspect"):
        result = cli(command, "/proc/self")
        assert result.exit_code == 2 and "kernel's proc filesystem" in result.stderr, result.stderr


def _deep_folder(root, levels: int = 22) -> str:
    """Folders nested under `root`, made one at a time relative to the last (no path this long can be opened): the
    relative path of the deepest, over PATH_MAX (4096 bytes) from `root`."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    names = []
    try:
        for i in range(levels):
            name = f"{i:02d}" + "d" * 198
            os.mkdir(name, dir_fd=fd)
            deeper = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
            names.append(name)
    finally:
        os.close(fd)
    return "/".join(names)


def _write_deep(root, relative: str, data: bytes) -> None:
    """Writes `data` at root/relative however long the path is (opened folder by folder)."""
    *folders, name = relative.split("/")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in folders:
            deeper = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=fd)
        try:
            os.write(out, data)
        finally:
            os.close(out)
    finally:
        os.close(fd)


@pytest.mark.parametrize("layout", ["listing", "model folder"])
def test_a_file_deeper_than_path_max_is_read_by_both(tmp_path, cli, layout):
    """`scan` used to exit 2 ("File name too long") where `inspect` skipped the file and said 0."""
    folder = tmp_path / "deep"
    folder.mkdir()
    _clean(folder / "model.pt")
    if layout == "listing":
        _clean(folder / "other.pt")
    canary = tmp_path / "canary"
    relative = _deep_folder(folder) + "/evil.pkl"
    _write_deep(folder, relative, os_system_pickle(canary))
    deep = f"{folder}/{relative}"
    assert len(os.fsencode(deep)) > 4096
    scan, inspect = _scan_and_inspect(cli, folder)
    assert scan.exit_code == 1 and inspect.exit_code == 1, (scan.stderr, inspect.stderr)
    assert _verdicts(scan.json())[deep] == "dangerous"
    if layout == "listing":
        assert _verdicts(inspect.json()) == _verdicts(scan.json())
    else:  # the folder is one checkpoint: the file beside it that would run code is named as a hazard
        assert any(relative in h["what"] for h in inspect.json()["hazards"]), inspect.stdout[:2000]
    for command in ("scan", "inspect"):  # named by its whole path, as a user copies it from the line above
        alone = cli(command, deep, "--json")
        assert alone.exit_code == 1 and "internal error" not in alone.stderr, alone.stderr
    assert not canary.exists()


def test_a_file_that_vanishes_is_said_by_both(tmp_path, monkeypatch, cli):
    """Deleted after the walk listed it, or between the folder's listing and the look at its entry."""
    import ckpt_doctor.readers as readers_module
    import ckpt_doctor.scan as scan_module
    from ckpt_doctor import sniff

    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("a.pt", "b.pt", "c.pt"):
        _clean(folder / name)
    walk = sniff.walk_folder

    def walk_then_delete(path, **kwargs):
        walked = walk(path, **kwargs)
        victim = folder / "b.pt"
        if victim.exists():
            victim.unlink()
        return walked

    for command in ("scan", "inspect"):
        _clean(folder / "b.pt")
        with monkeypatch.context() as m:
            m.setattr(sniff, "walk_folder", walk_then_delete)
            m.setattr(scan_module, "walk_folder", walk_then_delete)
            m.setattr(readers_module, "walk_folder", walk_then_delete)  # the folder listing's walk
            result = cli(command, folder, "--json")
        assert result.exit_code == 2 and "internal error" not in result.stderr, result.stderr
        line = {f["path"]: f for f in result.json()["files"]}[str(folder / "b.pt")]
        assert "No such file or directory" in line["error"] and line["verdict"] == "safe"

    entries = sniff._entries
    monkeypatch.setattr(sniff, "_entries", lambda fd: entries(fd) + ["gone.pt"])
    scan, inspect = _scan_and_inspect(cli, folder)
    for result in (scan, inspect):
        assert result.exit_code == 2
        assert f"{folder / 'gone.pt'}: vanished while the folder was read" in result.json()["problems"]
    assert _verdicts(scan.json()) == _verdicts(inspect.json())


def test_a_hugging_face_snapshot_is_followed_into_its_cache_only(tmp_path, cli, fixtures):
    repo = tmp_path / "hub" / "models--org--name"
    blobs, snapshot, extra = repo / "blobs", repo / "snapshots" / "abc123", repo / "extra"
    for d in (blobs, snapshot, extra):
        d.mkdir(parents=True)
    (blobs / "1111").write_bytes(fixtures["safetensors"]["path"].read_bytes())
    os.symlink("../../blobs/1111", snapshot / "model.safetensors")
    canary = tmp_path / "canary"
    (extra / "evil.pkl").write_bytes(os_system_pickle(canary))
    os.symlink("../../extra", snapshot / "extra")  # a folder link inside the repository's cache: followed
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "x.pt").write_bytes(os_system_pickle(canary))
    os.symlink(tmp_path / "outside", snapshot / "outside")  # out of the cache: not followed
    scan, inspect = _scan_and_inspect(cli, snapshot)
    assert scan.exit_code == 1 and inspect.exit_code == 1
    files = {f["path"]: f for f in scan.json()["files"]}
    assert set(files) == {str(snapshot / "model.safetensors"), str(snapshot / "extra" / "evil.pkl")}
    assert files[str(snapshot / "model.safetensors")]["link"] == "../../blobs/1111"
    assert files[str(snapshot / "extra" / "evil.pkl")]["verdict"] == "dangerous"
    assert [s["path"] for s in scan.json()["skipped"]] == [str(snapshot / "outside")]
    # inspect reads the snapshot's model and names what beside it would run code, as scan does
    assert inspect.json()["tensor_count"] > 0
    assert any("extra/evil.pkl" in h["what"] for h in inspect.json()["hazards"])
    assert not any("outside" in h["what"] for h in inspect.json()["hazards"])
    assert not canary.exists()


def test_a_folder_link_inside_the_folder_is_walked_once_under_its_own_name(tmp_path, cli):
    folder = tmp_path / "run"
    (folder / "z_real").mkdir(parents=True)
    _clean(folder / "a.pt")
    _clean(folder / "c.pt")
    _clean(folder / "z_real" / "b.pt")
    os.symlink("z_real", folder / "a_alias")
    scan, inspect = _scan_and_inspect(cli, folder)
    expected = {str(folder / n): "safe" for n in ("a.pt", "c.pt", "z_real/b.pt")}
    assert _verdicts(scan.json()) == expected and _verdicts(inspect.json()) == expected
    assert scan.exit_code == 0 and inspect.exit_code == 0 and not scan.json()["skipped"]


def test_a_pipe_a_dcp_folder_names_as_its_shard_is_never_opened(tmp_path, cli):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    dcp.save({"model": torch.nn.Linear(4, 2).state_dict()}, checkpoint_id=str(folder), no_dist=True)
    (folder / "__0_0.distcp").unlink()
    os.mkfifo(folder / "__0_0.distcp")
    scan, inspect = _scan_and_inspect(cli, folder)
    assert [s["path"] for s in scan.json()["skipped"]] == [str(folder / "__0_0.distcp")]
    assert inspect.exit_code == 2 and "__0_0.distcp is not a regular file" in inspect.stderr


@pytest.mark.parametrize("name, skipped", [("weights.bin", False), ("model.pt", False), ("notes.txt", True)])
def test_a_file_that_is_no_checkpoint_is_judged_alike_by_both(tmp_path, cli, name, skipped):
    """Named as a checkpoint (Core ML's weights.bin, a git-lfs pointer as model.pt), it is an error for both commands,
    never passed over for the checkpoint beside it; under any other name scan skips it with a line, and inspect
    reads the one checkpoint beside it."""
    _clean(tmp_path / "good.pt")
    (tmp_path / name).write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 12\n")
    scan, inspect = cli("scan", tmp_path), cli("inspect", tmp_path)
    assert scan.exit_code == inspect.exit_code == (0 if skipped else 2)
    if skipped:
        assert f"skipped {tmp_path / name}: not a checkpoint" in scan.stderr
        assert "good.pt loads with torch's defaults" in inspect.stderr  # the folder's one checkpoint, as for a model
    else:
        line = next(line for line in scan.stderr.splitlines() if name in line)
        assert line.startswith(f"{tmp_path / name}: NOT READ — not a checkpoint: the bytes are a Git LFS pointer")
        table = " ".join(inspect.stdout.split())  # (the table wraps its cells where the folder's path length puts it)
        assert "good.pt" in table and name in table and "Git LFS pointer" in table


def _core_ml_weights() -> bytes:
    """The head of a Core ML `weight.bin` (MIL blob storage v2: a count, the version, then a blob sentinel)."""
    header = (1).to_bytes(4, "little") + (2).to_bytes(4, "little") + bytes(56)
    return header + b"\xef\xbe\xad\xde" + (2).to_bytes(4, "little") + bytes(120)


@pytest.mark.parametrize("name, data, what", [
    ("weight.bin", _core_ml_weights(), "a Core ML weight file"),
    ("weights.pt", b"\x89HDF\r\n\x1a\n" + bytes(600), "an HDF5 file"),
    ("config.bin", b'{"hidden_size": 32}\n', "JSON text"),
])
def test_a_file_whose_bytes_say_what_else_it_is_is_skipped_whatever_its_name(tmp_path, cli, name, data, what):
    """A Hugging Face snapshot with a Core ML package beside the model, an HDF5 file under `.pt`: the bytes name
    another format, so the folder is not failed for it (a pointer or an empty file under such a name is)."""
    _clean(tmp_path / "good.pt")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / name).write_bytes(data)
    scan, inspect = cli("scan", tmp_path), cli("inspect", tmp_path)
    assert scan.exit_code == inspect.exit_code == 0, (scan.stderr, inspect.stderr)
    assert f"sub/{name}: not a PyTorch checkpoint: {what}" in scan.stderr
    _clean(tmp_path / "other.pt")  # two checkpoints: inspect lists the folder, the file under sub/ as skipped
    inspect = cli("inspect", tmp_path)
    assert inspect.exit_code == 0 and f"sub/{name}: not a PyTorch checkpoint: {what}" in inspect.stderr
    (tmp_path / "other.pt").unlink()
    (tmp_path / "sub" / name).rename(tmp_path / name)  # beside the checkpoint: inspect still reads good.pt
    inspect = cli("inspect", tmp_path)
    assert inspect.exit_code == 0 and "good.pt" in inspect.stdout + inspect.stderr


def test_a_clean_checkpoint_beside_a_file_that_runs_code_is_not_called_unsafe_itself(tmp_path, cli):
    """inspect DIR reads the folder's one checkpoint, and says the danger is the file beside it, with no rescue it
    cannot print; scan promises no rescue line a NumPy array does not get."""
    from tests.payloads import object_npy

    _clean(tmp_path / "ok.pt")
    (tmp_path / "evil.npy").write_bytes(object_npy(os_system_pickle(tmp_path / "CANARY")))
    inspect, scan = cli("inspect", tmp_path), cli("scan", tmp_path)
    assert inspect.exit_code == scan.exit_code == 1
    assert "UNSAFE folder: ok.pt itself names nothing off the allow-list" in inspect.stderr
    assert "rescue" not in inspect.stderr and "rescue line" not in scan.stderr
    assert "evil.npy in the same folder would run code" in inspect.stderr


def test_a_shard_index_named_by_itself_is_its_checkpoint(tmp_path, cli):
    """`inspect model.safetensors.index.json` reads the shards it names, as the folder is read (a remote index URL
    already was); `scan` of it scans those shards; a shard it names that is missing is one error line."""
    import json

    from safetensors.torch import save_file

    folder = tmp_path / "sharded"
    folder.mkdir()
    save_file({"a.weight": torch.ones(2, 3)}, folder / "model-00001-of-00002.safetensors")
    save_file({"b.weight": torch.zeros(4)}, folder / "model-00002-of-00002.safetensors")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 40}, "weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}))
    by_index, by_folder = cli("inspect", index, "--json"), cli("inspect", folder, "--json")
    assert by_index.exit_code == by_folder.exit_code == 0, by_index.stderr
    assert by_index.json()["tensors"] == by_folder.json()["tensors"]
    assert [t["key"] for t in by_index.json()["tensors"]] == ["a.weight", "b.weight"]
    scanned = cli("scan", index, "--json")
    assert scanned.exit_code == 0, scanned.stderr
    assert sorted(Path(f["path"]).name for f in scanned.json()["files"]) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (folder / "model-00002-of-00002.safetensors").unlink()
    for command in ("inspect", "scan"):
        broken = cli(command, index)
        assert broken.exit_code == 2 and "model-00002-of-00002.safetensors" in broken.stderr


@pytest.mark.parametrize("shard", [["model-00001-of-00001.safetensors"], "model-00001-of-00001.safetensors\0"])
def test_a_shard_index_naming_a_shard_by_no_file_name_is_refused_in_one_line(tmp_path, cli, shard):
    """A weight_map value that is a JSON list (unhashable: the index's shards were deduplicated before each was
    checked) or a name with a NUL (os.stat raises ValueError, not OSError) is one error line, read through the
    folder or the index, by every command: never an internal error."""
    import json

    from safetensors.torch import save_file

    folder = tmp_path / "sharded"
    folder.mkdir()
    save_file({"a.weight": torch.ones(2, 3)}, folder / "model-00001-of-00001.safetensors")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a.weight": shard}}))
    for args in (("inspect", folder), ("inspect", index), ("scan", index), ("fix", index, "-o", tmp_path / "out.pt"),
                 ("diff", folder, folder)):
        result = cli(*args)
        assert result.exit_code == 2, (args, result.stderr)
        assert "internal error" not in result.stderr, (args, result.stderr)
        assert "weight_map names shard" in result.stderr and "which is not a file name" in result.stderr, result.stderr
    assert not (tmp_path / "out.pt").exists()
