"""Helpers for comparing ckpt-doctor's view of a file with torch's own."""

from __future__ import annotations

import os

import torch


def flat_tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """{key path: tensor} of every tensor in what torch.load returned, nested dicts, lists and tuples walked."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def torch_view(obj, prefix: str = "") -> dict[str, tuple[list[int], str, str]]:
    """{key path: (shape, dtype, device)} of every tensor in what torch.load returned."""
    return {k: (list(t.shape), str(t.dtype).removeprefix("torch."), str(t.device))
            for k, t in flat_tensors(obj, prefix).items()}


def child_fires(code: str, path, canary) -> bool:
    """Whether `code` (Python that loads sys.argv[1] for real) runs the payload of the file at `path`: the canary
    appears. In a child process, its errors ignored; the canary is removed for the next try."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", code, str(path)], check=False, capture_output=True, timeout=120)
    ran = canary.exists()
    if ran:
        canary.unlink()
    return ran


def doctor_view(data: dict) -> dict[str, tuple[list[int], str, str]]:
    return {t["key"]: (t["shape"], t["dtype"], t["device"]) for t in data["tensors"]}


def torch_verdict(model, state_dict) -> dict:
    """What torch itself says when `state_dict` is really loaded into `model` (CPU tensors): the missing and
    unexpected keys (as its post hooks see them) and the size mismatches it reports."""
    import re

    seen: dict = {}
    handle = model.register_load_state_dict_post_hook(
        lambda module, incompatible: seen.update(missing=list(incompatible.missing_keys),
                                                 unexpected=list(incompatible.unexpected_keys)))
    mismatched = []
    try:
        model.load_state_dict(state_dict, strict=False)
    except RuntimeError as exc:
        mismatched = re.findall(r"size mismatch for (.+?): copying", str(exc))
    finally:
        handle.remove()
    return {"missing": seen["missing"], "unexpected": seen["unexpected"], "mismatched": mismatched}


def torch_filled_fraction(model, state_dict) -> float:
    """The share of the model's parameter elements (a tied Parameter once) that a real load_state_dict(strict=False)
    writes: every parameter is set to NaN first, and what is no longer NaN afterwards was filled."""
    import math

    unique = {id(p): p for p in model.parameters()}.values()
    with torch.no_grad():
        for p in unique:
            p.fill_(math.nan)
    try:
        model.load_state_dict(state_dict, strict=False)
    except RuntimeError:
        pass  # size mismatches are reported after everything else was copied
    total = sum(p.numel() for p in unique)
    filled = sum(p.numel() for p in unique if not torch.isnan(p).any())
    return filled / total if total else 1.0


def spawn_two(fn, *args) -> None:
    """Run fn(rank, *args, port) in two processes (two gloo ranks), with a free port for their rendezvous. Each
    rank computes on one thread: the samples are tiny, and two ranks of two threads each beside the other test
    worker only wait for each other on a 2-core machine."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read by each spawned interpreter as it imports torch
    try:
        mp.spawn(fn, args=(*args, port), nprocs=2)
    finally:
        if threads is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = threads
