"""`--model hf:PATH`: Hugging Face configs as model specs, judged against transformers' own loading report.

Each scenario is a model folder as people meet them (save_pretrained's safetensors, a legacy pytorch_model.bin,
`bert.` stripped, `module.` added, a swapped head, tied embeddings), written here from tiny configs. The oracles are
transformers' `from_pretrained(..., output_loading_info=True)` and torch's strict `load_state_dict`.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import ROOT, run_cli  # noqa: E402
from helpers import torch_verdict  # noqa: E402

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, vocab_size=99)


def _configs() -> dict[str, object]:
    t = transformers
    return {
        "bert": t.BertConfig(**SMALL, max_position_embeddings=64, num_labels=3,
                             architectures=["BertForSequenceClassification"]),
        "gpt2": t.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=99, n_positions=64, bos_token_id=0,
                             eos_token_id=0, architectures=["GPT2LMHeadModel"]),
        "llama": t.LlamaConfig(**SMALL, num_key_value_heads=1, max_position_embeddings=64, bos_token_id=0,
                               eos_token_id=0, architectures=["LlamaForCausalLM"]),
        "vit": t.ViTConfig(**SMALL, image_size=16, patch_size=8, num_labels=4,
                           architectures=["ViTForImageClassification"]),
        "t5": t.T5Config(vocab_size=99, d_model=32, d_kv=16, d_ff=37, num_layers=2, num_heads=2,
                         decoder_start_token_id=0, architectures=["T5ForConditionalGeneration"]),
    }


def _model(config):
    torch.manual_seed(0)
    cls = getattr(transformers, config.architectures[0])
    return cls(config).eval()


def _write_config(config, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, dict]:
    """name -> {path: the folder, spec: what --model names, view: which of ckpt-doctor's verdicts transformers'
    report matches ("as-is", or "after-fix" where transformers itself adds or strips the base model's prefix)}."""
    transformers.utils.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("hf")
    configs = _configs()
    out: dict[str, dict] = {}
    for name in ("bert", "gpt2", "llama", "vit", "t5"):  # save_pretrained: safetensors, tied names left out
        _model(configs[name]).save_pretrained(root / name)
        out[name] = {"path": root / name, "spec": "hf:", "view": "as-is"}
    # transformers 5 saves ViT under its older names and renames them as it loads: torch's strict load needs the fix
    out["vit"]["view"] = "after-fix"
    bert = _model(configs["bert"])
    sd = bert.state_dict()
    _write_config(configs["bert"], root / "bert_bin")  # the legacy format transformers wrote before safetensors
    torch.save(sd, root / "bert_bin" / "pytorch_model.bin")
    out["bert_bin"] = {"path": root / "bert_bin", "spec": f"hf:{root / 'bert_bin'}", "view": "as-is"}
    _write_config(configs["bert"], root / "bert_stripped")  # `bert.` taken off every key that had it
    torch.save({k.removeprefix("bert."): v for k, v in sd.items()}, root / "bert_stripped" / "pytorch_model.bin")
    out["bert_stripped"] = {"path": root / "bert_stripped", "spec": "hf:", "view": "after-fix"}
    _write_config(configs["bert"], root / "bert_base")  # the base model's own save, into the classifier
    torch.save(bert.bert.state_dict(), root / "bert_base" / "pytorch_model.bin")
    out["bert_base"] = {"path": root / "bert_base", "spec": "hf:", "view": "after-fix"}
    _write_config(configs["bert"], root / "bert_module")  # trained in DataParallel
    torch.save({f"module.{k}": v for k, v in sd.items()}, root / "bert_module" / "pytorch_model.bin")
    out["bert_module"] = {"path": root / "bert_module", "spec": "hf:", "view": "as-is"}
    # a swapped head: the checkpoint's classifier has 3 labels, the config being loaded into 5
    swapped = configs["bert"].to_dict() | {"num_labels": 5}
    swapped.pop("id2label"), swapped.pop("label2id")
    (root / "head5").mkdir()
    (root / "head5" / "config.json").write_text(json.dumps(swapped))
    out["bert_head"] = {"path": root / "bert", "spec": f"hf:{root / 'head5'}", "view": "as-is",
                        "mismatched": True}
    return out


def _spec(case: dict) -> str:
    return case["spec"]


def _config_of(case: dict) -> Path:
    spec = case["spec"][3:]
    return Path(spec) / "config.json" if spec else case["path"] / "config.json"


def _transformers_report(case: dict) -> dict[str, set[str]]:
    """What from_pretrained says loading the folder into the config's class (sizes that differ: ignored and
    reported, as its error message advises)."""
    config = transformers.AutoConfig.from_pretrained(_config_of(case).parent)
    cls = getattr(transformers, config.architectures[0])
    _, info = cls.from_pretrained(case["path"], config=config, output_loading_info=True,
                                  ignore_mismatched_sizes=case.get("mismatched", False))
    return {"missing": set(info["missing_keys"]), "unexpected": set(info["unexpected_keys"]),
            "mismatched": {k if isinstance(k, str) else k[0] for k in info["mismatched_keys"]}}


def _real_model(case: dict):
    config = transformers.AutoConfig.from_pretrained(_config_of(case).parent)
    return getattr(transformers, config.architectures[0])(config)


def _raw_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(folder / "model.safetensors")
    return torch.load(folder / "pytorch_model.bin", weights_only=True)


SCENARIOS = ["bert", "bert_bin", "gpt2", "llama", "vit", "t5", "bert_stripped", "bert_base", "bert_module",
             "bert_head"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_verdict_is_transformers_and_torch_s_and_every_printed_command_runs(folders, name, tmp_path):
    case = folders[name]
    result = run_cli("inspect", case["path"], "--model", _spec(case), "--json")
    assert result.exit_code in (0, 1), result.stderr
    data = result.json()
    c = data["comparison"]
    # torch's strict load of the file as it is, into the real model: the same keys missing and unexpected (a tied
    # name the file leaves out is listed as tied, filled by the Parameter it shares)
    torch_says = torch_verdict(_real_model(case), _raw_state_dict(case["path"]))
    assert set(torch_says["missing"]) == set(c["missing"]) | {t["key"] for t in c["tied"]}
    assert set(torch_says["unexpected"]) == set(c["unexpected"])
    assert set(torch_says["mismatched"]) == {m["key"] for m in c["mismatched"]}
    assert c["strict_load_ok"] is not (torch_says["mismatched"] or torch_says["unexpected"] or torch_says["missing"])
    # transformers' own report: as it is, or after the fix where transformers adds/strips the prefix itself
    hf = _transformers_report(case)
    view = c if case["view"] == "as-is" else c["after_fix"]
    assert hf["missing"] - hf["mismatched"] == set(view["missing"])
    assert hf["unexpected"] == set(view["unexpected"])
    assert hf["mismatched"] == {m["key"] for m in view["mismatched"]}
    assert not c["ambiguous"]  # every rename is by name, none guessed from shapes
    # every command printed runs as printed (from the checkpoints' folder: the outputs land beside them), and
    # what a fix writes loads strictly into the real model
    table = run_cli("inspect", case["path"], "--model", _spec(case))
    assert sorted(s["command"] for s in data["suggested_commands"]) == sorted(_printed(table.stderr))
    for s in data["suggested_commands"]:
        argv = shlex.split(s["command"])
        assert "hf:" + str(_config_of(case)) in argv or _spec(case) in argv, argv  # the model, named
        done = run_cli(*argv[1:])
        assert done.exit_code == 0, (s["command"], done.stderr)
        if s["promise"] == "loads":
            out = Path(argv[argv.index("-o") + 1])
            net = _real_model(case)
            allow = argv[argv.index("--allow-missing") + 1] if "--allow-missing" in argv else None
            loaded = net.load_state_dict(torch.load(out, weights_only=True), strict=allow is None)
            if allow is not None:
                import re

                assert not loaded.unexpected_keys and all(re.search(allow, k) for k in loaded.missing_keys)
            out.unlink()


def _printed(text: str) -> list[str]:
    import re

    return re.findall(r"`(ckpt-doctor [^`]+)`", text)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # printed outputs (`-o bert_fixed.pt`) land in the test's own folder


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "vit", "t5"])
def test_verify_runs_each_family_on_inputs_made_from_its_config(folders, name, tmp_path):
    case = folders[name]
    path, spec = case["path"], "hf:"
    if case["view"] == "after-fix":  # verify loads the file as torch does: the names transformers renames, fixed
        path, spec = tmp_path / "fixed.safetensors", f"hf:{case['path']}"
        assert run_cli("fix", case["path"], "-o", path, "--model", spec, "--auto").exit_code == 0
    result = run_cli("verify", path, "--model", spec, "--mode", "single", "--json")
    assert result.exit_code == 0, result.stderr
    (run,) = result.json()["runs"]
    assert run["status"] == "pass" and result.json()["loaded_fraction"] == 1.0


def test_verify_loads_the_weights_into_the_real_model_ties_included(folders):
    """The model verify runs is transformers' own, with the file's weights: its outputs equal from_pretrained's."""
    from ckpt_doctor.verify import InputSpec, _prepare

    case = folders["t5"]
    spec = f"hf:{case['path']}"
    prepared = _prepare(str(case["path"]), spec, {}, InputSpec(), None, None, None, None)
    reference = transformers.T5ForConditionalGeneration.from_pretrained(case["path"]).eval()
    model = prepared.model.eval()
    assert model.shared.weight is model.encoder.embed_tokens.weight is model.lm_head.weight
    input_ids, mask, decoder = prepared.inputs
    assert input_ids.max() < 99 and bool(mask.all())
    with torch.no_grad():
        assert torch.equal(model(*prepared.inputs).logits, reference(input_ids, mask, decoder).logits)
    from ckpt_doctor.verify import make_inputs

    (pixels,) = make_inputs(InputSpec(), "hf:" + str(folders["vit"]["path"]))
    assert pixels.shape == (4, 3, 16, 16) and pixels.dtype == torch.float32


def test_verify_under_ddp_with_gloo(folders):
    result = run_cli("verify", folders["gpt2"]["path"], "--model", "hf:", "--mode", "ddp", "--gpus", "2", "--json")
    assert result.exit_code == 0, result.stderr
    (run,) = result.json()["runs"]
    assert run["mode"] == "ddp" and run["status"] == "pass" and run["backend"] == "gloo"


def test_fix_auto_through_the_installed_command(folders, tmp_path):
    """The command as a user runs it: a new process, `ckpt-doctor` on the PATH, the model named by `hf:`."""
    case = folders["bert_module"]
    out = tmp_path / "clean.safetensors"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    exe = Path(sys.executable).with_name("ckpt-doctor")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "ckpt_doctor"]
    done = subprocess.run([*command, "fix", str(case["path"]), "-o", str(out), "--model", "hf:", "--auto"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    _real_model(case).load_state_dict(load_file(out), strict=True)


def test_model_arg_overrides_a_config_field(folders):
    case = folders["bert"]
    result = run_cli("inspect", case["path"], "--model", "hf:", "--model-arg", "num_labels=5", "--json")
    assert result.exit_code == 1
    mismatched = {m["key"]: m["model_shape"] for m in result.json()["comparison"]["mismatched"]}
    assert mismatched == {"classifier.weight": [5, 32], "classifier.bias": [5]}
    command = result.json()["suggested_commands"][0]["command"]
    assert "--model-arg num_labels=5" in command
    typo = run_cli("inspect", case["path"], "--model", "hf:", "--model-arg", "num_lables=5")
    assert typo.exit_code == 2 and "num_lables" in typo.stderr and "Traceback" not in typo.stderr


def test_bad_specs_are_one_line_and_exit_2(folders, tmp_path):
    lone = tmp_path / "lone.pt"
    torch.save({"w": torch.zeros(2)}, lone)
    no_config = run_cli("inspect", lone, "--model", "hf:")
    assert no_config.exit_code == 2 and "config.json" in no_config.stderr
    assert no_config.stderr.count("\n") == 1 and no_config.stderr.startswith("Error:")
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({
        "model_type": "my-model", "architectures": ["MyModelForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModel"}}))
    (remote / "modeling_my.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    refused = run_cli("inspect", folders["bert"]["path"], "--model", f"hf:{remote}")
    assert refused.exit_code == 2 and "trust_remote_code" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "ran").exists()
    missing = run_cli("verify", folders["bert"]["path"], "--model", f"hf:{tmp_path / 'nowhere'}")
    assert missing.exit_code == 2 and "does not exist" in missing.stderr


def test_without_transformers_the_message_says_how_to_install_it(folders, tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    (tmp_path / "transformers.py").write_text("raise ImportError('No module named transformers')\n")
    done = subprocess.run([sys.executable, "-m", "ckpt_doctor", "inspect", str(folders["bert"]["path"]), "--model",
                           "hf:"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "pip install 'ckpt-doctor[hf]'" in done.stderr, done.stderr
