"""DeepSpeed ZeRO checkpoints written by DeepSpeed itself (DS_ACCELERATOR=cpu, two gloo ranks): ZeRO-1, -2 and -3,
fp32 and bf16, with a tied weight, a frozen layer, two param groups and sizes that do not divide by the world size."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too
from tests.helpers import spawn_two  # noqa: E402

# (name, stage, bf16)
VARIANTS = (("z1", 1, False), ("z2", 2, False), ("z2_bf16", 2, True), ("z3", 3, False), ("z3_bf16", 3, True))


class TiedNet(torch.nn.Module):
    """An embedding tied to the output layer, a frozen projection, a LayerNorm, a floating buffer and an integer
    one; odd sizes everywhere."""

    def __init__(self, vocab: int = 11, width: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.frozen = torch.nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.norm = torch.nn.LayerNorm(width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        self.register_buffer("steps", torch.tensor(5))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = self.frozen(x.to(self.frozen.weight.dtype))
        x = self.norm(x.to(self.norm.weight.dtype)) * self.scale.to(x.dtype)
        return self.head(x.to(self.head.weight.dtype))


def _rank(rank: int, out: str, port: int, variants: tuple = VARIANTS, size: tuple[int, int] = (11, 6)) -> None:
    import deepspeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    deepspeed.init_distributed(dist_backend="gloo")
    for name, stage, bf16 in variants:
        torch.manual_seed(0)
        model = TiedNet(*size)
        decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
        config = {"train_batch_size": 4, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
                  "bf16": {"enabled": bf16}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        tokens = torch.randint(0, size[0], (2, 3))
        loss = engine(tokens.view(-1)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(str(Path(out) / name), tag="global_step1", client_state={"epoch": 3})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # DeepSpeed's CPU communication op leaves a C++ thread running: at interpreter exit its destructor can abort
    # the process ("terminate called without an active exception", seen once in CI). Every file is written and
    # closed by now: leave without running the C++ static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_samples(out: Path) -> Path:
    spawn_two(_rank, str(out))
    return out


# What the remote tests serve: ZeRO-2 in fp32, ZeRO-3 in bf16 (its `bf16_` optimizer files, a model-states file per
# rank), of a TiedNet of 1 M parameters, so that the rank files (about 18 MB per folder) are much bigger than the
# pickles and headers read to list them.
REMOTE_VARIANTS = (("z2", 2, False), ("z3_bf16", 3, True))


def _remote_rank(rank: int, out: str, port: int) -> None:
    _rank(rank, out, port, REMOTE_VARIANTS, (4096, 256))


def write_remote_sample(out: Path) -> Path:
    """`out`/z2 and `out`/z3_bf16: DeepSpeed save folders (`latest`, `global_step1/`) of TiedNet(4096, 256)."""
    spawn_two(_remote_rank, str(out))
    return out


if __name__ == "__main__":
    write_samples(Path(sys.argv[1]))
