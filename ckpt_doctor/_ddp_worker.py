"""One DDP rank of `ckpt-doctor verify`: load, forward on its shard, one training step, compare with the others.

The parent (or torchrun) describes the run in a RankJob; the rank answers with a RankResult. Both are plain
records written as JSON, so the parent reads exactly the record the rank wrote. This module imports nothing of
verify.py: the outputs are compared by outputs.py, which the parent uses too.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from ._record import asdict, field, field_names, record
from datetime import timedelta
from pathlib import Path
from typing import Any

from .errors import one_line


@record
class RankJob:
    checkpoint: str
    model: str
    model_args: dict[str, str]  # repr of each value (literal_eval'd by the rank)
    backend: str
    world_size: int
    cwd: str
    select: str | None = None
    allow_missing: str | None = None
    allow_unexpected: str | None = None
    rtol: float | None = None
    atol: float | None = None
    seed: int = 0  # every process builds the model after the same seed: keys a file lacks start equal


@record(frozen=False)
class RankResult:
    rank: int
    device: str = "?"
    status: str = "fail"  # pass | fail
    error: str = ""  # `Type: message`, the first line of what went wrong
    where: str = ""  # the line of the user's code that raised (file:line: source)
    root_cause: bool = True  # False when the error only echoes a peer that failed (a closed connection)
    samples: list[int] = field(default_factory=list)  # the batch rows this rank ran (DistributedSampler's split)
    max_abs_diff: float | None = None
    rtol: float | None = None
    atol: float | None = None
    peak_memory: int = 0  # bytes: the CUDA device's peak allocation, or this process's peak RSS on the CPU
    traceback: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RankResult":
        known = set(field_names(cls))
        return cls(**{k: v for k, v in data.items() if k in known})


def run_rank(job: RankJob, inputs: list[Any], reference: list[Any]) -> RankResult:
    """What this rank saw. Creates the process group unless torchrun already made one; never destroys it.

    The ranks agree after each stage (loaded; its shard's outputs checked) whether all of them may go on, so a
    rank that fails there stops its peers at the same point instead of leaving them in a collective it never
    joins (under torchrun no parent would end them)."""
    import torch
    import torch.distributed as dist

    from .loader import load_into
    from .modelspec import build_model, materialize_lazy, parse_model_args
    from .outputs import Tolerance, compare_outputs, flat_outputs, shard_indices, take

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = f"cuda:{local}" if job.backend == "nccl" else "cpu"
    result = RankResult(rank, device)
    if not dist.is_initialized():
        if job.backend == "nccl":
            torch.cuda.set_device(local)
        dist.init_process_group(job.backend, timeout=timedelta(seconds=float(os.environ.get("CKPT_DOCTOR_PG_TIMEOUT",
                                                                                                  "120"))))
    model: Any = None
    try:
        torch.manual_seed(job.seed)
        model = build_model(job.model, parse_model_args([f"{k}={v}" for k, v in job.model_args.items()]), "cpu")
        materialize_lazy(model, tuple(inputs), job.model)  # as the parent did, after the same seed
        # each rank maps the saved devices to its own; tied names filled, allowances as the parent applied them
        load_into(model, job.checkpoint, fix=None, device=device, select=job.select,
                  allow_missing=job.allow_missing, allow_unexpected=job.allow_unexpected)
    except Exception as exc:  # reported to the parent as this rank's failure, in one line
        _failed(result, exc)
    if not _all_go_on(result, device):
        return result
    try:
        saved = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        model.to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if job.backend == "nccl" else None)
        batch = inputs[0].shape[0]
        result.samples = shard_indices(batch, world, rank)
        shard = take(list(inputs), result.samples, batch)
        expected = take(list(reference), result.samples, batch)
        ddp.eval()
        with torch.no_grad():
            out = flat_outputs(ddp(*[x.to(device) for x in shard]))
        diff = compare_outputs(out, expected, Tolerance(job.rtol, job.atol), split=True)
        result.max_abs_diff, result.rtol, result.atol = diff.max_abs_diff, diff.rtol, diff.atol
        if not diff.ok:
            result.error = f"its shard's outputs differ from the single run: {diff.describe()}; {diff.detail}"
    except Exception as exc:
        _failed(result, exc)
    if not _all_go_on(result, device):
        return result
    try:
        ddp.train()
        optimizer = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=1e-3)
        optimizer.zero_grad()
        loss = sum(t.float().pow(2).mean() for t in flat_outputs(ddp(*[x.to(device) for x in shard]))
                   if t.is_floating_point())
        loss.backward()
        unused = [n for n, p in ddp.module.named_parameters() if p.requires_grad and p.grad is None]
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
                result.error = f"replicas differ after the optimizer step at {name}"
                if unused:  # DDP syncs no gradient of a parameter the forward never used
                    result.error += (f"; {len(unused)} parameters took no part in the forward ({', '.join(unused[:3])}"
                                     f"{', …' if len(unused) > 3 else ''}): DDP all-reduces no gradient for them — "
                                     "train such a model with DistributedDataParallel(find_unused_parameters=True)")
                return result
        wrapped = ddp.state_dict()
        stripped = {k.removeprefix("module."): tuple(v.shape) for k, v in wrapped.items()}
        if stripped != saved:
            extra = sorted(set(stripped) ^ set(saved))[:3]
            result.error = f"DDP state_dict (module. stripped) differs from the checkpoint: {extra}"
            return result
        result.peak_memory = _peak_memory(job.backend, local)
        dist.barrier()  # every rank got here: nobody leaves while a peer still talks to it
        result.status = "pass"
        return result
    except Exception as exc:
        _failed(result, exc)
        return result


def _failed(result: RankResult, exc: BaseException) -> None:
    """This rank's failure in one line, with the model line that raised; a peer's closed connection marked as
    the echo it is."""
    message = str(exc).strip()
    result.error = f"{type(exc).__name__}: {one_line(message.splitlines()[0]) if message else ''}"
    result.where = user_frame(exc)
    result.traceback = traceback.format_exc()[-2000:]
    # A peer that vanished shows up here as a broken connection: an echo, not the cause.
    echo = type(exc).__name__ == "DistBackendError" or any(
        s in message for s in ("Connection closed by peer", "Read error", "Connection reset", "Broken pipe"))
    result.root_cause = not echo


def _all_go_on(result: RankResult, device: str) -> bool:
    """Every rank says whether it failed; all go on only when none did. A rank stopped by a peer says which."""
    import torch
    import torch.distributed as dist

    try:
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
        flags[dist.get_rank()] = 1 if result.error else 0
        dist.all_reduce(flags)
        failed = [r for r, f in enumerate(flags.tolist()) if f]
    except Exception as exc:  # a peer gone: this collective is where it shows
        if not result.error:
            _failed(result, exc)
        return False
    if failed and not result.error:
        result.error = f"stopped: rank {failed[0]} failed"
        result.root_cause = False
    return not failed


def user_frame(exc: BaseException) -> str:
    """`file:line: source` of the innermost frame outside torch and ckpt-doctor: the model line that raised."""
    import linecache

    here = str(Path(__file__).resolve().parent)
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        name = frame.filename
        if f"{os.sep}torch{os.sep}" in name or name.startswith(here) or "<frozen" in name:
            continue
        line = (frame.line or linecache.getline(name, frame.lineno or 0)).strip()
        return f"{name}:{frame.lineno}: {line}"
    return ""


def _peak_memory(backend: str, local: int) -> int:
    import torch

    if backend == "nccl":
        return int(torch.cuda.max_memory_allocated(local))
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KB


def write_job(folder: Path, job: RankJob) -> None:
    (folder / "job.json").write_text(json.dumps(asdict(job)))


def main() -> None:
    import torch

    folder = Path(os.environ["CKPT_DOCTOR_DDP_JOB"])
    job = RankJob(**json.loads((folder / "job.json").read_text()))
    os.chdir(job.cwd)
    if job.cwd not in sys.path:
        sys.path.insert(0, job.cwd)
    io = torch.load(folder / "io.pt", weights_only=True)  # written by the parent a moment ago
    result = run_rank(job, io["inputs"], io["reference"])
    (folder / f"rank{result.rank}.json").write_text(json.dumps(asdict(result)))
    sys.stderr.flush()
    # The verdict is on disk; tearing down a group whose peers may be gone can abort, so leave at once.
    os._exit(0 if result.status == "pass" else 1)


if __name__ == "__main__":
    main()
