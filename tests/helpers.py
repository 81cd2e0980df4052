"""Helpers for comparing ckpt-doctor's view of a file with torch's own."""

from __future__ import annotations

import torch


def torch_view(obj, prefix: str = "") -> dict[str, tuple[list[int], str, str]]:
    """{key path: (shape, dtype, device)} of every tensor in what torch.load returned."""
    out: dict[str, tuple[list[int], str, str]] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = (list(obj.shape), str(obj.dtype).removeprefix("torch."), str(obj.device))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(torch_view(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(torch_view(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def doctor_view(data: dict) -> dict[str, tuple[list[int], str, str]]:
    return {t["key"]: (t["shape"], t["dtype"], t["device"]) for t in data["tensors"]}
