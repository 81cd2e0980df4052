"""The CUDA paths, on real devices: files saved from GPU tensors, devices a file names that this machine lacks,
`verify` with DataParallel and nccl DDP, and `--gpus` beyond what the machine has. Skipped without CUDA (CI has
none); on a GPU machine: `python -m pytest tests/test_gpu.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures.make_fixtures import saved_on
from fixtures.models import make_cnn
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CNN = "fixtures.models:SmallCNN"
IMG = ("--input-shape", "8,3,8,8")


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


def runs(result) -> dict[str, dict]:
    return {r["mode"]: r for r in result.json()["runs"]}


def torch_loads_by_default(path: Path) -> bool:
    """torch.load(path, weights_only=True) in a fresh process: the authority on what this machine can load."""
    code = f"import torch; torch.load({str(path)!r}, weights_only=True)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.fixture
def on_gpu(tmp_path):
    """A state_dict saved from real cuda:0 tensors (torch tags each storage `cuda:0` itself), beside its CPU copy."""
    torch.manual_seed(0)
    sd = make_cnn().state_dict()
    path = tmp_path / "on_gpu.pt"
    torch.save({k: v.to("cuda:0") for k, v in sd.items()}, path)
    return path, sd


def test_a_file_saved_from_the_gpu_is_read_mapped_and_moved_bit_for_bit(on_gpu, cli, tmp_path):
    path, sd = on_gpu
    data = cli("inspect", path, "--json")
    assert data.exit_code == 0, data.stderr
    assert data.json()["devices"] == ["cuda:0"]
    assert data.json()["default_load"]["missing_devices"] == [] and data.json()["default_load"]["ok"] is True
    assert torch_loads_by_default(path)

    out = tmp_path / "cpu.pt"
    assert cli("fix", path, "-o", out, "--map-location", "cpu").exit_code == 0
    moved = torch.load(out, weights_only=True)
    assert {str(v.device) for v in moved.values()} == {"cpu"}
    assert moved.keys() == sd.keys() and all(torch.equal(moved[k], sd[k]) for k in sd)

    back = tmp_path / "back.pt"
    assert cli("fix", out, "-o", back, "--map-location", "cpu=cuda:0").exit_code == 0
    again = torch.load(back, weights_only=True)  # restored onto this machine's GPU by torch's defaults
    assert {str(v.device) for v in again.values()} == {"cuda:0"}
    assert all(torch.equal(again[k].cpu(), sd[k]) for k in sd)


def test_a_device_this_machine_lacks_is_named_and_its_printed_rescue_loads(cli, tmp_path):
    have = torch.cuda.device_count()
    absent = f"cuda:{have}"
    sd = make_cnn().state_dict()
    path = tmp_path / "elsewhere.pt"
    with saved_on(absent):
        torch.save(sd, path)
    assert not torch_loads_by_default(path)  # torch itself refuses it here: the claim below is torch's

    data = cli("inspect", path, "--json")
    assert data.exit_code == 0, data.stderr
    assert data.json()["default_load"]["missing_devices"] == [absent]
    (rescue,) = data.json()["suggested_commands"]
    argv = rescue["argv"]
    out = Path(argv[argv.index("-o") + 1])
    if not out.is_absolute():
        out = ROOT / out
    try:
        assert cli(*argv[1:]).exit_code == 0
        assert torch_loads_by_default(out)
        fixed = torch.load(out, weights_only=True)
        assert all(torch.equal(fixed[k].cpu(), sd[k]) for k in sd)
    finally:
        out.unlink(missing_ok=True)

    import ckpt_doctor

    loaded = ckpt_doctor.load(path)  # the library maps what is missing to a device that exists
    assert loaded.device_map == {absent: "cuda:0"}
    assert {str(v.device) for v in loaded.values()} == {"cuda:0"}

    result = cli("verify", path, "--model", CNN, *IMG, "--gpus", "1", "--json")
    assert result.exit_code == 0, result.stderr
    assert runs(result)["single"]["devices"] == ["cuda:0"]


def test_verify_runs_dataparallel_and_nccl_ddp_on_the_gpus_here(on_gpu, cli):
    path, _ = on_gpu
    have = torch.cuda.device_count()
    result = cli("verify", path, "--model", CNN, *IMG, "--gpus", str(have), "--json")
    assert result.exit_code == 0, result.stderr
    by_mode = runs(result)
    gpus = [f"cuda:{i}" for i in range(have)]
    assert by_mode["single"]["devices"] == ["cuda:0"] and by_mode["single"]["status"] == "pass"
    assert by_mode["dp"]["devices"] == gpus and by_mode["dp"]["status"] == "pass"
    ddp = by_mode["ddp"]
    assert (ddp["backend"], ddp["world_size"], ddp["devices"], ddp["status"]) == ("nccl", have, gpus, "pass")
    assert f"nccl on {have} GPU" in ddp["detail"]  # "1 GPU", "2 GPUs"
    assert set(ddp["peak_memory"]) == set(gpus) and all(v > 0 for v in ddp["peak_memory"].values())
    assert result.json()["ok"] is True


def test_more_gpus_than_the_machine_has_is_said_and_not_a_pass(on_gpu, cli):
    path, _ = on_gpu
    have = torch.cuda.device_count()
    want = have + 1
    result = cli("verify", path, "--model", CNN, *IMG, "--gpus", str(want), "--json")
    assert result.exit_code == 1, result.stderr  # a mode run on fewer devices than asked never passes silently
    by_mode = runs(result)
    dp = by_mode["dp"]
    assert dp["status"] == "skipped" and dp["devices"] == [f"cuda:{i}" for i in range(have)]
    assert f"needs {want} CUDA devices, found {have}" in dp["detail"]
    ddp = by_mode["ddp"]  # the world size asked for, on the CPU with gloo, and the report says why
    assert (ddp["backend"], ddp["world_size"], ddp["status"]) == ("gloo", want, "pass")
    assert f"{want} needed for nccl" in ddp["detail"]
    accepted = cli("verify", path, "--model", CNN, *IMG, "--gpus", str(want), "--allow-skip")
    assert accepted.exit_code == 0, accepted.stderr
    assert "skipped for lack of hardware, accepted by --allow-skip: dp" in accepted.stderr


def test_the_installed_command_verifies_on_the_gpu(on_gpu):
    """The same run through a fresh process, as CI on a GPU runner would call it."""
    path, _ = on_gpu
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "ckpt_doctor", "verify", str(path), "--model", CNN, *IMG,
                           "--gpus", "1", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert [(r["mode"], r["status"]) for r in data["runs"]] == [("single", "pass"), ("dp", "pass"), ("ddp", "pass")]


def test_a_torchrun_group_uses_nccl_when_each_rank_has_a_gpu(on_gpu):
    """Under torchrun, as many ranks as GPUs: the group forms on nccl, each rank on its own device."""
    import shutil

    path, _ = on_gpu
    have = torch.cuda.device_count()
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", f"--nproc_per_node={have}", "-m", "ckpt_doctor", "verify",
                           str(path), "--model", CNN, *IMG, "--json"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    ddp = {r["mode"]: r for r in json.loads(proc.stdout)["runs"]}["ddp"]
    assert (ddp["backend"], ddp["world_size"], ddp["status"]) == ("nccl", have, "pass")
    assert ddp["devices"] == [f"cuda:{i}" for i in range(have)]
