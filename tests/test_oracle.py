"""Issue 12: `inspect --model` answers as torch does, and the fix it prints makes torch's strict load succeed.

Every case writes a file the way users meet it (save_pretrained of a tied model, a BatchNorm state_dict from older
torch, a DataParallel MiniLM with its pooler, a Lightning module with a weighted loss, a fine-tuned head, a
classifier under a detector's backbone, layers of one shape in another order, a file saved on cuda:3). For each:

1. ckpt-doctor's missing / unexpected / tied / mismatched keys and `loaded_fraction` equal what torch reports when
   the same file is really loaded into the same model on CPU (the filled fraction is measured by setting every
   parameter to NaN and counting what the load overwrote);
2. the verdict and the exit code say the same;
3. the printed fix, run through the installed command, writes a file that torch loads strictly (or fails only on
   what the printed --allow-missing accepts), with every tensor bitwise equal to its source.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tests import oracle_nets as nets
from tests.helpers import torch_filled_fraction, torch_verdict

SPEC = "tests.oracle_nets:"


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)  # SPECs import tests.oracle_nets from the working directory, as a user's package would


@dataclass
class Case:
    model: str  # attribute of tests.oracle_nets
    write: Callable[[Path], Path]  # writes the file, returns its path
    root: str = ""  # where a user's code finds the state_dict in what torch.load returns
    args: tuple[str, ...] = ()  # more for `inspect` (--select, --allow-*)
    kwargs: dict[str, Any] = field(default_factory=dict)  # model constructor arguments
    code: int = 1  # inspect's exit code
    fix_kind: str = "rename"  # what the printed fix is
    tied: tuple[str, ...] = ()  # keys ckpt-doctor must call tied (torch calls them missing)

    def build(self):
        return getattr(nets, self.model)(**self.kwargs)

    def cli_args(self) -> list[str]:
        extra = [a for k, v in self.kwargs.items() for a in ("--model-arg", f"{k}={v}")]
        return ["--model", SPEC + self.model, *extra, *self.args]


def _save(sd, name: str, metadata: dict | None = None) -> Callable[[Path], Path]:
    def write(folder: Path) -> Path:
        path = folder / name
        value = sd() if callable(sd) else sd
        if metadata is not None:
            value._metadata = metadata
        torch.save(value, path)
        return path
    return write


def _without(model: str, *keys: str, metadata_version: int | None = None, **kwargs) -> Callable[[], Any]:
    def make():
        sd = getattr(nets, model)(**kwargs).state_dict()
        for key in keys:
            del sd[key]
        if metadata_version is not None:  # what an older torch wrote: every module at version 1
            sd._metadata = {name: {"version": metadata_version} for name in sd._metadata}
        return sd
    return make


def _pretrained(factory: str) -> Callable[[Path], Path]:
    def write(folder: Path) -> Path:
        getattr(nets, factory)().save_pretrained(folder / factory)  # safetensors: a tied head is written once
        return folder / factory / "model.safetensors"
    return write


def _minilm_in_dataparallel(folder: Path) -> Path:
    sd = nets.minilm(add_pooling_layer=True).state_dict()
    sd = OrderedDict(("module." + k, v) for k, v in sd.items())
    sd["module.embeddings.position_ids"] = torch.arange(32)[None]  # older transformers saved it
    path = folder / "minilm_dp.pt"
    torch.save(sd, path)
    return path


def _versioned_v1() -> Any:
    sd = nets.Versioned().state_dict()
    old = OrderedDict((k.replace("proj.weight", "proj.w").replace("proj.bias", "proj.b"), v) for k, v in sd.items())
    old._metadata = {"": {"version": 1}, "proj": {"version": 1}, "out": {"version": 1}}
    return old


def _hooked() -> Any:
    sd = nets.HookNet().state_dict()
    del sd["scale"]
    sd["legacy_temperature"] = torch.ones(1)
    return sd


def _permuted_twins() -> Any:
    sd = nets.Twins().state_dict()
    order = [("l2", "second"), ("l1", "first"), ("head", "out")]
    return OrderedDict((f"{new}.{p}", sd[f"{old}.{p}"]) for new, old in order for p in ("weight", "bias"))


def _on_cuda3(folder: Path) -> Path:
    from fixtures.make_fixtures import saved_on

    path = folder / "cuda3.pt"
    with saved_on("cuda:3"):
        torch.save(nets.BNNet().state_dict(), path)
    return path


CASES = {
    "tied, torch": Case("TiedLM", _save(_without("TiedLM", "lm_head.weight"), "tied.pt"), code=0, fix_kind="none",
                        tied=("lm_head.weight",)),
    "tied, GPT-2 save_pretrained": Case("gpt2", _pretrained("gpt2"), code=0, fix_kind="none",
                                        tied=("lm_head.weight",)),
    "tied, Llama save_pretrained": Case("llama", _pretrained("llama"), code=0, fix_kind="none",
                                        tied=("lm_head.weight",)),
    "BatchNorm from older torch": Case("BNNet", _save(_without("BNNet", "bn.num_batches_tracked", metadata_version=1),
                                                      "bn_v1.pt"), code=0, fix_kind="none"),
    "BatchNorm v2 without its counter": Case("BNNet", _save(_without("BNNet", "bn.num_batches_tracked"), "bn_v2.pt"),
                                             fix_kind="allowed"),
    "old names read by _load_from_state_dict": Case("Versioned", _save(_versioned_v1, "versioned.pt"), code=0,
                                                    fix_kind="none"),
    "load pre-hook": Case("HookNet", _save(_hooked, "hooked.pt"), code=0, fix_kind="none"),
    "non-persistent buffer in the file": Case("Masked", _save(lambda: {**nets.Masked().state_dict(),
                                                                       "mask": torch.ones(4)}, "masked.pt")),
    # a device this machine lacks is a fact of torch.load(path), not of the strict load (devices are mapped)
    "saved on cuda:3": Case("BNNet", _on_cuda3, code=0, fix_kind="none"),
    "MiniLM in DataParallel with its pooler": Case("minilm", _minilm_in_dataparallel),
    "Lightning with a weighted loss": Case("Classifier", _save(lambda: {"state_dict": nets.Criterion().state_dict(),
                                                                        "epoch": 3}, "lightning.ckpt"),
                                           root="state_dict", kwargs={"num_classes": 5}),
    "new head": Case("Classifier", _save(lambda: nets.Classifier(10).state_dict(), "ten.pt"),
                     kwargs={"num_classes": 5}, fix_kind="allowed"),
    "classifier into a detector's backbone": Case("Detector", _save(lambda: nets.Classifier(10).state_dict(),
                                                                    "cls.pt"), fix_kind="allowed"),
    "EMA weights selected": Case("BNNet", _save(lambda: {"model": nets.BNNet().state_dict(),
                                                         "model_ema": nets.BNNet().state_dict()}, "ema.pt"),
                                 root="model_ema", args=("--select", "model_ema"), code=0, fix_kind="none"),
    "nested state_dict.model": Case("BNNet", _save(lambda: {"state_dict": {"model": nets.BNNet().state_dict()},
                                                            "step": 1}, "nested.pt"),
                                    root="state_dict.model", code=0, fix_kind="none"),
    # every difference accepted, nothing loaded: no check passes on nothing
    "everything allowed": Case("Detector", _save(lambda: nets.Classifier(10).state_dict(), "cls.pt"),
                               args=("--allow-missing", ".*", "--allow-unexpected", ".*"), fix_kind="allowed"),
}


def load_source(path: Path, root: str) -> "OrderedDict[str, torch.Tensor]":
    """The state_dict a user's code would take from the file (torch itself reads it)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return OrderedDict(load_file(path))
    node = torch.load(path, weights_only=True, map_location="cpu")
    for part in root.split(".") if root else []:
        node = node[part]
    return node


def inspect(cli, path: Path, case: Case) -> tuple[int, dict]:
    result = cli("inspect", path, *case.cli_args(), "--json")
    return result.exit_code, result.json()["comparison"]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Each case's file, written once for the module."""
    from tests.conftest import ROOT

    import os

    folder = tmp_path_factory.mktemp("oracle")
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        torch.manual_seed(0)
        return {name: case.write(folder) for name, case in CASES.items()}
    finally:
        os.chdir(here)


@pytest.mark.parametrize("name", list(CASES))
def test_the_verdict_is_torchs(cli, cases, name):
    case, path = CASES[name], cases[name]
    code, comp = inspect(cli, path, case)
    sd = load_source(path, case.root)
    theirs = torch_verdict(case.build(), sd)
    allowed = set(comp["allowed_missing"])
    mismatched = {m["key"] for m in comp["mismatched"]}
    tied = {t["key"] for t in comp["tied"]}
    # torch's missing keys are ckpt-doctor's missing, tied and allowed ones; its size mismatches the same
    assert sorted(theirs["missing"]) == sorted(set(comp["missing"]) | tied | (allowed - set(theirs["mismatched"])))
    assert sorted(theirs["unexpected"]) == sorted(set(comp["unexpected"]) | set(comp["allowed_unexpected"]))
    assert set(comp["non_persistent"]) <= set(comp["unexpected"])  # named among them
    assert sorted(theirs["mismatched"]) == sorted(mismatched | (allowed & set(theirs["mismatched"])))
    assert tied == set(case.tied)
    assert comp["loaded_fraction"] == pytest.approx(torch_filled_fraction(case.build(), sd), abs=1e-6)
    # the verdict line and the exit code say the same
    assert code == case.code
    assert comp["ok"] is (code == 0)
    assert ("FAILS" in comp["verdict"].split(":")[0]) is (code == 1)
    assert comp["fix_kind"] == case.fix_kind
    assert comp["strict_load_ok"] is not (theirs["missing"] or theirs["unexpected"] or theirs["mismatched"])


def test_a_file_saved_on_a_missing_device_fails_as_torch_load_does(cli, cases):
    """torch.load(path) fails here; the strict load (devices mapped) succeeds: the first is the default_load fact,
    failing only under --require-default-load, and the rewrite that settles it for good is printed."""
    path = cases["saved on cuda:3"]
    with pytest.raises(RuntimeError):
        torch.load(path, weights_only=True)  # what a user's torch.load(path) does on this machine
    result = cli("inspect", path, *CASES["saved on cuda:3"].cli_args(), "--json")
    data = result.json()
    assert result.exit_code == 0 and data["comparison"]["missing_devices"] == ["cuda:3"]
    assert data["default_load"]["ok"] is False and data["default_load"]["missing_devices"] == ["cuda:3"]
    (rewrite,) = data["suggested_commands"]
    assert rewrite["argv"][-2:] == ["--map-location", "cpu"]
    assert cli("inspect", path, *CASES["saved on cuda:3"].cli_args(), "--require-default-load").exit_code == 1
    out = rewrite["argv"][rewrite["argv"].index("-o") + 1]
    assert cli(*rewrite["argv"][1:]).exit_code == 0
    CASES["saved on cuda:3"].build().load_state_dict(torch.load(out, weights_only=True), strict=True)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.fix_kind != "none" and c.fix_kind != "partial"
                                  or c.tied])
def test_the_printed_fix_makes_torchs_strict_load_succeed(cli, cases, tmp_path, name):
    case, path = CASES[name], cases[name]
    _, comp = inspect(cli, path, case)
    flags = comp["suggested_fix"]
    out = tmp_path / "fixed.pt"
    result = subprocess.run([sys.executable, "-m", "ckpt_doctor", "fix", str(path), "-o", str(out), *flags],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    fixed = torch.load(out, weights_only=True)  # no map_location: devices were re-tagged
    model = case.build()
    allow = flags[flags.index("--allow-missing") + 1] if "--allow-missing" in flags else None
    if allow is None:
        model.load_state_dict(fixed, strict=True)
    else:
        theirs = torch_verdict(model, fixed)
        assert not theirs["unexpected"] and not theirs["mismatched"]
        assert all(re.search(allow, k) for k in theirs["missing"])
    # bitwise equal to the source, key by key through the renames (and each tied alias to its tensor)
    source = load_source(path, comp["fix_root"] or comp["state_dict_root"] or "")
    origin = {r["new"]: r["old"] for r in comp["renames"]}
    ties = dict(flags[i + 1].split("=", 1) for i, f in enumerate(flags) if f == "--tie")
    assert set(fixed) == (set(source) - set(comp["dropped"]) - set(origin.values())) | set(origin) | set(ties)
    for key, tensor in fixed.items():
        src = source[origin.get(ties.get(key, key), ties.get(key, key))]
        assert tensor.dtype == src.dtype and torch.equal(tensor, src), key


@pytest.mark.parametrize("name", ["new head", "classifier into a detector's backbone"])
def test_fix_auto_never_passes_silently(cli, cases, tmp_path, name):
    """When what --auto would write still fails a strict load (beyond an explicit --allow-*), it writes nothing and
    exits 1 naming the closest fix."""
    case, path = CASES[name], cases[name]
    out = tmp_path / "auto.pt"
    result = cli("fix", path, "-o", out, "--auto", *case.cli_args())
    assert result.exit_code == 1 and not out.exists()
    assert "would still not load strictly" in result.stderr
    if case.fix_kind == "allowed":  # the command that accepts the new head, as inspect's line does
        assert "the line inspect prints accepts them (a new head?) with `ckpt-doctor fix" in result.stderr
        command = result.stderr.split("with `", 1)[1].split("`", 1)[0]
        assert " --auto " in command and " --allow-missing " in command
        assert cli(*shlex.split(command)[1:]).exit_code == 0 and out.exists()


@pytest.mark.parametrize("name", ["tied, GPT-2 save_pretrained", "MiniLM in DataParallel with its pooler",
                                  "Lightning with a weighted loss", "saved on cuda:3", "nested state_dict.model"])
def test_fix_auto_writes_what_loads_strictly(cli, cases, tmp_path, name):
    case, path = CASES[name], cases[name]
    out = tmp_path / "auto.pt"
    assert cli("fix", path, "-o", out, "--auto", *case.cli_args()).exit_code == 0
    case.build().load_state_dict(torch.load(out, weights_only=True), strict=True)


def test_a_permutation_of_same_shaped_layers_is_refused_without_force(cli, tmp_path):
    """Two layers of one shape stored in another order than the model defines them: every position a permutation
    fits is named, and the mapping by order is refused until --force."""
    path = tmp_path / "twins.pt"
    torch.save(_permuted_twins(), path)
    code, comp = inspect(cli, path, Case("Twins", lambda _: path))
    assert code == 1 and comp["fix_kind"] == "map-by-order" and "--force" not in comp["suggested_fix"]
    assert {a.split(":")[0] for a in comp["ambiguous"]} == {"0", "1", "2", "3"}  # l2 and l1, weights and biases
    out = tmp_path / "fixed.pt"
    refused = cli("fix", path, "-o", out, *comp["suggested_fix"])
    assert refused.exit_code == 2 and "--force" in refused.stderr and not out.exists()
    assert cli("fix", path, "-o", out, *comp["suggested_fix"], "--force").exit_code == 0


def test_allowances_that_name_every_key_require_everything(cli, cases):
    """`--allow-missing '.*' --allow-unexpected '.*'` accepts every difference torch reports; a file none of whose
    keys fill the model then fails (exit 1), as torch's filled fraction says, with the way out in the verdict."""
    path, case = cases["everything allowed"], CASES["everything allowed"]
    code, comp = inspect(cli, path, case)
    model = case.build()
    assert torch_filled_fraction(model, load_source(path, "")) == 0.0  # torch: nothing of the model comes from it
    assert code == 1 and comp["ok"] is False and comp["loaded_fraction"] == 0.0
    assert not comp["missing"] and not comp["unexpected"]  # every difference accepted …
    assert comp["verdict"] == ("FAILS: only 0.0% of the model's parameters come from the checkpoint (required: "
                               "100.0%: --allow-missing '.*' names every key; name the keys you mean, or set "
                               "--min-loaded)")  # … and still no pass
    assert inspect(cli, path, Case("Detector", case.write, args=("--allow-missing", "", "--allow-unexpected", ".*")))[0] \
        == 1  # an empty pattern matches every key too
    low = subprocess.run([sys.executable, "-m", "ckpt_doctor", "inspect", str(path), *case.cli_args(),
                          "--min-loaded", "0.5"], capture_output=True, text=True)
    assert low.returncode == 1 and "FAILS --min-loaded" in low.stderr  # an explicit --min-loaded replaces it


def test_renames_are_grouped_pairs(cli, cases):
    result = cli("inspect", cases["MiniLM in DataParallel with its pooler"],
                 *CASES["MiniLM in DataParallel with its pooler"].cli_args())
    lines = result.stdout.splitlines()[2:]
    # a rename too long for one line of 120 columns goes on two: `old  verdict …`, then `  → new` under it
    rows = [line if not line.startswith("  → ") else None for line in lines]
    pairs = [f"{lines[i].split('  ')[0]} {line.strip()}" for i, line in enumerate(lines[1:]) if rows[i + 1] is None]
    assert "module.embeddings.word_embeddings.weight → embeddings.word_embeddings.weight" in pairs
    model_keys = len(nets.minilm().state_dict())
    assert len([r for r in rows if r is not None]) == model_keys + 3  # one row per rename and the three leftovers
    comp = inspect(cli, cases["MiniLM in DataParallel with its pooler"],
                   CASES["MiniLM in DataParallel with its pooler"])[1]
    assert len(comp["renames"]) == model_keys
    assert set(comp["dropped"]) == {"module.pooler.dense.weight", "module.pooler.dense.bias",
                                    "module.embeddings.position_ids"}
    assert comp["dropped_parameters"] == 32 * 32 + 32 + 32  # the pooler's weight and bias, the position ids


def _ema_file(path: Path) -> tuple[dict, dict]:
    """A training file whose `model` weights hold a NaN and whose `model_ema` weights are good."""
    torch.manual_seed(0)
    model, ema = nets.BNNet().state_dict(), nets.BNNet().state_dict()
    model["fc.weight"][0, 0] = float("nan")
    torch.save({"model": model, "model_ema": ema, "epoch": 9}, path)
    return model, ema


def test_a_selected_ema_state_dict_is_what_verify_and_load_into_use(cli, tmp_path):
    import ckpt_doctor

    path = tmp_path / "ema.pt"
    _, ema = _ema_file(path)
    run = ("--model", SPEC + "BNNet", "--input-shape", "4,3,8,8")
    assert cli("verify", path, *run, "--mode", "single").exit_code == 1  # the main weights give NaN
    assert cli("verify", path, *run, "--mode", "single,ddp", "--select", "model_ema").exit_code == 0
    code, comp = inspect(cli, path, Case("BNNet", lambda _: path, args=("--select", "model_ema")))
    assert code == 0 and comp["state_dict_root"] == "model_ema"
    model = nets.BNNet()
    ckpt_doctor.load_into(model, path, select="model_ema")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ema.items())
    loaded = ckpt_doctor.load(path, "cpu", select="model_ema")
    assert all(torch.equal(loaded[k], v) for k, v in ema.items())


def test_verify_runs_a_tied_model_saved_without_its_alias(cli, cases):
    """A GPT-2 from save_pretrained lacks lm_head.weight: verify fills it from the Parameter it shares, in every
    rank, as from_pretrained does."""
    path = cases["tied, GPT-2 save_pretrained"]
    result = cli("verify", path, "--model", SPEC + "gpt2", "--input-shape", "4,8", "--input-dtype", "int64",
                 "--input-range", "0,64", "--mode", "single,ddp")
    assert result.exit_code == 0, result.stderr


# --- found by using it on real files as a newcomer would ------------------------------------------------------

def test_the_models_own_weights_come_before_a_copy_of_them(cli, tmp_path):
    path = tmp_path / "nested.pt"
    torch.manual_seed(0)
    model, ema = nets.BNNet().state_dict(), nets.BNNet().state_dict()
    torch.save({"state_dict": {"model": model, "ema": ema}, "epoch": 1}, path)
    code, comp = inspect(cli, path, Case("BNNet", lambda _: path))
    assert code == 0 and comp["state_dict_root"] == "state_dict.model"
    assert "(the state_dict at state_dict.model)" in comp["verdict"]


def test_two_different_tensors_for_one_tied_parameter_are_a_warning(cli, tmp_path):
    torch.manual_seed(0)
    sd = nets.TiedLM().state_dict()
    sd["lm_head.weight"] = sd["wte.weight"] + 1  # no longer the same tensor
    path = tmp_path / "untied.pt"
    torch.save(sd, path)
    code, comp = inspect(cli, path, Case("TiedLM", lambda _: path))
    model = nets.TiedLM()
    model.load_state_dict(torch.load(path, weights_only=True), strict=True)  # torch accepts it …
    assert torch.equal(model.wte.weight, sd["lm_head.weight"])  # … and keeps the key loaded last
    assert code == 0 and comp["tie_conflicts"] == [{"kept": "lm_head.weight", "overwritten": "wte.weight"}]
    assert "WARNING" in cli("inspect", path, "--model", SPEC + "TiedLM").stderr
    assert inspect(cli, cases_tied_full(tmp_path), Case("TiedLM", lambda _: path))[1]["tie_conflicts"] == []


def cases_tied_full(tmp_path: Path) -> Path:
    path = tmp_path / "tied_full.pt"
    torch.save(nets.TiedLM().state_dict(), path)  # both names, one storage: no conflict
    return path


def test_a_model_that_cannot_be_built_on_meta_is_built_on_the_cpu(cli, tmp_path):
    (tmp_path / "reads_back.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class ReadsBack(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(4, 4)\n"
        "        self.scale = float(self.fc.weight.abs().max().item())  # meta tensors cannot do this\n")
    path = tmp_path / "w.pt"
    torch.save({"fc." + k: v for k, v in torch.nn.Linear(4, 4).state_dict().items()}, path)
    result = cli("inspect", path, "--model", f"{tmp_path}/reads_back.py:ReadsBack", "--json")
    assert result.exit_code == 0 and result.json()["comparison"]["ok"] is True


def test_a_verify_allowance_covers_a_reshaped_head_as_in_inspect(cli, tmp_path):
    path = tmp_path / "ten.pt"
    torch.save(nets.Classifier(10).state_dict(), path)
    args = ("--model", SPEC + "Classifier", "--model-arg", "num_classes=5", "--allow-missing", r"^fc\.")
    assert cli("inspect", path, *args).exit_code == 0
    assert cli("verify", path, *args, "--input-shape", "2,3,8,8", "--mode", "single").exit_code == 0


def test_no_fix_is_offered_that_fills_nothing(cli, tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"encoder.block.weight": torch.zeros(3, 3), "encoder.block.bias": torch.zeros(3)}, path)
    code, comp = inspect(cli, path, Case("BNNet", lambda _: path))
    assert code == 1 and comp["suggested_fix"] == [] and comp["fix_kind"] == "none"


def test_a_tensor_under_two_names_is_counted_once(cli, tmp_path):
    path = tmp_path / "tied_full.pt"
    torch.save(nets.TiedLM().state_dict(), path)
    stderr = cli("inspect", path).stderr
    unique = sum(p.numel() for p in nets.TiedLM().parameters())  # parameters() yields a tied one once
    assert f"{unique:,} parameters" in stderr
