"""ckpt-doctor: open, diagnose, repair and verify PyTorch checkpoints without running code from them.

Names are imported on first use, so `ckpt-doctor inspect` starts fast and never imports torch.
"""

from __future__ import annotations

import importlib

from ._version import __version__

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any

_EXPORTS = {
    "read_checkpoint": "readers",
    "load": "loader", "load_into": "loader", "StateDict": "loader",
    "compare_checkpoint": "compare", "Comparison": "compare", "keys_from_spec": "modelspec",
    "inspect_checkpoint": "report", "InspectReport": "report",
    "Checkpoint": "records", "Format": "records", "GlobalRef": "records", "StorageRecord": "records",
    "TensorRecord": "records", "Verdict": "records",
    "CkptDoctorError": "errors", "ReadError": "errors", "UsageError": "errors", "ModelSpecError": "errors",
    "FixOptions": "fix", "FixPlan": "fix", "FixResult": "fix", "plan_fix": "fix", "prepare_fix": "fix",
    "fix_checkpoint": "fix", "Policy": "safepickle.policy", "DEFAULT_POLICY": "safepickle.policy",
    "PlanError": "errors", "WriteError": "errors", "VerifyError": "errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_doctor' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ckpt_doctor.{module}"), name)


def __dir__() -> list[str]:
    return __all__
