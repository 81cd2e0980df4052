"""Writes DeepSpeed ZeRO-2 / ZeRO-3 save folders of any number of ranks without running DeepSpeed: the files hold what
DeepSpeed 0.19's save_checkpoint writes (one param group, Adam, fp32), partitioned by its rules. Used by
bench_deepspeed.py --ranks: 64 real gloo ranks do not fit this machine. Run as a script in a child process.

    python bench/_zero_folders.py OUT STAGE RANKS LAYERS WIDTH [FROZEN]

FROZEN (ZeRO-3 only): that many more layers saved as frozen parameters (a LoRA run's base model), each rank's
fragment of each in its model states, as DeepSpeed saves them (frozen_param_shapes, frozen_param_fragments).
"""

import math
import os
import sys
from collections import OrderedDict

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address


def write(out: str, stage: int, world: int, layers: int, width: int, frozen: int = 0) -> None:
    torch.manual_seed(0)
    params = OrderedDict()
    for i in range(layers):
        params[f"layers.{i}.weight"] = torch.randn(width, width + 1)  # sizes that do not divide by the world size
        params[f"layers.{i}.bias"] = torch.randn(width)
    shapes = [OrderedDict((k, v.shape) for k, v in params.items())]
    tag = os.path.join(out, "global_step1")
    os.makedirs(tag, exist_ok=True)
    group = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": False, "params": [0]}
    model = {"buffer_names": [], "optimizer": None, "param_shapes": shapes, "frozen_param_shapes": OrderedDict(),
             "shared_params": {}, "frozen_param_fragments": {}, "lr_scheduler": None, "data_sampler": None,
             "random_ltd": None, "skipped_steps": 0, "global_steps": 1, "global_samples": 2, "dp_world_size": world,
             "mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
             "ds_config": {"train_batch_size": 2, "zero_optimization": {"stage": stage}}, "ds_version": "0.19.8"}
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    if stage == 2:
        align = 2 * world  # DeepSpeed pads each group's flat buffer to a multiple of world × 2 elements
        padded = torch.cat([flat, flat.new_zeros(-flat.numel() % align)])
        part = padded.numel() // world
        torch.save({**model, "module": params}, os.path.join(tag, "mp_rank_00_model_states.pt"))
        starts, at = {}, 0
        for k, p in params.items():
            starts[k] = (at, p.numel())
            at += p.numel()
        for r in range(world):
            lo, hi = r * part, (r + 1) * part
            mine = {k: fragment_address(numel=min(s + n, hi) - max(s, lo), start=max(s, lo) - lo)
                    for k, (s, n) in starts.items() if s < hi and s + n > lo}
            chunk = padded[lo:hi].clone()
            optim = {"loss_scaler": None, "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
                     "base_optimizer_state": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": chunk * 0.1,
                                                            "exp_avg_sq": chunk * chunk}},
                                              "param_groups": [group]},
                     "single_partition_of_fp32_groups": [chunk], "zero_stage": ZeroStageEnum.gradients,
                     "group_paddings": [padded.numel() - flat.numel() if r == world - 1 else 0],
                     "param_alignment_paddings": [[0] * len(params)], "partition_count": [world],
                     "ds_version": "0.19.8", "param_slice_mappings": [mine]}
            torch.save({"optimizer_state_dict": optim, "ds_config": model["ds_config"], "ds_version": "0.19.8"},
                       os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    else:
        still = OrderedDict((f"frozen.{i}.weight", torch.randn(width, width + 1)) for i in range(frozen))
        empty = OrderedDict((k, torch.empty(0)) for k in [*params, *still])
        if still:
            model["frozen_param_shapes"] = OrderedDict((k, v.shape) for k, v in still.items())
        for r in range(world):
            fragments = {}
            for k, p in still.items():
                chunk = math.ceil(p.numel() / world)
                v = p.reshape(-1)[r * chunk:(r + 1) * chunk]
                fragments[k] = torch.cat([v, v.new_zeros(chunk - v.numel())])
            pieces = []
            for p in params.values():
                chunk = math.ceil(p.numel() / world)
                v = p.reshape(-1)[r * chunk:(r + 1) * chunk]
                pieces.append(torch.cat([v, v.new_zeros(chunk - v.numel())]))
            mine = torch.cat(pieces)
            torch.save({**model, "module": empty, "frozen_param_fragments": fragments},
                       os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
            optim = {"zero_stage": ZeroStageEnum.weights, "loss_scaler": None, "dynamic_loss_scale": False,
                     "overflow": False, "partition_count": world,
                     "optimizer_state_dict": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": mine * 0.1,
                                                            "exp_avg_sq": mine * mine}},
                                              "param_groups": [group]},
                     "fp32_flat_groups": [mine]}
            torch.save({"optimizer_state_dict": optim, "ds_config": model["ds_config"], "ds_version": "0.19.8"},
                       os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    with open(os.path.join(out, "latest"), "w") as f:
        f.write("global_step1")


if __name__ == "__main__":
    write(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
          int(sys.argv[6]) if len(sys.argv) > 6 else 0)
