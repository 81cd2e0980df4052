"""The values a repair hands on: the plan (what the output will hold) and the result of writing it."""

from __future__ import annotations

from pathlib import Path

from .._record import field, record
from ..dtypes import FLOATING, element_size
from ..records import OutTensor, tied_names
from ..safepickle.policy import DEFAULT_POLICY, Policy
from .options import OutputFormat

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Any, Iterable


@record
class FixPlan:
    input: Path
    output: Path
    format: OutputFormat
    applied: tuple[str, ...]
    renamed: dict[str, str]
    dropped: tuple[str, ...]
    tensors: tuple[OutTensor, ...]
    tree: Any = None  # torch output: containers with OutTensor leaves
    notes: tuple[str, ...] = ()
    tied: dict[str, str] = field(default_factory=dict)  # safetensors: duplicate key -> key written
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__
    ambiguous: tuple[str, ...] = ()  # --map-by-order: the keys whose place another of their shape could take
    policy: Policy = DEFAULT_POLICY  # what the output may name (planned under it, written under it)
    # A dry run's: what the write itself would refuse (an existing output without --force, a folder that cannot be
    # written), so that the dry run does not pass a command that then fails
    write_refusal: Exception | None = None
    dtype: str | None = None  # --dtype: what the state_dict's floating tensors are cast to
    ties: tuple[tuple[str, str], ...] = ()  # (alias, key): the names --tie (or --auto) wrote as another's tensor

    @property
    def shared(self) -> dict[str, str]:
        """Each name the output holds as the tensor of another → that other (a tie --tie wrote, or one the file
        had): in safetensors written once (`tied`), in a torch file or DCP folder one storage for both."""
        if self.format is OutputFormat.SAFETENSORS:
            return dict(self.tied)
        shared = tied_duplicates(self.tensors)  # later name → earlier; a --tie as the user wrote it, alias → key
        for alias, key in self.ties:
            if shared.get(key) == alias:
                del shared[key]
                shared[alias] = key
        return shared

    @property
    def cast(self) -> tuple[list[str], list[str]]:
        """--dtype: the keys of the tensors cast, and of the floating ones written as saved (cast_keys); a tied name
        written once (safetensors) is counted once, as in `tensors`."""
        return cast_keys([t for t in self.tensors if t.key not in self.tied], self.dtype) if self.dtype else ([], [])

    @property
    def inputs(self) -> tuple[Path, ...]:
        """The input and every file its tensors are read from (a sharded input's shards): none is ever written."""
        return (self.input, *{t.source.storage.file for t in self.tensors if t.source.storage})

    @property
    def nbytes(self) -> int:
        seen, total = set(), 0
        for t in self.tensors:
            if t.key in self.tied:
                continue
            ident = t.source.storage.ident if t.source.storage else t.key
            if self.format is OutputFormat.SAFETENSORS:
                total += t.source.numel * element_size(t.dtype)
            elif ident not in seen:
                seen.add(ident)
                total += converted_nbytes(t.source.storage.nbytes, t.source.dtype, t.dtype) if t.source.storage else 0
        return total


@record
class FixResult:
    plan: FixPlan
    bytes: int
    verified: bool
    unknown_globals: tuple[str, ...] = ()
    shards: tuple[Path, ...] = ()  # with --max-shard-size: the shard files; plan.output is then the index
    dtype_classes: tuple[str, ...] = ()  # the NumPy dtype classes the output builds (numpy.dtypes.UInt32DType)
    removed: tuple[Path, ...] = ()  # --force: what an earlier output of this name left beside it, now removed

    @property
    def safe_globals(self) -> tuple[str, ...]:
        """What torch.serialization.safe_globals needs to hold for torch.load(weights_only=True) of the output."""
        return tuple(sorted({*self.unknown_globals, *self.dtype_classes}))



def cast_keys(tensors: Iterable[OutTensor], dtype: str) -> tuple[list[str], list[str]]:
    """The keys of the tensors cast to `dtype`, and of the floating ones --dtype leaves as saved (beside the
    state_dict; those already of `dtype` are neither)."""
    cast = [t.key for t in tensors if t.dtype != t.source.dtype]
    left = [t.key for t in tensors if t.source.dtype in FLOATING and t.dtype == t.source.dtype != dtype]
    return cast, left


def converted_nbytes(nbytes: int, src: str, dst: str) -> int:
    return nbytes // element_size(src) * element_size(dst)


def tied_duplicates(outs: Iterable[OutTensor]) -> dict[str, str]:
    """Each output name whose tensor an earlier one holds → that name (records.tied_names)."""
    return tied_names((t.key, t.source) for t in outs)
