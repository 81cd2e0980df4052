"""The `fix` command that rescues a file torch.load(weights_only=True) refuses: its tensors and plain data written
as a file that loads, checked by planning it, so that the command printed is one that runs."""

from __future__ import annotations

from pathlib import Path

from ..advice import Promise, Suggestion, output_beside, shell_path
from ..errors import CkptDoctorError
from ..records import Checkpoint
from ..safepickle.policy import DEFAULT_POLICY, Policy
from ..transforms import drop
from .options import FixOptions
from .plan import plan_fix

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Sequence


def rescue(ckpt: Checkpoint, extra: Sequence[str] = (), taken: set[str] | None = None,
           source: str | None = None, *, policy: Policy = DEFAULT_POLICY) -> Suggestion | None:
    """The `fix` command that writes a file's tensors and plain data as a file torch.load(weights_only=True) loads
    (a whole pickled model as its state_dict; what only code can rebuild left out with --drop), checked by planning
    it — nothing is written — so the command printed is one that runs. None when no plain command does. `policy`:
    the allow-list the file was read under, which the plan writes by."""
    path = source or str(ckpt.path)  # as the user named it (a model's folder)
    out = output_beside(path, taken=taken)
    flags: list[str] = ["--allow-unsafe"] if ckpt.dangerous_globals else []
    flags += extra
    for _ in range(2):
        try:
            plan_fix(ckpt, Path(out), FixOptions(transforms=tuple(_drops(flags)), policy=policy))
        except CkptDoctorError as exc:
            pattern = getattr(exc, "drop", None)
            if not pattern or "--drop" in flags:
                return None
            flags += ["--drop", pattern]
            continue
        return Suggestion(("fix", shell_path(path), "-o", out, *flags), Promise.WRITES,
                          "writes its tensors and plain data as a file torch.load loads with its defaults; nothing "
                          "it names is run or written")
    return None


def _drops(flags: Sequence[str]) -> list:
    return [drop(flags[i + 1]) for i, f in enumerate(flags) if f == "--drop"]
