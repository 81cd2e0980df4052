"""A whole repair, as the library runs it: read the checkpoint, refuse what needs consent, plan, write, verify."""

from __future__ import annotations

import os
from pathlib import Path

from .._record import replace
from ..errors import Rerun, UsageError, WriteError
from ..readers import read_checkpoint
from ..records import Checkpoint
from ..writers.atomic import check_destination
from .execute import execute
from .options import FixOptions, OutputFormat
from .plan import plan_fix
from .results import FixPlan, FixResult
from .shard import (check_index_beside, check_sharded_destination, execute_sharded, remove_stale, shard_paths,
                    split_plan)

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Callable


def prepare_fix(source: str | os.PathLike[str] | Checkpoint, output: str | os.PathLike[str],
                options: FixOptions = FixOptions()) -> FixPlan:
    """The plan of a repair of `source` into `output`, checked before anything is written: a file that names
    dangerous globals is refused unless options.allow_unsafe, an existing output unless options.force."""
    output = Path(output)
    checkpoint = source if isinstance(source, Checkpoint) else read_checkpoint(source, policy=options.policy)
    if not options.allow_unsafe and checkpoint.dangerous_globals:
        # A whole pickled model (code: its classes) is what fix rescues; what is known to be dangerous needs consent.
        from .rescue import rescue  # the rescue planner: only for a file that needs consent

        found = rescue(checkpoint, policy=options.policy, keep_allowed=True)  # what the user allows, kept
        added = list(found.argv[4:]) if found is not None else ["--allow-unsafe"]
        for i in reversed(range(len(added) - 1)):  # the user's command names its --allow-global already
            if added[i] == "--allow-global":
                del added[i:i + 2]
        if options.plain_data and "--plain-data" in added:  # and its --plain-data
            added.remove("--plain-data")
        extra = tuple(added)
        checkpoint.refuse_if_unsafe("rewrite it", "To keep only its tensors and plain data (nothing it names is ever "
                                    "run or written): {0}", code_too=False, reruns=(Rerun(add=extra),))
    # The whole fix is planned (every option checked) before the destination is: `--force` is offered only when it
    # alone would make the command succeed, never for a command that would then fail on another option.
    plan = plan_fix(checkpoint, output, options)
    sharded = planned_shards(plan, options)
    try:
        check_output(plan, checkpoint, options, sharded)
    except WriteError as exc:
        if not options.dry_run:
            raise
        plan = replace(plan, write_refusal=exc)  # the dry run says it: the write would stop there
    return plan


def planned_shards(plan: FixPlan, options: FixOptions) -> tuple[list[Path], Path] | None:
    """What the output's layout cannot hold, refused with the plan (a dry run says what the write would): a value a
    DCP folder cannot save, a tree --max-shard-size cannot split. Returns the shards and the index the write makes
    (None without --max-shard-size)."""
    if plan.format is OutputFormat.DCP:
        from .dcp_output import check_dcp_plan  # only for --format dcp

        check_dcp_plan(plan)
    if options.max_shard_size is None:
        return None
    if plan.format is OutputFormat.DCP:  # its index would name folders, which nothing (inspect included) reads
        raise UsageError("--max-shard-size splits a torch or safetensors file; a DCP folder is written whole (its "
                         "files are one per rank): leave out --max-shard-size or --format dcp")
    return shard_paths(plan.output, len(split_plan(plan, options.max_shard_size)))


def check_output(plan: FixPlan, checkpoint: Checkpoint, options: FixOptions,
                 sharded: tuple[list[Path], Path] | None) -> None:
    """What only the write could still refuse, checked before it: the destination (an input, an existing file
    without --force, a folder that cannot be written), each shard's and the index's, a DCP folder's."""
    if plan.format is OutputFormat.DCP:
        from .dcp_output import check_dcp_destination, dcp_inputs  # only for --format dcp

        check_dcp_destination(plan.output, dcp_inputs(plan), options.force)
    elif sharded is not None:
        check_sharded_destination(plan.output, *sharded, checkpoint.files, options.force)
    else:
        check_destination(plan.output, checkpoint.files, options.force)
        check_index_beside(plan.output, checkpoint.files, options.force)


def write_fix(plan: FixPlan, options: FixOptions = FixOptions(),
              progress_callback: Callable[[int, int], None] | None = None) -> FixResult:
    """Write a plan (in shards with options.max_shard_size), atomically, re-read and compared unless told not to."""
    if options.dry_run:
        raise UsageError("a dry run writes nothing: prepare_fix returns its plan")
    if options.max_shard_size is not None:
        return execute_sharded(plan, options.max_shard_size, progress_callback, options.verify, options.force)
    stale = [] if plan.format is OutputFormat.DCP else check_index_beside(plan.output, plan.inputs, options.force)
    result = execute(plan, progress_callback=progress_callback, verify=options.verify, force=options.force)
    return replace(result, removed=remove_stale(stale))  # --force: an earlier sharded output, once this is written


def fix_checkpoint(source: str | os.PathLike[str] | Checkpoint, output: str | os.PathLike[str],
                   options: FixOptions = FixOptions(),
                   progress_callback: Callable[[int, int], None] | None = None) -> FixResult:
    """`ckpt-doctor fix` as a function: the repair `options` asks, written to `output` and verified."""
    return write_fix(prepare_fix(source, output, options), options, progress_callback)
