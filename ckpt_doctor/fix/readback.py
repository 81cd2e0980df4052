"""After writing: the output re-read by the reader a user's `inspect` uses, and its structure compared with the
plan (the bytes are compared as they are written, by crc32)."""

from __future__ import annotations

from pathlib import Path

from ..errors import WriteError
from ..readers import read_checkpoint
from ..writers.pickler import TensorOut
from ..writers.safetensors_writer import TensorBytes
from .results import FixPlan


def verify_torch_structure(tmp: Path, plan: FixPlan, expected: dict[str, TensorOut]) -> None:
    """The written file, re-read by the same reader a user's inspect uses, holds exactly the planned tensors."""
    written = {t.key: t for t in read_checkpoint(tmp, policy=plan.policy).tensors}
    if set(written) != set(expected):
        missing = sorted(set(expected) ^ set(written))[:3]
        raise WriteError(f"{plan.output}: verification failed: keys differ from the plan ({missing}); nothing written")
    for key, out in expected.items():
        got = written[key]
        want = out.record
        if (got.shape, got.stride, got.storage_offset, got.dtype, got.device) != \
                (want.shape, want.stride, want.storage_offset, out.dtype, out.device):
            raise WriteError(f"{plan.output}: verification failed for {key}: wrote {got.dtype}{list(got.shape)} on "
                             f"{got.device}, expected {out.dtype}{list(want.shape)}; nothing written")


def verify_safetensors_structure(tmp: Path, entries: list[TensorBytes]) -> None:
    written = {t.key: t for t in read_checkpoint(tmp).tensors}
    for e in entries:
        got = written.get(e.key)
        if got is None or got.shape != tuple(e.shape) or got.dtype != e.dtype:
            raise WriteError(f"verification failed for {e.key}: the written header does not match; nothing written")
    if len(written) != len(entries):
        raise WriteError("verification failed: the written file holds other tensors than planned; nothing written")

