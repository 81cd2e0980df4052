"""The user's journey as a property: for every scenario, every command ckpt-doctor prints (in stderr, in the
JSON's `suggested_commands`, in an error's way out) is run as printed, and what its sentence promises is checked
with torch: the exit code, an output that torch.load(weights_only=True) loads, strictly into the model, with the
source's tensors bit for bit. The words and the exit code come from one value."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from torch import nn

from tests.helpers import flat_tensors

NETS = textwrap.dedent('''
    import torch
    from torch import nn


    from fixtures.models import RenamedCNN as OtherVGG  # the same network under other names
    from fixtures.models import SmallCNN as VGG


    class Wrapped(nn.Module):
        """A real submodule named `module`."""

        def __init__(self):
            super().__init__()
            self.module = VGG()
            self.head = nn.Linear(10, 2)

        def forward(self, x):
            return self.head(self.module(x))


    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(20, 8)
            self.body = nn.Linear(8, 8)
            self.lm_head = nn.Linear(8, 20, bias=False)
            self.lm_head.weight = self.embed.weight

        def forward(self, tokens):
            return self.lm_head(torch.relu(self.body(self.embed(tokens))))


    class Unrelated(nn.Module):
        """Shares no name and no shape with VGG."""

        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.zeros(7, 5))
''')


def _saved_on(location: str):
    from fixtures.make_fixtures import saved_on

    return saved_on(location)


def _build(tmp: Path) -> dict[str, dict]:
    """Every scenario: a checkpoint made here from a model defined in code, and the model it should load into."""
    (tmp / "nets.py").write_text(NETS)
    sys.path.insert(0, str(tmp))
    try:
        import importlib

        nets = importlib.import_module("nets")
        importlib.reload(nets)
    finally:
        sys.path.remove(str(tmp))
    torch.manual_seed(0)
    vgg = nets.VGG().eval()
    sd = vgg.state_dict()
    spec = f"{tmp / 'nets.py'}:VGG"
    out: dict[str, dict] = {}

    def save(name: str, obj, model: str = spec, **extra) -> None:
        torch.save(obj, tmp / name)
        out[name] = {"path": tmp / name, "model": model, **extra}

    save("dataparallel.pth", nn.DataParallel(vgg).state_dict())
    save("compiled.pt", {f"_orig_mod.{k}": v for k, v in sd.items()})
    save("lightning.ckpt", {"state_dict": {f"model.{k}": v for k, v in sd.items()}, "epoch": 3, "global_step": 10,
                            "hyper_parameters": {"lr": 0.1}})
    with _saved_on("cuda:3"):
        save("cuda3.pt", sd)
        save("cuda3_dp.pt", {f"module.{k}": v for k, v in sd.items()})
    save("whole.pt", vgg)
    save("whole_other.pt", vgg, f"{tmp / 'nets.py'}:Unrelated")  # a whole model against one it does not fit
    torch.manual_seed(1)
    save("other.pth", nets.OtherVGG().state_dict())
    head = {k: v for k, v in sd.items()}
    head["classifier.weight"] = torch.randn(5, 16)
    head["classifier.bias"] = torch.randn(5)
    save("new_head.pth", head)
    save("args.pt", {"model": sd, "args": argparse.Namespace(lr=0.1, epochs=3), "epoch": 3})
    save("extra.pth", {**sd, "aux.weight": torch.randn(3, 3)})
    save("no_bn_stats.pth", {k: v for k, v in sd.items() if "running" not in k})
    save("wrapped.pth", nets.Wrapped().state_dict(), f"{tmp / 'nets.py'}:Wrapped")
    lm = nets.TiedLM()
    save("tied.pth", {k: v for k, v in lm.state_dict().items() if k != "lm_head.weight"},
         f"{tmp / 'nets.py'}:TiedLM")
    return out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("journeys"))


COMMAND = re.compile(r"`(ckpt-doctor [^`]+)`")


def printed_commands(text: str) -> list[str]:
    return COMMAND.findall(text)


def _model(spec: str):
    from ckpt_doctor.modelspec import build_model

    torch.manual_seed(0)
    return build_model(spec, {}, "cpu")


def _source_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the source file, by full path, read by ckpt-doctor's own loader (no code run)."""
    from ckpt_doctor.dtypes import QUANTIZED
    from ckpt_doctor.readers import read_checkpoint
    from ckpt_doctor.tensordata import load_tensor

    return {t.key: load_tensor(t) for t in read_checkpoint(path).tensors if t.dtype not in QUANTIZED}


def _option(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def check_promise(command: str, promise: str, model: list[str] | None, source: Path) -> None:
    """Run a printed command as printed and check what it promises."""
    argv = shlex.split(command)
    assert argv[0] == "ckpt-doctor"
    result = run_cli(*argv[1:], "--json") if argv[1] == "fix" and "--dry-run" not in argv else run_cli(*argv[1:])
    assert result.exit_code == 0, (command, result.stderr)
    if promise == "shows":
        assert result.stdout.strip(), command
        return
    out = Path(_option(argv, "-o") or _option(argv, "--output"))
    report = result.json()
    loaded = torch.load(out, weights_only=True)  # torch's defaults load it, here
    # bit for bit: every written tensor is the source's under its old name; nothing left out unlisted
    src = _source_tensors(source)
    written = flat_tensors(loaded)
    select = _option(argv, "--select")
    renamed = report["renamed"]
    back = {new: old for old, new in renamed.items()}
    ties = [t.split("=", 1) for i, t in enumerate(argv) if i and argv[i - 1] == "--tie"]
    back.update({alias: back.get(key, key) for alias, key in ties})  # a tied name is the tensor it shares
    from ckpt_doctor.readers import read_checkpoint

    root = select if select is not None else read_checkpoint(source).state_dict_root
    prefix = f"{root}." if root else ""
    for key, tensor in written.items():
        origin = back.get(key, key)
        full = origin if origin in src else prefix + origin
        if full not in src and key.startswith(prefix):
            full = key
        assert full in src, (command, key)
        assert torch.equal(src[full].flatten().view(torch.uint8) if src[full].dtype != tensor.dtype else src[full],
                           tensor.view(src[full].dtype) if src[full].dtype != tensor.dtype else tensor) or \
            _option(argv, "--dtype"), (command, key)
    written_sources = {back.get(k, k) for k in written} | {prefix + back.get(k, k) for k in written}
    dropped = set(report["dropped"])
    for key in src:
        rel = key[len(prefix):] if prefix and key.startswith(prefix) else None
        listed = any(key == d or key.startswith(d + ".") or rel == d for d in dropped)
        assert key in written_sources or (rel is not None and rel in written_sources) or listed, (command, key)
    if promise == "loads":
        assert model, command
        net = _model(model[1])
        allow = _option(argv, "--allow-missing")
        result = net.load_state_dict(loaded, strict=allow is None)
        if allow is not None:
            assert not result.unexpected_keys and all(re.search(allow, k) for k in result.missing_keys), command


SCENARIO_NAMES = ["dataparallel.pth", "compiled.pt", "lightning.ckpt", "cuda3.pt", "cuda3_dp.pt", "whole.pt",
                  "other.pth", "new_head.pth", "args.pt", "extra.pth", "no_bn_stats.pth", "wrapped.pth", "tied.pth",
                  "whole_other.pt"]


def json_commands(data: dict) -> list[dict]:
    """Every command a JSON report suggests: its own, and each file's (scan)."""
    return list(data.get("suggested_commands", [])) + [s for f in data.get("files", []) if isinstance(f, dict)
                                                       for s in f.get("suggested_commands", [])]


@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_every_printed_command_runs_and_keeps_its_promise(scenarios, name, tmp_path):
    case = scenarios[name]
    path, spec = str(case["path"]), case["model"]
    for args in (("inspect", path, "--model", spec), ("inspect", path), ("scan", path)):
        table = run_cli(*args)
        data = run_cli(*args, "--json")
        # one verdict: the words, the JSON and the exit code come from one value
        assert table.exit_code == data.exit_code == data.json()["exit_code"]
        if args[0] == "inspect":
            assert data.json()["ok"] is (data.exit_code == 0)
        if "comparison" in data.json():
            assert data.json()["comparison"]["ok"] is ("comparison" not in data.json()["problems"] and
                                                       "unsafe" not in data.json()["problems"])
        suggested = json_commands(data.json())
        shown = printed_commands(table.stderr)
        # what stderr prints is exactly what the JSON lists: rendered from the same values
        assert sorted(shown) == sorted(s["command"] for s in suggested), (args, shown)
        for s in suggested:
            check_promise(s["command"], s["promise"], s.get("model"), case["path"])
            if s["promise"] == "loads":  # the journey closes: the fixed file passes the check that failed
                argv = shlex.split(s["command"])
                allow = _option(argv, "--allow-missing")
                again = run_cli("inspect", _option(argv, "-o"), "--model", spec, "--json",
                                *(("--allow-missing", allow) if allow else ()))
                assert again.json()["comparison"]["ok"], again.stderr


def test_an_error_s_way_out_is_a_command_that_runs(scenarios, tmp_path):
    """Refusals name the user's own command, changed: it runs as printed."""
    other = scenarios["other.pth"]
    out = tmp_path / "mapped.pt"
    refused = run_cli("fix", other["path"], "-o", out, "--model", other["model"], "--map-by-order")
    assert refused.exit_code == 2 and not out.exists()
    dry, force = printed_commands(refused.stderr)
    assert dry.endswith("--dry-run") and force.endswith("--force")
    shown = run_cli(*shlex.split(dry)[1:])
    assert shown.exit_code == 0 and "≈" in shown.stdout and not out.exists()
    check_promise(force, "loads", ["--model", other["model"]], other["path"])

    args = scenarios["args.pt"]
    refused = run_cli("fix", args["path"], "-o", tmp_path / "a.pt")
    assert refused.exit_code == 2
    drop, plain, keep = printed_commands(refused.stderr)
    check_promise(drop, "writes", None, args["path"])
    (tmp_path / "a.pt").unlink()  # the three are alternatives: each runs where the others have not
    assert plain.endswith("--plain-data") and run_cli(*shlex.split(plain)[1:]).exit_code == 0
    assert type(torch.load(tmp_path / "a.pt", weights_only=True)["args"]) is dict
    (tmp_path / "a.pt").unlink()
    kept = run_cli(*shlex.split(keep)[1:])
    assert kept.exit_code == 0 and "safe_globals" in kept.stderr

    exists = run_cli("fix", args["path"], "-o", tmp_path / "a.pt", "--drop", "^args$")
    assert exists.exit_code == 2
    (again,) = printed_commands(exists.stderr)
    assert again.endswith("--force") and run_cli(*shlex.split(again)[1:]).exit_code == 0

    dp = scenarios["dataparallel.pth"]
    bad = run_cli("fix", dp["path"], "-o", tmp_path / "r.pt", "--rename", "^module=")
    assert bad.exit_code == 2 and "empty component" in bad.stderr
    (meant,) = printed_commands(bad.stderr)
    check_promise(meant, "writes", None, dp["path"])


def test_a_prefix_without_its_dot_is_the_whole_component(scenarios, tmp_path):
    dp = scenarios["dataparallel.pth"]
    result = run_cli("fix", dp["path"], "-o", tmp_path / "s.pt", "--strip-prefix", "module", "--json")
    assert result.exit_code == 0
    keys = list(torch.load(tmp_path / "s.pt", weights_only=True))
    assert keys and all(k.startswith(("features.", "classifier.")) for k in keys)
    _model(dp["model"]).load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True), strict=True)
    assert run_cli("fix", dp["path"], "-o", tmp_path / "t.pt", "--add-prefix", "net").exit_code == 0
    assert all(k.startswith("net.module.") for k in torch.load(tmp_path / "t.pt", weights_only=True))
    assert run_cli("fix", dp["path"], "-o", tmp_path / "u.pt", "--strip-prefix", "a..b").exit_code == 2


def test_select_everything_keeps_the_nesting_and_lists_what_a_flat_output_leaves_out(scenarios, tmp_path):
    lit = scenarios["lightning.ckpt"]
    nested = run_cli("fix", lit["path"], "-o", tmp_path / "all.pt", "--select", "", "--json")
    plain = run_cli("fix", lit["path"], "-o", tmp_path / "plain.pt", "--json")
    assert nested.exit_code == plain.exit_code == 0
    whole = torch.load(tmp_path / "all.pt", weights_only=True)
    assert whole["epoch"] == 3 and whole["hyper_parameters"] == {"lr": 0.1}
    assert whole.keys() == torch.load(tmp_path / "plain.pt", weights_only=True).keys()
    assert nested.json()["dropped"] == []
    flat = run_cli("fix", lit["path"], "-o", tmp_path / "all.safetensors", "--select", "", "--json")
    assert flat.exit_code == 0
    assert set(flat.json()["dropped"]) == {"epoch", "global_step", "hyper_parameters"}
    part = run_cli("fix", lit["path"], "-o", tmp_path / "sd.pt", "--select", "state_dict", "--json")
    assert set(part.json()["dropped"]) == {"epoch", "global_step", "hyper_parameters"}


def test_default_load_is_a_fact_that_agrees_with_torch(scenarios):
    """`default_load.ok` is what torch.load(path) with torch's defaults does here; --require-default-load fails
    on it."""
    for name in SCENARIO_NAMES:
        path = scenarios[name]["path"]
        data = run_cli("inspect", path, "--json").json()
        try:
            torch.load(path)
            torch_loads = True
        except Exception:  # noqa: BLE001 - torch's own verdict, whatever it raises
            torch_loads = False
        assert data["default_load"]["ok"] is torch_loads, (name, data["default_load"])
        strict = run_cli("inspect", path, "--require-default-load")
        assert strict.exit_code == (1 if not torch_loads or data["exit_code"] else 0), name


def test_whole_model_pickle_verdict_says_it_needs_code(scenarios):
    case = scenarios["whole.pt"]
    data = run_cli("inspect", case["path"], "--model", case["model"], "--json")
    assert data.exit_code == 1
    comp = data.json()["comparison"]
    assert comp["ok"] is False and comp["verdict"].startswith("needs code to load")
    assert [s["label"] for s in data.json()["suggested_commands"]] == ["fix"]


def test_a_whole_model_that_fits_points_at_its_fix_line(scenarios):
    """Its keys fit as they are (no flag to infer), so the rescue is the fix line alone: the verdict points there,
    not at a torch.load line that holds no command."""
    case = scenarios["whole.pt"]
    table = run_cli("inspect", case["path"], "--model", case["model"])
    lines = dict(line.split(None, 1) for line in table.stderr.splitlines() if line.startswith(("verdict", "fix ")))
    assert "rescued by the fix line" in lines["verdict"], lines["verdict"]
    assert printed_commands(lines["fix"])


def test_a_tar_checkpoint_s_rewrite_is_listed_and_runs_as_printed(tmp_path):
    """The rewrite the note of a pre-0.4 tar file prints is in `suggested_commands`, and keeps its promise."""
    from tests.payloads import tar_checkpoint

    path = tmp_path / "old model.pt"
    path.write_bytes(tar_checkpoint({"w": [1.0, 2.0], "b": [3.0]}))
    printed = printed_commands(run_cli("inspect", path).stderr)
    listed = run_cli("inspect", path, "--json").json()["suggested_commands"]
    assert [s["command"] for s in listed] == printed and len(printed) == 1, (printed, listed)
    check_promise(printed[0], listed[0]["promise"], None, path)


def test_a_whole_model_no_fix_fits_still_gets_its_rescue(scenarios):
    """No fix makes it load into this model; the safety line's way out is printed all the same, and the verdict
    points at it."""
    case = scenarios["whole_other.pt"]
    data = run_cli("inspect", case["path"], "--model", case["model"], "--json")
    assert data.exit_code == 1
    assert [s["label"] for s in data.json()["suggested_commands"]] == ["torch.load"]
    assert "rescued by the command on the torch.load line" in data.json()["comparison"]["verdict"]


def test_devices_this_machine_lacks_are_a_fact_not_a_failure(scenarios):
    if torch.cuda.device_count() >= 4:
        pytest.skip("this machine has cuda:3")
    case = scenarios["cuda3.pt"]
    plain = run_cli("inspect", case["path"])
    model = run_cli("inspect", case["path"], "--model", case["model"], "--json")
    assert plain.exit_code == model.exit_code == 0
    assert model.json()["default_load"]["missing_devices"] == ["cuda:3"]
    assert "strict load OK" in model.json()["comparison"]["verdict"]
    assert run_cli("inspect", case["path"], "--require-default-load").exit_code == 1


def test_a_load_that_succeeds_in_a_run_that_fails_says_so_where_ok_is_read(scenarios):
    """inspect --model --require-default-load of a file whose state_dict loads but which torch.load refuses: the
    verdict line says the load is OK and, in the same line, why the exit code is 1 all the same."""
    case = scenarios["args.pt"]
    strict = run_cli("inspect", case["path"], "--model", case["model"], "--require-default-load")
    verdict = next(line for line in strict.stderr.splitlines() if line.startswith("verdict"))
    assert strict.exit_code == 1
    assert "strict load OK" in verdict and "exit 1 all the same: torch.load fails with torch's defaults" in verdict
    plain = run_cli("inspect", case["path"], "--model", case["model"])
    assert plain.exit_code == 0 and "exit 1" not in plain.stderr


def test_diff_exits_1_when_a_side_would_run_code(scenarios, tmp_path):
    case = scenarios["whole.pt"]
    clean = tmp_path / "clean.pt"
    assert run_cli("fix", case["path"], "-o", clean).exit_code == 0
    result = run_cli("diff", case["path"], clean, "--json")
    assert result.exit_code == 1 and result.json()["identical"] and result.json()["unsafe"] == ["A"]
    assert run_cli("diff", clean, clean).exit_code == 0


def test_load_into_errors_are_one_plain_line(scenarios):
    import ckpt_doctor

    case = scenarios["other.pth"]  # no fix fits a model that shares no name and no shape with the file
    with pytest.raises(ckpt_doctor.ReadError) as caught:
        ckpt_doctor.load_into(_model(scenarios["whole_other.pt"]["model"]), case["path"])
    message = str(caught.value)
    assert "\n" not in message and "\x1b" not in message and "allow_missing=" in message
    assert len(ckpt_doctor.load(scenarios["args.pt"]["path"])) == 16  # torch would refuse its Namespace


def test_dtype_aliases(scenarios, tmp_path):
    dp = scenarios["dataparallel.pth"]
    for alias in ("half", "fp16", "float16", "torch.float16", "FP16"):
        result = run_cli("fix", dp["path"], "-o", tmp_path / f"{alias}.pt", "--dtype", alias)
        assert result.exit_code == 0, result.stderr
        loaded = torch.load(tmp_path / f"{alias}.pt", weights_only=True)
        assert loaded["module.features.0.weight"].dtype == torch.float16
    assert run_cli("fix", dp["path"], "-o", tmp_path / "x.pt", "--dtype", "fp8").exit_code == 2


def test_parameters_are_counted_as_torch_counts_them(scenarios):
    case = scenarios["dataparallel.pth"]
    net = _model(case["model"])
    data = run_cli("inspect", case["path"], "--json").json()
    assert data["parameter_count"] == sum(p.numel() for p in net.parameters())
    assert data["buffer_count"] == sum(b.numel() for b in net.buffers())


def test_suggested_outputs_go_beside_the_input(tmp_path):
    from ckpt_doctor.advice import output_beside

    assert output_beside("runs/Net2DFast_UK_same.pth.tar") == "runs/Net2DFast_UK_same_fixed.pt"
    assert output_beside(tmp_path / "model.pt") == str(tmp_path / "model_fixed.pt")
    (tmp_path / "model_fixed.pt").write_bytes(b"")
    assert output_beside(tmp_path / "model.pt") == str(tmp_path / "model_fixed2.pt")
    assert output_beside("ckpt/step_100/") == "ckpt/step_100_fixed.pt"
    assert json.dumps(output_beside("net.v2")) == '"net.v2_fixed.pt"'


def _run_every_suggestion(path: Path, tmp: Path, canary: Path | None = None) -> int:
    """inspect and scan `path`; run every command they print, in a scratch copy's folder so outputs land there;
    return how many ran. Each exits 0 and writes a file torch.load loads with its defaults."""
    import shutil

    copy = tmp / path.name
    if not copy.exists():
        (shutil.copytree if path.is_dir() else shutil.copy2)(path, copy)
    ran = 0
    for args in (("inspect", copy), ("scan", copy)):
        table, data = run_cli(*args), run_cli(*args, "--json")
        assert table.exit_code == data.exit_code, (args, table.stderr)
        if not data.stdout.strip():  # the file could not be read (one Error line): no advice to run
            assert data.exit_code in (1, 2) and not printed_commands(table.stderr), (args, table.stderr)
            continue
        suggested = json_commands(data.json())
        assert sorted(printed_commands(table.stderr)) == sorted(s["command"] for s in suggested), table.stderr
        for s in suggested:
            argv = shlex.split(s["command"])
            result = run_cli(*argv[1:])
            assert result.exit_code == 0, (s["command"], result.stderr)
            out = Path(_option(argv, "-o"))
            torch.load(out, weights_only=True)  # torch's defaults load what the rescue wrote
            ran += 1
    if canary is not None:
        assert not canary.exists(), path
    return ran


def test_every_fixture_s_printed_commands_run(fixtures, tmp_path):
    ran = sum(_run_every_suggestion(info["path"], tmp_path) for name, info in fixtures.items())
    assert ran >= 6, ran  # the cuda:3 files, the whole-model pickle, the TorchScript archive at least


def test_every_rescue_of_a_malicious_file_runs_nothing_and_loads(fixtures, tmp_path):
    """The malicious corpus: each file's printed rescue runs as printed, runs nothing from the file (the canary
    stays absent) and writes a file torch.load loads with its defaults."""
    from tests.corpus import malicious

    canary = tmp_path / "CANARY"
    evil = tmp_path / "evil"
    evil.mkdir()
    ran = 0
    for name, data in malicious(canary, fixtures["legacy"]["path"].read_bytes()).items():
        (evil / name).write_bytes(data)
        (tmp_path / name).mkdir()
        ran += _run_every_suggestion(evil / name, tmp_path / name, canary)
    assert ran >= 8, ran  # every file with tensors to rescue, from inspect and from scan


def test_add_safe_globals_advice_is_what_torch_needs(tmp_path):
    """Where the torch.load line says add_safe_globals([...]) suffices, torch's own weights_only load succeeds with
    exactly those names; NumPy values (which need more) get the fix rescue instead."""
    import datetime
    import pathlib

    import numpy as np

    from ckpt_doctor.default_load import ADD_SAFE_GLOBALS_SUFFICES

    objects = {"argparse.Namespace": argparse.Namespace(lr=0.1), "datetime.date": datetime.date(2024, 1, 1),
               "datetime.datetime": datetime.datetime(2024, 1, 1, 3), "datetime.timedelta": datetime.timedelta(3),
               "datetime.time": datetime.time(3, 4), "pathlib.PosixPath": pathlib.PosixPath("/a/b"),
               "builtins.frozenset": frozenset({1, 2}), "builtins.slice": slice(1, 2), "builtins.range": range(3)}
    assert set(objects) <= ADD_SAFE_GLOBALS_SUFFICES
    for name, obj in objects.items():
        path = tmp_path / f"{name}.pt"
        torch.save({"w": torch.ones(2), "x": obj}, path)
        data = run_cli("inspect", path, "--json").json()["default_load"]
        assert data["add_safe_globals"] == [name], (name, data)
        with torch.serialization.safe_globals([type(obj)]):
            torch.load(path)
    path = tmp_path / "numpy.pt"
    torch.save({"w": torch.ones(2), "x": np.arange(3)}, path)
    data = run_cli("inspect", path, "--json").json()
    assert data["default_load"]["ok"] is False and data["default_load"]["add_safe_globals"] == []
    (rescue,) = data["suggested_commands"]
    check_promise(rescue["command"], rescue["promise"], None, path)


def test_numpy_values_kept_with_allow_global_load_with_the_names_the_note_gives(tmp_path, monkeypatch):
    """accelerate's random_states_0.pkl: NumPy's RNG state beside torch's. The refusal's keep-it way out runs as
    printed, and the written file loads with torch.load(weights_only=True) within safe_globals of exactly the names
    fix's note gives: torch builds a NumPy dtype only of a class it holds (numpy.dtypes.UInt32DType here)."""
    import random

    import numpy as np

    monkeypatch.chdir(tmp_path)
    state = {"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
             "torch_manual_seed": torch.get_rng_state()}
    torch.save(state, "random_states_0.pkl")
    refused = run_cli("fix", "random_states_0.pkl", "-o", "states.pt", "--select", "")
    assert refused.exit_code == 2
    keep = next(c for c in printed_commands(refused.stderr) if "--allow-global" in c)
    kept = run_cli(*shlex.split(keep)[1:])
    assert kept.exit_code == 0, kept.stderr
    (note,) = [line for line in kept.stderr.splitlines() if "safe_globals([" in line]
    names = re.search(r"safe_globals\(\[([^\]]*)\]\)", note).group(1).split(", ")
    assert "numpy.dtypes.UInt32DType" in names

    def named(dotted: str):
        module, _, attr = dotted.rpartition(".")
        return getattr(__import__(module, fromlist=[attr]), attr)

    with pytest.raises(Exception, match="UInt32DType"):  # the three globals alone: what the note once said
        with torch.serialization.safe_globals([named(n) for n in names if not n.startswith("numpy.dtypes.")]):
            torch.load("states.pt", weights_only=True)
    with torch.serialization.safe_globals([named(n) for n in names]):
        loaded = torch.load("states.pt", weights_only=True)
    assert torch.equal(loaded["torch_manual_seed"], state["torch_manual_seed"])
    assert loaded["numpy_random_seed"][0] == "MT19937"
    assert np.array_equal(loaded["numpy_random_seed"][1], state["numpy_random_seed"][1])
    again = ["again.pt" if a == "states.pt" else a for a in shlex.split(keep)[1:]]
    data = run_cli(*again, "--json").json()
    assert data["safe_globals"] == sorted(names) and "numpy.dtypes.UInt32DType" not in data["unknown_globals"]


def test_a_wrapped_classifier_loads_into_its_base_model(tmp_path):
    """DataParallel(torch.compile(BertForSequenceClassification)) saved in a training checkpoint, checked against
    BertModel: the fix strips the wrappers with the head the base model lacks and drops the classifier."""
    from transformers import BertConfig, BertForSequenceClassification

    (tmp_path / "hf.py").write_text(
        "from transformers import BertConfig, BertModel\n"
        "def base():\n"
        "    return BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,"
        " intermediate_size=20))\n")
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=20)
    torch.manual_seed(0)
    sd = BertForSequenceClassification(config).state_dict()
    path = tmp_path / "train.pt"
    torch.save({"model": {f"module._orig_mod.{k}": v for k, v in sd.items()}, "epoch": 1}, path)
    spec = f"{tmp_path / 'hf.py'}:base"
    data = run_cli("inspect", path, "--model", spec, "--json").json()
    (fix,) = [s for s in data["suggested_commands"] if s["label"] == "fix"]
    assert "--strip-prefix module._orig_mod.bert." in fix["command"]
    check_promise(fix["command"], fix["promise"], fix["model"], path)


def test_verify_refused_for_a_new_head_prints_the_verify_that_accepts_it(scenarios, tmp_path):
    case = scenarios["new_head.pth"]
    head = tmp_path / "head.pt"
    fixed = run_cli("fix", case["path"], "-o", head, "--drop", "^classifier", "--model", case["model"],
                    "--allow-missing", "^classifier")
    assert fixed.exit_code == 0, fixed.stderr
    refused = run_cli("verify", head, "--model", case["model"], "--input-shape", "2,3,8,8", "--mode", "single")
    assert refused.exit_code == 1
    (accept,) = printed_commands(refused.stderr)
    assert "verify" in accept and "--allow-missing" in accept and "fix" not in accept.split()[1]
    assert run_cli(*shlex.split(accept)[1:]).exit_code == 0


def test_select_of_a_submodule_lists_every_tensor_it_leaves(scenarios, tmp_path):
    case = scenarios["whole.pt"]
    result = run_cli("fix", case["path"], "-o", tmp_path / "features.pt", "--select", "features", "--json")
    assert result.exit_code == 0
    assert set(result.json()["dropped"]) == {"classifier.weight", "classifier.bias"}


def test_shares_never_round_to_nothing_or_to_everything():
    from ckpt_doctor.errors import percent

    assert percent(0.00047) == "0.047%" and percent(0.0) == "0.0%"
    assert percent(0.99999) == "99.999%" and percent(1.0) == "100.0%" and percent(0.944) == "94.4%"


def test_module_versions_survive_a_repair(tmp_path):
    """A state_dict's `_metadata` (each module's version, which its loading code reads) is written back under the
    renamed module names: a module that converts version-1 weights loads the repaired file as it loads the
    original."""
    from collections import OrderedDict

    class Versioned(nn.Module):
        _version = 2

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *args):
            if local_metadata.get("version", 1) < 2 and prefix + "lin.weight" in state_dict:
                state_dict[prefix + "lin.weight"] = -state_dict[prefix + "lin.weight"]
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *args)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.v = Versioned()

    source = nn.DataParallel(Outer()).state_dict()
    source._metadata["module.v"] = {"version": 1}  # saved by an older release of the module
    path = tmp_path / "old.pt"
    torch.save(source, path)
    assert run_cli("fix", path, "-o", tmp_path / "new.pt", "--strip-module").exit_code == 0
    fixed = torch.load(tmp_path / "new.pt", weights_only=True)
    assert isinstance(fixed, OrderedDict) and fixed._metadata["v"] == {"version": 1}
    a, b = Outer(), Outer()
    a.load_state_dict(fixed)
    nn.DataParallel(b).load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(a.v.lin.weight, b.v.lin.weight)


def test_quantized_tensors_are_refused_not_rewritten_without_their_scale(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.tensor([0.5, 1.0]), 0.1, 3, torch.quint8)
    path = tmp_path / "q.pt"
    torch.save({"w": torch.ones(2), "q": q}, path)
    refused = run_cli("fix", path, "-o", tmp_path / "out.pt")
    assert refused.exit_code == 2 and not (tmp_path / "out.pt").exists()
    (drop,) = printed_commands(refused.stderr)
    check_promise(drop, "writes", None, path)
    assert run_cli("diff", path, path).exit_code == 2  # no values read without their scale (it crashed before)


def test_a_load_hook_that_reads_values_is_checked_on_the_cpu(tmp_path):
    """A model's _load_from_state_dict that calls .item() cannot run on meta tensors: the check runs it on the CPU
    and gives torch's own verdict, and suggests no --drop of what the hook consumes."""
    (tmp_path / "scaled.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class Scaled(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(2, 2)\n"
        "    def _load_from_state_dict(self, sd, prefix, meta, strict, *args):\n"
        "        scale = sd.pop(prefix + 'scale', None)\n"
        "        if scale is not None:\n"
        "            sd[prefix + 'lin.weight'] = sd[prefix + 'lin.weight'] / scale.item()\n"
        "        super()._load_from_state_dict(sd, prefix, meta, strict, *args)\n")
    sd = nn.Linear(2, 2).state_dict()
    path = tmp_path / "scaled.pt"
    torch.save({"lin.weight": sd["weight"], "lin.bias": sd["bias"], "scale": torch.tensor(2.0)}, path)
    data = run_cli("inspect", path, "--model", f"{tmp_path / 'scaled.py'}:Scaled", "--json")
    assert data.exit_code == 0 and data.json()["comparison"]["ok"] and not data.json()["suggested_commands"]


def test_a_storage_member_longer_than_its_storage_is_what_torch_load_refuses(tmp_path):
    """torch.load checks each storage record's size against what the pickle gives it and refuses a longer one;
    inspect and scan say so (not "loads with torch's defaults"), and the rescue they print writes each storage at
    its size, which torch.load then loads."""
    import zipfile

    state = {"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(3)}
    saved, longer = tmp_path / "saved.pt", tmp_path / "longer.pt"
    torch.save(state, saved)
    with zipfile.ZipFile(saved) as src, zipfile.ZipFile(longer, "w") as out:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data/0"):
                data += b"\0" * 8  # (8 bytes the pickle gives no tensor)
            out.writestr(info, data)
    with pytest.raises(RuntimeError, match="record size"):
        torch.load(longer, weights_only=True)
    data = run_cli("inspect", longer, "--json").json()
    assert data["default_load"]["ok"] is False and "data/0 holds more bytes" in data["default_load"]["reason"]
    assert run_cli("inspect", longer, "--require-default-load").exit_code == 1
    (tmp_path / "rescue").mkdir()
    assert _run_every_suggestion(longer, tmp_path / "rescue") >= 1
    rescued = tmp_path / "rescue" / "longer_fixed.pt"
    got = torch.load(rescued, weights_only=True)
    assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"], state["b"])
