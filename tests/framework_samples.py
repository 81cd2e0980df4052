"""Checkpoints written by Lightning (Fabric's ModelParallelStrategy: FSDP2 on 2 CPU processes, a DCP folder plus
meta.pt) and accelerate (save_state on the CPU), each with the full state beside it for comparison.

Run as a script (`python tests/framework_samples.py lightning|accelerate OUT`): Fabric relaunches this file once
per process, and accelerate keeps process-wide state, so neither runs inside the test process."""

from __future__ import annotations

import sys
from pathlib import Path

import torch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(10, 7)
        self.l2 = torch.nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def lightning(out: Path) -> None:
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    def parallelize(model, device_mesh):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=device_mesh["data_parallel"])
        return model

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(Net())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
    fabric.backward(model(torch.randn(4, 10)).sum())
    optimizer.step()
    fabric.save(out, {"model": model, "optimizer": optimizer, "step": 5})
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if fabric.global_rank == 0:
        torch.save(full, out.with_suffix(".full.pt"))


def accelerate(out: Path) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    model(torch.randn(4, 10)).sum().backward()
    optimizer.step()
    acc.save_state(str(out))
    torch.save(model.state_dict(), out.with_suffix(".full.pt"))


if __name__ == "__main__":
    {"lightning": lightning, "accelerate": accelerate}[sys.argv[1]](Path(sys.argv[2]))
