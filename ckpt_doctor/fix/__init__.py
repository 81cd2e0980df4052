"""Repairs a checkpoint into a file that loads: planned (options.py → plan.py, pure) apart from carried out
(execute.py, produce.py, readback.py, shard.py; a DCP folder: dcp_output.py).

    from ckpt_doctor.fix import FixOptions, fix_checkpoint
    from ckpt_doctor.transforms import strip_prefix
    fix_checkpoint("dp.pth", "clean.safetensors", FixOptions(transforms=(strip_prefix("module."),)))

Names are imported on first use: planning a rescue (inspect, scan) does not load the writers.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Any

_EXPORTS = {
    "FixOptions": "options", "OutputFormat": "options", "output_format": "options",
    "FixPlan": "results", "FixResult": "results", "OutTensor": "results",
    "plan_fix": "plan", "execute": "execute", "execute_sharded": "shard", "split_plan": "shard",
    "shard_paths": "shard", "prepare_fix": "run", "write_fix": "run", "fix_checkpoint": "run", "rescue": "rescue",
    "left_out": "rebuild",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_doctor.fix' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ckpt_doctor.fix.{module}"), name)


def __dir__() -> list[str]:
    return __all__
