"""Loads a checkpoint's state_dict on the devices this machine has, and loads it into a model with the inferred fix."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .compare import Comparison, compare_checkpoint
from .devices import mapper
from .errors import ReadError
from .modelspec import model_keys
from .readers import read_checkpoint
from .records import Checkpoint, Format
from .transforms import plan_keys


class StateDict(OrderedDict):
    """A state_dict, with `device_map` telling where each saved device was put ({"cuda:3": "cpu"})."""

    device_map: dict[str, str]
    source: Checkpoint


def _tensors_via_torch_load(ckpt: Checkpoint, device_map: dict[str, str]) -> dict[str, Any] | None:
    """torch.load(weights_only=True) for plain torch files; None where torch.load would run code or fail."""
    import torch

    if ckpt.format not in (Format.TORCH_ZIP, Format.TORCH_LEGACY) or ckpt.unsafe_globals or ckpt.hazards:
        return None
    try:
        loaded = torch.load(ckpt.path, map_location=device_map, weights_only=True)
    except (RuntimeError, ValueError, EOFError, OSError, pickle.UnpicklingError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ReadError(f"{ckpt.path}: torch.load(weights_only=True) failed: {first}") from None
    flat: dict[str, Any] = {}

    def walk(obj: Any, prefix: str) -> None:
        if isinstance(obj, torch.Tensor):
            flat[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{prefix}.{i}" if prefix else str(i))

    walk(loaded, "")
    return flat


def load(path: str | Path, device: Any = "auto", *, checkpoint: Checkpoint | None = None) -> StateDict:
    """The state_dict inside any checkpoint, each tensor on a device this machine has.

    `device`: "auto" (cuda:N if present, else cuda:0, else mps, else cpu), a device ("cpu", "cuda:1"), or a
    dict like torch's map_location ({"cuda:3": "cuda:0"}). Never unpickles with weights_only=False: files that
    need their own classes (whole-model pickles, TorchScript) are read tensor by tensor from their records.
    """
    from .tensordata import load_tensor

    ckpt = checkpoint or read_checkpoint(path)
    ckpt.refuse_if_unsafe("load it", code_too=False)  # a pickled whole model is rescued tensor by tensor
    if ckpt.state_dict_root is None:
        raise ReadError(f"{ckpt.path}: no state_dict found (no container that holds mostly tensors)")
    map_fn = mapper(device)
    device_map = {saved: map_fn(saved) for saved in ckpt.devices}
    by_path = _tensors_via_torch_load(ckpt, device_map)
    out = StateDict()
    root = ckpt.state_dict_root
    for record in ckpt.state_dict_tensors():
        full = f"{root}.{record.key}" if root else record.key
        if by_path is not None and full in by_path:
            out[record.key] = by_path[full]
        else:
            out[record.key] = load_tensor(record).to(device_map[record.device])
    out.device_map = device_map
    out.source = ckpt
    return out


def load_into(model: Any, path: str | Path, fix: str | None = "auto", device: Any = None) -> Comparison:
    """Apply the inferred fix to the keys, load strictly into `model`, and return the comparison report.

    `fix="auto"` applies the prefix changes `inspect --model` suggests (not a mapping by order, which only
    `ckpt-doctor fix --map-by-order` does, with its checks); `fix=None` loads the keys as they are.
    """
    ckpt = read_checkpoint(path)
    keys = model_keys(model, type(model).__name__)
    comparison = compare_checkpoint(ckpt, keys)
    target = device
    if target is None:
        first = next((p for p in model.parameters()), None)
        target = str(first.device) if first is not None and first.device.type != "meta" else "auto"
    state = load(path, target, checkpoint=ckpt)
    transforms = list(comparison.transforms) if fix == "auto" and comparison.fix_kind in ("rename", "none") else []
    plan = plan_keys(list(state), transforms)
    fixed = OrderedDict((new, state[old]) for old, new in plan.mapping.items())
    try:
        model.load_state_dict(fixed, strict=True)
    except RuntimeError as exc:
        first_line = str(exc).strip().splitlines()
        detail = " ".join(line.strip() for line in first_line[:3])
        raise ReadError(f"{ckpt.path}: strict load into {type(model).__name__} failed after the inferred fix "
                        f"({comparison.fix_kind}): {detail[:300]}") from None
    return comparison
