"""A checkpoint's tensors held column-wise (records.TensorTable) are the records they stand for: same fields, bytes
where torch put them, and inspect's JSON rows written from the columns equal the rows the encoder writes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ckpt_doctor.readers import read_checkpoint
from ckpt_doctor.records import TensorRecord, TensorTable
from ckpt_doctor.render.json_out import dumps, inspect_json
from ckpt_doctor.report import inspect_checkpoint

KEYS = ['a"quote', "ü.0.w", "line\nbreak", "back\\slash", "layers.0.w", "layers.1.w", "layers.2.w", "empty"]


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {k: torch.randn(2, i + 1) for i, k in enumerate(KEYS[:-1])}
    state["empty"] = torch.zeros(0, 3)
    state["flags"] = torch.tensor([True, False])
    state["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    return state


@pytest.fixture(params=["safetensors", "torch"])
def saved(request, tmp_path):
    state = _state()
    if request.param == "safetensors":
        path = tmp_path / "m.safetensors"
        save_file(state, str(path))
    else:
        path = tmp_path / "m.pt"
        base = torch.arange(20.0)
        state.update(view_a=base[:10], view_b=base[10:], tied=state["layers.0.w"])  # views and a tied weight
        torch.save(state, path)
    return path, torch.load(path, weights_only=True) if path.suffix == ".pt" else state


def test_records_match_torch_and_point_at_the_tensor_bytes(saved):
    path, state = saved
    ckpt = read_checkpoint(path)
    assert isinstance(ckpt.tensors, TensorTable)
    assert sorted(t.key for t in ckpt.tensors) == sorted(state)
    raw = path.read_bytes()
    for t in ckpt.tensors:
        assert isinstance(t, TensorRecord)
        expected = state[t.key]
        assert t.shape == tuple(expected.shape) and t.stride == expected.stride()
        assert t.dtype == str(expected.dtype).removeprefix("torch.") and t.device == "cpu"
        start = t.file_offset
        assert raw[start:start + t.nbytes] == expected.contiguous().numpy().tobytes()
    assert ckpt.tensors == tuple(ckpt.tensors)  # the table is the tuple of its records
    assert ckpt.tensors[0] is tuple(ckpt.tensors)[0]


def test_json_rows_from_columns_equal_the_encoders(saved):
    path, _ = saved
    report = inspect_checkpoint(path)
    fast = dumps(inspect_json(report, encoded_rows=True))
    assert fast == dumps(inspect_json(report))
    assert json.loads(fast)["tensors"] == inspect_json(report)["tensors"]


def test_filter_keeps_the_matching_tensors(saved):
    path, _ = saved
    report = inspect_checkpoint(path, filter=r"layers\.[12]|quote")
    assert [t.key for t in report.tensors] == [k for k in (t.key for t in report.checkpoint.tensors)
                                               if k.startswith(("layers.1", "layers.2", 'a"'))]
    assert dumps(inspect_json(report, encoded_rows=True)) == dumps(inspect_json(report))


def test_torch_zip_storages_agree_with_the_tree_torch_and_a_pickled_copy(tmp_path):
    """A torch zip's storages are held as columns, a record made when one is asked for: the tensor's record, its
    tensor in the unpickled tree and a pickled copy of the tree all name the same storage, and the storages counted
    are torch's."""
    import pickle

    base = torch.arange(20.0)
    state = {"w": torch.randn(3, 4), "tied": None, "view_a": base[:10], "view_b": base[10:], "b": torch.ones(2)}
    state["tied"] = state["w"]
    path = tmp_path / "m.pt"
    torch.save(state, path)
    ckpt = read_checkpoint(path)
    first = ckpt.root["view_b"].storage.resolved  # one storage's record asked for before the table's
    records = {t.key: t.storage for t in ckpt.tensors}
    assert records["view_b"] is first and records["view_a"] is first
    assert all(ckpt.root[key].storage.resolved is records[key] for key in state)
    copy = pickle.loads(pickle.dumps(ckpt.root))
    assert {key: copy[key].storage.resolved for key in state} == records
    report = inspect_checkpoint(path)
    loaded = torch.load(path, weights_only=True)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in loaded.values()}
    assert (report.storage_count, report.total_bytes) == (len(storages), sum(storages.values()))
    assert {g.keys for g in report.shared} == {("w", "tied"), ("view_a", "view_b")}
