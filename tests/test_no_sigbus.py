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


# --- diff maps its inputs only while it holds them still (readers/held.py) ---------------------------------------

def _pair_of_files(tmp_path):
    torch.manual_seed(0)
    a = {f"w{i}": torch.randn(256, 1024) for i in range(6)}  # 1 MB each: read in pieces, not as small copies
    pa, pb = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(a, pa)
    torch.save({k: v * 1.01 for k, v in a.items()}, pb)
    return pa, pb


HOLD_THEN_TRUNCATE = r"""
import os, subprocess, sys, time
from ckpt_doctor.diff import diff_checkpoints
from ckpt_doctor.errors import ReadError

a, b = sys.argv[1], sys.argv[2]
truncater = []

def progress(done, total):
    if not truncater:  # another process cuts B short while diff is reading it
        truncater.append(subprocess.Popen([sys.executable, "-c", "import os, sys; os.truncate(sys.argv[1], 100)", b]))
        time.sleep(30)  # the lease's break signal ends this wait: diff stops here

try:
    diff_checkpoints(a, b, progress=progress)
    print("finished")
except ReadError as exc:
    print("ReadError:", exc)
print("truncater exit", truncater[0].wait(timeout=60), "size", os.path.getsize(b))
"""


def test_a_file_cut_short_while_diff_maps_it_is_named_and_the_cut_waits(tmp_path):
    """Another process truncating a file diff has mapped waits for diff to let go (a read lease), and diff ends in
    one named error instead of dying of SIGBUS. Run in a fresh process: the lease's signal needs the main thread."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    pa, pb = _pair_of_files(tmp_path)
    proc = subprocess.run([sys.executable, "-c", HOLD_THEN_TRUNCATE, str(pa), str(pb)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]  # alive: no SIGBUS (-7)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"ReadError: {pb}: another process opened it for writing or truncated it"), lines
    assert lines[1] == "truncater exit 0 size 100"  # the cut went through once diff had let go


def test_a_file_that_cannot_be_held_is_read_by_pread_and_a_cut_is_a_read_error(tmp_path):
    """B is open for writing (here, by this process), so no lease can be had: diff reads it with pread, gives the
    same figures, and a cut made during the diff is a ReadError naming the truncation, never SIGBUS."""
    from ckpt_doctor.diff import diff_checkpoints

    pa, pb = _pair_of_files(tmp_path)
    mapped = diff_checkpoints(pa, pb)
    with open(pb, "r+b") as writer:
        unheld = diff_checkpoints(pa, pb)
        assert [(r.key, r.status, r.stats) for r in unheld.rows] == [(r.key, r.status, r.stats) for r in mapped.rows]

        def cut(done, total):
            if done == 1:
                writer.truncate(100)

        with pytest.raises(ReadError, match="cut short"):
            diff_checkpoints(pa, pb, progress=cut)
