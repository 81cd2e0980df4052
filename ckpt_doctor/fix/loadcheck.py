"""With --model: whether the planned output would load strictly into the model, asked of torch's own loading code
before anything is written."""

from __future__ import annotations

import shlex

from .._record import replace
from ..advice import command_line, shell_path
from ..compare import allowances, check_entries, short_of_required, with_extras
from ..errors import CheckFailed, Rerun, one_line
from ..records import OutTensor
from .options import FixOptions

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from collections import OrderedDict
    from typing import Sequence


def check_loads(state: "OrderedDict[str, OutTensor]", opts: FixOptions, notes: list[str],
                 path: str = "", extras: set[str] | None = None, others: Sequence[str] = ()) -> None:
    """With a model: what the output's state_dict would get from load_state_dict(strict=True), asked of torch's
    own loading code; refuse (exit 1, nothing written) when it would fail beyond --allow-missing/--allow-unexpected.
    `others`: the keys of the written state_dict that hold no tensor (nor an `_extra_state`): the model's loading
    code counts each as it counts a tensor's key, unexpected where the model has no such name."""
    assert opts.model is not None
    entries = [(k, tuple(o.source.shape), o.dtype) for k, o in state.items() if isinstance(o, OutTensor)]
    check = with_extras(check_entries(opts.model, entries, None), extras or set())
    if others:
        names = {e.key for e in opts.model.entries}
        check = replace(check, unexpected=(*check.unexpected, *(k for k in others if k not in names)),
                        errors=(*check.errors, *(f"{k!r} holds no tensor, where the model has a tensor of that name"
                                                 for k in others if k in names)))
    np_set = set(opts.model.non_persistent)
    unexpected = [k for k in check.unexpected if k not in np_set]
    allowed_m, allowed_u = allowances(opts.allow_missing, opts.allow_unexpected, check, unexpected)
    missing = [k for k in check.missing if k not in allowed_m]
    mismatched = [m for m in check.mismatched if m.key not in allowed_m]
    unexpected = [k for k in check.unexpected if k not in allowed_u]
    short = short_of_required(opts.model, check, opts.allow_missing)
    if missing or mismatched or unexpected or check.errors or short:
        parts = [short] if short else []
        if missing:
            parts.append(f"{len(missing)} missing ({', '.join(missing[:3])}{'…' if len(missing) > 3 else ''})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({', '.join(unexpected[:3])}"
                         f"{'…' if len(unexpected) > 3 else ''})")
        if mismatched:
            parts.append(f"{len(mismatched)} of another shape ({', '.join(m.key for m in mismatched[:3])})")
        if check.errors:
            parts.append(f"the model's loading code: {one_line(check.errors[0], 160)}")
        closest = (f"the closest fix: {' '.join(shlex.quote(f) for f in opts.closest)}" if opts.closest else
                   f"`{command_line(('inspect', shell_path(path), *opts.model.flags))}` shows the closest fix")
        accept = _acceptances(opts)
        if accept:  # --auto's line as inspect prints it: its --allow-missing too, which --auto never takes itself
            closest = "the line inspect prints accepts them (a new head?) with {0}"
        raise CheckFailed(f"the output would still not load strictly into {opts.model.source}: {'; '.join(parts)}. "
                          f"Nothing was written; {closest} (--allow-missing/--allow-unexpected accept intended "
                          "differences)", reruns=(Rerun(add=accept),) if accept else ())
    if allowed_m or allowed_u:
        notes.append(f"accepted: {len(allowed_m)} model keys left missing (--allow-missing), {len(allowed_u)} extra "
                     "keys (--allow-unexpected)")



def _acceptances(opts: FixOptions) -> tuple[str, ...]:
    """With --auto: the --allow-missing/--allow-unexpected of the line `inspect --model` prints that the command
    lacks (a new head is accepted only where the user asks: --auto alone refuses it)."""
    if not opts.auto:
        return ()
    flags: list[str] = []
    for flag, given in (("--allow-missing", opts.allow_missing), ("--allow-unexpected", opts.allow_unexpected)):
        if flag in opts.closest and not given:
            flags += [flag, opts.closest[opts.closest.index(flag) + 1]]
    return tuple(flags)
