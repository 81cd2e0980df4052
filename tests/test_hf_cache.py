"""`hf://org/name[@revision][/file]`: a model in the local Hugging Face cache, laid out as huggingface_hub lays it
(refs/, snapshots/<commit>/ of links into blobs/), read offline by every read-only command and as fix's and verify's
source; a reference the cache lacks is one error line saying how to download it."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.payloads import call

SHA1 = "1" * 40
SHA2 = "2" * 40


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.out = torch.nn.Linear(3, 2)


def add_snapshot(cache: Path, repo: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ()) -> Path:
    """A snapshot as huggingface_hub writes it: each file a blob named by its content, linked from the snapshot."""
    import hashlib

    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    (folder / "refs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (folder / "blobs" / blob).write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(folder / "blobs" / blob, link.parent), link)
    for ref in refs:
        (folder / "refs" / ref).write_text(commit)
    return snapshot


def safetensors_bytes(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> bytes:
    path = tmp_path / "made.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    data = path.read_bytes()
    path.unlink()
    return data


def torch_bytes(tmp_path: Path, obj: object) -> bytes:
    path = tmp_path / "made.bin"
    torch.save(obj, path)
    data = path.read_bytes()
    path.unlink()
    return data


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache named by HF_HUB_CACHE, and a working folder outside it."""
    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return hub


def listing(result) -> dict[str, list[int]]:
    assert result.exit_code == 0, result.stderr
    return {t["key"]: t["shape"] for t in result.json()["tensors"]}


def test_a_cached_model_is_inspected_by_its_name_its_revision_and_its_files(cache, tmp_path, cli):
    torch.manual_seed(0)
    old, new = Net().state_dict(), Net().state_dict()
    new["extra.weight"] = torch.ones(5)
    add_snapshot(cache, "org/name", SHA1, {"model.safetensors": safetensors_bytes(tmp_path, old)}, refs=("v1",))
    add_snapshot(cache, "org/name", SHA2, {"model.safetensors": safetensors_bytes(tmp_path, new),
                                           "config.json": b'{"model_type": "none"}'}, refs=("main",))
    expect_new = {k: list(v.shape) for k, v in new.items()}
    expect_old = {k: list(v.shape) for k, v in old.items()}
    assert listing(cli("inspect", "hf://org/name", "--json")) == expect_new  # main
    assert listing(cli("inspect", "hf://org/name/model.safetensors", "--json")) == expect_new
    assert listing(cli("inspect", "hf://org/name@v1", "--json")) == expect_old  # refs/v1 names the older commit
    assert listing(cli("inspect", "hf://org/name@v1/model.safetensors", "--json")) == expect_old
    assert listing(cli("inspect", f"hf://org/name@{SHA1}", "--json")) == expect_old  # a commit names its snapshot
    assert cli("scan", "hf://org/name").exit_code == 0
    diff = cli("diff", "hf://org/name@v1", "hf://org/name", "--json")
    assert diff.exit_code == 1, diff.stderr  # B has a tensor A lacks


def test_a_reference_the_cache_lacks_says_how_to_download_it_and_downloads_nothing(cache, tmp_path, cli):
    add_snapshot(cache, "org/name", SHA1, {"model.safetensors": safetensors_bytes(tmp_path, Net().state_dict())},
                 refs=("main",))
    before = sorted(p.relative_to(cache) for p in cache.rglob("*"))
    cases = {"hf://org/missing": "huggingface-cli download org/missing`",
             "hf://org/name@v9": "huggingface-cli download org/name --revision v9`",
             "hf://org/name/pytorch_model.bin": "huggingface-cli download org/name pytorch_model.bin`"}
    for ref, hint in cases.items():
        for command in (("inspect", ref), ("scan", ref), ("diff", ref, ref), ("fix", ref, "-o", "out.pt")):
            result = cli(*command)
            assert result.exit_code == 2, (command, result.stderr)
            assert result.stdout == ""
            lines = result.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"Error: {ref}: "), result.stderr
            assert "not in the local" in lines[0] and "nothing was downloaded" in lines[0] and hint in lines[0]
    assert "hf download org/name --revision v9" in cli("inspect", "hf://org/name@v9").stderr
    assert sorted(p.relative_to(cache) for p in cache.rglob("*")) == before
    assert list(Path.cwd().iterdir()) == []


def test_the_cache_is_found_where_huggingface_hub_finds_it(tmp_path, monkeypatch, cli):
    home = tmp_path / "hf_home"
    add_snapshot(home / "hub", "org/name", SHA1, {"model.safetensors": safetensors_bytes(tmp_path, Net().state_dict())},
                 refs=("main",))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    assert cli("inspect", "hf://org/name").exit_code == 0
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "nobody"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    result = cli("inspect", "hf://org/name")
    assert result.exit_code == 2 and str(tmp_path / "nobody" / ".cache" / "huggingface" / "hub") in result.stderr


def test_the_printed_fix_runs_as_printed_and_writes_here_not_into_the_cache(cache, tmp_path, cli):
    torch.manual_seed(1)
    model = Net()
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}  # saved from DataParallel
    snapshot = add_snapshot(cache, "org/name", SHA1, {"pytorch_model.bin": torch_bytes(tmp_path, wrapped),
                                                      "config.json": b"{}"}, refs=("main",))
    (tmp_path / "work" / "nets.py").write_text(
        "import torch\n\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = torch.nn.Linear(4, 3)\n        self.out = torch.nn.Linear(3, 2)\n")
    result = cli("inspect", "hf://org/name", "--model", "nets.py:Net")
    assert result.exit_code == 1
    fix = [line for line in result.stderr.splitlines() if line.startswith("fix")]
    assert len(fix) == 1, result.stderr
    command = fix[0].split("`")[1]
    assert command.startswith("ckpt-doctor fix hf://org/name -o name_fixed.pt "), command
    ran = cli(*shlex.split(command)[1:])
    assert ran.exit_code == 0, ran.stderr
    out = torch.load(tmp_path / "work" / "name_fixed.pt", weights_only=True)
    fresh = Net()
    fresh.load_state_dict(out, strict=True)  # torch, the oracle
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "pytorch_model.bin"]
    verify = cli("verify", "hf://org/name", "--model", "nets.py:Net", "--input-shape", "2,4", "--mode", "single")
    assert verify.exit_code == 1 and "ckpt-doctor fix hf://org/name -o name_fixed2.pt" in verify.stderr
    # the reference is read, never written: an output in the cache's scheme is refused
    refused = cli("fix", "hf://org/name", "-o", "hf://org/name/fixed.pt", "--strip-module")
    assert refused.exit_code == 2 and "never writes into it" in refused.stderr


def test_a_sharded_snapshot_is_one_checkpoint(cache, tmp_path, cli):
    import json

    sd = Net().state_dict()
    first = {k: v for k, v in sd.items() if k.startswith("fc.")}
    second = {k: v for k, v in sd.items() if k.startswith("out.")}
    index = {"metadata": {}, "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in first},
                                            **{k: "model-00002-of-00002.safetensors" for k in second}}}
    add_snapshot(cache, "org/big", SHA1, {"model.safetensors.index.json": json.dumps(index).encode(),
                                          "model-00001-of-00002.safetensors": safetensors_bytes(tmp_path, first),
                                          "model-00002-of-00002.safetensors": safetensors_bytes(tmp_path, second)},
                 refs=("main",))
    result = cli("inspect", "hf://org/big", "--json")
    assert listing(result) == {k: list(v.shape) for k, v in sd.items()}
    assert result.json()["format"] == "sharded"


def test_scan_of_a_cached_model_finds_what_it_would_run(cache, tmp_path, cli):
    canary = tmp_path / "CANARY"
    evil = b"\x80\x02" + call("os", "system", f"touch {canary}") + b"."
    add_snapshot(cache, "org/evil", SHA1, {"pytorch_model.bin": evil}, refs=("main",))
    for ref in ("hf://org/evil", "hf://org/evil/pytorch_model.bin"):
        result = cli("scan", ref, "--json")
        assert result.exit_code == 1, result.stderr
        assert any(f["verdict"] == "dangerous" for f in result.json()["files"])
    assert not canary.exists()


def test_a_snapshot_link_out_of_the_cache_is_refused(cache, tmp_path, cli):
    snapshot = add_snapshot(cache, "org/name", SHA1, {"config.json": b"{}"}, refs=("main",))
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(safetensors_bytes(tmp_path, Net().state_dict()))
    os.symlink(outside, snapshot / "model.safetensors")
    for ref in ("hf://org/name", "hf://org/name/model.safetensors"):
        for command in (("inspect", ref), ("scan", ref)):
            result = cli(*command)
            assert result.exit_code == 2, result.stderr
            assert "outside the cache" in result.stderr and len(result.stderr.splitlines()) == 1
    assert cli("inspect", snapshot / "model.safetensors").exit_code == 0  # named as a path, a link is followed


def test_a_reference_that_names_no_repository_is_refused(cache, cli):
    for ref in ("hf://", "hf://org/../x", "hf://org/name/../../etc/passwd", "hf://org/name@"):
        result = cli("inspect", ref)
        assert result.exit_code == 2 and result.stderr.startswith("Error: "), (ref, result.stderr)
        assert len(result.stderr.splitlines()) == 1


def test_a_cached_model_s_own_config_is_its_model_spec(cache, tmp_path, cli):
    """`--model hf://org/name` builds the model from the config.json of the cached snapshot, offline, and checks the
    cached weights (or any file) against it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=37, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(config)
    add_snapshot(cache, "org/bert-tiny", SHA1, {"config.json": config.to_json_string().encode(),
                                                 "model.safetensors": safetensors_bytes(tmp_path, model.state_dict())},
                 refs=("main",))
    result = cli("inspect", "hf://org/bert-tiny", "--model", "hf://org/bert-tiny", "--json")
    assert result.exit_code == 0, result.stderr
    assert "strict load OK" in result.json()["comparison"]["verdict"]
    missing = cli("inspect", "hf://org/bert-tiny", "--model", "hf://org/other")
    assert missing.exit_code == 2 and missing.stderr.startswith("Error: --model hf://org/other: ")
    assert "not in the local Hugging Face cache" in missing.stderr and len(missing.stderr.splitlines()) == 1
