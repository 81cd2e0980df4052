"""What `fix` and `inspect --model` tell the user to run, run as printed: `--force` is offered only when it alone
makes the command succeed, a suggested rename is one that plans, no transform writes a key no module has, and a
module renamed whole (features → backbone) is renamed by name, not mapped by order."""

from __future__ import annotations

import re
import shlex
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from torch import nn

COMMAND = re.compile(r"`(ckpt-doctor [^`]+)`")


def printed(text: str) -> list[str]:
    return COMMAND.findall(text)


def run_printed(command: str):
    argv = shlex.split(command)
    assert argv[0] == "ckpt-doctor"
    return run_cli(*argv[1:])


@pytest.fixture
def plain(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    torch.save(net.state_dict(), tmp_path / "plain.pt")
    torch.save({f"module.{k}": v for k, v in net.state_dict().items()}, tmp_path / "dp.pt")
    return tmp_path


# --- 1. the destination is checked after everything else ------------------------------------------------------------

@pytest.mark.parametrize("options", [
    ("--tie", "garbage"), ("--tie", "a=nothere"), ("--tie", "0.weight=0.weight"), ("--map-location", "cuda:99=foo"),
    ("--map-location", ""),
    ("--map-location", "meta"), ("--select", "nothere"), ("--select", "a..b"), ("--dtype", ""),
    ("--rename", "^=\\n"), ("--strip-prefix", "a..b"),
])
def test_force_is_not_offered_for_a_command_that_fails_on_another_option(plain, options):
    out = plain / "existing.pt"
    out.write_bytes(b"keep me")
    result = run_cli("fix", plain / "plain.pt", "-o", out, *options)
    assert result.exit_code == 2
    assert "already exists" not in result.stderr and "--force" not in result.stderr, result.stderr
    for command in printed(result.stderr):  # whatever way out is printed runs as printed
        assert run_printed(command).exit_code == 0, command
    assert out.read_bytes() == b"keep me"


def test_force_is_offered_when_it_alone_makes_the_command_succeed(plain):
    out = plain / "existing.pt"
    out.write_bytes(b"old")
    result = run_cli("fix", plain / "dp.pt", "-o", out, "--strip-module", "--tie", "extra.weight=0.weight")
    assert result.exit_code == 2 and "already exists" in result.stderr
    (again,) = printed(result.stderr)
    assert again.endswith("--force")
    assert run_printed(again).exit_code == 0
    loaded = torch.load(out, weights_only=True)
    assert loaded["extra.weight"] is loaded["0.weight"] or torch.equal(loaded["extra.weight"], loaded["0.weight"])


def test_sharded_output_checks_every_shard_after_planning(plain):
    first = run_cli("fix", plain / "plain.pt", "-o", plain / "s.pt", "--max-shard-size", "40B")
    assert first.exit_code == 0, first.stderr
    bad = run_cli("fix", plain / "plain.pt", "-o", plain / "s.pt", "--max-shard-size", "40B", "--select", "nothere")
    assert bad.exit_code == 2 and "--force" not in bad.stderr
    again = run_cli("fix", plain / "plain.pt", "-o", plain / "s.pt", "--max-shard-size", "40B")
    assert again.exit_code == 2 and "already exists" in again.stderr
    (command,) = printed(again.stderr)
    assert run_printed(command).exit_code == 0


def test_dcp_onto_a_file_is_refused_without_offering_force(plain):
    out = plain / "existing.pt"
    out.write_bytes(b"keep me")
    for extra in ((), ("--force",)):
        result = run_cli("fix", plain / "plain.pt", "-o", out, "--format", "dcp", *extra)
        assert result.exit_code == 2 and "not a DCP folder" in result.stderr
        assert printed(result.stderr) == []
    assert out.read_bytes() == b"keep me"
    folder = plain / "dcp"
    assert run_cli("fix", plain / "plain.pt", "-o", folder, "--format", "dcp").exit_code == 0
    again = run_cli("fix", plain / "plain.pt", "-o", folder, "--format", "dcp")
    assert again.exit_code == 2
    (command,) = printed(again.stderr)
    assert command.endswith("--force") and run_printed(command).exit_code == 0


# --- 2. a suggested rename is one that plans ------------------------------------------------------------------------

def test_a_rename_that_would_fail_is_not_suggested(plain):
    result = run_cli("fix", plain / "dp.pt", "-o", plain / "r.pt", "--rename", ".*=")
    assert result.exit_code == 2
    assert printed(result.stderr) == []  # the dotted rename would give every weight one name: not offered
    assert "would not do either" in result.stderr and "same name" in result.stderr
    assert not (plain / "r.pt").exists()


def test_a_suggested_rename_runs_as_printed(plain):
    result = run_cli("fix", plain / "dp.pt", "-o", plain / "r.pt", "--rename", "^module=")
    assert result.exit_code == 2
    (meant,) = printed(result.stderr)
    assert run_printed(meant).exit_code == 0
    assert list(torch.load(plain / "r.pt", weights_only=True)) == ["0.weight", "0.bias", "2.weight", "2.bias"]


# --- 3. no transform writes a key no module could have --------------------------------------------------------------

@pytest.mark.parametrize("flags", [("--rename", "^=\\n"), ("--rename", "weight=w\\t"), ("--add-prefix", "x\x01"),
                                   ("--rename", "^0\\.=0.."), ("--rename", "bias$=bias.")])
def test_no_key_with_a_control_character_or_an_empty_component(plain, flags):
    out = plain / "q.pt"
    result = run_cli("fix", plain / "plain.pt", "-o", out, *flags)
    assert result.exit_code == 2 and not out.exists()
    assert "control character" in result.stderr or "empty component" in result.stderr
    for command in printed(result.stderr):
        assert run_printed(command).exit_code == 0
        assert all(k.isprintable() and ".." not in k for k in torch.load(out, weights_only=True))


def test_the_library_refuses_such_keys_too():
    from ckpt_doctor.errors import PlanError
    from ckpt_doctor.transforms import plan_keys, rename

    with pytest.raises(PlanError, match="control character"):
        plan_keys(["a.weight"], [rename("^=\\n")])
    assert plan_keys(["a\nb"], []).mapping == {"a\nb": "a\nb"}  # a name the file already has is kept


# --- 4. modules renamed whole ---------------------------------------------------------------------------------------

NETS = textwrap.dedent('''
    from torch import nn


    def _features():
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16))


    class Old(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 3, 1)
            self.features = _features()
            self.head = nn.Linear(16, 10)


    class New(nn.Module):
        """features → backbone, head → fc, conv1 → stem."""

        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 3, 1)
            self.backbone = _features()
            self.fc = nn.Linear(16, 10)


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = nn.Linear(6, 6)
            self.norm = nn.LayerNorm(6)


    class DeepOld(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.block = Block()
            self.encoder.out = nn.Linear(6, 2)


    class DeepNew(nn.Module):
        """encoder.block → encoder.layer: a module renamed at depth 2, its parent and sibling as they were."""

        def __init__(self):
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.layer = Block()
            self.encoder.out = nn.Linear(6, 2)


    class Seq(nn.Sequential):
        def __init__(self):
            super().__init__(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))


    class Named(nn.Module):
        """Seq's layers under names that say nothing of their order: only a mapping by order fits."""

        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
''')


@pytest.fixture
def nets(tmp_path):
    (tmp_path / "renets.py").write_text(NETS)
    sys.path.insert(0, str(tmp_path))
    try:
        import importlib

        module = importlib.import_module("renets")
        module = importlib.reload(module)
    finally:
        sys.path.remove(str(tmp_path))
    module.SPEC = f"{tmp_path / 'renets.py'}:"
    return module


def _inspect(path: Path, spec: str) -> tuple[int, dict, str]:
    table = run_cli("inspect", path, "--model", spec)
    data = run_cli("inspect", path, "--model", spec, "--json")
    assert table.exit_code == data.exit_code
    return data.exit_code, data.json(), table.stderr


def _fix_runs_and_loads(stderr: str, source: Path, model: nn.Module, expect: dict[str, str]) -> None:
    """The printed fix line runs as printed; its output loads strictly into the model, each tensor the file's."""
    fixes = [c for c in printed(stderr) if c.startswith("ckpt-doctor fix ") and "--dry-run" not in c]
    assert len(fixes) == 1, stderr
    assert "--map-by-order" not in fixes[0] and "--force" not in fixes[0]
    result = run_printed(fixes[0])
    assert result.exit_code == 0, (fixes[0], result.stderr)
    out = shlex.split(fixes[0])[shlex.split(fixes[0]).index("-o") + 1]
    written = torch.load(out, weights_only=True)
    model.load_state_dict(written, strict=True)
    saved = torch.load(source, weights_only=True)
    for new, old in expect.items():
        assert torch.equal(written[new], saved[old]), new
    for old, tensor in saved.items():  # every tensor of the file is in the output, bit for bit
        assert any(torch.equal(tensor, t) and tensor.shape == t.shape for t in written.values()), old


def test_renamed_modules_are_renamed_by_name(nets, tmp_path):
    torch.manual_seed(0)
    old = nets.Old()
    old.features[1].running_mean += 1.5  # stats the output must carry over
    path = tmp_path / "renamed.pt"
    torch.save(old.state_dict(), path)
    code, data, stderr = _inspect(path, nets.SPEC + "New")
    comp = data["comparison"]
    assert code == 1 and comp["fix_kind"] == "rename" and comp["ambiguous"] == []
    flags = comp["suggested_fix"]
    assert [flags[i + 1] for i, f in enumerate(flags) if f == "--rename"] == [
        r"^conv1\.=stem.", r"^features\.=backbone.", r"^head\.=fc."]
    # the file holds the BatchNorm statistics (under features.*): nothing says they are missing
    assert comp["bn_stats_missing"] == [] and "running stats missing" not in stderr
    assert "ambiguous" not in stderr
    _fix_runs_and_loads(stderr, path, nets.New(), {"backbone.1.running_mean": "features.1.running_mean",
                                                   "fc.weight": "head.weight", "stem.weight": "conv1.weight"})


def test_a_module_renamed_below_the_top(nets, tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "deep.pt"
    torch.save(nets.DeepOld().state_dict(), path)
    code, data, stderr = _inspect(path, nets.SPEC + "DeepNew")
    flags = data["comparison"]["suggested_fix"]
    assert code == 1 and flags == ["--rename", r"^encoder\.block\.=encoder.layer."], flags
    _fix_runs_and_loads(stderr, path, nets.DeepNew(), {"encoder.layer.attention.weight": "encoder.block.attention.weight",
                                                       "encoder.layer.norm.bias": "encoder.block.norm.bias"})


def test_a_renamed_model_behind_a_wrapper(nets, tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "dp.pt"
    torch.save(nn.DataParallel(nets.Old()).state_dict(), path)
    code, data, stderr = _inspect(path, nets.SPEC + "New")
    flags = data["comparison"]["suggested_fix"]
    assert code == 1 and flags[0] == "--strip-module" and r"^features\.=backbone." in flags
    _fix_runs_and_loads(stderr, path, nets.New(), {"backbone.0.weight": "module.features.0.weight"})


def test_names_that_give_no_pairing_still_map_by_order(nets, tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "seq.pt"
    torch.save(nets.Seq().state_dict(), path)
    code, data, stderr = _inspect(path, nets.SPEC + "Named")
    comp = data["comparison"]
    assert code == 1 and comp["fix_kind"] == "map-by-order" and comp["ambiguous"]
    assert "--map-by-order" in comp["suggested_fix"]
    commands = printed(stderr)
    force = next(c for c in commands if c.startswith("ckpt-doctor fix") and c.endswith("--force"))
    dry = next(c for c in commands if c.endswith("--dry-run"))
    assert run_printed(dry).exit_code == 0
    assert run_printed(force).exit_code == 0
    out = shlex.split(force)[shlex.split(force).index("-o") + 1]
    nets.Named().load_state_dict(torch.load(out, weights_only=True), strict=True)


def test_the_rescue_leaves_out_a_tuple_whole_not_an_item_that_would_shift_the_rest(tmp_path):
    """A training checkpoint's NumPy RNG state is a tuple ('MT19937', keys, pos, has_gauss, cached): leaving out
    only the array (item 1) wrote ('MT19937', 623, 0, 0.0), which np.random.set_state misreads. The printed rescue
    leaves the tuple out whole; what it keeps is as saved."""
    import numpy as np

    path = tmp_path / "train.pt"
    saved = {"model": {"w": torch.randn(3)}, "rng": {"numpy": np.random.get_state(), "torch": torch.get_rng_state()},
             "epoch": 3}
    torch.save(saved, path)
    data = run_cli("inspect", path, "--json").json()
    [rescue] = data["suggested_commands"]
    assert run_printed(rescue["command"]).exit_code == 0
    loaded = torch.load(rescue["argv"][rescue["argv"].index("-o") + 1], weights_only=True)
    assert "numpy" not in loaded["rng"] and loaded["epoch"] == 3
    assert torch.equal(loaded["rng"]["torch"], saved["rng"]["torch"]) and torch.equal(loaded["model"]["w"],
                                                                                       saved["model"]["w"])


def test_a_file_without_a_state_dict_that_torch_load_refuses_gets_its_rescue(tmp_path):
    """accelerate's random_states_0.pkl holds no state_dict: its torch.load line said FAILS with no way out (the
    rescue planned without --select, which fix refuses for such a file). It prints one that runs as printed."""
    import random

    import numpy as np

    path = tmp_path / "random_states_0.pkl"
    saved = {"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
             "torch_manual_seed": torch.get_rng_state()}
    torch.save(saved, path)
    data = run_cli("inspect", path, "--json").json()
    assert not data["default_load"]["ok"]
    [rescue] = data["suggested_commands"]
    assert run_printed(rescue["command"]).exit_code == 0
    loaded = torch.load(rescue["argv"][rescue["argv"].index("-o") + 1], weights_only=True)
    assert torch.equal(loaded["torch_manual_seed"], saved["torch_manual_seed"])
    assert tuple(loaded["random_state"]) == saved["random_state"] and "numpy_random_seed" not in loaded


def test_one_entry_holding_several_refused_objects_is_one_entry(tmp_path):
    """fix's refusal counts entries, not objects: one list holding a NumPy RNG state and a Namespace is '1 entry
    holds … Leave it out', and the --drop it prints runs."""
    import argparse

    import numpy as np

    path = tmp_path / "one_entry.pt"
    torch.save({"model": {"w": torch.ones(2)}, "rng": [np.random.get_state(), argparse.Namespace(a=1)]}, path)
    refused = run_cli("fix", path, "-o", tmp_path / "out.pt", "--select", "")
    assert refused.exit_code == 2 and "Error: 1 entry holds objects" in refused.stderr
    assert "Leave it out with `" in refused.stderr
    leave = refused.stderr.split("Leave it out with `", 1)[1].split("`", 1)[0]
    assert run_cli(*shlex.split(leave)[1:]).exit_code == 0
    assert set(torch.load(tmp_path / "out.pt", weights_only=True)) == {"model"}


def test_plain_data_of_a_shared_or_self_holding_namespace_and_what_it_leaves_as_it_is(tmp_path):
    """A Namespace at two places is converted at both; one that holds itself is converted once (it had been
    unrolled until the key length limit, which made inspect fail), its cycle left for the --drop the rescue prints;
    a Namespace given two BUILDs (pickle updates one __dict__ with both) and a scalar of a dtype state numpy
    refuses are left as they are, never converted to something torch.load of the source would not give."""
    import argparse

    from tests.payloads import global_op, torch_zip

    shared = argparse.Namespace(a=1)
    path = tmp_path / "shared.pt"
    torch.save({"model": {"w": torch.ones(2)}, "x": shared, "y": [shared, shared]}, path)
    assert run_cli("fix", path, "-o", tmp_path / "s.pt", "--plain-data").exit_code == 0
    assert torch.load(tmp_path / "s.pt", weights_only=True)["y"] == [{"a": 1}, {"a": 1}]

    class Again:  # pickles as Namespace() given a state that holds the Namespace itself
        def __reduce__(self):
            return argparse.Namespace, (), {"me": self, "lr": 0.1}

    path = tmp_path / "cycle.pt"
    torch.save({"model": {"w": torch.ones(2)}, "args": Again()}, path)
    inspected = run_cli("inspect", path, "--json")
    assert inspected.exit_code == 0, inspected.stderr
    [rescue] = inspected.json()["suggested_commands"]
    assert "--plain-data" in rescue["argv"] and run_printed(rescue["command"]).exit_code == 0
    out = rescue["argv"][rescue["argv"].index("-o") + 1]
    assert torch.load(out, weights_only=True)["args"] == {"lr": 0.1}

    def text(s: str) -> bytes:
        return b"X" + len(s.encode()).to_bytes(4, "little") + s.encode()

    two_builds = global_op("argparse", "Namespace") + b")R}" + text("a") + b"K\x01sb}" + text("b") + b"K\x02sb"
    dtype = global_op("numpy", "dtype") + b"(" + text("f8") + b"\x89\x88tR(K\x63" + text("<") + b"NNNJ\xff\xff\xff" \
        b"\xffJ\xff\xff\xff\xffK\x00tb"
    scalar = global_op("numpy._core.multiarray", "scalar") + dtype + b"C\x08" + bytes(8) + b"\x86R"
    weight = global_op("torch._utils", "_rebuild_tensor_v2") + b"((" + text("storage") + \
        global_op("torch", "FloatStorage") + text("0") + text("cpu") + b"K\x02tQK\x00K\x02\x85K\x01\x85\x89" + \
        global_op("collections", "OrderedDict") + b")RtR"
    for name, value, what in (("two_builds", two_builds, "v holds an argparse.Namespace"),
                              ("dtype_version_99", scalar, "v (numpy._core.multiarray.scalar")):
        path = tmp_path / f"{name}.pt"
        path.write_bytes(torch_zip(b"\x80\x02}(" + text("w") + weight + text("v") + value + b"u.", {"0": bytes(8)}))
        result = run_cli("fix", path, "-o", tmp_path / f"{name}_out.pt", "--plain-data")
        assert result.exit_code == 2 and what in result.stderr and "converted" not in result.stderr, \
            (name, result.stderr)
    assert run_cli("inspect", path, "--json").json()["metadata"]["v"] == "<numpy._core.multiarray.scalar>"


def test_the_consent_line_of_a_dangerous_file_does_not_repeat_the_user_s_plain_data(tmp_path):
    import argparse

    from tests.payloads import call

    marker = "MARKER_OF_THE_PAYLOAD"
    canary = tmp_path / "canary"
    path = tmp_path / "danger.pt"
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(a=1), "p": marker}, path)
    with zipfile.ZipFile(path) as z:  # the string `marker` made into os.system('touch canary')
        members = {i.filename: z.read(i) for i in z.infolist()}
    name = next(n for n in members if n.endswith("data.pkl"))
    text = b"X" + len(marker).to_bytes(4, "little") + marker.encode()
    members[name] = members[name].replace(text, call("os", "system", f"touch {canary}"))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for member, data in members.items():
            z.writestr(member, data)
    refused = run_cli("fix", path, "-o", tmp_path / "out.pt", "--plain-data")
    assert refused.exit_code == 1, refused.stderr
    [command] = printed(refused.stderr)
    assert command.count("--plain-data") == 1 and "--allow-unsafe" in command, command
    assert run_printed(command).exit_code == 0 and not canary.exists()
    assert torch.load(tmp_path / "out.pt", weights_only=True)["args"] == {"a": 1}


def _training_script_file(path: Path, array: bool) -> dict:
    """`torch.save({"model": …, "args": args, "best_acc": np.float64(…), …})` as training scripts write it; torch's
    defaults refuse the Namespace, the NumPy scalars and the path. What a plain-data copy must give back."""
    import argparse
    import pathlib

    import numpy as np

    args = argparse.Namespace(lr=0.1, arch="resnet", sched=argparse.Namespace(gamma=0.5, steps=[30, 60]),
                              out=pathlib.PurePosixPath("/runs/exp1"), seed=np.int64(7))
    saved = {"model": {"w": torch.randn(3)}, "args": args, "best_acc": np.float64(0.8125),
             "half": np.float16(1.5), "done": np.bool_(True), "epoch": 3}
    if array:
        saved["confusion"] = np.eye(2)
    torch.save(saved, path)
    return {"model": saved["model"], "args": {"lr": 0.1, "arch": "resnet", "sched": {"gamma": 0.5, "steps": [30, 60]},
                                              "out": "/runs/exp1", "seed": 7},
            "best_acc": 0.8125, "half": 1.5, "done": True, "epoch": 3}


@pytest.mark.parametrize("array", [False, True])
def test_plain_data_keeps_a_namespace_and_numpy_scalars_as_their_values(tmp_path, array):
    """The refusal and inspect's rescue offer --plain-data (with a --drop of what is no plain data, a NumPy array),
    and each command runs as printed: the output loads with torch's defaults and holds the values, where --drop
    lost the hyper-parameters whole."""
    path = tmp_path / "train.pt"
    expected = _training_script_file(path, array)
    weights = expected.pop("model")["w"]
    refused = run_cli("fix", path, "-o", tmp_path / "out.pt")
    assert refused.exit_code == 2, refused.stderr
    offers = [c for c in printed(refused.stderr) if "--plain-data" in c]
    assert offers == [f"ckpt-doctor fix {path} -o {tmp_path / 'out.pt'} --plain-data"
                      + (" --drop '^confusion$'" if array else "")], refused.stderr
    inspected = run_cli("inspect", path, "--json").json()
    [rescue] = inspected["suggested_commands"]
    assert "--plain-data" in rescue["argv"]
    shown = inspected["metadata"]  # the values, read as --plain-data reads them (they were `<…scalar>`)
    assert (shown["best_acc"], shown["done"], shown["args.seed"], shown["args.out"]) == (
        "<numpy.float64 0.8125>", "<numpy.bool True>", "<numpy.int64 7>", "<pathlib.PurePosixPath /runs/exp1>")
    for command in (offers[0], rescue["command"]):
        result = run_printed(command)
        assert result.exit_code == 0, (command, result.stderr)
        assert "args (argparse.Namespace → dict)" in result.stderr and "best_acc (numpy.float64 → float)" in \
            result.stderr
        out = shlex.split(command)[shlex.split(command).index("-o") + 1]
        loaded = torch.load(out, weights_only=True)  # torch's defaults
        assert "confusion" not in loaded
        assert torch.equal(loaded.pop("model")["w"], weights)
        assert loaded == expected and type(loaded["best_acc"]) is float and type(loaded["done"]) is bool
    quiet = run_cli("fix", tmp_path / "out.pt", "-o", tmp_path / "again.pt", "--plain-data")
    assert quiet.exit_code == 0 and "--plain-data converted nothing" in quiet.stderr


def _body_and_head(tmp_path) -> str:
    """The SPEC of a model of a body and a head (`classes` outputs, a constructor argument), in tmp_path."""
    (tmp_path / "headnets.py").write_text(textwrap.dedent("""
        import torch.nn as nn
        class Net(nn.Module):
            def __init__(self, classes=2):
                super().__init__()
                self.body = nn.Linear(4, 4)
                self.head = nn.Linear(4, int(classes))
    """))
    return f"{tmp_path / 'headnets.py'}:Net"


def test_a_file_that_only_lacks_the_model_s_head_is_accepted_not_rewritten(tmp_path):
    """A state_dict that lacks only keys the model keeps its own values for (a new head): the fix line wrote the
    file again unchanged; the line is now the check that accepts them, which runs as printed, exits 0 and writes
    nothing. With --allow-missing given, nothing more is suggested."""
    spec = _body_and_head(tmp_path)
    path = tmp_path / "body.pt"
    torch.save({"body.weight": torch.ones(4, 4), "body.bias": torch.zeros(4)}, path)
    table, data = run_cli("inspect", path, "--model", spec), run_cli("inspect", path, "--model", spec, "--json").json()
    assert table.exit_code == data["exit_code"] == 1
    [accept] = data["suggested_commands"]
    assert accept["label"] == "accept" and accept["promise"] == "shows" and accept["argv"][1] == "inspect"
    assert f"`{accept['command']}`" in table.stderr and "head.weight" in accept["why"]
    before = sorted(p.name for p in tmp_path.iterdir())
    accepted = run_cli(*shlex.split(accept["command"])[1:])
    assert accepted.exit_code == 0 and "OK with the allowances given" in accepted.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    assert "`ckpt-doctor" not in accepted.stderr  # accepted: nothing more to run
    # A file that also needs rewriting (a prefix to strip) still gets its fix line
    wrapped = tmp_path / "dp.pt"
    torch.save({"module.body.weight": torch.ones(4, 4), "module.body.bias": torch.zeros(4)}, wrapped)
    [fix] = run_cli("inspect", wrapped, "--model", spec, "--json").json()["suggested_commands"]
    assert fix["label"] == "fix" and "--strip-module" in fix["argv"]


def test_auto_refused_for_a_new_head_prints_the_command_that_accepts_it(tmp_path):
    """--auto never accepts missing keys itself; its refusal listed the closest fix as bare flags. It now prints the
    user's command with the --allow-missing of inspect's line, which runs as printed; a tie --auto infers is listed
    once."""
    spec = _body_and_head(tmp_path)
    path, out = tmp_path / "dp.pt", tmp_path / "out.pt"
    torch.save({"module.body.weight": torch.ones(4, 4), "module.body.bias": torch.zeros(4),
                "module.head.weight": torch.ones(5, 4), "module.head.bias": torch.zeros(5)}, path)
    refused = run_cli("fix", path, "-o", out, "--model", spec, "--auto")
    assert refused.exit_code == 1 and not out.exists()
    [command] = printed(refused.stderr)
    assert command.endswith(r"--auto --allow-missing '^(head\.weight|head\.bias)$'"), command
    done = run_printed(command)
    assert done.exit_code == 0, done.stderr
    assert sorted(torch.load(out, weights_only=True)) == ["body.bias", "body.weight"]


def test_a_tie_auto_infers_is_listed_once(tmp_path):
    (tmp_path / "lm.py").write_text(textwrap.dedent("""
        import torch.nn as nn
        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(10, 4)
                self.lm_head = nn.Linear(4, 10, bias=False)
                self.lm_head.weight = self.embed.weight
    """))
    path = tmp_path / "lm.pt"
    torch.save({"embed.weight": torch.ones(10, 4)}, path)
    data = run_cli("fix", path, "-o", tmp_path / "out.pt", "--model", f"{tmp_path / 'lm.py'}:LM", "--auto",
                   "--json").json()
    assert data["applied"] == ["--auto → --tie lm_head.weight=embed.weight"], data["applied"]


def test_a_tie_over_a_copy_of_the_same_bytes_is_written_and_said(tmp_path):
    """--tie onto a name the output already holds as a copy of the same bytes (an untied export) writes the tie,
    which loses nothing (it was refused with 'drop it first (--drop)'); the summary, the dry run's table and --json
    name it (--json `tied` was empty for torch output)."""
    torch.manual_seed(0)
    embed = torch.randn(10, 4)
    path, out = tmp_path / "untied.pt", tmp_path / "out.pt"
    torch.save({"embed.weight": embed, "lm_head.weight": embed.clone()}, path)
    flags = ("fix", path, "-o", out, "--tie", "lm_head.weight=embed.weight")
    dry = run_cli(*flags, "--dry-run")
    assert "1 tied (lm_head.weight = embed.weight)" in dry.stderr and "the same bytes" in dry.stderr, dry.stderr
    assert re.search(r"lm_head\.weight\s+=\s+lm_head\.weight \(tied: the tensor of embed\.weight\)", dry.stdout), \
        dry.stdout
    done = run_cli(*flags, "--json")
    assert done.exit_code == 0 and done.json()["tied"] == {"lm_head.weight": "embed.weight"}, done.stderr
    assert done.json()["dropped"] == []
    loaded = torch.load(out, weights_only=True)
    assert loaded["lm_head.weight"].data_ptr() == loaded["embed.weight"].data_ptr()
    assert torch.equal(loaded["embed.weight"], embed)


def test_a_tie_over_values_of_its_own_offers_to_keep_either(tmp_path):
    """Where the alias holds other values, a tie keeps one of the two: the refusal prints both commands (each the
    user's, with the --drop of the tensor's path in the file, before --strip-module renames it), and each keeps what
    it says."""
    torch.manual_seed(0)
    embed = torch.randn(10, 4)
    path, out = tmp_path / "dp.pt", tmp_path / "out.pt"
    torch.save({"model": {"module.embed.weight": embed, "module.lm_head.weight": embed + 0.5}, "epoch": 3}, path)
    refused = run_cli("fix", path, "-o", out, "--select", "model", "--strip-module", "--tie",
                      "lm_head.weight=embed.weight")
    assert refused.exit_code == 2 and "values differ" in refused.stderr, refused.stderr
    keep_embed, keep_head = printed(refused.stderr)
    assert keep_embed.endswith("--drop '^model\\.module\\.lm_head\\.weight$'"), keep_embed
    assert "--tie embed.weight=lm_head.weight --drop '^model\\.module\\.embed\\.weight$'" in keep_head, keep_head
    for command, kept in ((keep_embed, embed), (keep_head, embed + 0.5)):
        out.unlink(missing_ok=True)
        assert run_printed(command).exit_code == 0, command
        loaded = torch.load(out, weights_only=True)
        assert loaded["lm_head.weight"].data_ptr() == loaded["embed.weight"].data_ptr()
        assert torch.equal(loaded["lm_head.weight"], kept), command


def test_a_model_with_constructor_arguments_gets_the_accept_line_too(tmp_path):
    """The model's --model-arg is part of naming the model: a file that only lacks its head got the fix line that
    wrote it again unchanged, not the accept line, whenever the model took a constructor argument."""
    spec = _body_and_head(tmp_path)
    path = tmp_path / "body.pt"
    torch.save({"body.weight": torch.ones(4, 4), "body.bias": torch.zeros(4)}, path)
    data = run_cli("inspect", path, "--model", spec, "--model-arg", "classes=5", "--json").json()
    [accept] = data["suggested_commands"]
    assert accept["label"] == "accept" and "--model-arg" in accept["argv"]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert run_cli(*shlex.split(accept["command"])[1:]).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_accept_line_keeps_the_min_loaded_it_was_asked_under(tmp_path):
    """The accept line is the same check with --allow-missing: it dropped the user's --min-loaded, so under
    --min-loaded 0.9 it passed (exit 0) a file that fills 66.7%, which the user's check with --allow-missing
    fails. It now keeps --min-loaded, and is not printed where accepting the head cannot meet it."""
    spec = _body_and_head(tmp_path)
    path = tmp_path / "body.pt"
    torch.save({"body.weight": torch.ones(4, 4), "body.bias": torch.zeros(4)}, path)
    unmet = run_cli("inspect", path, "--model", spec, "--min-loaded", "0.9", "--json").json()
    assert unmet["exit_code"] == 1 and not unmet["suggested_commands"]
    [accept] = run_cli("inspect", path, "--model", spec, "--min-loaded", "0.5", "--json").json()["suggested_commands"]
    assert accept["label"] == "accept" and "--min-loaded" in accept["argv"]
    assert run_cli(*shlex.split(accept["command"])[1:]).exit_code == 0


def test_extra_keys_accepted_by_allow_unexpected_need_no_rewrite(tmp_path):
    """Extra keys the user accepts with --allow-unexpected beside a missing head: load_state_dict(strict=False)
    loads the file as it is, yet the line was a fix that drops them; with --allow-missing too the check said 'OK
    with the allowances given', exited 0, and still printed that fix."""
    spec = _body_and_head(tmp_path)
    path = tmp_path / "extra.pt"
    torch.save({"body.weight": torch.ones(4, 4), "body.bias": torch.zeros(4), "aux.weight": torch.ones(3)}, path)
    both = run_cli("inspect", path, "--model", spec, "--allow-unexpected", "^aux", "--allow-missing", "^head",
                   "--json").json()
    assert both["exit_code"] == 0 and not both["suggested_commands"]
    [accept] = run_cli("inspect", path, "--model", spec, "--allow-unexpected", "^aux",
                       "--json").json()["suggested_commands"]
    assert accept["label"] == "accept" and "--drop" not in accept["argv"]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert run_cli(*shlex.split(accept["command"])[1:]).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # not accepted: the extra key is still dropped by the fix line
    [fix] = run_cli("inspect", path, "--model", spec, "--json").json()["suggested_commands"]
    assert fix["label"] == "fix" and "--drop" in fix["argv"]


def test_a_numpy_scalar_or_path_is_shown_and_converted_only_as_numpy_and_pathlib_would_read_it(tmp_path):
    """inspect shows (and --plain-data writes) a NumPy scalar's value only for numpy's own pickle of it: a dtype
    made with copy=False (numpy then ignores its BUILD: 0.81's big-endian bytes read as -5.97e+213), one with
    flags set, one BUILT after the scalar was made (numpy decodes at the scalar's REDUCE), a scalar made by NEWOBJ
    (numpy refuses it) were shown and written as 0.81. A path the memo repeats into gigabytes is not joined (1 MB
    made inspect take 22 s and 7.8 GB); Python 3.13's pathlib._local paths are read; a float32 shows NumPy's
    digits."""
    import struct

    from tests.payloads import global_op, torch_zip

    def text(s: str) -> bytes:
        return b"X" + len(s.encode()).to_bytes(4, "little") + s.encode()

    def state(order: str = ">", flags: int = 0) -> bytes:
        return b"(K\x03" + text(order) + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK" + bytes([flags]) + b"t"

    def dtype(copy: bytes = b"\x88", build: bytes = b"b") -> bytes:
        return global_op("numpy", "dtype") + b"(" + text("f8") + b"\x89" + copy + b"tR" + (state() + build if build
                                                                                             else b"")
    value = b"C\x08" + struct.pack(">d", 0.81)
    scalar = global_op("numpy._core.multiarray", "scalar")
    weight = global_op("torch._utils", "_rebuild_tensor_v2") + b"((" + text("storage") + \
        global_op("torch", "FloatStorage") + text("0") + text("cpu") + b"K\x02tQK\x00K\x02\x85K\x01\x85\x89" + \
        global_op("collections", "OrderedDict") + b")RtR"
    big = "d" * 100_000
    cases = {
        "numpy's own": (scalar + dtype() + value + b"\x86R", "<numpy.float64 0.81>"),
        "copy False": (scalar + dtype(copy=b"\x89") + value + b"\x86R", None),
        "flags": (scalar + global_op("numpy", "dtype") + b"(" + text("f8") + b"\x89\x88tR" + state(flags=4) + b"b"
                  + value + b"\x86R", None),
        "built after": (scalar + dtype(build=b"") + b"q\x07" + value + b"\x86R" + b"h\x07" + state() + b"b0", None),
        "newobj": (scalar + b"(" + dtype() + value + b"t\x81", None),
        "float32": (scalar + global_op("numpy", "dtype") + b"(" + text("f4") + b"\x89\x88tR" + state() + b"b"
                    + b"C\x04" + struct.pack(">f", 0.81) + b"\x86R", "<numpy.float32 0.81>"),
        "3.13 path": (global_op("pathlib._local", "PosixPath") + b"(" + text("runs") + text("exp1") + b"tR",
                      "<pathlib._local.PosixPath runs/exp1>"),
        "repeated": (global_op("pathlib", "PosixPath") + b"(" + text(big) + b"q\x08" + b"h\x08" * 99 + b"tR", None),
    }
    for name, (value_ops, shown) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.pt"
        path.write_bytes(torch_zip(b"\x80\x02}(" + text("w") + weight + text("v") + value_ops + b"u.",
                                   {"0": bytes(8)}))
        inspected = run_cli("inspect", path, "--json")
        assert inspected.exit_code == 0, (name, inspected.stderr)
        got = inspected.json()["metadata"]["v"]
        assert got == shown if shown else got.startswith("<") and "0.81" not in got and len(got) < 300, (name, got)
        fixed = run_cli("fix", path, "-o", tmp_path / f"{path.stem}_out.pt", "--plain-data")
        assert fixed.exit_code == (0 if shown else 2), (name, fixed.stderr)
    assert torch.load(tmp_path / "numpy's_own_out.pt", weights_only=True)["v"] == 0.81
    assert torch.load(tmp_path / "float32_out.pt", weights_only=True)["v"] == struct.unpack(">f", struct.pack(">f", 0.81))[0]


def test_the_tie_refusals_commands_name_the_files_own_paths_and_keep_the_users_argument_order(tmp_path):
    """The --drop a tie refusal prints names the tensor's path in the file (a relative name also dropped a top-level
    entry of that name: `lm_head.weight: 5` beside `model`); flags go before the user's `--` (after it they were
    arguments, and the command failed); the reversed tie is offered only where no other --tie names either tensor
    (it broke `--tie c=a` beside `--tie b=a`); a key the file lists first stays the tie's KEY in --json."""
    torch.manual_seed(0)
    embed, head = torch.randn(4, 3), torch.randn(4, 3)
    nested, out = tmp_path / "nested.pt", tmp_path / "out.pt"
    torch.save({"model": {"embed.weight": embed, "lm_head.weight": head}, "lm_head.weight": 5}, nested)
    refused = run_cli("fix", "-o", out, "--tie", "lm_head.weight=embed.weight", "--", nested)
    keep_embed, keep_head = printed(refused.stderr)
    assert keep_embed.endswith(f"--drop '^model\\.lm_head\\.weight$' -- {nested}"), keep_embed
    for command, kept in ((keep_embed, embed), (keep_head, head)):
        out.unlink(missing_ok=True)
        assert run_printed(command).exit_code == 0, command
        loaded = torch.load(out, weights_only=True)
        assert loaded["lm_head.weight"] == 5 and torch.equal(loaded["model"]["embed.weight"], kept)
        assert loaded["model"]["lm_head.weight"].data_ptr() == loaded["model"]["embed.weight"].data_ptr()
    several = tmp_path / "several.pt"
    torch.save({"a": embed, "b": head, "c": torch.zeros(1)}, several)
    [only] = printed(run_cli("fix", several, "-o", out, "--tie", "b=a", "--tie", "d=a").stderr)
    assert only.endswith("--drop '^b$'")
    first = tmp_path / "first.pt"
    torch.save({"lm_head.weight": embed, "embed.weight": embed.clone()}, first)
    data = run_cli("fix", first, "-o", tmp_path / "first_out.pt", "--tie", "lm_head.weight=embed.weight", "--json")
    assert data.json()["tied"] == {"lm_head.weight": "embed.weight"}, data.stderr


def test_a_printed_drop_holds_no_character_a_shell_cannot_carry():
    """An exact-key regex writes what is not printable as its escape: a NUL, which no argument can hold, cut the
    printed --drop at `^lm` (and dropped every key starting so); a newline or a right-to-left override hid."""
    import re

    from ckpt_doctor.transforms import exact_keys_regex

    keys = ["lm\x00head", "a\nb", "x\u202ey", "fc.weight"]
    pattern = exact_keys_regex(keys)
    assert pattern.isprintable() and "\\x00" in pattern
    assert all(re.search(pattern, k) for k in keys) and not re.search(pattern, "lm")
    assert exact_keys_regex(["fc.weight"]) == "^fc\\.weight$"
