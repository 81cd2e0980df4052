"""The one-pass reader's keyed runs (safepickle.statedict._Reader._keyed_run): what it splits, against
what it reads."""

from __future__ import annotations

import re

import pytest
import torch

from ckpt_doctor.safepickle import statedict
from ckpt_doctor.safepickle.policy import DEFAULT_POLICY
from tests.test_statedict import _pickle_of, _read_both_ways, _same_as_two_passes


class _CountingSplit:
    """statedict._KEYED, counting the bytes each split is handed."""

    def __init__(self, pattern: re.Pattern) -> None:
        self.pattern, self.split_bytes, self.calls = pattern, 0, 0
        self.groups = pattern.groups

    def split(self, data: bytes) -> list:
        self.split_bytes += len(data)
        self.calls += 1
        return self.pattern.split(data)


def _one_batch(data: bytes) -> bytes:
    """torch.save's pickle with its SETITEMS batches of 1,000 items joined into one (the `u(` between two batches
    dropped): a pickle every unpickler reads as the same dict."""
    joined, count = re.subn(rb"(r....)u\(X", rb"\1X", data, flags=re.DOTALL)
    assert count
    return joined


@pytest.mark.parametrize("join", [False, True], ids=["torch-batches", "one-batch"])
def test_keyed_runs_split_about_the_pickle_once(join, tmp_path, monkeypatch) -> None:
    """A run is cut at _MAX_RUN items and the next one read from where it stopped: each stretch split should be
    about as long as what it reads. The stretch grew with the whole streak of runs read end to end instead, so a
    batch of k * _MAX_RUN items was split ~k**2 / 2 runs' worth: quadratic. With the real _MAX_RUN (4,096), a crafted
    torch.save file of 390,000 tensors in one batch took `ckpt-doctor inspect` 27.8 s against 7.2 s before (the same
    file torch.save wrote, with its batches, 4.4 s either way), 942 MB split for a 36 MB pickle. _MAX_RUN is made
    small here so that torch's own batches of 1,000 show it at a test's size."""
    monkeypatch.setattr(statedict, "_MAX_RUN", 64)
    data = _pickle_of({f"w{i}": torch.zeros(2) for i in range(4000)}, tmp_path)
    if join:
        data = _one_batch(data)
    counting = _CountingSplit(statedict._KEYED)
    monkeypatch.setattr(statedict, "_KEYED", counting)
    assert statedict.read_state_dict(data, "archive/data.pkl", DEFAULT_POLICY) is not None
    size, split = len(data), counting.split_bytes
    assert size // 2 <= split <= 3 * size, f"split {split:,} bytes of a {size:,}-byte pickle"  # (runs are split)
    monkeypatch.setattr(statedict, "_KEYED", counting.pattern)
    at_once, one_by_one = _read_both_ways(data, monkeypatch)
    assert at_once[1] is not None and at_once == one_by_one
    assert _same_as_two_passes(data)


def test_a_str_that_starts_no_item_is_not_split_for(tmp_path, monkeypatch) -> None:
    """Every str the reader meets inside a MARK past the first 256 memo entries (a key whose value is no tensor, a
    str value) asks _keyed_run for a run: a stretch of 512 bytes was split for each, to find no item at its start.
    A dict of 400,000 short str items (13 MB) was split 31 times over (409 MB), its one-pass read 3.8 s -> 7.8 s."""
    import pickle

    data = pickle.dumps({f"k{i}": f"v{i}" for i in range(3000)}, protocol=2)
    counting = _CountingSplit(statedict._KEYED)
    monkeypatch.setattr(statedict, "_KEYED", counting)
    read = statedict.read_state_dict(data, "archive/data.pkl", DEFAULT_POLICY)
    assert read is not None and read.root == {f"k{i}": f"v{i}" for i in range(3000)}
    size, split = len(data), counting.split_bytes
    assert split <= 3 * size, f"split {split:,} bytes of a {size:,}-byte pickle"
    monkeypatch.setattr(statedict, "_KEYED", counting.pattern)
    assert _same_as_two_passes(data)
