"""Whether `torch.load(path)` with torch's defaults loads a file on this machine: since torch 2.6 that is
`weights_only=True`, whose unpickler refuses every global off torch's own allow-list (an `argparse.Namespace` that
ckpt-doctor knows to be inert included), TorchScript archives and pre-0.4 tar files; and without `map_location` a
tensor saved on a device this machine lacks fails. Worked out from what the readers found; torch is not imported."""

from __future__ import annotations

from ._record import record
from .devices import missing_devices
from .records import Checkpoint, Format, Verdict
from .safepickle.policy import TORCH_WEIGHTS_ONLY, GlobalRef, resolve

# Formats torch.load opens, and why it refuses the others with its defaults.
_OPENS = (Format.TORCH_ZIP, Format.TORCH_LEGACY, Format.SAFETENSORS)
_PICKLES_READ = (Format.TORCH_ZIP, Format.TORCH_LEGACY)  # formats whose readers unpickle what torch.load unpickles
_REFUSES = {
    Format.TORCHSCRIPT: "a TorchScript archive, which torch.load refuses with weights_only=True (torch.jit.load "
                        "would run its code)",
    Format.TORCH_TAR: "torch's pre-0.4 tar format, which torch.load refuses with weights_only=True",
    Format.PICKLE: "a bare pickle, not a torch.save file: torch.load with weights_only=True refuses it",
}


# Globals for which `torch.serialization.add_safe_globals([...])` is all torch's weights_only unpickler needs (each
# rebuilt by NEWOBJ/REDUCE and BUILD of plain data; checked against torch by tests/test_journeys.py). Others the
# allow-list holds need more than their own name — NumPy arrays their dtype classes under numpy._core's spelling, a
# defaultdict its factory — and are rescued by `fix` instead.
ADD_SAFE_GLOBALS_SUFFICES = frozenset({
    "argparse.Namespace", "datetime.date", "datetime.datetime", "datetime.time", "datetime.timedelta",
    "datetime.timezone", "pathlib.PosixPath", "pathlib.PurePosixPath", "pathlib.Path", "builtins.frozenset",
    "builtins.slice", "builtins.range",
})


@record
class DefaultLoad:
    """The verdict of `torch.load(path)` with torch's defaults, here."""

    applies: bool  # a file torch.load is pointed at (a folder of shards or ranks is read by its own loader)
    refused: tuple[str, ...] = ()  # globals torch's weights_only unpickler refuses, by name
    inert: tuple[str, ...] = ()  # of those, the ones ckpt-doctor knows to be inert records: add_safe_globals helps
    missing_devices: tuple[str, ...] = ()  # saved devices this machine lacks: torch.load needs map_location
    format_reason: str = ""  # a format torch.load refuses outright
    longer_storages: tuple[str, ...] = ()  # storages whose record size torch.load refuses (longer than the pickle's)

    @property
    def ok(self) -> bool:
        return not self.applies or not (self.refused or self.missing_devices or self.format_reason
                                        or self.longer_storages)

    def reasons(self) -> list[str]:
        out = [self.format_reason] if self.format_reason else []
        if self.longer_storages:
            many = len(self.longer_storages) > 1
            out.append(f"{', '.join(self.longer_storages[:3])}{', …' if len(self.longer_storages) > 3 else ''} "
                       f"hold{'' if many else 's'} more bytes than {'their storages' if many else 'its storage'} "
                       "(torch checks each record's size)")
        if self.refused:
            told = self.told_first
            shown = ", ".join(told[:4]) + (f", … {len(told) - 4} more" if len(told) > 4 else "")
            out.append(f"its weights_only unpickler refuses {shown}")
        if self.missing_devices:
            out.append(f"saved on {', '.join(self.missing_devices)}, which this machine lacks (map_location needed)")
        return out

    @property
    def told_first(self) -> list[str]:
        """The refused globals, NumPy's last: an array's five or six dtype and reconstruct globals listed first hid
        the one that says what the file holds (an argparse.Namespace) behind '… 1 more'."""
        return sorted(self.refused, key=lambda name: name.startswith("numpy."))

    def brief(self) -> str:
        """A few words for a table cell: `torch.load refuses argparse.Namespace`."""
        if self.format_reason:
            return "torch.load refuses its format"
        if self.longer_storages:
            return "torch.load refuses its storage sizes"
        if self.refused:
            return "torch.load refuses " + ", ".join(self.told_first[:2]) + (", …" if len(self.refused) > 2 else "")
        return "torch.load needs map_location (" + ", ".join(self.missing_devices[:2]) + ")"

    @property
    def trusted_way_out(self) -> tuple[str, ...]:
        """The globals to hand torch.serialization.add_safe_globals when that is all the file needs (every refused
        one an inert record ckpt-doctor knows); empty when it needs more (its code, another format)."""
        if self.format_reason or self.longer_storages or not self.refused \
                or not set(self.refused) <= ADD_SAFE_GLOBALS_SUFFICES:
            return ()
        return self.refused

    def json(self) -> dict[str, object]:
        return {"applies": self.applies, "ok": self.ok, "refused_globals": list(self.refused),
                "add_safe_globals": list(self.trusted_way_out), "missing_devices": list(self.missing_devices),
                "reason": "; ".join(self.reasons()) or None}


def met_by_torch(ckpt: Checkpoint) -> tuple[GlobalRef, ...]:
    """The globals torch.load's unpickler meets: of a torch zip or legacy file, those of the pickles the reader
    unpickled as torch.load does (not a pickle np.load would find in a member, nor one torch never reads)."""
    return ckpt.loaded_globals if ckpt.loaded_globals is not None and ckpt.format in _PICKLES_READ else ckpt.globals


def default_load(ckpt: Checkpoint) -> DefaultLoad:
    """What `torch.load(ckpt.path)` does here with torch's defaults."""
    if ckpt.format not in _OPENS and ckpt.format not in _REFUSES:
        return DefaultLoad(applies=False)
    if getattr(ckpt.distributed, "family", None) == "torch.distributed.checkpoint":  # a .distcp file: archives end
        return DefaultLoad(applies=False)  # to end, which dcp.load reads one by one from the folder's metadata, and
        # of which torch.load(path) opens at most one
    if ckpt.format is Format.PICKLE and any(g.module.startswith("torch.distributed.checkpoint.") for g in
                                            ckpt.globals):  # a DCP folder's .metadata: dcp's reader unpickles it
        return DefaultLoad(applies=False)
    refused: dict[str, None] = {}
    inert: dict[str, None] = {}
    for g in met_by_torch(ckpt):
        if "→ nested pickle" in g.source:  # a pickle inside a byte string: torch.load never unpickles it
            continue
        full = ".".join(resolve(g.module, g.name))
        if full not in TORCH_WEIGHTS_ONLY:
            refused[full] = None
            if g.verdict is Verdict.SAFE:
                inert[full] = None
    devices = () if ckpt.format is Format.SAFETENSORS else tuple(missing_devices(ckpt.devices))
    return DefaultLoad(True, tuple(refused), tuple(inert), devices, _REFUSES.get(ckpt.format, ""),
                       ckpt.longer_storages)
