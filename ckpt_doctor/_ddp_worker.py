"""One DDP rank of `ckpt-doctor verify`: load, forward on its shard, one training step, compare with the others."""

from __future__ import annotations

import ast
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any


def run_rank(ckpt: str, model_spec: str, model_args: dict[str, Any], inputs: list[Any], reference: list[Any],
             backend: str, select: str | None = None) -> dict[str, Any]:
    """What this rank saw. Creates the process group unless torchrun already made one; never destroys it."""
    import torch
    import torch.distributed as dist

    from .loader import load_into
    from .modelspec import build_model
    from .verify import flat_outputs, max_diff

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = f"cuda:{local}" if backend == "nccl" else "cpu"
    result: dict[str, Any] = {"rank": rank, "device": device, "status": "fail"}
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=timedelta(seconds=float(os.environ.get("CKPT_DOCTOR_PG_TIMEOUT",
                                                                                              "120"))))
    try:
        model = build_model(model_spec, model_args, "cpu")
        load_into(model, ckpt, fix=None, device=device, select=select)  # each rank maps saved devices to its own
        saved = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        model.to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if backend == "nccl" else None)
        shard = [x.chunk(world)[rank] if x.shape[0] >= world else x for x in inputs]
        ref_shard = [r.chunk(world)[rank] if r.dim() and r.shape[0] == inputs[0].shape[0] else r for r in reference]
        ddp.eval()
        with torch.no_grad():
            out = flat_outputs(ddp(*[x.to(device) for x in shard]))
        diff, tol = max_diff(out, ref_shard)
        result["max_abs_diff"] = diff
        if diff > tol:
            result["error"] = f"shard output differs from single by {diff:.3g} (tolerance {tol:.3g})"
            return result
        ddp.train()
        optimizer = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=1e-3)
        optimizer.zero_grad()
        loss = sum(t.float().pow(2).mean() for t in flat_outputs(ddp(*[x.to(device) for x in shard]))
                   if t.is_floating_point())
        loss.backward()
        optimizer.step()
        ddp.eval()
        with torch.no_grad():
            ddp(*[x.to(device) for x in shard])  # DDP broadcasts rank 0's buffers at the start of a forward
        for name, tensor in list(ddp.module.state_dict().items()):
            theirs = tensor.detach().clone()
            dist.broadcast(theirs, 0)
            same = torch.equal(theirs, tensor)
            flag = torch.tensor([0 if same else 1], device=device)
            dist.all_reduce(flag)
            if flag.item():
                result["error"] = f"replicas differ after the optimizer step at {name}"
                return result
        wrapped = ddp.state_dict()
        stripped = {k.removeprefix("module."): tuple(v.shape) for k, v in wrapped.items()}
        if stripped != saved:
            extra = sorted(set(stripped) ^ set(saved))[:3]
            result["error"] = f"DDP state_dict (module. stripped) differs from the checkpoint: {extra}"
            return result
        if backend == "nccl":
            result["peak_memory"] = int(torch.cuda.max_memory_allocated(local))
        dist.barrier()  # every rank got here: nobody leaves while a peer still talks to it
        result["status"] = "pass"
        return result
    except Exception as exc:  # reported to the parent as this rank's failure, in one line
        message = str(exc).strip()
        result["error"] = f"{type(exc).__name__}: {message.splitlines()[0][:300] if message else ''}"
        result["traceback"] = traceback.format_exc()[-2000:]
        # A peer that vanished shows up here as a broken connection: an echo, not the cause.
        echo = type(exc).__name__ == "DistBackendError" or any(
            s in message for s in ("Connection closed by peer", "Read error", "Connection reset", "Broken pipe"))
        result["root_cause"] = not echo
        return result


def main() -> None:
    import torch

    job = Path(os.environ["CKPT_DOCTOR_DDP_JOB"])
    spec = json.loads((job / "job.json").read_text())
    os.chdir(spec["cwd"])
    if spec["cwd"] not in sys.path:
        sys.path.insert(0, spec["cwd"])
    io = torch.load(job / "io.pt", weights_only=True)  # written by the parent a moment ago
    args = {k: ast.literal_eval(v) for k, v in spec["model_args"].items()}
    rank = int(os.environ["RANK"])
    result = run_rank(spec["checkpoint"], spec["model"], args, io["inputs"], io["reference"], spec["backend"],
                      spec.get("select"))
    (job / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stderr.flush()
    # The verdict is on disk; tearing down a group whose peers may be gone can abort, so leave at once.
    os._exit(0 if result["status"] == "pass" else 1)


if __name__ == "__main__":
    main()
