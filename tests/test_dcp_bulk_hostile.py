"""Hostile .metadata against the column-wise reading of a DCP folder's storage entries (NumPy int64: _Meta.by_file,
dcp_items.ChunkItems.prepare past BULK_MIN entries): a storage entry whose offset or length does not fit int64, or
whose end overflows it, is a malformed folder like any other. The command says so in one clear line (what the
reading entry by entry, in Python ints, said: "... the file is truncated"), never an internal error nor a bare
"Invalid argument" from a read at a negative offset."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch

from ckpt_doctor.readers import dcp_items
from tests.conftest import run_cli


def _folder(root: Path, n: int, bad: int, offset: int | None = None, length: int | None = None,
            value: tuple[int, int] | None = None, flat: bool = False) -> Path:
    """One float32 tensor `w` of `n` rows, a row a chunk, its items back to back in one file, with torch's own
    metadata classes; the storage entry of row `bad` says `offset` / `length` instead of the item's own. `value`:
    a value (BytesStorageMetadata) `v` stored at (offset, length) too. `flat`: row `bad` is listed (and stored) at
    the one-dimensional offset [bad], not [bad, 0], in a tensor of two dimensions."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    buf = io.BytesIO()
    torch.save(torch.ones(1, 2), buf)
    archives = [buf.getvalue()] * n  # (every row alike: what is read is where the items are, not their values)
    root.mkdir()
    storage, at = {}, 0
    for r, archive in enumerate(archives):
        where = (offset if offset is not None else at, length if length is not None else len(archive)) \
            if r == bad else (at, len(archive))
        storage[MetadataIndex("w", [r] if flat and r == bad else [r, 0], 0)] = _StorageInfo("__0_0.distcp", *where)
        at += len(archive)
    (root / "__0_0.distcp").write_bytes(b"".join(archives))
    sdm = {"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([n, 2]), [
        ChunkStorageMetadata(torch.Size([r] if flat and r == bad else [r, 0]), torch.Size([1, 2])) for r in range(n)])}
    if value is not None:
        storage[MetadataIndex("v")] = _StorageInfo("__0_0.distcp", *value)
        sdm["v"] = BytesStorageMetadata()
    (root / ".metadata").write_bytes(pickle.dumps(Metadata(sdm, {"w": ("w",)}, storage, None, "1.0.0")))
    return root


@pytest.mark.parametrize(("offset", "length"), [
    (2**62, 2**62),  # each fits int64, their sum does not: wraps negative, passes `at + length <= size`, IndexError
    (2**64 + 5, None),  # an offset past int64: OverflowError in np.array
    (None, 2**63 + 1),  # a length past int64
])
def test_an_entry_past_int64_is_refused_as_a_small_folder_refuses_it(tmp_path, offset, length):
    n = dcp_items.BULK_MIN + 4
    big = _folder(tmp_path / "big", n, n * 2 // 3, offset, length)
    small = _folder(tmp_path / "small", 40, 20, offset, length)
    want = run_cli("inspect", small, "--json")
    assert want.exit_code == 2 and "the file is truncated" in want.stderr, want.stderr
    got = run_cli("inspect", big, "--json")
    assert got.exit_code == 2
    assert "internal error" not in got.stderr, got.stderr
    assert "the file is truncated" in got.stderr, got.stderr


@pytest.mark.parametrize("n", [40, dcp_items.BULK_MIN + 4])
@pytest.mark.parametrize("value", [(10, 2**63 - 1), (2**62, 2**62)])
def test_a_value_entry_whose_end_overflows_int64_is_refused_clearly(tmp_path, n, value):
    """A value item whose offset + length passes 2**63 (each fits int64: the recognizer reads them): _Meta.by_file's
    value_ends wraps negative, and _Items.blob reads the shard at a negative offset (EINVAL). Before by_file (Python
    ints, 5450928) this said the file is truncated; now any folder the recognizer reads says "Invalid argument"."""
    folder = _folder(tmp_path / "ckpt", n, -1, value=value)
    got = run_cli("inspect", folder, "--json")
    assert got.exit_code == 2
    assert "Invalid argument" not in got.stderr and "internal error" not in got.stderr, got.stderr
    assert "the file is truncated" in got.stderr, got.stderr


@pytest.mark.parametrize("n", [40, dcp_items.BULK_MIN + 4])
def test_a_chunk_of_another_rank_than_its_tensor_is_named(tmp_path, n):
    """A chunk listed (and stored) at a one-dimensional offset in a two-dimensional tensor: the folder is refused in
    one line that names the chunk, by inspect and fix alike (the layout's words once indexed its offsets by the
    tensor's dimensions first: an internal error)."""
    folder = _folder(tmp_path / "ckpt", n, n // 2, flat=True)
    for args in (("inspect", folder), ("inspect", folder, "--json"), ("fix", folder, "-o", tmp_path / "out.pt")):
        got = run_cli(*args)
        assert got.exit_code == 2, got.stderr
        assert "internal error" not in got.stderr and len(got.stderr.strip().splitlines()) == 1, got.stderr
        assert f"a chunk whose offsets [{n // 2}] and sizes [1, 2] are not both of the tensor's rank, 2" in got.stderr
    assert not (tmp_path / "out.pt").exists()


def _first_entry_changed(folder: Path, **fields: object) -> Path:
    """The folder with its first storage entry's _StorageInfo fields replaced (pickled back as torch pickles it)."""
    import dataclasses

    meta = pickle.loads((folder / ".metadata").read_bytes())
    key = next(iter(meta.storage_data))
    meta.storage_data[key] = dataclasses.replace(meta.storage_data[key], **fields)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    return folder


@pytest.mark.parametrize("n", [40, dcp_items.BULK_MIN + 4])
def test_a_storage_entry_naming_a_file_with_a_nul_is_refused(tmp_path, n):
    """A storage entry whose relative_path holds a NUL names no file: refused as a name with a slash is (os.stat
    raised ValueError, an internal error, where an OSError was expected)."""
    folder = _first_entry_changed(_folder(tmp_path / "ckpt", n, -1), relative_path="__0_0.distcp\0")
    for args in (("inspect", folder), ("fix", folder, "-o", tmp_path / "out.pt"), ("diff", folder, folder)):
        got = run_cli(*args)
        assert got.exit_code == 2, got.stderr
        assert "internal error" not in got.stderr and len(got.stderr.strip().splitlines()) == 1, got.stderr
        assert "names '__0_0.distcp\\x00', not a file in the folder" in got.stderr, got.stderr
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("n", [40, dcp_items.BULK_MIN + 4])
@pytest.mark.parametrize(("offsets", "sizes", "said"), [
    ([0, 0], [1, 2], "two chunks lie at [0, 0]: they overlap"),  # row 0 listed twice (one storage entry for both)
    ([0, 1], [2, 1], "the chunks at [0, 0] and [0, 1] overlap"),  # a column across rows 0 and 1
])
def test_chunks_that_overlap_and_leave_a_gap_as_large_are_refused(tmp_path, n, offsets, sizes, said):
    """Row 1's chunk replaced by one that overlaps row 0 and holds as many elements: the chunks' count still adds up
    to the tensor's, so inspect called the folder whole (exit 0) where torch's dcp.load leaves row 1 unread and fix
    refused it; now every command refuses it in one line that names the chunks."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    folder = _folder(tmp_path / "ckpt", n, -1)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    w = meta.state_dict_metadata["w"]
    w.chunks[1] = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    del meta.storage_data[MetadataIndex("w", [1, 0])]
    if offsets != [0, 0]:
        buf = io.BytesIO()
        torch.save(torch.ones(sizes), buf)
        at = (folder / "__0_0.distcp").stat().st_size
        with open(folder / "__0_0.distcp", "ab") as f:
            f.write(buf.getvalue())
        meta.storage_data[MetadataIndex("w", offsets)] = _StorageInfo("__0_0.distcp", at, len(buf.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    for args in (("inspect", folder), ("inspect", folder, "--json"), ("fix", folder, "-o", tmp_path / "out.pt")):
        got = run_cli(*args)
        assert got.exit_code == 2, (args, got.stderr)
        assert len(got.stderr.strip().splitlines()) == 1 and said in got.stderr, got.stderr
        assert "leave as many of its elements in no chunk" in got.stderr, got.stderr
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("n", [40, dcp_items.BULK_MIN + 4])
@pytest.mark.parametrize("transforms", [["rot13"] * 100_000, ["x" * 1_000_000]])
def test_unknown_transforms_are_named_in_a_short_line(tmp_path, n, transforms):
    """A storage entry whose transform descriptors are unknown is refused in one line that names a few of them (it
    joined every descriptor, whole: a line of megabytes)."""
    folder = _first_entry_changed(_folder(tmp_path / "ckpt", n, -1), transform_descriptors=transforms)
    got = run_cli("inspect", folder)
    assert got.exit_code == 2 and "a transform ckpt-doctor does not know" in got.stderr, got.stderr[:300]
    assert len(got.stderr) < 500 and len(got.stderr.strip().splitlines()) == 1, got.stderr[:300]


@pytest.mark.parametrize("n", [40, dcp_items.BULK_MIN + 4])
def test_a_file_the_metadata_names_that_cannot_be_opened_is_named_in_a_short_line(tmp_path, n):
    """A storage entry naming a file of 300,000 characters (ENAMETOOLONG) is refused in one line that shows the name
    cut (it printed it whole: a line of 300 KB)."""
    name = "y" * 300_000
    folder = _first_entry_changed(_folder(tmp_path / "ckpt", n, -1), relative_path=name)
    got = run_cli("inspect", folder)
    assert got.exit_code == 2 and name[:80] in got.stderr, got.stderr[:300]
    assert len(got.stderr) < 500 and len(got.stderr.strip().splitlines()) == 1, got.stderr[:300]
