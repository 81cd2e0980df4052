"""The `fix` command that rescues a file torch.load(weights_only=True) refuses: its tensors and plain data written
as a file that loads, checked by planning it, so that the command printed is one that runs."""

from __future__ import annotations

from pathlib import Path

from ..advice import Promise, Suggestion, allow_flags, output_beside, shell_path, under_safe_globals, user_allowed
from ..errors import CkptDoctorError
from ..records import Checkpoint
from ..safepickle.policy import DEFAULT_POLICY, Policy
from ..transforms import drop
from .options import FixOptions
from .plan import drop_pattern, held_entries, holding_findings, plan_fix, with_a_drop, with_whole

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Sequence


def rescue(ckpt: Checkpoint, extra: Sequence[str] = (), taken: set[str] | None = None,
           source: str | None = None, *, policy: Policy = DEFAULT_POLICY, keep_allowed: bool = False
           ) -> Suggestion | None:
    """The `fix` command that writes a file's tensors and plain data as a file torch.load(weights_only=True) loads
    (a whole pickled model as its state_dict; what only code can rebuild left out with --drop), checked by planning
    it — nothing is written — so the command printed is one that runs. None when no plain command does. `policy`:
    the allow-list the file was read under; the command carries --allow-global for each of its names the file uses,
    so that it reads the file as this did.

    What only --allow-global allows is left out too (a file torch.load loads with its defaults: the input itself
    loads within safe_globals), unless `keep_allowed` (fix's own advice: the user asked to keep it) or nothing but
    keeping it gives a command that runs; then the Suggestion's safe_globals names it, and its sentence says so."""
    if any("→ nested pickle" in place for place in ckpt.finding_places):
        return None  # a byte string that is itself a pickle is plain data: the copy would hold it as it is
    path = source or str(ckpt.path)  # as the user named it (a model's folder)
    allowed = user_allowed(ckpt.globals)
    flags: list[str] = ["--allow-unsafe"] if ckpt.dangerous_globals else []
    flags += [*extra, *allow_flags(allowed)]
    if ckpt.state_dict_root is None and isinstance(ckpt.root, dict):  # fix refuses to guess the part: all of it
        flags += ["--select", ""]
    from .plain import with_plain_data  # (a walk of the tree: only for a file that needs a rescue)

    try:
        converted = with_plain_data(ckpt)[1]
    except CkptDoctorError:  # (a key path past its limit): no --plain-data in the command, which plans without it
        converted = []
    if converted:  # a Namespace, a NumPy scalar, a path: kept as the data they hold rather than dropped
        flags.append("--plain-data")
    held = holding_findings(ckpt)
    entries = held_entries(ckpt, held)
    if held:
        flags += ["--drop", drop_pattern(entries, held)]
    tries = (True,) if not allowed or keep_allowed else (False, True)
    for keep in tries:
        found = _planned(ckpt, path, list(flags), taken, policy if keep else DEFAULT_POLICY)
        if found is not None:
            argv, out = found
            if keep and allowed:
                return Suggestion(argv, Promise.WRITES,
                                  f"writes its tensors and plain data as a file torch.load loads "
                                  f"{under_safe_globals(allowed)}; nothing it names is run", safe_globals=allowed)
            left = f", without what names {', '.join(allowed)} (torch's defaults refuse it, --allow-global or " \
                   "not)" if allowed else ""
            if held:
                more = f", … {len(held) - 3} more" if len(held) > 3 else ""
                left += f", without {', '.join(held[:3])}{more} (" + ("a tensor whose bytes hold" if len(held) == 1
                                                                       else "tensors whose bytes hold") + \
                    f" a pickle np.load would unpickle){with_whole([e for e in entries if e not in held])}"
            if converted:
                names = ", ".join(dict.fromkeys(was for _, was, _ in converted))
                left = f" ({names} kept as plain data){left}"
            return Suggestion(argv, Promise.WRITES,
                              f"writes its tensors and plain data as a file torch.load loads with its defaults{left}; "
                              "nothing it names is run or written")
    return None


def _planned(ckpt: Checkpoint, path: str, flags: list[str], taken: set[str] | None,
             writes: Policy) -> tuple[tuple[str, ...], str] | None:
    """The argv of the fix that plans (with one --drop of what `writes` does not allow), and its output; None."""
    out = output_beside(path, taken=set(taken or ()))
    added = with_a_drop(lambda more: plan_fix(ckpt, Path(out), FixOptions(
        transforms=(*_drops(flags), *more), policy=writes, select="" if "--select" in flags else None,
        plain_data="--plain-data" in flags)))
    if added is None:
        return None
    if taken is not None:
        taken.add(out)
    return ("fix", shell_path(path), "-o", out, *flags, *added), out


def _drops(flags: Sequence[str]) -> list:
    return [drop(flags[i + 1]) for i, f in enumerate(flags) if f == "--drop"]
