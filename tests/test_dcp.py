"""torch.distributed.checkpoint folders written by torch's own DCP (two gloo ranks): listed with their global shapes,
consolidated bitwise equal to the state every rank saw (and to dcp_to_torch_save), refused when incomplete or unsafe.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.dcp_samples import Net, write_samples
from tests.payloads import os_system_pickle

NET = "tests/dcp_samples.py:Net"


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    return write_samples(tmp_path_factory.mktemp("dcp"))


def flat(tree, prefix: str = "") -> dict:
    """Dotted key -> leaf, as inspect names them (list indices and integer keys written as numbers)."""
    out = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, (dict, list)) and v:
            out.update(flat(v, key))
        else:
            out[key] = v
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                    b.reshape(-1).view(torch.uint8))


def assert_same_tree(got, want, where: str = "") -> None:
    """Same containers (dict vs list, integer vs string keys), same values, tensors equal bit for bit."""
    assert type(got) is type(want) or isinstance(got, dict) and isinstance(want, dict), (where, type(got), type(want))
    if isinstance(want, dict):
        assert list(got) == list(want) or set(got) == set(want), (where, list(got)[:5], list(want)[:5])
        for k in want:
            assert_same_tree(got[k], want[k], f"{where}.{k!r}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_tree(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert same_bits(got, want), where
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("name", ["dtensors", "fsdp2", "ddp", "nocoll"])
def test_inspect_lists_the_global_shapes(samples, name):
    result = run_cli("inspect", samples / name, "--json")
    assert result.exit_code == 0, result.stderr
    data = result.json()
    full = torch.load(samples / f"{name}.full.pt", weights_only=True)
    want = {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in flat(full).items()
            if isinstance(v, torch.Tensor)}
    assert {t["key"]: (t["shape"], t["dtype"]) for t in data["tensors"]} == want
    assert data["format"] == "torch-dcp" and data["distributed"]["ranks"] == 2


def test_layouts_say_how_each_tensor_was_split(samples):
    data = run_cli("inspect", samples / "dtensors", "--json").json()
    layout = {t["key"]: t["layout"] for t in data["tensors"]}
    assert layout["s0"] == "Shard(0) 2 ways uneven [3, 2]"
    assert layout["s1"] == "Shard(1) 2 ways uneven [3, 2]"
    assert layout["empty"].endswith("1 empty") and layout["rep"].startswith("whole")
    assert data["metadata"]["step"] == 7
    nocoll = run_cli("inspect", samples / "nocoll", "--json").json()
    assert "per-rank metadata" in nocoll["distributed"]["variant"][0]
    table = run_cli("inspect", samples / "fsdp2")
    assert "optim: 18 tensors (optimizer state)" in table.stderr and "model: 9 tensors (model weights)" in table.stderr


@pytest.mark.parametrize("name", ["dtensors", "fsdp2", "ddp", "nocoll"])
def test_fix_everything_is_bitwise_the_saved_state(samples, tmp_path, name):
    out = tmp_path / "all.pt"
    result = run_cli("fix", samples / name, "-o", out, "--select", "")
    assert result.exit_code == 0, result.stderr
    assert_same_tree(torch.load(out, weights_only=True), torch.load(samples / f"{name}.full.pt", weights_only=True))


def test_fix_agrees_with_dcp_to_torch_save(samples, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    official = tmp_path / "official.pt"
    dcp_to_torch_save(str(samples / "fsdp2"), str(official))
    mine = tmp_path / "mine.pt"
    assert run_cli("fix", samples / "fsdp2", "-o", mine, "--select", "").exit_code == 0
    theirs, ours = flat(torch.load(official, weights_only=False)), flat(torch.load(mine, weights_only=True))
    assert set(theirs) == set(ours)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert same_bits(ours[key], value), key
        else:
            assert ours[key] == value, key


def test_integer_optimizer_keys_stay_integers(samples, tmp_path):
    """DCP saves an optimizer's integer state keys as strings; Optimizer.load_state_dict would then restore nothing."""
    out = tmp_path / "all.pt"
    assert run_cli("fix", samples / "ddp", "-o", out, "--select", "").exit_code == 0
    optimizer = torch.load(out, weights_only=True)["optimizer"]
    assert sorted(optimizer["state"]) == list(range(6))
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(optimizer)
    first = next(iter(model.parameters()))
    assert same_bits(opt.state[first]["momentum_buffer"], optimizer["state"][0]["momentum_buffer"])


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_fix_writes_the_model_weights_by_default(samples, tmp_path, suffix):
    out = tmp_path / f"model{suffix}"
    result = run_cli("fix", samples / "fsdp2", "-o", out)
    assert result.exit_code == 0, result.stderr
    assert "--select ''" in result.stderr
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(out)
    else:
        state = torch.load(out, weights_only=True)
    want = torch.load(samples / "fsdp2.full.pt", weights_only=True)["model"]
    assert_same_tree(dict(state), dict(want))
    Net().load_state_dict(state, strict=True)


def test_inspect_model_compares_the_model_item(samples):
    result = run_cli("inspect", samples / "fsdp2", "--model", NET, "--json")
    assert result.exit_code == 0, result.stderr
    comparison = result.json()["comparison"]
    assert comparison["strict_load_ok"] is True and comparison["state_dict_root"] == "model"
    assert comparison["loaded_fraction"] == 1.0 and comparison["verdict"].startswith("strict load OK")


def test_verify_runs_a_dcp_folder(samples):
    result = run_cli("verify", samples / "fsdp2", "--model", NET, "--input-shape", "4,10", "--mode", "single")
    assert result.exit_code == 0, result.stderr


def test_missing_or_truncated_files_are_named(samples, tmp_path):
    folder = tmp_path / "fsdp2"
    shutil.copytree(samples / "fsdp2", folder)
    (folder / "__1_0.distcp").unlink()
    out = tmp_path / "out.safetensors"
    for command in (("inspect", folder), ("fix", folder, "-o", out)):
        result = run_cli(*command)
        assert result.exit_code == 2 and "__1_0.distcp is missing" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and not out.exists()
    shutil.copy(samples / "fsdp2" / "__1_0.distcp", folder / "__1_0.distcp")
    data = (folder / "__1_0.distcp").read_bytes()
    (folder / "__1_0.distcp").write_bytes(data[:len(data) // 2])
    result = run_cli("fix", folder, "-o", out)
    assert result.exit_code == 2 and "truncated" in result.stderr and not out.exists(), result.stderr


def test_a_payload_in_an_item_is_reported_not_run(samples, tmp_path, capfd):
    for command in ("scan", "inspect"):
        result = run_cli(command, samples / "payload")
        assert result.exit_code == 1, result.stderr
        assert "functools.partial" in result.stdout + result.stderr
    out = tmp_path / "out.pt"
    result = run_cli("fix", samples / "payload", "-o", out)
    assert result.exit_code == 1 and not out.exists()
    assert "payload ran" not in capfd.readouterr().out


def test_a_payload_in_the_metadata_is_reported_not_run(samples, tmp_path):
    folder = tmp_path / "evil"
    shutil.copytree(samples / "dtensors", folder)
    canary = tmp_path / "canary"
    (folder / ".metadata").write_bytes(os_system_pickle(canary))
    for command in ("scan", "inspect"):
        result = run_cli(command, folder)
        assert result.exit_code in (1, 2) and "os.system" in result.stdout + result.stderr, result.stderr
    assert not canary.exists()


def test_a_lone_shard_names_its_folder_and_fix_refuses_it(samples, tmp_path):
    shard = samples / "fsdp2" / "__0_0.distcp"
    result = run_cli("inspect", shard)
    assert result.exit_code == 0, result.stderr
    assert f"shard of the torch.distributed.checkpoint folder {samples / 'fsdp2'}" in result.stderr
    out = tmp_path / "one.safetensors"
    refused = run_cli("fix", shard, "-o", out)
    assert refused.exit_code == 2 and f"ckpt-doctor fix {samples / 'fsdp2'}" in refused.stderr and not out.exists()
    scan = run_cli("scan", samples / "dtensors")
    assert scan.exit_code == 0, scan.stdout + scan.stderr


def test_formats_not_read_yet_say_so(samples, tmp_path):
    result = run_cli("inspect", samples / "stformat")
    assert result.exit_code == 2 and "safetensors-format DCP folder" in result.stderr, result.stderr
    bare = tmp_path / "no_metadata"
    shutil.copytree(samples / "fsdp2", bare)
    (bare / ".metadata").unlink()
    result = run_cli("inspect", bare)
    assert result.exit_code == 2 and "no .metadata" in result.stderr, result.stderr
