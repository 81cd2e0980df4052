"""Folders the training frameworks write, through the installed command: Lightning's ModelParallelStrategy (a DCP
folder plus meta.pt) and accelerate's save_state. Written by the real libraries in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, run_cli

SCRIPT = Path(__file__).with_name("framework_samples.py")


def _write(kind: str, out: Path) -> Path:
    pytest.importorskip(kind, reason=f"{kind} writes the sample (it is in the test extra)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(SCRIPT), kind, str(out)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_lightning_model_parallel_folder(tmp_path):
    folder = _write("lightning", tmp_path / "lightning_ckpt")
    data = run_cli("inspect", folder, "--json").json()
    assert data["format"] == "torch-dcp" and data["state_dict_root"] == "model"
    assert data["metadata"]["step"] == 5 and "Lightning" in " ".join(data["distributed"]["variant"])
    out = tmp_path / "model.safetensors"
    assert run_cli("fix", folder, "-o", out).exit_code == 0
    from safetensors.torch import load_file

    mine, full = load_file(out), torch.load(tmp_path / "lightning_ckpt.full.pt", weights_only=True)
    assert set(mine) == set(full) and all(torch.equal(mine[k], full[k]) for k in full)


def test_accelerate_save_state_folder(tmp_path):
    folder = _write("accelerate", tmp_path / "acc_state")
    result = run_cli("inspect", folder, "--json")
    assert result.exit_code == 0, result.stderr
    data = result.json()
    assert data["path"].endswith("model.safetensors") and any("accelerate save_state" in n for n in data["notes"])
    (note,) = [n for n in data["notes"] if "accelerate save_state" in n]  # what is beside the model, by name
    assert "optimizer.bin" in note and "random_states_0.pkl" in note and "scheduler" not in note, note
    assert all((folder / name).exists() for name in ("optimizer.bin", "random_states_0.pkl"))
    full = torch.load(tmp_path / "acc_state.full.pt", weights_only=True)
    assert {t["key"]: t["shape"] for t in data["tensors"]} == {k: list(v.shape) for k, v in full.items()}
    optimizer = run_cli("inspect", folder / "optimizer.bin")
    assert optimizer.exit_code == 0 and "optimizer state, not model weights" in optimizer.stderr
