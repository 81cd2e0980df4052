"""What a repair is asked to do: the output's format and the options of one `fix`, as one value."""

from __future__ import annotations

import enum
from pathlib import Path

from .._record import record
from ..errors import UsageError
from ..safepickle.policy import DEFAULT_POLICY, Policy
from ..transforms import Transform

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from ..modelspec import ModelKeys


class OutputFormat(str, enum.Enum):
    """The file (or folder) a repair writes."""

    TORCH = "torch"
    SAFETENSORS = "safetensors"
    DCP = "dcp"  # a torch.distributed.checkpoint folder, written by torch's own DCP writer


SUFFIX_FORMAT = {".safetensors": OutputFormat.SAFETENSORS, ".pt": OutputFormat.TORCH, ".pth": OutputFormat.TORCH,
                 ".bin": OutputFormat.TORCH, ".ckpt": OutputFormat.TORCH, ".tar": OutputFormat.TORCH}


def output_format(output: Path, requested: OutputFormat | None) -> OutputFormat:
    if requested is not None:
        return requested
    fmt = SUFFIX_FORMAT.get(output.suffix.lower())
    if fmt is None:
        raise UsageError(f"{output}: cannot tell the format from the suffix {output.suffix!r}; use .pt/.pth/.bin "
                         "or .safetensors, or pass --format torch|safetensors")
    return fmt


@record
class FixOptions:
    """Everything one repair is asked: which part, under which names, in which format (planning), and how to write it
    (execution). `fix` on the command line builds one from its flags; the library takes one as it is."""

    transforms: tuple[Transform, ...] = ()
    select: str | None = None
    map_location: tuple[tuple[str, str], ...] = ()  # (saved device or "*", new device)
    dtype: str | None = None
    model: ModelKeys | None = None
    reorder: bool = False
    auto: bool = False
    map_by_order: bool = False
    force: bool = False
    format: OutputFormat | None = None
    allow_missing: str | None = None  # with --model: model keys the output may lack (a new head)
    allow_unexpected: str | None = None  # with --model: output keys the model may lack
    ties: tuple[tuple[str, str], ...] = ()  # (alias, key): write `alias` as the same tensor as `key`
    closest: tuple[str, ...] = ()  # with --auto: the flags of the fix inspect --model infers, for the message
    dry_run: bool = False  # planned to be shown, not written: what only writing needs (--force) is not asked
    max_shard_size: int | None = None  # bytes: shards of at most this, and an index naming them
    verify: bool = True  # re-read the output and compare every tensor with its source (the default never skips it)
    allow_unsafe: bool = False  # rewrite a file that names dangerous globals (its tensors and plain data only)
    plain_data: bool = False  # write a Namespace as a dict, a NumPy scalar as a number, a path as a str (fix/plain.py)
    policy: Policy = DEFAULT_POLICY  # the allow-list (--allow-global): the source read under it, the output naming it

