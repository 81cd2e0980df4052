"""The DCP chunk items read on their template (readers/dcp_items.py) against the general reading of the same bytes
(survey_item, read_torch_zip): for folders torch's own dcp.save wrote, and for many mutations of an item's bytes,
the template's reading gives exactly the general reading's result — the same pieces, field by field, the same
globals, hazards and notes, the same error — or declines the item, which is then read the general way."""

from __future__ import annotations

import io
import random
import struct
import typing
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_doctor.errors import CkptDoctorError
from ckpt_doctor.readers import dcp as dcp_reader
from ckpt_doctor.readers import dcp_items
from tests.conftest import run_cli
from tests.dcp_samples import write_samples


@pytest.fixture(autouse=True, params=["item by item", "in bulk"])
def _bulk(request, monkeypatch) -> None:
    """Every test twice: the items parsed one by one (a small folder), and parsed in bulk over each shard file (what
    a folder of many chunks gets: dcp_items.ChunkItems.prepare, and a tensor's chunks read together)."""
    monkeypatch.setattr(dcp_items, "BULK_MIN", 0 if request.param == "in bulk" else 1 << 60)
    # (items back to back checked a few at a time, ~1.6 KB each: a tampered one among others of its block is found)
    monkeypatch.setattr(dcp_items, "_CHECK_BYTES", 5000)


class _Counted(dcp_reader._Items):
    made: typing.ClassVar[list] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _Counted.made.append(self)


def _outcome(folder: Path) -> tuple:
    """What reading `folder` gives, everything the readers downstream use: each tensor's pieces (every field), the
    globals, hazards, notes and the walked bytes; or the error's text and findings."""
    import os

    try:
        ckpt = dcp_reader.read_dcp(folder, os.listdir(folder))
    except CkptDoctorError as exc:
        return ("error", str(exc), tuple(getattr(exc, "findings", ()) or ()))
    tensors = []
    for t in ckpt.tensors:
        assembly = t.storage.assembly if t.storage is not None else None
        # (a zstd item is inflated into a temporary file of its own name each time it is read)
        pieces = tuple((p.file if p.file.parent == folder else "inflated", p.offset, p.offsets, p.sizes, p.stride,
                        p.label, p.crc) for p in (assembly.pieces if assembly is not None else ()))
        tensors.append((t.key, t.dtype, t.shape, t.stride, pieces))
    return ("ok", tuple(tensors), tuple(ckpt.globals), tuple(ckpt.hazards), ckpt.notes, ckpt.layouts,
            ckpt.distributed)


def _both(folder: Path, monkeypatch) -> tuple[tuple, tuple, int]:
    """(the reading with the template, the general reading alone, items the template read)."""
    monkeypatch.setattr(dcp_reader, "_Items", _Counted)
    _Counted.made = []
    fast = _outcome(folder)
    used = sum(i.chunks.used for i in _Counted.made)
    monkeypatch.setattr(dcp_items, "ENABLED", False)
    slow = _outcome(folder)
    monkeypatch.setattr(dcp_items, "ENABLED", True)
    return fast, slow, used


def _cli_both(folder: Path, monkeypatch) -> None:
    fast = run_cli("inspect", folder, "--json")
    monkeypatch.setattr(dcp_items, "ENABLED", False)
    slow = run_cli("inspect", folder, "--json")
    monkeypatch.setattr(dcp_items, "ENABLED", True)
    assert (fast.exit_code, fast.stdout, fast.stderr) == (slow.exit_code, slow.stdout, slow.stderr)


def _real_state() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {f"layer{i}.weight": torch.randn(4, 6) for i in range(4)}  # alike items: one data.pkl, read once
    state.update({
        "bf16": torch.randn(3, 5).to(torch.bfloat16), "bf16b": torch.randn(3, 5).to(torch.bfloat16),
        "i64": torch.arange(7), "flags": torch.tensor([True, False, True]), "f16": torch.randn(2, 2, 2).half(),
        "scalar": torch.tensor(3.5), "scalar2": torch.tensor(-1.0), "empty": torch.empty(0, 4),
        "empty2": torch.empty(0, 4), "transposed": base.t(), "view": base[1:3, 2:5],
        "big": torch.randn(300, 80),  # an item over dcp_items.WHOLE: read as its head and its tail
        "big2": torch.randn(300, 80),
        "opt": {"lr": 0.1, "name": "adam", "steps": [1, 2]}, "epoch": 7,
    })
    return state


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("real") / "ckpt"
    dcp.save(_real_state(), checkpoint_id=str(folder), no_dist=True)
    return folder


def test_a_folder_dcp_save_wrote_reads_the_same_on_the_template(real, monkeypatch, tmp_path):
    fast, slow, used = _both(real, monkeypatch)
    assert fast[0] == "ok" and fast == slow
    assert used == 7  # each alike item after the first of its kind (which taught the template its pickle)
    _cli_both(real, monkeypatch)
    out_fast, out_slow = tmp_path / "fast.pt", tmp_path / "slow.pt"
    assert run_cli("fix", real, "-o", out_fast).exit_code == 0
    monkeypatch.setattr(dcp_items, "ENABLED", False)
    assert run_cli("fix", real, "-o", out_slow).exit_code == 0
    got, want = torch.load(out_fast, weights_only=True), torch.load(out_slow, weights_only=True)
    assert got.keys() == want.keys() and "big2" in got and "transposed" in got
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key
    assert torch.equal(got["transposed"], torch.arange(24, dtype=torch.float32).reshape(4, 6).t())


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    return write_samples(tmp_path_factory.mktemp("dcp"))


def test_the_two_rank_samples_read_the_same_on_the_template(samples, monkeypatch):
    folders = sorted(p for p in samples.iterdir() if p.is_dir() and any(p.glob("*.metadata")))
    assert len(folders) >= 8
    used = 0
    for folder in folders:
        fast, slow, n = _both(folder, monkeypatch)
        assert fast == slow, folder.name
        used += n
        _cli_both(folder, monkeypatch)
    assert used > 0


# --- mutations of one item's bytes ---------------------------------------------------------------------------


def _archive(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def _folder(root: Path, archives: list[bytes], cols: int = 8) -> Path:
    """A DCP folder of one float32 tensor `w` of one row a chunk, each chunk's item one of `archives`, back to back
    in one file, with torch's own metadata classes (as FileSystemWriter lays out one rank)."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    root.mkdir()
    storage, at = {}, 0
    for r, archive in enumerate(archives):
        storage[MetadataIndex("w", [r, 0], 0)] = _StorageInfo("__0_0.distcp", at, len(archive))
        at += len(archive)
    (root / "__0_0.distcp").write_bytes(b"".join(archives))
    sdm = {"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([len(archives), cols]), [
        ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, cols])) for r in range(len(archives))])}
    (root / ".metadata").write_bytes(pickle.dumps(Metadata(sdm, {"w": ("w",)}, storage, None, "1.0.0")))
    return root


def _rezip(item: bytes, deflate: tuple[str, ...] = (), extra: tuple[str, bytes] | None = None,
           order: list[str] | None = None) -> bytes:
    """The item's members written again by Python's zipfile (another writer's layout), some deflated, one added."""
    src = zipfile.ZipFile(io.BytesIO(item))
    names = order or src.namelist()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name in names:
            z.writestr(name, src.read(name), zipfile.ZIP_DEFLATED if name in deflate else zipfile.ZIP_STORED)
        if extra is not None:
            z.writestr(*extra)
    return out.getvalue()


def _members(item: bytes) -> dict[str, tuple[int, int, int]]:
    """name -> (local header offset, data offset, size), as the item's directory gives them."""
    z = zipfile.ZipFile(io.BytesIO(item))
    out = {}
    for info in z.infolist():
        nlen, xlen = struct.unpack_from("<HH", item, info.header_offset + 26)
        out[info.filename] = (info.header_offset, info.header_offset + 30 + nlen + xlen, info.file_size)
    return out


def _set_member(item: bytes, name: str, content: bytes) -> bytes:
    """The item with one member's bytes replaced by as many others, its crc32 updated where it is recorded."""
    _h, at, size = _members(item)[name]
    assert len(content) == size
    old = item[at:at + size]
    out = item[:at] + content + item[at + size:]
    return out.replace(struct.pack("<I", zlib.crc32(old)), struct.pack("<I", zlib.crc32(content)))


def _mutations(item: bytes) -> list[tuple[str, bytes]]:
    m = _members(item)
    out: list[tuple[str, bytes]] = []
    # every byte of the structure flipped (local headers, padding, data descriptors, directory, end records), and
    # bytes of the pickle and the records
    structural = set(range(64))
    for name, (header, data, size) in m.items():
        structural.update(range(header, header + 34))
        structural.update(range(data + size, data + size + 16))
        if not name.endswith("data/0"):
            structural.update(range(data, data + size, 3 if name.endswith("data.pkl") else 1))
    cd = len(item) - 561
    structural.update(range(cd, len(item)))
    rng = random.Random(7)
    chosen = rng.sample(sorted(p for p in structural if p < len(item)), 90) + rng.sample(range(len(item) - 98,
                                                                                                len(item)), 30)
    for at in sorted(set(chosen)):
        flip = rng.choice((0x01, 0x80, 0xFF))
        out.append((f"byte {at} ^ {flip:#x}", item[:at] + bytes([item[at] ^ flip]) + item[at + 1:]))
    for k in range(8):
        at = rng.randrange(len(item))
        out.append((f"insert at {at}", item[:at] + bytes([rng.randrange(256)]) + item[at:]))
        at = rng.randrange(len(item))
        out.append((f"delete at {at}", item[:at] + item[at + 1:]))
    out.append(("trailing byte", item + b"\0"))
    out.append(("one byte short", item[:-1]))
    pkl = zipfile.ZipFile(io.BytesIO(item)).read("archive/data.pkl")
    tensor_data = zipfile.ZipFile(io.BytesIO(item)).read("archive/data/0")
    # semantic changes with every crc kept right
    out.append(("another global", _set_member(item, "archive/data.pkl",
                                              pkl.replace(b"_rebuild_tensor_v2", b"_rebuild_tensor_v9"))))
    out.append(("another storage type", _set_member(item, "archive/data.pkl",
                                                    pkl.replace(b"\nFloatStorage\n", b"\nShortStorage\n"))))
    out.append(("numpy magic in data/0", _set_member(item, "archive/data/0",
                                                     b"\x93NUMPY" + tensor_data[6:])))
    out.append(("big-endian", _set_member(item, "archive/byteorder", b"bigbig")))
    out.append(("version 9", _set_member(item, "archive/version", b"9\n")))
    out.append(("version xx", _set_member(item, "archive/version", b"xx")))
    out.append(("format version 2", _set_member(item, "archive/.format_version", b"2")))
    out.append(("id not digits", _set_member(item, "archive/.data/serialization_id", b"x" * 40)))
    out.append(("id numpy", _set_member(item, "archive/.data/serialization_id", b"\x93NUMPY" + b"0" * 34)))
    out.append(("pickle crc wrong", item.replace(struct.pack("<I", zlib.crc32(pkl)), b"\0\0\0\0")))
    out.append(("data crc wrong", item.replace(struct.pack("<I", zlib.crc32(tensor_data)), b"\0\0\0\0")))
    # other writers, other layouts
    out.append(("rezipped", _rezip(item)))
    out.append(("deflated data/0", _rezip(item, deflate=("archive/data/0",))))
    out.append(("deflated data.pkl", _rezip(item, deflate=("archive/data.pkl",))))
    out.append(("extra member", _rezip(item, extra=("archive/extra.pkl", pkl))))
    names = zipfile.ZipFile(io.BytesIO(item)).namelist()
    out.append(("members reordered", _rezip(item, order=names[::-1])))
    # a shorter tensor (data/0 of 16 bytes for a (1, 8) float32 chunk), and a longer one
    out.append(("short data", _archive(torch.zeros(1, 4))))
    out.append(("long data", _archive(torch.zeros(1, 16))))
    out.append(("another dtype", _archive(torch.zeros(1, 8, dtype=torch.float64))))
    out.append(("a view of a bigger storage", _archive(torch.zeros(2, 8)[1:])))
    out.append(("a value", _archive(torch.zeros(1, 8)).replace(b"archive/", b"archivX/")))
    return out


def test_every_mutation_of_an_item_reads_as_the_general_reading_reads_it(tmp_path, monkeypatch):
    rows = [torch.arange(8, dtype=torch.float32) + 8 * r for r in range(4)]
    archives = [_archive(r.reshape(1, 8).clone()) for r in rows]
    clean = _folder(tmp_path / "clean", archives)
    fast, slow, used = _both(clean, monkeypatch)
    assert fast[0] == "ok" and fast == slow and used == 3  # the first item taught, the other three read on it
    accepted = declined = 0
    for n, (what, item) in enumerate(_mutations(archives[2])):
        # a later item (after the first taught the template its pickle); the first too, for the named changes
        for where in (2, 0) if not what.startswith(("byte", "insert", "delete")) else (2,):
            folder = _folder(tmp_path / f"m{n}_{where}", archives[:where] + [item] + archives[where + 1:])
            fast, slow, used = _both(folder, monkeypatch)
            assert fast == slow, (what, where, fast[:2], slow[:2])
            if where == 2:
                accepted += used == 3
                declined += used < 3
    assert accepted and declined > 100  # (the descriptors' bytes, which no reader reads, may differ)


def test_an_item_past_the_budget_is_left_to_the_general_reading(tmp_path, monkeypatch):
    """The walk budget is paid by each item read on the template as by each read the general way: when it runs
    out, the item is declined and the general reading refuses it, as it did before."""
    rows = [torch.arange(8, dtype=torch.float32) + 8 * r for r in range(5)]
    folder = _folder(tmp_path / "ckpt", [_archive(r.reshape(1, 8).clone()) for r in rows])
    from ckpt_doctor.safepickle import limits

    monkeypatch.setattr(limits, "MAX_PICKLE_OPCODES", 37 * 3 + 5)  # three walks' worth of torch.save's pickle
    monkeypatch.setattr(limits, "ITEM_OPCODES", 0)  # (and nothing more for the items the metadata names)
    fast, slow, used = _both(folder, monkeypatch)
    assert fast == slow and fast[0] == "error" and "opcodes" in fast[1], fast
    assert used == 2


def test_the_walk_budget_grows_with_the_items_the_metadata_names(tmp_path, monkeypatch):
    """A folder of many chunks honestly costs its walk more than one file may (about 40 opcodes an item: a million
    chunks need 40 million): it is allowed MAX_PICKLE_OPCODES plus ITEM_OPCODES for each item its metadata names,
    on the template and the general reading alike; past that it is refused, naming what it was allowed."""
    rows = [torch.arange(8, dtype=torch.float32) + 8 * r for r in range(5)]
    folder = _folder(tmp_path / "ckpt", [_archive(r.reshape(1, 8).clone()) for r in rows])
    from ckpt_doctor.safepickle import limits

    monkeypatch.setattr(limits, "MAX_PICKLE_OPCODES", 100)  # under the five items' 5 x 37 opcodes
    fast, slow, _used = _both(folder, monkeypatch)
    assert fast == slow and fast[0] != "error", fast
    monkeypatch.setattr(limits, "ITEM_OPCODES", 10)  # 100 + 5 x 10: short of what the five walks cost
    fast, slow, _used = _both(folder, monkeypatch)
    assert fast == slow and fast[0] == "error" and "more than 150 opcodes" in fast[1], fast
