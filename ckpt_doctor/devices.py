"""Which devices exist here, and where a tensor saved on one device should go on this machine."""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any, Callable


def cuda_count_without_torch() -> int:
    """GPUs this process could use, from the driver's /proc entries (inspect must not import torch)."""
    if "torch" in sys.modules:
        import torch

        return torch.cuda.device_count()
    try:
        present = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        return min(present, len(ids))
    return present


def _index(text: str) -> int | None:
    """A device index written in ASCII digits (`str.isdigit` also accepts `²`, which int() refuses)."""
    return int(text) if text.isascii() and text.isdigit() and len(text) < 10 else None


def missing_devices(saved: tuple[str, ...] | list[str]) -> list[str]:
    """Saved devices torch.load(path) cannot restore here without map_location: cuda:3 with one GPU, any cuda
    without one, mps off a Mac, xpu/hpu/privateuseone tags without their backend, and tags torch's restore
    functions do not know at all (`cpu:0`, `CUDA:0`). `cpu` and `meta` always restore."""
    count = None
    out = []
    for device in saved:
        kind, _, index = device.partition(":")
        if device == "cpu" or kind == "meta":
            continue
        if kind == "cuda":
            if count is None:
                count = cuda_count_without_torch()
            if count == 0 or (_index(index) is not None and _index(index) >= count) or \
                    index and _index(index) is None:
                out.append(device)
        elif not _backend_here(kind) or index and _index(index) is None:
            out.append(device)
    return out


def _backend_here(kind: str) -> bool:
    """Whether this process could restore a storage tagged with this backend (torch is asked only when loaded)."""
    if kind == "mps":
        if sys.platform != "darwin":
            return False
    elif kind not in ("xpu", "hpu", "privateuseone"):
        return False  # no restore function in torch for it (`CUDA`, `cpu:0` is handled by its index)
    if "torch" not in sys.modules:
        return kind == "mps"  # a Mac without torch loaded: assume its GPU is there
    import torch

    module = getattr(torch, "backends" if kind == "mps" else kind, None)
    probe = getattr(getattr(module, "mps", module), "is_available", None) if module is not None else None
    return bool(probe()) if callable(probe) else False


def auto_device(saved: str) -> str:
    """`cuda:3` stays if this machine has it, else `cuda:0`, else `mps`, else `cpu`."""
    import torch

    kind, _, index = saved.partition(":")
    if kind == "cuda" and torch.cuda.is_available():
        n = _index(index) or 0
        return f"cuda:{n}" if n < torch.cuda.device_count() else "cuda:0"
    if kind in ("cuda", "mps") and getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def mapper(request: Any) -> Callable[[str], str]:
    """A function saved-device -> device from `auto`, a device string/torch.device, or a dict like map_location."""
    if request is None or request == "auto":
        return auto_device
    from collections.abc import Mapping

    if isinstance(request, Mapping):
        table = {str(k): str(v) for k, v in request.items()}
        return lambda saved: table[saved] if saved in table else auto_device(saved)
    target = str(request)
    return lambda saved: target
