"""inspect --json agrees exactly with torch about every format: keys, shapes, dtypes and saved devices."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import doctor_view, torch_view

ALL = ["plain", "dataparallel", "ddp", "compiled", "training", "lightning", "ema", "tied", "legacy", "cuda3",
       "cuda0_legacy", "whole_model", "torchscript", "safetensors", "dtypes", "sharded_safetensors", "sharded_bin",
       "hf_folder"]
EXPECTED_FORMAT = {"legacy": "torch-legacy", "cuda0_legacy": "torch-legacy", "torchscript": "torchscript",
                   "safetensors": "safetensors", "hf_folder": "safetensors", "sharded_safetensors": "sharded",
                   "sharded_bin": "sharded"}


# Files that need their code to load: a whole pickled model names its classes, a TorchScript archive runs code/.
# They are listed all the same — and flagged, with exit 1, as `scan` flags them.
NEEDS_CODE = {"whole_model", "torchscript"}


@pytest.mark.parametrize("name", ALL)
def test_keys_shapes_dtypes_match_the_fixture(fixtures, cli, name):
    info = fixtures[name]
    result = cli("inspect", info["path"], "--json")
    assert result.exit_code == (1 if name in NEEDS_CODE else 0), result.stderr
    data = result.json()
    assert data["format"] == EXPECTED_FORMAT.get(name, "torch-zip")
    got = {t["key"]: (t["shape"], t["dtype"]) for t in data["tensors"]}
    assert got == {k: tuple(v) for k, v in info["expected"].items()}
    assert {t["device"] for t in data["tensors"]} == {info["device"]}
    if name in NEEDS_CODE:
        assert data["verdict"] == "code"
        assert data["unsafe_globals"] or data["hazards"]
    else:
        assert data["verdict"] == "safe" and data["unsafe_globals"] == [] and data["hazards"] == []


@pytest.mark.parametrize("name", ["plain", "dataparallel", "ddp", "compiled", "training", "lightning", "ema", "tied",
                                  "legacy", "dtypes", "cuda3", "cuda0_legacy"])
def test_agrees_with_torch_load(fixtures, cli, name):
    path = fixtures[name]["path"]
    data = cli("inspect", path, "--json").json()
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    theirs = {k: v[:2] for k, v in torch_view(loaded).items()}
    ours = {k: tuple(v[:2]) for k, v in doctor_view(data).items()}
    assert ours == {k: tuple(v) for k, v in theirs.items()}
    assert list(ours) == list(theirs), "keys must come in the file's order"


def test_safetensors_agrees_with_safe_open(fixtures, cli):
    from safetensors import safe_open

    path = fixtures["safetensors"]["path"]
    data = cli("inspect", path, "--json").json()
    with safe_open(str(path), framework="pt") as f:
        theirs = {k: (list(f.get_slice(k).get_shape()), str(f.get_tensor(k).dtype).removeprefix("torch."))
                  for k in f.keys()}
        assert data["metadata"] == f.metadata()
    assert {t["key"]: (t["shape"], t["dtype"]) for t in data["tensors"]} == theirs


def test_saved_device_is_reported(fixtures, cli):
    result = cli("inspect", fixtures["cuda3"]["path"])
    assert result.exit_code == 0
    assert "cuda:3" in result.stderr
    assert "saved on" in result.stderr


@pytest.mark.parametrize("name,root", [("training", "state_dict"), ("lightning", "state_dict"), ("ema", "model"),
                                       ("plain", ""), ("whole_model", ""), ("torchscript", "")])
def test_state_dict_root(fixtures, cli, name, root):
    data = cli("inspect", fixtures[name]["path"], "--json").json()
    assert data["state_dict_root"] == root
    if name == "ema":
        assert data["other_state_dicts"] == ["ema"]


def test_many_state_dict_like_containers(tmp_path, cli):
    # 40,000 one-tensor dicts: each is a state_dict candidate. Choosing among them once took minutes (every
    # candidate's tensors were counted by scanning every key); the table names the first few and counts the rest.
    n = 40_000
    base = torch.arange(float(n))
    torch.save({f"m{i}": {"w": base[i:i + 1]} for i in range(n)}, tmp_path / "many.pt")
    result = cli("inspect", tmp_path / "many.pt", "--json")
    assert result.exit_code == 0, result.stderr
    data = result.json()
    assert len(data["tensors"]) == n
    assert data["state_dict_root"] == "m0" and len(data["other_state_dicts"]) == n - 1
    table = cli("inspect", tmp_path / "many.pt")
    line = next(x for x in table.stderr.splitlines() if x.startswith("state_dict"))
    assert line.endswith(f"m8, … {n - 9} more (--full))"), line
    full = cli("inspect", tmp_path / "many.pt", "--full").stderr
    assert f"m{n - 1})" in next(x for x in full.splitlines() if x.startswith("state_dict"))


def test_state_dict_root_among_nested_candidates(tmp_path, cli):
    # The model's weights under a named holder win over a bigger copy; a holder nested in another is not listed.
    t = torch.zeros
    torch.save({"teacher": {"a": t(1), "b": t(1), "c": t(1)}, "state_dict": {"model": {"a": t(1)}, "x": t(1)},
                "optimizer": {"state": {0: {"exp_avg": t(1)}}, "param_groups": [{"params": [0]}]}}, tmp_path / "n.pt")
    data = cli("inspect", tmp_path / "n.pt", "--json").json()
    assert data["state_dict_root"] == "state_dict"
    assert data["other_state_dicts"] == ["teacher"]


@pytest.mark.parametrize("name,prefixes", [("dataparallel", ["module."]), ("ddp", ["module."]),
                                           ("compiled", ["_orig_mod."]), ("lightning", ["model."]),
                                           ("plain", [])])
def test_prefixes(fixtures, cli, name, prefixes):
    data = cli("inspect", fixtures[name]["path"], "--json").json()
    assert data["prefixes"] == prefixes


def test_mid_key_and_stacked_prefixes(tmp_path, cli):
    sd = {"features.module.0.weight": torch.zeros(2), "features.module.0.bias": torch.zeros(2),
          "head.weight": torch.zeros(1)}
    torch.save(sd, tmp_path / "mid.pt")
    data = cli("inspect", tmp_path / "mid.pt", "--json").json()
    assert data["prefixes"] == ["module."]
    assert data["prefix_details"] == [{"prefix": "module.", "where": "features.", "count": 2, "of": 3, "certain": True}]
    torch.save({f"_orig_mod.module.{k}": v for k, v in sd.items() if k.startswith("head")}, tmp_path / "stack.pt")
    assert cli("inspect", tmp_path / "stack.pt", "--json").json()["prefixes"] == ["_orig_mod.", "module."]


def test_tied_weights_share_a_storage(fixtures, cli):
    data = cli("inspect", fixtures["tied"]["path"], "--json").json()
    assert {"storage": data["shared"][0]["storage"], "keys": ["embed.weight", "lm_head.weight"],
            "tied": True} in data["shared"]


def test_views_are_shown_as_sharing(tmp_path, cli):
    base = torch.arange(12.0)
    torch.save({"all": base, "tail": base[6:]}, tmp_path / "views.pt")
    data = cli("inspect", tmp_path / "views.pt", "--json").json()
    assert data["shared"] == [{"storage": data["shared"][0]["storage"], "keys": ["all", "tail"], "tied": False}]


def test_every_layout_torch_accepts_is_read(tmp_path, cli):
    # Each tensor's reach is checked against its storage; none of these legal layouts may trip that check.
    base = torch.arange(24.0)
    tensors = {"expanded": torch.ones(1, 3).expand(4, 3), "transposed": base.reshape(4, 6).t(),
               "empty_at_offset": base[20:20], "empty_2d": base[5:].reshape(-1)[:0].reshape(0, 3),
               "scalar": torch.tensor(7.0), "strided": base[1::5], "base": base}
    torch.save(tensors, tmp_path / "layouts.pt")
    result = cli("inspect", tmp_path / "layouts.pt", "--json")
    assert result.exit_code == 0, result.stderr
    loaded = torch.load(tmp_path / "layouts.pt", weights_only=True)
    assert doctor_view(result.json()) == torch_view(loaded)


def test_whole_model_pickle_of_a_missing_class(fixtures, cli):
    info = fixtures["whole_model"]
    data = cli("inspect", info["path"], "--json").json()
    assert data["model_class"] == "gone_models.GoneNet"
    assert data["non_persistent_buffers"] == ["scratch"]
    assert "gone_models.GoneNet" in [g["global"] for g in data["globals"]]
    # Its classes are what torch.load(weights_only=False) would import and build: code, not dangerous.
    assert {g["verdict"] for g in data["globals"]} == {"code"}
    assert data["verdict"] == "code"


def test_torchscript_matches_its_state_dict_and_is_not_run(fixtures, cli):
    data = cli("inspect", fixtures["torchscript"]["path"], "--json").json()
    assert any("not run" in note for note in data["notes"])
    assert [t["key"] for t in data["tensors"]] == list(fixtures["torchscript"]["expected"])


def test_a_traced_torchscript_example_reads_as_the_scripted_one(tmp_path, cli, monkeypatch):
    """The example generator traces where torch's TorchScript frontend fails: the archive it writes is read alike."""
    from fixtures.make_fixtures import _scripted
    from fixtures.models import TwoInputNet

    def refuse(model):
        raise RuntimeError("builtin cannot be used as a value")

    model = TwoInputNet().eval()
    scripted = _scripted(model)
    monkeypatch.setattr(torch.jit, "script", refuse)
    traced = _scripted(model)
    assert isinstance(traced, torch.jit.ScriptModule) and not isinstance(scripted, torch.jit.TracedModule)
    for name, module in (("scripted", scripted), ("traced", traced)):
        module.save(str(tmp_path / f"{name}.pt"))
    keys = [[t["key"] for t in cli("inspect", tmp_path / f"{name}.pt", "--json").json()["tensors"]]
            for name in ("scripted", "traced")]
    assert keys[0] == keys[1] == list(model.state_dict())


def test_training_checkpoint_metadata(fixtures, cli):
    data = cli("inspect", fixtures["training"]["path"], "--json").json()
    assert data["metadata"]["epoch"] == 7
    assert data["metadata"]["lr"] == 0.001
    assert data["metadata"]["args.arch"] == "cnn"
    assert "optimizer.state.0.exp_avg" in {t["key"] for t in data["tensors"]}


def test_collapsed_table_and_full(fixtures, cli):
    path = fixtures["tied"]["path"]
    table = cli("inspect", path).stdout
    assert "layers.{0..3}.attn.in_proj_weight" in table
    assert "layers.2.attn.in_proj_weight" not in table
    full = cli("inspect", path, "--full").stdout
    assert "layers.2.attn.in_proj_weight" in full and "{0..3}" not in full


def test_filter(fixtures, cli):
    data = cli("inspect", fixtures["training"]["path"], "--json", "--filter", r"^state_dict\.classifier").json()
    assert [t["key"] for t in data["tensors"]] == ["state_dict.classifier.weight", "state_dict.classifier.bias"]
    bad = cli("inspect", fixtures["training"]["path"], "--filter", "(")
    assert bad.exit_code == 2 and bad.stderr.startswith("Error: --filter")


def test_table_goes_to_stdout_summary_to_stderr(fixtures, cli):
    result = cli("inspect", fixtures["plain"]["path"])
    assert result.stdout.splitlines()[0].split() == ["key", "shape", "dtype", "device", "size"]
    assert "format" in result.stderr and "format" not in result.stdout


def test_the_metadata_line_shows_the_files_own_values_before_an_optimizers(tmp_path, cli):
    """{"model", "optimizer", "epoch", "args"}: SGD's param_groups (ten values) came first in the file and took the
    line's eight places, leaving epoch and args behind "… more"."""
    import argparse

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = tmp_path / "train.pth"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3,
                "args": argparse.Namespace(lr=0.1, arch="net")}, path)
    result = cli("inspect", path)
    assert result.exit_code == 0, result.stderr
    line = next(line for line in result.stderr.splitlines() if line.startswith("metadata"))
    shown = line.split("… ")[0]
    assert "epoch=3" in shown and "args.lr=0.1" in shown and "args.arch=net" in shown, line
    assert shown.index("args.arch=net") < shown.index("optimizer.param_groups.0.lr=0.1")
    assert "… 5 more (--json or --full lists all)" in line  # 13 values: the count is unchanged
    assert list(cli("inspect", path, "--json").json()["metadata"])[0] == "optimizer.param_groups.0.lr"  # as saved
