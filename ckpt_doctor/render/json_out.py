"""JSON renderings of result objects, with the stable field names docs/cli.md lists for each command's --json."""

from __future__ import annotations

import math
from itertools import chain, repeat
from math import prod

from ..dtypes import element_size
from ..readers.source import usage
from ..records import GlobalRef, TensorTable
from ..report import InspectReport

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any, Callable


def _num(x: float | None) -> float | str | None:
    if x is None:
        return None
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return x


def global_json(g: GlobalRef) -> dict[str, Any]:
    return {"global": g.qualname, "verdict": g.verdict.value, "reason": g.reason, "source": g.source}


def inspect_json(report: InspectReport, *, encoded_rows: bool = False) -> dict[str, Any]:
    """`inspect --json`'s data. With `encoded_rows`, for `dumps` only: its `tensors` are written from the table's
    columns when the reader checked their types (str keys, int shapes), without a dict per tensor (20,000 rows
    through the encoder one by one cost three times as much)."""
    ckpt = report.checkpoint
    table = TensorTable.of(report.tensors)
    layouts, stats = ckpt.layouts, report.stats
    tensors = _EncodedRows(table, layouts) if encoded_rows and table.checked and stats is None else \
        _rows(table, layouts, stats)
    out: dict[str, Any] = {
        "ok": report.exit_code == 0,
        "exit_code": report.exit_code,
        "problems": list(report.problems),
        "path": str(ckpt.path),
        "format": ckpt.format.value,
        "tensors": tensors,
        "state_dict_root": ckpt.state_dict_root,
        "prefixes": list(dict.fromkeys(p.prefix for p in report.prefixes if p.certain)),
        "prefix_details": [{"prefix": p.prefix, "where": p.where, "count": p.count, "of": p.total,
                            "certain": p.certain} for p in report.prefixes],
        "metadata": ckpt.metadata,
        "verdict": ckpt.verdict.value,
        "unsafe_globals": [g.qualname for g in ckpt.unsafe_globals],
        "globals": [global_json(g) for g in ckpt.globals if g.verdict.value != "safe"],
        "hazards": [{"verdict": h.verdict.value, "what": h.what} for h in ckpt.hazards],
        "tensor_count": len(ckpt.tensors),
        "parameter_count": report.parameter_count,
        "buffer_count": report.buffer_count,
        "total_bytes": report.total_bytes,
        "devices": list(ckpt.devices),
        "shared": [{"storage": g.storage_key, "keys": list(g.keys), "tied": g.same_bytes} for g in report.shared],
        "other_state_dicts": list(ckpt.other_state_dicts),
        "model_class": ckpt.model_class,
        "non_persistent_buffers": list(ckpt.non_persistent),
        "notes": list(ckpt.notes) + list(report.extra_notes),
    }
    if ckpt.distributed is not None:
        out["distributed"] = ckpt.distributed.json()
    _remote(out)
    if len(ckpt.files) > 1:
        out["files"] = [str(f) for f in ckpt.files]
    if report.stats is not None:
        out["batchnorm_at_init"] = list(report.batchnorm_at_init)
    if report.filter:
        out["filter"] = report.filter
    if report.missing_devices:
        out["missing_devices"] = list(report.missing_devices)
    if report.value_diffs is not None:
        out["value_diffs"] = report.value_diffs
    if report.default_load is not None:
        out["default_load"] = report.default_load.json()
    out["suggested_commands"] = [dict(s.json(), label=label) for label, s in report.suggestions]
    if report.comparison is not None:
        # only with --model: compare_out brings compare, modelspec and transforms, which plain --json never pays for
        from .compare_out import comparison_json, needs_code_text  # noqa: PLC0415

        out["comparison"] = comparison_json(report.comparison, needs_code_text(ckpt) if report.needs_code else "")
    return out


def _rows(table: TensorTable, layouts: dict[str, str], stats: dict[str, Any] | None) -> list[dict[str, Any]]:
    rows = []
    for key, shape, dtype, device, nbytes, storage in zip(table.keys, table.shapes, table.dtypes, table.devices,
                                                          table.nbytes(), table.storage_keys()):
        item: dict[str, Any] = {"key": key, "shape": list(shape), "dtype": dtype, "device": device, "nbytes": nbytes}
        if storage is not None:
            item["storage"] = storage
        if layouts and key in layouts:
            item["layout"] = layouts[key]
        if stats is not None:
            s = stats.get(key)
            item["stats"] = None if s is None else {
                "min": _num(s.min), "max": _num(s.max), "mean": _num(s.mean), "std": _num(s.std),
                "nan": s.nan, "inf": s.inf}
        rows.append(item)
    return rows


class _EncodedRows:
    """inspect's `tensors` as `dumps` writes them, from a checked table's columns: each line what the encoder makes
    of the row's dict."""

    def __init__(self, table: TensorTable, layouts: dict[str, str]) -> None:
        self.table, self.layouts = table, layouts

    def __bool__(self) -> bool:
        return bool(len(self.table))

    def block(self) -> str | None:
        """The rows, one a line, each line after the first indented under the first: what `dumps` writes between the
        list's brackets."""
        try:
            return self._block(self.table, _encode_text())
        except TypeError:  # a value that is not what the reader checked: the encoder decides
            return None

    def dicts(self) -> list[dict[str, Any]]:
        return _rows(self.table, self.layouts, None)

    def _block(self, table: Any, text: Callable[[str], str]) -> str:
        layouts = self.layouts
        keys, shapes = table.keys, table.shapes
        storages = table.storage_keys()
        if not layouts and None not in storages:  # every row alike: the text interleaved from columns by C loops
            return self._alike(table, text, keys, shapes, storages)
        dtypes = {d: text(d) for d in set(table.dtypes)}
        devices = {d: text(d) for d in set(table.devices)}
        # A reader hands out one tuple a distinct shape (a checkpoint repeats a few): each written once, by the
        # tuple's id (not its value: a file chooses the hashes of its tuples of ints).
        ids = list(map(id, shapes))
        written = {at: ", ".join(map(str, shape)) for at, shape in dict(zip(ids, shapes)).items()}
        out = []
        for key, dims, dtype, device, nbytes, storage in zip(keys, map(written.__getitem__, ids),
                                                             map(dtypes.__getitem__, table.dtypes),
                                                             map(devices.__getitem__, table.devices),
                                                             table.nbytes(), storages):
            line = (f'{{"key": {text(key)}, "shape": [{dims}], "dtype": {dtype}, "device": {device}, '
                    f'"nbytes": {nbytes}')
            if storage is not None:
                line += f', "storage": {text(storage)}'
            if layouts and key in layouts:
                line += f', "layout": {text(layouts[key])}'
            out.append(line + "}")
        return ",\n    ".join(out)

    @staticmethod
    def _alike(table: Any, text: Callable[[str], str], keys: list[str], shapes: list[tuple],
               storages: list[str]) -> str:
        """The rows of a table whose every tensor has a storage, no layout: per row, its key, the text from its key
        to its storage (written once for each distinct shape, dtype and device: its nbytes too, where that is
        numel × element size), and its storage."""
        dtypes, devices = table.dtypes, table.devices
        ids, distinct = table.shape_kinds()
        one = len(set(dtypes)) == 1 and len(set(devices)) == 1
        # nbytes is numel × element size but for a safetensors file's (its header's offsets): written per row then
        by_shape = not table.owns_storages
        if one:
            signatures: Any = ids
            kinds = {at: (shape, dtypes[0], devices[0]) for at, shape in distinct.items()}
        else:
            signatures = list(zip(ids, dtypes, devices))
            kinds = {signature: (distinct[signature[0]], *signature[1:]) for signature in set(signatures)}
        middle = {}
        for signature, (shape, dtype, device) in kinds.items():
            head = f', "shape": [{", ".join(map(str, shape))}], "dtype": {text(dtype)}, "device": {text(device)}, ' \
                   '"nbytes": '
            middle[signature] = f'{head}{prod(shape) * element_size(dtype)}, "storage": ' if by_shape else head
        encoded = list(map(text, keys))
        columns = [encoded, map(middle.__getitem__, signatures)]
        if not by_shape:
            columns += [map(str, table.nbytes()), repeat(', "storage": ')]
        columns += [encoded if storages is keys else map(text, storages), repeat(_ROW_BREAK)]
        return '{"key": ' + "".join(chain.from_iterable(zip(*columns)))[:-len(_ROW_BREAK)] + "}"


_ROW_BREAK = '},\n    {"key": '


def _item_encoder() -> Callable[[Any], str]:
    """One compact-line encoder, built once: `json.dumps` makes a new encoder per call, which is half the time
    of writing 20,000 tensor rows. Falls back to the pure-Python encoder where the C one is missing."""
    try:  # the C encoder itself: the json package would bring its decoder, which inspect never uses
        from _json import make_encoder
    except ImportError:
        import json

        return json.JSONEncoder(ensure_ascii=False, default=str).encode
    iterencode = make_encoder(None, str, _encode_text(), None, ": ", ", ", False, False, True)
    return lambda value: "".join(iterencode(value, 0))


def _encode_text() -> Callable[[str], str]:
    """json.encoder.encode_basestring (a str as JSON writes it, non-ASCII kept), without the json package."""
    try:
        from _json import encode_basestring
    except ImportError:
        from json.encoder import encode_basestring
    return encode_basestring


def dumps(data: Any) -> str:
    """Indented at the top two levels, each list item on one line: readable, and fast on 20k tensors."""
    enc = _item_encoder()
    parts = []
    for key, value in data.items():
        if type(value) is _EncodedRows:
            inner = value.block() if value else None
            if inner is not None:
                parts.append(f"  {enc(key)}: [\n    {inner}\n  ]")
                continue
            value = value.dicts()
        if isinstance(value, list) and value:
            inner = ",\n    ".join(map(enc, value))
            parts.append(f"  {enc(key)}: [\n    {inner}\n  ]")
        else:
            parts.append(f"  {enc(key)}: {enc(value)}")
    return "{\n" + ",\n".join(parts) + "\n}"


def _remote(out: dict[str, Any]) -> None:
    """Bytes and requests used over the network (https://, s3://), when any were."""
    used = usage()
    if used is not None:
        out["remote"] = used
