"""The structure of a file is read with pread, never through a memory map: a file another process cuts short while
it is read is reported as truncated instead of killing the process with SIGBUS (issue 24)."""

from __future__ import annotations

import mmap
import pickle

import pytest
import torch

from ckpt_doctor.errors import ReadError
from ckpt_doctor.readers import read_checkpoint
from ckpt_doctor.readers.mapping import READ_UP_TO
from ckpt_doctor.readers.survey import survey_file


@pytest.fixture
def no_mmap(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a reader mapped the file")

    monkeypatch.setattr(mmap, "mmap", refuse)


def test_big_legacy_file_is_read_without_a_map(tmp_path, no_mmap):
    path = tmp_path / "legacy.pt"
    state = {"w": torch.randn(8, 8), "blob": b"x" * (READ_UP_TO + (4 << 20))}  # its pickle alone is over 16 MB
    torch.save(state, path, _use_new_zipfile_serialization=False)
    ckpt = read_checkpoint(path)
    assert [t.key for t in ckpt.tensors] == ["w"]
    assert survey_file(path).verdict.value == "safe"


def test_big_pickle_cut_short_is_truncated_not_a_crash(tmp_path, no_mmap):
    path = tmp_path / "cut.pkl"
    raw = pickle.dumps({"blob": b"x" * (READ_UP_TO * 2), "after": [1, 2, 3]}, protocol=4)
    path.write_bytes(raw[:READ_UP_TO + (8 << 20)])  # what a reader sees once another process truncated it
    survey = survey_file(path)
    assert survey.main_walk.truncated
    with pytest.raises(ReadError):
        read_checkpoint(path)


def test_big_zip_with_a_big_data_pkl_is_walked_without_a_map(tmp_path, no_mmap):
    path = tmp_path / "bigpkl.pt"
    torch.save({"w": torch.randn(4), "names": [f"{i:064d}" for i in range(300_000)]}, path)  # data.pkl ~21 MB
    ckpt = read_checkpoint(path)
    assert [t.key for t in ckpt.tensors] == ["w"]
