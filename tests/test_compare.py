"""inspect --model: the verdict per key, the inferred fix, the CI exit codes, and load/load_into from Python."""

from __future__ import annotations

import re
import textwrap

import pytest
import torch
from torch import nn

import ckpt_doctor
from fixtures.models import RenamedCNN, SmallCNN, TinyTransformer, make_cnn
from tests.helpers import torch_verdict

CNN = "fixtures.models:SmallCNN"


@pytest.fixture(autouse=True)
def _cwd(monkeypatch, tmp_path):
    # SPECs like fixtures.models:SmallCNN import from the working directory, as a user's package would.
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)


def comparison(cli, path, *args):
    result = cli("inspect", path, "--model", *args, "--json")
    return result.exit_code, result.json()["comparison"]


@pytest.mark.parametrize("name,fix", [
    ("dataparallel", ["--strip-module"]),
    ("ddp", ["--strip-module"]),
    ("compiled", ["--strip-prefix", "_orig_mod."]),
    ("lightning", ["--select", "state_dict", "--strip-prefix", "model."]),
])
def test_wrapped_checkpoints_against_the_plain_model(fixtures, cli, name, fix):
    code, comp = comparison(cli, fixtures[name]["path"], CNN)
    assert code == 1
    assert comp["ok"] is False and comp["loaded_fraction"] == 0.0
    assert comp["suggested_fix"] == fix
    assert comp["fix_kind"] == "rename"
    # torch's own verdict: BatchNorm fills `num_batches_tracked` for a state_dict without its module versions
    loaded = torch.load(fixtures[name]["path"], weights_only=True)
    sd = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else loaded
    theirs = torch_verdict(SmallCNN(), sd)
    assert sorted(comp["missing"]) == sorted(theirs["missing"])
    assert sorted(comp["unexpected"]) == sorted(theirs["unexpected"])


def test_plain_checkpoint_is_ok(fixtures, cli):
    code, comp = comparison(cli, fixtures["plain"]["path"], CNN)
    assert code == 0
    assert comp == {**comp, "ok": True, "missing": [], "unexpected": [], "mismatched": [], "loaded_fraction": 1.0,
                    "suggested_fix": []}


def test_training_checkpoint_suggests_select(fixtures, cli):
    code, comp = comparison(cli, fixtures["training"]["path"], CNN)
    assert code == 0 and comp["state_dict_root"] == "state_dict"
    assert comp["suggested_fix"] == ["--select", "state_dict"]


def write_module(tmp_path, body: str, name: str = "nets.py"):
    path = tmp_path / name
    path.write_text("import torch\nfrom torch import nn\nfrom fixtures.models import *\n" + textwrap.dedent(body))
    return path


def test_model_side_prefixed_adds_module(fixtures, cli, tmp_path):
    spec = write_module(tmp_path, "def wrapped():\n    return nn.DataParallel(SmallCNN())\n")
    code, comp = comparison(cli, fixtures["plain"]["path"], f"{spec}:wrapped")
    assert code == 1 and comp["suggested_fix"] == ["--add-module"]


def test_stacked_and_mid_key_wrappers(cli, tmp_path):
    sd = make_cnn().state_dict()
    torch.save({f"_orig_mod.module.{k}": v for k, v in sd.items()}, tmp_path / "stack.pt")
    code, comp = comparison(cli, tmp_path / "stack.pt", CNN)
    assert comp["suggested_fix"] == ["--strip-prefix", "_orig_mod.module."]
    torch.save({f"module._orig_mod.{k}": v for k, v in sd.items()}, tmp_path / "stack2.pt")
    assert comparison(cli, tmp_path / "stack2.pt", CNN)[1]["suggested_fix"] == ["--strip-prefix", "module._orig_mod."]
    mid = {k.replace("features.", "features.module."): v for k, v in sd.items()}
    torch.save(mid, tmp_path / "mid.pt")
    code, comp = comparison(cli, tmp_path / "mid.pt", CNN)
    assert code == 1 and comp["fix_kind"] == "rename"
    assert comp["suggested_fix"] == ["--rename", r"^features\.module\.=features."]


def test_new_head_is_a_shape_mismatch_and_can_be_allowed(fixtures, cli):
    path = fixtures["plain"]["path"]
    code, comp = comparison(cli, path, CNN, "--model-arg", "num_classes=5")
    assert code == 1
    assert comp["mismatched"] == [{"key": "classifier.weight", "checkpoint_shape": [10, 16], "model_shape": [5, 16]},
                                  {"key": "classifier.bias", "checkpoint_shape": [10], "model_shape": [5]}]
    assert 0.9 < comp["loaded_fraction"] < 1.0
    code, comp = comparison(cli, path, CNN, "--model-arg", "num_classes=5", "--allow-missing", r"^classifier\.")
    assert code == 0 and comp["ok"] is True and comp["strict_load_ok"] is False  # a plain strict load still fails
    code, _ = comparison(cli, path, CNN, "--model-arg", "num_classes=5", "--allow-missing", r"^classifier\.",
                         "--min-loaded", "0.99")
    assert code == 1


def test_renamed_layers_are_renamed_module_by_module(fixtures, cli):
    """Each layer of SmallCNN holds keys of shapes no other layer holds: its module is renamed whole, by name, and
    no position is left to a guess (a mapping by order would call the BatchNorms' neighbours ambiguous)."""
    code, comp = comparison(cli, fixtures["plain"]["path"], "fixtures.models:RenamedCNN")
    assert code == 1
    assert comp["fix_kind"] == "rename" and comp["ambiguous"] == []
    flags = comp["suggested_fix"]
    renames = [flags[i + 1] for i, f in enumerate(flags) if f == "--rename"]
    assert renames == [r"^features\.0\.=conv1.", r"^features\.1\.=bn1.", r"^features\.3\.=conv2.",
                       r"^features\.4\.=bn2.", r"^classifier\.=fc."]
    assert "--map-by-order" not in flags and comp["bn_stats_missing"] == []


def test_non_persistent_buffer_is_named(cli, tmp_path):
    torch.manual_seed(0)
    model = TinyTransformer()
    sd = dict(model.state_dict())
    sd["positions"] = torch.arange(32)  # saved when the buffer was still persistent
    torch.save(sd, tmp_path / "old.pt")
    code, comp = comparison(cli, tmp_path / "old.pt", "fixtures.models:TinyTransformer")
    assert comp["non_persistent"] == ["positions"] and comp["unexpected"] == ["positions"]  # as torch says
    assert code == 1  # a strict load rejects it …
    assert comp["suggested_fix"] == ["--drop", "^positions$"]  # … and dropping it is the fix


def test_missing_batchnorm_stats_are_called_out(cli, tmp_path):
    sd = {k: v for k, v in make_cnn().state_dict().items() if "running" not in k}
    torch.save(sd, tmp_path / "nostats.pt")
    code, comp = comparison(cli, tmp_path / "nostats.pt", CNN)
    assert code == 1 and "features.1.running_mean" in comp["bn_stats_missing"]
    assert comp["loaded_fraction"] == 1.0  # parameters are all there: only buffers are missing


def test_human_output_prints_the_fix_command(fixtures, cli):
    result = cli("inspect", fixtures["dataparallel"]["path"], "--model", CNN)
    assert result.exit_code == 1
    assert "ckpt-doctor fix" in result.stderr and "--strip-module" in result.stderr
    # a prefix mismatch is one row per key, old → new, not a missing row and an unexpected row for each
    assert "module.features.0.weight → features.0.weight" in result.stdout
    assert "unexpected" not in result.stdout and result.stdout.count("renamed by the fix") == 16


def test_reference_checkpoint_and_values(fixtures, cli, tmp_path):
    sd = make_cnn().state_dict()
    sd["classifier.bias"] = sd["classifier.bias"] + 0.5
    torch.save(sd, tmp_path / "other.pt")
    result = cli("inspect", tmp_path / "other.pt", "--model", fixtures["plain"]["path"], "--values", "--json")
    assert result.exit_code == 0
    diffs = result.json()["value_diffs"]
    assert diffs["classifier.bias"] == pytest.approx(0.5)
    assert diffs["features.0.weight"] == 0.0
    code, comp = comparison(cli, fixtures["dataparallel"]["path"], str(fixtures["plain"]["path"]))
    assert code == 1 and comp["suggested_fix"] == ["--strip-module"]


def test_values_pair_tensors_by_the_renames_the_comparison_infers(fixtures, cli, tmp_path):
    """A DataParallel copy against its clean reference: the table renames `module.features.0.weight` onto
    `features.0.weight`, and --values compares those pairs (it had said "no common tensors" of the same weights)."""
    sd = {f"module.{k}": v for k, v in make_cnn().state_dict().items()}
    sd["module.classifier.bias"] = sd["module.classifier.bias"] + 0.25
    torch.save({"model": sd, "epoch": 3}, tmp_path / "dp.pt")
    result = cli("inspect", tmp_path / "dp.pt", "--model", fixtures["plain"]["path"], "--values", "--json")
    diffs = result.json()["value_diffs"]
    assert len(diffs) == len(sd) and diffs["module.classifier.bias"] == pytest.approx(0.25)
    assert diffs["module.features.0.weight"] == 0.0
    summary = cli("inspect", tmp_path / "dp.pt", "--model", fixtures["plain"]["path"], "--values").stderr
    assert f"max |diff| over {len(sd)} common tensors: module.classifier.bias 0.25" in summary


@pytest.mark.parametrize("spec,words", [("no_such_pkg.mod:Net", "importing no_such_pkg.mod failed"),
                                        ("fixtures.models:Nope", "has no attribute"),
                                        ("fixtures.models", "expected package.module:attr"),
                                        ("fixtures.models:make_cnn", None)])
def test_bad_specs_are_one_line(fixtures, cli, spec, words):
    result = cli("inspect", fixtures["plain"]["path"], "--model", spec)
    if words is None:  # a factory works too
        assert result.exit_code == 0
        return
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and words in result.stderr


def test_bad_constructor_argument(fixtures, cli):
    result = cli("inspect", fixtures["plain"]["path"], "--model", CNN, "--model-arg", "depth=3")
    assert result.exit_code == 2 and "unexpected keyword argument 'depth'" in result.stderr


def test_model_is_built_on_meta(cli, fixtures, tmp_path):
    spec = write_module(tmp_path, """
        class Huge(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.empty(200_000, 200_000))  # 160 GB if it were real
    """, "huge.py")
    result = cli("inspect", fixtures["plain"]["path"], "--model", f"{spec}:Huge", "--json")
    assert result.exit_code == 1
    assert result.json()["comparison"]["missing"] == ["w"]


def test_saved_device_missing_here_is_reported(fixtures, cli):
    result = cli("inspect", fixtures["cuda3"]["path"])
    if torch.cuda.device_count() >= 4:
        pytest.skip("this machine has cuda:3")
    assert result.exit_code == 0  # a fact of torch.load(path) here, not a problem of the file
    assert "saved on cuda:3, which this machine lacks" in result.stderr
    assert "map_location='cpu'" in result.stderr and "--map-location cpu`" in result.stderr


# --- Python API ---------------------------------------------------------------------------------------------

def test_load_maps_missing_devices(fixtures):
    sd = ckpt_doctor.load(fixtures["cuda3"]["path"])
    expected = "cuda:3" if torch.cuda.device_count() > 3 else ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert sd.device_map == {"cuda:3": expected}
    assert {str(v.device) for v in sd.values()} == {expected}
    ref = torch.load(fixtures["cuda3"]["path"], map_location="cpu", weights_only=True)
    assert all(torch.equal(sd[k].cpu(), ref[k]) for k in ref)
    explicit = ckpt_doctor.load(fixtures["cuda0_legacy"]["path"], device={"cuda:0": "cpu"})
    assert explicit.device_map == {"cuda:0": "cpu"}


@pytest.mark.parametrize("name", ["whole_model", "torchscript", "safetensors", "sharded_bin", "training"])
def test_load_reads_every_format_without_running_it(fixtures, name):
    sd = ckpt_doctor.load(fixtures[name]["path"], device="cpu")
    expected = fixtures[name]["expected"]
    if name == "training":
        expected = {k.removeprefix("state_dict."): v for k, v in expected.items() if k.startswith("state_dict.")}
    assert {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()} == \
        {k: tuple(v) for k, v in expected.items()}


@pytest.mark.parametrize("name", ["plain", "dataparallel", "ddp", "compiled", "lightning", "training", "cuda3"])
def test_load_into_applies_the_fix(fixtures, name):
    model = SmallCNN()
    report = ckpt_doctor.load_into(model, fixtures[name]["path"])
    assert report.loaded_fraction == 1.0 and not report.missing and not report.unexpected
    out = model(torch.randn(2, 3, 8, 8))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


def test_load_into_values_are_the_files(fixtures):
    model = SmallCNN()
    ckpt_doctor.load_into(model, fixtures["dataparallel"]["path"])
    # The CPU model holds the file's values; the file may name cuda:0 (the fixtures are saved on a GPU where one exists).
    ref = torch.load(fixtures["dataparallel"]["path"], map_location="cpu", weights_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref["module." + k])


def test_load_into_refuses_what_it_cannot_fix(fixtures):
    with pytest.raises(ckpt_doctor.ReadError, match="strict load"):
        ckpt_doctor.load_into(nn.Linear(2, 2), fixtures["plain"]["path"])


def test_load_into_renames_whole_modules_but_does_not_guess_by_order(fixtures, tmp_path):
    """Each of RenamedCNN's layers holds the keys of exactly one of SmallCNN's: renamed module by module, the values
    the file's. Layers of one shape that only their order tells apart are not guessed."""
    model = RenamedCNN()
    ckpt_doctor.load_into(model, fixtures["plain"]["path"])
    ref = torch.load(fixtures["plain"]["path"], weights_only=True)
    assert torch.equal(model.bn2.running_mean, ref["features.4.running_mean"])
    assert torch.equal(model.fc.weight, ref["classifier.weight"])
    torch.save(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).state_dict(), tmp_path / "seq.pt")

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    with pytest.raises(ckpt_doctor.ReadError):
        ckpt_doctor.load_into(Two(), tmp_path / "seq.pt")


ENTRY_NETS = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)


class WithExtra(Net):
    def __init__(self):
        super().__init__()
        self.x = 0

    def get_extra_state(self):
        return {"x": self.x}

    def set_extra_state(self, state):
        self.x = state["x"]


class NoneBuffer(Net):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", None)
"""


@pytest.mark.parametrize("model,extra", [
    ("Net", {"version": 3}),
    ("Net", {"name": "resnet"}),
    ("Net", {"extra": {"a": torch.zeros(2)}}),
    ("Net", {"fc": 3}),  # a module's name: torch still counts the key
    ("WithExtra", {"_extra_state": {"x": 1}}),  # set_extra_state takes it
    ("Net", {"_extra_state": {"x": 1}}),  # no set_extra_state: unexpected
    ("Net", {"fc._extra_state": 5}),
    ("NoneBuffer", {"b": None}),
    ("NoneBuffer", {"b": torch.zeros(2)}),
    ("Net", {}),
])
def test_entries_beside_the_tensors_count_as_torch_counts_them(cli, tmp_path, model, extra):
    """The verdict is torch's strict load of what torch.load returns: every key counts, tensor or not."""
    spec = write_module(tmp_path, ENTRY_NETS, "entry_nets.py")
    import runpy

    namespace = runpy.run_path(str(spec))
    net = namespace[model]()
    sd = {**net.state_dict(), **extra}
    torch.save(sd, tmp_path / "sd.pt")
    theirs = torch_verdict(namespace[model](), sd)
    try:
        namespace[model]().load_state_dict(sd, strict=True)
        loads = True
    except RuntimeError:
        loads = False
    code, comp = comparison(cli, tmp_path / "sd.pt", f"{spec}:{model}")
    assert comp["ok"] is loads and code == (0 if loads else 1)
    assert comp["unexpected"] == theirs["unexpected"] and comp["missing"] == theirs["missing"]
    if not loads:  # the fix line leaves the entry out, and its output loads strictly
        drops = [comp["suggested_fix"][i + 1] for i, f in enumerate(comp["suggested_fix"]) if f == "--drop"]
        assert any(re.search(d, k) for d in drops for k in extra)
        out = tmp_path / "fixed.pt"
        fixed = cli("fix", tmp_path / "sd.pt", "-o", out, *comp["suggested_fix"], "--model", f"{spec}:{model}")
        assert fixed.exit_code == 0
        namespace[model]().load_state_dict(torch.load(out, weights_only=True), strict=True)


def test_a_non_tensor_where_the_model_has_a_parameter_fails_as_torch_does(cli, tmp_path):
    spec = write_module(tmp_path, ENTRY_NETS, "entry_nets.py")
    torch.save({"fc.weight": 1, "fc.bias": torch.zeros(2)}, tmp_path / "sd.pt")
    code, comp = comparison(cli, tmp_path / "sd.pt", f"{spec}:Net")
    assert code == 1 and comp["ok"] is False
    assert comp["errors"] == ["'fc.weight' holds no tensor, where the model has a tensor of that name"]
