"""DeepSpeed ZeRO folders written by DeepSpeed on the CPU (two gloo ranks): consolidated bit for bit as DeepSpeed's own
zero_to_fp32 does it, in the same key order, without importing deepspeed; incomplete folders and lone rank files
refused with the file to use named."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli

pytest.importorskip("deepspeed", reason="DeepSpeed writes the samples (it is in the test extra)")

from tests.deepspeed_samples import VARIANTS, TiedNet, write_samples  # noqa: E402
from tests.test_journeys import COMMAND  # noqa: E402

NET = "tests/deepspeed_samples.py:TiedNet"
NAMES = [name for name, _, _ in VARIANTS]


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    return write_samples(tmp_path_factory.mktemp("deepspeed"))


def official(folder: Path) -> dict:
    """What DeepSpeed's zero_to_fp32 rebuilds (it unpickles with weights_only=False: files this test wrote)."""
    import tqdm
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tqdm.tqdm.monitor_interval = 0  # its progress bars start no monitor thread, which would outlive the test and
    # keep ckpt-doctor from forking in the tests after it (pool.can_fork: no other thread)
    return get_fp32_state_dict_from_zero_checkpoint(str(folder))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                                                    b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("name", NAMES)
def test_fix_is_bitwise_zero_to_fp32(samples, tmp_path, name):
    out = tmp_path / "fp32.pt"
    result = run_cli("fix", samples / name, "-o", out)
    assert result.exit_code == 0, result.stderr
    mine, theirs = torch.load(out, weights_only=True), official(samples / name)
    extra = [k for k in mine if k not in theirs]
    assert [k for k in mine if k in theirs] == list(theirs)
    for key, value in theirs.items():
        assert same_bits(mine[key], value), key
    if name == "z1":  # ZeRO-1 saves no frozen_param_shapes: zero_to_fp32 drops the frozen layer, ckpt-doctor does not
        assert extra == ["frozen.weight", "frozen.bias"] and "taken from module" in result.stderr
        module = torch.load(samples / name / "global_step1" / "mp_rank_00_model_states.pt", weights_only=False)
        assert all(same_bits(mine[k], module["module"][k]) for k in extra)
    else:
        assert extra == []
    assert mine["head.weight"].data_ptr() == mine["embed.weight"].data_ptr()  # shared_params stay one tensor
    TiedNet().load_state_dict({k: v.float() for k, v in mine.items()}, strict=True)


@pytest.mark.parametrize("name", ["z2_bf16", "z3"])
def test_safetensors_output_holds_the_same_weights(samples, tmp_path, name):
    from safetensors.torch import load_file

    out = tmp_path / "fp32.safetensors"
    assert run_cli("fix", samples / name, "-o", out).exit_code == 0
    mine, theirs = load_file(out), official(samples / name)
    assert set(mine) == set(theirs) - {"head.weight"}  # safetensors cannot share: the tie is noted in its metadata
    for key, value in mine.items():
        assert same_bits(value, theirs[key]), key


@pytest.mark.parametrize("name", NAMES)
def test_inspect_lists_whole_weights_and_their_partitions(samples, name):
    result = run_cli("inspect", samples / name, "--json")
    assert result.exit_code == 0, result.stderr
    data = result.json()
    stage = int(name[1])
    assert data["format"] == "deepspeed-zero" and data["state_dict_root"] == "fp32_weights"
    assert data["distributed"]["zero_stage"] == stage and data["distributed"]["ranks"] == 2
    shapes = {t["key"].removeprefix("fp32_weights."): t["shape"] for t in data["tensors"]
              if t["key"].startswith("fp32_weights.")}
    want = {k: list(v.shape) for k, v in official(samples / name).items()}
    if name == "z1":
        want.update({"frozen.weight": [6, 6], "frozen.bias": [6]})
    assert shapes == want
    layouts = {t["key"]: t.get("layout", "") for t in data["tensors"]}
    assert layouts["fp32_weights.norm.bias"].startswith(f"ZeRO-{stage}")
    if stage == 3:
        assert layouts["fp32_weights.norm.bias"].endswith("2 ranks × 3")
        assert "module" not in data["distributed"]["offered"]
    else:
        assert "module" in data["distributed"]["offered"]
        module = run_cli("fix", samples / name, "-o", samples / f"{name}_module.pt", "--select", "module")
        assert module.exit_code == 0, module.stderr
        want = "bfloat16" if name.endswith("bf16") else "float32"
        assert str(torch.load(samples / f"{name}_module.pt")["embed.weight"].dtype) == f"torch.{want}"


def test_inspect_model_and_verify(samples):
    result = run_cli("inspect", samples / "z3_bf16", "--model", NET, "--json")
    assert result.exit_code == 0, result.stderr
    comparison = result.json()["comparison"]
    assert comparison["strict_load_ok"] is True and comparison["loaded_fraction"] == 1.0
    ran = run_cli("verify", samples / "z2", "--model", NET, "--input-shape", "4", "--input-dtype", "int64",
                  "--input-range", "0,11", "--mode", "single")
    assert ran.exit_code == 0, ran.stderr


def test_incomplete_folders_name_what_is_missing(samples, tmp_path):
    folder = tmp_path / "z2"
    shutil.copytree(samples / "z2", folder)
    out = tmp_path / "out.pt"
    (folder / "global_step1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    result = run_cli("fix", folder, "-o", out)
    assert result.exit_code == 2 and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in result.stderr, result.stderr
    assert not out.exists() and "Traceback" not in result.stderr
    (folder / "latest").write_text("global_step9")
    result = run_cli("inspect", folder)
    assert result.exit_code == 2 and "global_step9" in result.stderr, result.stderr


def test_a_lone_rank_file_is_refused_with_the_folder_named(samples, tmp_path):
    rank = samples / "z3" / "global_step1" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    result = run_cli("inspect", rank)
    assert result.exit_code == 0 and f"one rank's part of the DeepSpeed checkpoint in {samples / 'z3'}" in result.stderr
    out = tmp_path / "rank0.pt"
    refused = run_cli("fix", rank, "-o", out)
    assert refused.exit_code == 2 and f"ckpt-doctor fix {samples / 'z3'}" in refused.stderr and not out.exists()
    scan = run_cli("scan", samples / "z3")
    assert scan.exit_code == 0, scan.stdout + scan.stderr


def test_a_rank_file_s_commands_are_listed_in_the_json_and_run_as_printed(samples, tmp_path):
    """The commands a rank file's note prints are in `suggested_commands` (the JSON lists what the summary prints,
    for inspect and for scan) and keep their promise run as printed: ZeRO-3's rank file consolidates the folder as
    zero_to_fp32 does, ZeRO-2's model states list the folder."""
    from safetensors.torch import load_file

    for name, rank, promise in (("z3", "zero_pp_rank_1_mp_rank_00_model_states.pt", "writes"),
                                ("z2", "mp_rank_00_model_states.pt", "shows")):
        folder = tmp_path / f"run {name}"
        shutil.copytree(samples / name, folder)
        for verb in ("inspect", "scan"):
            printed = COMMAND.findall(run_cli(verb, folder / "global_step1" / rank).stderr)
            data = run_cli(verb, folder / "global_step1" / rank, "--json").json()
            listed = data["suggested_commands"] if verb == "inspect" else data["files"][0]["suggested_commands"]
            assert [s["command"] for s in listed] == printed and len(printed) == 1, (verb, printed, listed)
            assert listed[0]["promise"] == promise
        argv = shlex.split(printed[0])
        result = run_cli(*argv[1:])
        assert result.exit_code == 0, result.stderr
        if promise == "shows":
            assert "fp32_weights.embed.weight" in result.stdout
        else:
            mine, theirs = load_file(argv[argv.index("-o") + 1]), official(folder)
            assert set(mine) == set(theirs) - {"head.weight"}  # safetensors cannot share: the tie is in its metadata
            assert all(same_bits(value, theirs[key]) for key, value in mine.items())


def _retouch(path: Path, change) -> None:
    """Rewrite a rank file this test run wrote (torch.load of its own file; the test trusts it)."""
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)


def test_tampered_folders_are_refused_not_misread(samples, tmp_path):
    """Partitions of two dtypes (read at one element size they would give wrong bytes), paddings that do not list
    one size per parameter, a pipe for a rank file, a `latest` of a megabyte: each exits 2, nothing written."""
    import os

    cases = {
        "dtype": lambda step: _retouch(step / "zero_pp_rank_1_mp_rank_00_optim_states.pt", lambda s: s[
            "optimizer_state_dict"]["single_partition_of_fp32_groups"].__setitem__(0, s["optimizer_state_dict"][
                "single_partition_of_fp32_groups"][0].to(torch.bfloat16))),
        "paddings": lambda step: _retouch(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda s: s[
            "optimizer_state_dict"].__setitem__("param_alignment_paddings", [[0, 0, 0, 0], [0]])),
        "fifo": lambda step: ((step / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(),
                              os.mkfifo(step / "zero_pp_rank_1_mp_rank_00_optim_states.pt")),
        "latest": lambda step: (step.parent / "latest").write_bytes(b"\0" * (1 << 20)),
    }
    expected = {"dtype": "share one dtype", "paddings": "param_alignment_paddings", "fifo": "not a regular file",
                "latest": "not a tag folder"}
    for name, spoil in cases.items():
        folder = tmp_path / name
        shutil.copytree(samples / "z2", folder)
        spoil(folder / "global_step1")
        out = tmp_path / f"{name}.safetensors"
        result = run_cli("fix", folder, "-o", out)
        assert result.exit_code == 2 and expected[name] in result.stderr and not out.exists(), (name, result.stderr)



def _osd(state: dict) -> dict:
    return state["optimizer_state_dict"]


def _first_shape(shapes: dict, value) -> None:
    shapes[next(iter(shapes))] = value


_OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
_Z3_MODEL = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
# (sample, files to retouch, change, what the one error line says; None: the folder reads, the odd entry ignored)
_HOSTILE = {
    "partition count of 10**12": ("z2", [_OPTIM.format(r) for r in (0, 1)],
                                  lambda s: _osd(s).__setitem__("partition_count", [10**12]),
                                  "the optimizer states of 1000000000000 ranks are needed"),
    "partition count of a string": ("z2", [_OPTIM.format(0)], lambda s: _osd(s).__setitem__(
        "partition_count", [2, "x"]), "partition_count is [2, 'x'], not a number of ranks"),
    "param_shapes of lists": ("z2", ["mp_rank_00_model_states.pt"], lambda s: s.__setitem__(
        "param_shapes", [list(g.items()) for g in s["param_shapes"]]), "param_shapes is not a list of {name: shape}"),
    "a shape of 10**320 elements": ("z3", [_Z3_MODEL.format(r) for r in (0, 1)], lambda s: _first_shape(
        s["param_shapes"][0], [10**160, 10**160]), "the checkpoint does not match its param_shapes"),
    "a list for a shared parameter": ("z2", ["mp_rank_00_model_states.pt"], lambda s: s.__setitem__(
        "shared_params", {"alias": ["x"]}), None),
    "a list for a buffer name": ("z2", ["mp_rank_00_model_states.pt"], lambda s: s.__setitem__(
        "buffer_names", [["scale"]]), None),
    "frozen fragments in a list": ("z2", ["mp_rank_00_model_states.pt"], lambda s: s.__setitem__(
        "frozen_param_fragments", [s["frozen_param_fragments"]]), "no frozen fragment frozen.weight"),
    "rank 1's optimizer_state_dict in a list": ("z2", [_OPTIM.format(1)], lambda s: s.__setitem__(
        "optimizer_state_dict", [_osd(s)]), "no single_partition_of_fp32_groups"),
    "fp32_flat_groups of an int": ("z3", [_OPTIM.format(1)], lambda s: _osd(s).__setitem__("fp32_flat_groups", 5),
                                   "fp32_flat_groups is not a list of flat partitions"),
    "an optimizer state of a list": ("z3", [_OPTIM.format(0)], lambda s: _osd(s)["optimizer_state_dict"][
        "state"].__setitem__(0, [1]), "the optimizer's state[0] is not a dict of its states"),
}


@pytest.mark.parametrize("case", list(_HOSTILE))
def test_hostile_rank_files_are_one_line_not_an_internal_error(samples, tmp_path, case):
    """Well-formed rank files whose structures are off (a key of the wrong type, a list where a dict is, counts and
    shapes no machine has): one error line naming what is off, or a reading that leaves the odd entry out; never an
    internal error (each was one: unhashable lists, a str index into a list, a float quotient past 1e308) nor a hang
    (a partition count of 10**12 listed every missing rank)."""
    sample, files, change, said = _HOSTILE[case]
    folder = tmp_path / "ckpt"
    shutil.copytree(samples / sample, folder)
    for name in files:
        _retouch(folder / "global_step1" / name, change)
    out = tmp_path / "out.safetensors"
    for args in (("inspect", folder), ("fix", folder, "-o", out), ("diff", folder, folder)):
        result = run_cli(*args)
        assert "internal error" not in result.stderr, (args, result.stderr)
        if said is None:
            assert result.exit_code == 0, (args, result.stderr)
        else:
            assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
            assert said in result.stderr, (args, result.stderr)
    assert out.exists() == (said is None)

@pytest.mark.parametrize("name", ["z2", "z3"])
def test_optimizer_state_per_parameter_is_adams_own_step(samples, tmp_path, name):
    """The per-parameter Adam state (cut from the partitions like the weights) must be what moved each weight: the
    step from the initial weights, by torch's AdamW formula, gives the fp32 weights zero_to_fp32 agrees with."""
    out = tmp_path / "all.pt"
    result = run_cli("fix", samples / name, "-o", out, "--select", "")
    assert result.exit_code == 0, result.stderr
    tree = torch.load(out, weights_only=True)
    optimizer, weights = tree["optimizer"], tree["fp32_weights"]
    torch.manual_seed(0)
    initial = TiedNet().state_dict()
    checked = 0
    for group in optimizer["param_groups"]:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for param in group["params"]:
            state = optimizer["state"][param]
            step = float(state["step"])
            m_hat = state["exp_avg"] / (1 - beta1 ** step)
            v_hat = state["exp_avg_sq"] / (1 - beta2 ** step)
            expected = initial[param] * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)
            torch.testing.assert_close(weights[param], expected)
            checked += 1
    assert checked == 3  # embed.weight (head.weight is tied to it), norm.weight, norm.bias; frozen has no state


def test_zero3_steps_come_from_each_parameters_own_group(samples, tmp_path):
    folder = tmp_path / "z3"
    shutil.copytree(samples / "z3", folder)
    for rank in (0, 1):
        _retouch(folder / "global_step1" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                 lambda s: s["optimizer_state_dict"]["optimizer_state_dict"]["state"][1].__setitem__(
                     "step", torch.tensor(7.0)))
    out = tmp_path / "all.pt"
    assert run_cli("fix", folder, "-o", out, "--select", "").exit_code == 0
    state = torch.load(out, weights_only=True)["optimizer"]["state"]
    assert float(state["norm.bias"]["step"]) == 7.0 and float(state["embed.weight"]["step"]) == 1.0


class Evil:
    """An object of a class no allow-list names: a checkpoint holding one would make torch.load import this module."""


def _zero3_without_frozen(samples: Path, tmp_path: Path) -> Path:
    """The ZeRO-3 sample with no frozen parameters saved (as a model that freezes none saves it): only rank 0's model
    states are then needed, and every rank's lists every parameter."""
    folder = tmp_path / "z3"
    shutil.copytree(samples / "z3", folder)
    for path in (folder / "global_step1").glob("*_model_states.pt"):
        _retouch(path, lambda s: (s["frozen_param_shapes"].clear(), s["frozen_param_fragments"].clear()))
    return folder


def test_zero3_rank_model_states_are_checked_though_only_rank_0s_are_needed(samples, tmp_path):
    folder = _zero3_without_frozen(samples, tmp_path)
    out = tmp_path / "fp32.pt"
    assert run_cli("fix", folder, "-o", out).exit_code == 0
    mine, theirs = torch.load(out, weights_only=True), official(folder)
    assert list(mine) == list(theirs) and "frozen.weight" not in mine
    assert all(same_bits(mine[key], value) for key, value in theirs.items())
    rank1 = folder / "global_step1" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    clean = rank1.read_bytes()
    _retouch(rank1, lambda s: s.__setitem__("extra", Evil()))
    result = run_cli("inspect", folder, "--json")
    assert result.exit_code == 1 and f"{Evil.__module__}.Evil" in result.json()["unsafe_globals"], result.stderr
    rank1.write_bytes(clean[:-200])  # its zip directory cut off
    result = run_cli("fix", folder, "-o", tmp_path / "cut.pt")
    assert result.exit_code == 2 and rank1.name in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "cut.pt").exists()
