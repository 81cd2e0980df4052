"""The frozen result types every stage passes on: tensor and storage records, globals, the Checkpoint."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from itertools import chain, repeat
from math import prod
from pathlib import Path

from ._record import fast_new, fast_new_columns, field, record, replace  # noqa: F401  (fast_new: re-exported for the readers)
from .dtypes import contiguous_strides, element_size
from .errors import ReadError
from .safepickle.policy import GlobalRef, Verdict  # noqa: F401  (re-exported: part of the result types)

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any, Iterable


class OpenEnum(str, enum.Enum):
    """A str enum that a format added in readers/table.py may add a member to (`Format.declare("toy")`)."""

    @classmethod
    def declare(cls, value: str) -> Any:
        """The member of this value, made when there is none: it is then found by `cls(value)`, compares, hashes and
        serialises as its value like the others, and is not listed when the class is iterated."""
        known = cls._value2member_map_.get(value)
        if known is not None:
            return known
        member = str.__new__(cls, value)
        member._name_ = value.upper().replace("-", "_")
        member._value_ = value
        cls._value2member_map_[value] = member
        return member


class Format(OpenEnum):
    """How a checkpoint is laid out on disk, found from its bytes (a format added in readers/table.py declares its
    own: `Format.declare("toy")`)."""

    TORCH_ZIP = "torch-zip"
    TORCH_LEGACY = "torch-legacy"
    TORCH_TAR = "torch-tar"  # torch's pre-0.4 format
    TORCHSCRIPT = "torchscript"
    SAFETENSORS = "safetensors"
    PICKLE = "pickle"
    SHARDED = "sharded"
    DCP = "torch-dcp"  # a torch.distributed.checkpoint folder
    DEEPSPEED = "deepspeed-zero"  # a DeepSpeed save folder (ZeRO partitions consolidated)


def span_elements(shape: tuple[int, ...], stride: tuple[int, ...]) -> int | None:
    """Elements of its storage a tensor can touch from its offset on; None when shape and stride cannot be."""
    if len(shape) != len(stride):
        return None
    last = 0
    empty = False
    for size, step in zip(shape, stride):
        if size < 0 or step < 0:
            return None
        if size == 0:
            empty = True
        last += (size - 1) * step
    return 0 if empty else last + 1


@record(slots=True)
class Piece:
    """One saved chunk of a tensor that several files hold parts of (a DCP chunk, a ZeRO partition's slice)."""

    file: Path
    offset: int  # absolute byte offset, in `file`, of the chunk's first element
    offsets: tuple[int, ...]  # where the chunk sits in its Assembly's grid
    sizes: tuple[int, ...]
    stride: tuple[int, ...]  # of the chunk's saved bytes, in elements
    label: str = ""  # how to name it in an error: "__1_0.distcp item at byte 1261"
    crc: int | None = None  # crc32 of exactly the piece's bytes, when its archive records it (a whole storage)


@record
class Assembly:
    """A tensor made of pieces: laid in a grid (the tensor's shape, or (numel,) for a flat partition), the output
    is the grid in row-major order. The pieces must tile the grid exactly; see assemble.py."""

    grid: tuple[int, ...]
    pieces: tuple[Piece, ...]
    dtype: str


class LazyAssembly(Assembly):
    """An Assembly whose pieces are cut when a command first reads them (fix, --values), not when the checkpoint is
    read: made by fast_new with `cut`, a function and its arguments, in place of `pieces`. inspect of a DCP folder of
    a million chunks, or of a ZeRO-3 folder's every rank, never looks at them. Cutting cannot fail (nothing is
    read); equality, hashing, repr and pickling go through the pieces, as an Assembly's do."""

    def __getattr__(self, name: str) -> Any:
        if name != "pieces":
            raise AttributeError(name)
        function, args = self.__dict__["cut"]
        pieces = self.__dict__["pieces"] = tuple(function(*args))
        return pieces

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Assembly):
            return NotImplemented
        return (self.grid, self.pieces, self.dtype) == (other.grid, other.pieces, other.dtype)

    def __hash__(self) -> int:
        return hash((self.grid, self.pieces, self.dtype))

    def __repr__(self) -> str:
        return f"Assembly(grid={self.grid!r}, pieces={self.pieces!r}, dtype={self.dtype!r})"

    def __reduce__(self) -> tuple:
        return Assembly, (self.grid, self.pieces, self.dtype)


@record(slots=True)
class StorageRecord:
    """One block of tensor bytes in a file: where it is and what it was saved as. (Its fields in slots: a torch zip
    of 20,000 tensors makes 20,000 of them, filled a field at a time in half the time a __dict__ each takes.)"""

    key: str
    dtype: str
    nbytes: int
    device: str
    file: Path
    offset: int  # absolute byte offset of the storage's first byte in `file`
    entry: str = ""  # zip member name, for writers that copy whole entries
    crc: int | None = None  # crc32 of exactly these bytes when the file records it (torch zip members)
    assembly: Assembly | None = None  # the bytes are not one range but pieces of several files (DCP, ZeRO)
    deflated: int = 0  # > 0: a deflated zip member of this many bytes at `offset`, inflated when read (tensordata.py)

    @property
    def ident(self) -> tuple[str, str]:
        """Which storage this is: tensors with the same ident share bytes (shards make the file part of it)."""
        return str(self.file), self.key


class StorageColumns:
    """Storages held as columns, one position a storage: a torch zip's members, which a 20,000-tensor file has
    20,000 of. A StorageRecord is made only for the storage a caller asks for (`record(i)`), or for all of them at
    once (`records()`), each once: the tensor table reads keys and sizes off the columns. Every storage is of `file`,
    stored (not deflated), of no assembly."""

    __slots__ = ("keys", "dtypes", "nbytes", "devices", "file", "offsets", "entries", "crcs", "_made", "_one")

    def __init__(self, keys: list[str], dtypes: list[str], nbytes: list[int], devices: list[str], file: Path,
                 offsets: list[int], entries: list[str], crcs: list[int | None]) -> None:
        self.keys, self.dtypes, self.nbytes, self.devices = keys, dtypes, nbytes, devices
        self.file, self.offsets, self.entries, self.crcs = file, offsets, entries, crcs
        self._made: list[StorageRecord] | None = None
        self._one: dict[int, StorageRecord] = {}  # made one at a time, before records()

    def __len__(self) -> int:
        return len(self.keys)

    def record(self, i: int) -> StorageRecord:
        """The StorageRecord of storage `i` (always the same object)."""
        if self._made is not None:
            return self._made[i]
        made = self._one.get(i)
        if made is None:
            made = self._one[i] = fast_new(StorageRecord, key=self.keys[i], dtype=self.dtypes[i], nbytes=self.nbytes[i],
                                           device=self.devices[i], file=self.file, offset=self.offsets[i],
                                           entry=self.entries[i], crc=self.crcs[i], assembly=None, deflated=0)
        return made

    def records(self) -> list[StorageRecord]:
        """Every storage's StorageRecord, by position, made a column at a time (those made before kept)."""
        if self._made is None:
            n = len(self.keys)
            made = fast_new_columns(StorageRecord, n, (self.keys, self.dtypes, self.nbytes, self.devices,
                                                       repeat(self.file, n), self.offsets, self.entries, self.crcs,
                                                       repeat(None, n), repeat(0, n)))
            for i, one in self._one.items():
                made[i] = one
            self._made = made
        return self._made


@record
class TensorRecord:
    key: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements
    storage: StorageRecord | None
    device: str
    requires_grad: bool = False
    is_parameter: bool = False

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(self.dtype)

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    @property
    def span_bytes(self) -> int:
        """Bytes of its storage the tensor can touch, from its storage offset on."""
        return (span_elements(self.shape, self.stride) or 0) * element_size(self.dtype)

    @property
    def file_offset(self) -> int | None:
        if self.storage is None:
            return None
        return self.storage.offset + self.storage_offset * element_size(self.dtype)


class TensorTable(Sequence):
    """A checkpoint's tensors held column-wise: keys, dtypes, shapes, strides, storage offsets, devices and storages in
    a few lists, read by the stages that pass over every tensor (analysis, JSON, the table) without a Python object
    per tensor. As a sequence it is the tuple of TensorRecords it stands for: a record (and a safetensors storage's
    StorageRecord) is made only when a caller asks for one, then all of them once.

    Storages are a list of StorageRecord (None: no storage); or StorageColumns (a torch zip's) with each tensor's
    position in them, `storage_at` (None: tensor i reads storage i, one each); or, for a safetensors file, where
    every tensor owns its bytes, `file` with each tensor's absolute byte offset and byte count, its StorageRecord
    named by its key."""

    __slots__ = ("keys", "dtypes", "shapes", "offsets", "devices", "requires_grad", "is_parameter", "_strides",
                 "_storages", "_file", "_file_offsets", "_nbytes", "_records", "checked", "_idents", "_at",
                 "_shape_kinds")

    def __init__(self, keys: Any, dtypes: Any, shapes: Any, strides: Any = None, offsets: Any = None,
                 devices: Any = None, storages: Any = None, requires_grad: Any = None, is_parameter: Any = None, *,
                 file: Path | None = None, file_offsets: Any = None, nbytes: Any = None,
                 storage_at: list[int] | None = None) -> None:
        n = len(keys)
        self.keys, self.dtypes, self.shapes = keys, dtypes, shapes
        self._strides = strides  # None: contiguous, made from the shapes when asked for
        self.offsets = offsets if offsets is not None else [0] * n  # storage offsets, in elements
        self.devices = devices if devices is not None else ["cpu"] * n
        self.requires_grad = requires_grad  # None: all False
        self.is_parameter = is_parameter  # None: all False
        self._storages, self._file, self._file_offsets, self._nbytes = storages, file, file_offsets, nbytes
        self._at = storage_at
        self._shape_kinds: tuple[list[int], dict[int, tuple[int, ...]]] | None = None
        self._records: tuple[TensorRecord, ...] | None = None
        self._idents: list[tuple[str, str] | None] | None = None
        # Set by a reader that checked its columns: keys, dtypes, devices and storage keys are str, shapes tuples of
        # int (not bool): the JSON of a row can then be written without asking the encoder about each value.
        self.checked = False

    @classmethod
    def of(cls, tensors: Any) -> TensorTable:
        """`tensors` as columns: itself when it is a table, else the columns of its records (kept as its records)."""
        if type(tensors) is cls:
            return tensors
        records = tuple(tensors)
        table = cls([t.key for t in records], [t.dtype for t in records], [t.shape for t in records],
                    [t.stride for t in records], [t.storage_offset for t in records], [t.device for t in records],
                    [t.storage for t in records], [t.requires_grad for t in records],
                    [t.is_parameter for t in records])
        table._records = records
        return table

    def take(self, positions: list[int]) -> TensorTable:
        """The tensors at these positions, as a table of their own (an --filter's)."""
        def pick(column: Any) -> Any:
            return None if column is None else [column[i] for i in positions]

        columns = type(self._storages) is StorageColumns
        at = (positions if self._at is None else pick(self._at)) if columns else None
        table = TensorTable(pick(self.keys), pick(self.dtypes), pick(self.shapes), pick(self._strides),
                            pick(self.offsets), pick(self.devices), self._storages if columns else pick(self._storages),
                            pick(self.requires_grad), pick(self.is_parameter), file=self._file,
                            file_offsets=pick(self._file_offsets),
                            nbytes=pick(self._nbytes) if self._storages is None else None, storage_at=at)
        table.checked = self.checked
        return table

    @property
    def strides(self) -> Any:
        if self._strides is None:
            made: dict[tuple[int, ...], tuple[int, ...]] = {}  # most shapes repeat: each made once
            strides = []
            for shape in self.shapes:
                stride = made.get(shape)
                if stride is None:
                    stride = made[shape] = contiguous_strides(shape)
                strides.append(stride)
            self._strides = strides
        return self._strides

    def shape_kinds(self) -> tuple[list[int], dict[int, tuple[int, ...]]]:
        """Each tensor's shape's id, and the shapes by id, once each: a reader hands out one tuple a distinct shape (a
        checkpoint repeats a few), so what is made of a shape is made once a tuple (by its id, not its value: a file
        chooses the hashes of its tuples of ints)."""
        if self._shape_kinds is None:
            ids = list(map(id, self.shapes))
            self._shape_kinds = ids, dict(zip(ids, self.shapes))
        return self._shape_kinds

    def check_types(self) -> TensorTable:
        """Sets `checked` when every key, dtype, device and storage key is a str and every shape a tuple of int."""
        text, tuples, ints = {str}, {tuple}, {int}  # each column's types, as sets made at C speed
        self.checked = set(map(type, self.keys)) <= text and set(map(type, self.dtypes)) <= text \
            and set(map(type, self.devices)) <= text and set(map(type, self.storage_keys())) <= {str, type(None)} \
            and set(map(type, self.shapes)) <= tuples \
            and set(map(type, chain.from_iterable(self.shape_kinds()[1].values()))) <= ints
        return self

    @property
    def owns_storages(self) -> bool:
        """Every tensor has a storage of its own (a safetensors file): none shares bytes with another."""
        return self._storages is None

    def nbytes(self) -> list[int]:
        """Each tensor's bytes (numel × element size), as TensorRecord.nbytes."""
        if self._nbytes is not None:
            return self._nbytes
        if len(set(self.dtypes)) == 1:  # each distinct shape multiplied out once
            size = element_size(self.dtypes[0])
            ids, shapes = self.shape_kinds()
            out = list(map({at: prod(shape) * size for at, shape in shapes.items()}.__getitem__, ids))
            self._nbytes = out
            return out
        sizes: dict[str, int] = {}
        out = []
        for shape, dtype in zip(self.shapes, self.dtypes):
            size = sizes.get(dtype)
            if size is None:
                size = sizes[dtype] = element_size(dtype)
            out.append(prod(shape) * size)
        self._nbytes = out
        return out

    def storage_keys(self) -> list[str | None]:
        """Each tensor's storage key (None: no storage)."""
        storages = self._storages
        if storages is None:
            return self.keys
        if type(storages) is StorageColumns:
            return storages.keys if self._at is None else list(map(storages.keys.__getitem__, self._at))
        return [None if s is None else s.key for s in storages]

    def storage_idents(self) -> list[tuple[str, str] | None]:
        """Each tensor's StorageRecord.ident (None: no storage): tensors with the same one share bytes."""
        if self._idents is not None:
            return self._idents
        if self._storages is None:
            name = str(self._file)
            self._idents = [(name, k) for k in self.keys]
            return self._idents
        if type(self._storages) is StorageColumns:  # one file
            self._idents = list(zip(repeat(str(self._storages.file)), self.storage_keys()))
            return self._idents
        names: dict[int, str] = {}
        out: list[tuple[str, str] | None] = []
        for s in self._storages:
            if s is None:
                out.append(None)
                continue
            name = names.get(id(s.file))
            if name is None:
                name = names[id(s.file)] = str(s.file)
            out.append((name, s.key))
        self._idents = out
        return out

    def shares_storages(self) -> bool:
        """Whether two tensors read one storage (tied weights, views), or a tensor has none: else each tensor's
        bytes are its own."""
        if self._storages is None:
            return False
        if type(self._storages) is StorageColumns:  # a position a storage, and every tensor has one
            return self._at is not None and len(set(self._at)) != len(self._at)
        idents = self.storage_idents()
        return len(set(idents)) != len(idents) or None in idents

    def storage_nbytes(self) -> list[int | None]:
        storages = self._storages
        if storages is None:
            return self._nbytes
        if type(storages) is StorageColumns:
            return storages.nbytes if self._at is None else list(map(storages.nbytes.__getitem__, self._at))
        return [None if s is None else s.nbytes for s in storages]

    def storage_totals(self) -> tuple[int, int]:
        """(bytes, count) of the distinct storages the tensors read (tensors without one read none)."""
        storages = self._storages
        if storages is None:  # a storage a tensor, each under its own key
            return sum(self.nbytes()), len(self.keys)
        if type(storages) is StorageColumns:
            if self._at is None:
                return sum(storages.nbytes), len(storages.nbytes)
            used = set(self._at)
            return sum(map(storages.nbytes.__getitem__, used)), len(used)
        idents = self.storage_idents()
        sizes = dict(zip(idents, self.storage_nbytes())) if None not in idents else \
            {ident: nbytes for ident, nbytes in zip(idents, self.storage_nbytes()) if ident is not None}
        return sum(sizes.values()), len(sizes)

    def records(self) -> tuple[TensorRecord, ...]:
        """The TensorRecords, made on the first call."""
        if self._records is None:
            n = len(self.keys)
            storages = self._storages
            if type(storages) is StorageColumns:
                made = storages.records()
                storages = made if self._at is None else list(map(made.__getitem__, self._at))
            elif storages is None:
                file, at, nbytes = self._file, self._file_offsets, self._nbytes
                storages = [fast_new(StorageRecord, key=k, dtype=d, nbytes=nb, device="cpu", file=file, offset=o,
                                     entry="", crc=None, assembly=None, deflated=0)
                            for k, d, nb, o in zip(self.keys, self.dtypes, nbytes, at)]
            grads = self.requires_grad or [False] * n
            params = self.is_parameter or [False] * n
            self._records = tuple(
                fast_new(TensorRecord, key=k, dtype=d, shape=sh, stride=st, storage_offset=o, storage=s, device=dev,
                         requires_grad=g, is_parameter=p)
                for k, d, sh, st, o, s, dev, g, p in zip(self.keys, self.dtypes, self.shapes, self.strides,
                                                          self.offsets, storages, self.devices, grads, params))
        return self._records

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: Any) -> Any:
        return self.records()[index]

    def __iter__(self) -> Any:
        return iter(self.records())

    def __reversed__(self) -> Any:
        return reversed(self.records())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TensorTable, tuple)):
            return self.records() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.records())

    def __add__(self, other: Any) -> Any:
        return self.records() + tuple(other)

    def __radd__(self, other: Any) -> Any:
        return tuple(other) + self.records()

    def __repr__(self) -> str:
        return repr(self.records())

    def __reduce__(self) -> Any:  # pickled (a worker's result) and copied as the tuple it stands for
        return tuple, (self.records(),)


@record
class OutTensor:
    """A tensor as an output will hold it: its key there, the source it is read from, its dtype and device tag (what
    `fix` plans and every writer takes)."""

    key: str  # full key in the output
    source: TensorRecord
    dtype: str
    device: str


@record
class Hazard:
    """A finding about a file rather than one global: TorchScript code, an archive torch could read two ways."""

    verdict: Verdict
    what: str
    beside: bool = False  # about another file of the folder (a training_args.bin beside the weights), not this one


@record
class SharedGroup:
    """Tensors that read the same storage (tied weights, views)."""

    storage_key: str
    keys: tuple[str, ...]
    same_bytes: bool  # True when every tensor covers exactly the same bytes (tied weights)


@record
class DcpFolder:
    """What a torch.distributed.checkpoint folder is (inspect's `distributed`, its JSON keys in this order)."""

    files: int
    ranks: int
    variant: tuple[str, ...]  # how it was written: a .metadata per rank, Lightning's meta.pt, the HF storage writer
    tensors: int
    sharded_tensors: int
    values: int
    version: Any = None  # the .metadata's version (the HF storage writer writes none)
    hf_writer: bool = False  # safetensors shards of torch's Hugging Face storage writer, no .metadata
    rank_differences: tuple[dict, ...] = ()  # items the ranks saved with different bytes (JSON records)
    contents: tuple[str, ...] = ()  # the entries of a nested tree, for the summary's `contents` line
    fix_notes: tuple[str, ...] = ()  # what `fix` says about writing it, whatever part it writes
    integer_state_keys: tuple[str, ...] = ()  # optimizer states whose keys were made integers again (fix's note)

    def json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": "torch.distributed.checkpoint"}
        if not self.hf_writer:
            out["version"] = self.version
        out.update(files=self.files, ranks=self.ranks, variant=list(self.variant), tensors=self.tensors,
                   sharded_tensors=self.sharded_tensors, values=self.values)
        if self.rank_differences:
            out["rank_differences"] = list(self.rank_differences)
        if self.contents:
            out["contents"] = list(self.contents)
        if not self.hf_writer:
            out["fix_notes"] = list(self.fix_notes)
            if self.integer_state_keys:
                out["fix_notes"].append(integer_keys_note(self.integer_state_keys))
        return out


def integer_keys_note(paths: Sequence[str]) -> str:
    """What inspect, and fix when it writes one of them, say of optimizer states whose keys were made integers
    again."""
    return (f"optimizer state keys at {', '.join(paths[:3])} are integers again: DCP saves them as strings, and "
            "Optimizer.load_state_dict matches state to the integer ids in param_groups")


@record
class DeepSpeedFolder:
    """What a DeepSpeed save folder is (inspect's `distributed`)."""

    zero_stage: int | None
    ranks: int
    tag: str
    files: int
    offered: tuple[str, ...]  # the state_dicts `--select` can pick
    fix_notes: tuple[str, ...] = ()

    def json(self) -> dict[str, Any]:
        return {"format": "deepspeed", "zero_stage": self.zero_stage, "ranks": self.ranks, "tag": self.tag,
                "files": self.files, "offered": list(self.offered), "fix_notes": list(self.fix_notes)}


@record
class DistributedShard:
    """One rank's file of a distributed checkpoint opened alone: parts of tensors, whole only in `shard_of`."""

    family: str  # "torch.distributed.checkpoint" or "deepspeed"
    shard_of: str  # the folder that holds whole tensors
    fix_notes: tuple[str, ...] = ()

    def json(self) -> dict[str, Any]:
        return {"format": self.family, "shard_of": self.shard_of}


@record
class Checkpoint:
    path: Path
    format: Format
    tensors: tuple[TensorRecord, ...]
    metadata: dict[str, Any]
    globals: tuple[GlobalRef, ...]
    state_dict_root: str | None
    other_state_dicts: tuple[str, ...] = ()
    root: Any = None  # the unpickled tree of plain containers and records (torch formats)
    model_class: str | None = None  # whole-model pickle: the class it names (never imported)
    notes: tuple[str, ...] = ()
    files: tuple[Path, ...] = ()
    non_persistent: tuple[str, ...] = field(default=())  # buffers a whole-model pickle marks non-persistent
    hazards: tuple[Hazard, ...] = ()
    layouts: dict[str, str] = field(default_factory=dict)  # key -> how a distributed checkpoint holds it
    value_bits: dict[str, str] = field(default_factory=dict)  # key -> "conj", "neg": its values are not its bytes
    tensor_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> its Python attributes' names
    distributed: DcpFolder | DeepSpeedFolder | DistributedShard | None = None  # what a distributed checkpoint is
    longer_storages: tuple[str, ...] = ()  # zip members longer than their storage, whose size torch.load refuses
    advice: tuple[tuple[str, Any], ...] = ()  # (what for, advice.Suggestion): the commands its notes print
    # the globals of the pickles torch.load itself unpickles, where the reader unpickled those alone (a torch zip's
    # data.pkl, a legacy file's five pickles); None: every global counts. `globals` also has what other loaders
    # would meet (np.load's view of a member, a pickle torch never reads), which torch.load's verdict leaves out.
    loaded_globals: tuple[GlobalRef, ...] | None = None
    # where globals off the allow-list are named, every place (`globals` keeps one place a name): two .npy tensors
    # that name os.system, a byte string pickle that names what data.pkl names
    finding_sources: tuple[str, ...] = ()

    @property
    def finding_places(self) -> tuple[str, ...]:
        """Every place a global off the allow-list is named, as far as the reader kept them."""
        return tuple(dict.fromkeys([*self.finding_sources, *(g.source for g in self.unsafe_globals)]))

    @property
    def unsafe_globals(self) -> tuple[GlobalRef, ...]:
        """Globals off the allow-list: what torch.load(weights_only=False) would import and call."""
        return tuple(g for g in self.globals if g.verdict is not Verdict.SAFE)

    @property
    def dangerous_globals(self) -> tuple[GlobalRef, ...]:
        return tuple(g for g in self.globals if g.verdict is Verdict.DANGEROUS)

    @property
    def verdict(self) -> Verdict:
        """The worst of its globals and hazards: safe, code or dangerous."""
        return max([g.verdict for g in self.globals] + [h.verdict for h in self.hazards], key=lambda v: v.rank,
                   default=Verdict.SAFE)

    def finding_names(self) -> tuple[str, ...]:
        names = [f"{g.qualname} ({g.verdict.value})" for g in self.unsafe_globals]
        names += [f"{h.what} ({h.verdict.value})" for h in self.hazards]
        return tuple(dict.fromkeys(names))

    def refuse_if_unsafe(self, action: str, way_out: str = "", *, code_too: bool = True, reruns: tuple = ()) -> None:
        """Raise (exit 1) when the file would run code under torch.load(weights_only=False): nothing is loaded,
        rewritten or run from it. With `code_too=False` only dangerous findings refuse (a whole pickled model,
        which names its classes, can still be rescued tensor by tensor)."""
        worst = self.verdict
        if worst is Verdict.SAFE or worst is Verdict.CODE and not code_too:
            return

        names = self.finding_names()
        shown = ", ".join(names[:4]) + (f", … {len(names) - 4} more" if len(names) > 4 else "")
        raise ReadError(f"{self.path}: would run code under torch.load(weights_only=False) ({shown}); refusing to "
                        f"{action}" + (f". {way_out}" if way_out else ""), names, reruns=reruns)

    def recorded_ties(self, root: str | None = "") -> tuple[tuple[str, str], ...]:
        """(alias, key) for each tied name a safetensors file holds once, as `fix` records them in its header
        (`ckpt_doctor.tied`: alias=key,…, the alias the tensor of key): those of both names under `root`, named
        relative to it (as the state_dict there is keyed)."""
        text = self.metadata.get("ckpt_doctor.tied") if self.format is Format.SAFETENSORS else None
        if not isinstance(text, str) or root is None:
            return ()
        prefix = root + "." if root else ""
        pairs = (entry.partition("=") for entry in text.split(","))
        return tuple((alias[len(prefix):], key[len(prefix):]) for alias, sep, key in pairs
                     if sep and alias.startswith(prefix) and key.startswith(prefix)
                     and len(alias) > len(prefix) and len(key) > len(prefix))

    @property
    def big_endian(self) -> bool:
        """Saved on a big-endian machine (its `byteorder` record): its tensor bytes are not little-endian ones."""
        return any(n.startswith("saved on a big-endian machine") for n in self.notes)

    def refuse_values(self, action: str) -> None:
        """Refuse reading tensor values where ckpt-doctor would read them wrong: big-endian bytes it does not swap
        yet; quantized tensors (their scale and zero point are not in the records)."""

        if self.big_endian and any(element_size(t.dtype) > 1 for t in self.tensors):
            raise ReadError(f"{self.path}: saved on a big-endian machine, and ckpt-doctor does not swap tensor bytes "
                            f"yet, so it does not {action}; torch.load reads the file (it swaps them)")

    @property
    def devices(self) -> tuple[str, ...]:
        tensors = self.tensors
        return tuple(sorted(set(tensors.devices) if type(tensors) is TensorTable else {t.device for t in tensors}))

    def state_dict_keys(self) -> list[str]:
        """The keys of state_dict_tensors(), without making their records."""
        root = self.state_dict_root
        if root is None:
            return []
        keys = TensorTable.of(self.tensors).keys
        if root == "":
            return list(keys)
        prefix = root + "."
        cut = len(prefix)
        return [k[cut:] for k in keys if k.startswith(prefix)]

    def state_dict_tensors(self) -> tuple[TensorRecord, ...]:
        """Tensors under the state_dict root, keyed relative to it."""
        return tuple(relative_to_root(self.tensors, self.state_dict_root))


def ancestors(path: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`, `a.b.c`]: a dotted path (a key, a module) and every path above it; none for ""."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def tied_names(named: Iterable[tuple[str, TensorRecord]]) -> dict[str, str]:
    """Each name whose tensor an earlier name holds (one storage, offset, shape, stride and dtype: tied weights) →
    that earlier name."""
    seen: dict[tuple, str] = {}
    tied = {}
    for key, r in named:
        if r.storage is None:
            continue
        ident = (*r.storage.ident, r.storage_offset, r.shape, r.stride, r.dtype)
        if ident in seen:
            tied[key] = seen[ident]
        else:
            seen[ident] = key
    return tied


def relative_to_root(tensors, root: str | None):
    if root is None:
        return []
    if root == "":
        return list(tensors)
    prefix = root + "."

    return [replace(t, key=t.key[len(prefix):]) for t in tensors if t.key.startswith(prefix)]
