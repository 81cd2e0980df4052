"""inspect --stats: per-tensor statistics and BatchNorm layers that were never trained."""

from __future__ import annotations

import math

import torch
from torch import nn

from fixtures.models import SmallCNN


def test_stats_match_torch(fixtures, cli):
    path = fixtures["plain"]["path"]
    data = cli("inspect", path, "--json", "--stats").json()
    sd = torch.load(path, weights_only=True)
    for t in data["tensors"]:
        ref = sd[t["key"]].double()
        s = t["stats"]
        assert math.isclose(s["min"], ref.min().item(), rel_tol=1e-6, abs_tol=1e-9)
        assert math.isclose(s["max"], ref.max().item(), rel_tol=1e-6, abs_tol=1e-9)
        assert math.isclose(s["mean"], ref.mean().item(), rel_tol=1e-5, abs_tol=1e-7)
        if ref.numel() > 1:
            assert math.isclose(s["std"], ref.std().item(), rel_tol=1e-5, abs_tol=1e-7)
    assert data["batchnorm_at_init"] == []


def test_untrained_batchnorm_and_nan_are_flagged(tmp_path, cli):
    sd = SmallCNN().state_dict()  # never run in train mode
    sd["classifier.weight"][0, 0] = float("nan")
    sd["classifier.bias"][1] = float("inf")
    torch.save(sd, tmp_path / "fresh.pt")
    result = cli("inspect", tmp_path / "fresh.pt", "--json", "--stats")
    assert result.exit_code == 1
    data = result.json()
    assert data["batchnorm_at_init"] == ["features.1", "features.4"]
    stats = {t["key"]: t["stats"] for t in data["tensors"]}
    assert stats["classifier.weight"]["nan"] == 1 and stats["classifier.bias"]["inf"] == 1
    human = cli("inspect", tmp_path / "fresh.pt", "--stats")
    assert "features.1: running stats at their initial values" in human.stderr


def test_stats_of_views_and_odd_dtypes(fixtures, cli):
    data = cli("inspect", fixtures["dtypes"]["path"], "--json", "--stats").json()
    stats = {t["key"]: t["stats"] for t in data["tensors"]}
    view = torch.arange(20.0).reshape(4, 5)[1:, 2:]
    assert stats["view"]["min"] == view.min().item() and stats["view"]["max"] == view.max().item()
    assert stats["b"] is None and stats["c64"] is None
    assert stats["empty"]["min"] is None
    assert stats["scalar"]["mean"] == 3.0


def test_stats_ignore_untouched_layers_without_batchnorm(tmp_path, cli):
    torch.save(nn.Linear(3, 2).state_dict(), tmp_path / "lin.pt")
    result = cli("inspect", tmp_path / "lin.pt", "--stats", "--json")
    assert result.exit_code == 0 and result.json()["batchnorm_at_init"] == []
