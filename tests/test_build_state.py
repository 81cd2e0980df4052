"""A BUILD's state is taken as it is when BUILD runs, as pickle.load takes it (found by a hostile review).

A `.metadata` may change a _StorageInfo's state dict AFTER the BUILD that used it (a BINGET of the memoized dict, a
SETITEM, the dict then kept under a key of the Metadata's state no reader uses). pickle.load's BUILD copied the dict
into the instance's __dict__ when it ran, so torch keeps the place written BEFORE; a reader that keeps a reference to
the state dict (dcp_meta_fast's recognizer, and the SafeUnpickler before it) reads the place written AFTER: another
tensor than dcp.load's, or a value "safe" that dcp.load unpickles, running its code, from other bytes.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_doctor.readers import dcp as dcp_reader
from tests.conftest import run_cli


def _unframed(raw: bytes) -> bytes:
    ops = list(pickletools.genops(raw))
    out = bytearray()
    for i, (op, _arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(raw)
        if op.name not in ("PROTO", "FRAME"):
            out += raw[pos:end]
    return bytes(out)


def _towards_info(state: str | None, op, arg, fqn: str) -> str | None:
    """Where a walk of the metadata's opcodes is on its way to `fqn`'s _StorageInfo: None, "fqn", then "info"."""
    if op.name in ("SHORT_BINUNICODE", "BINUNICODE") and arg == fqn and state is None:
        return "fqn"
    if state == "fqn" and op.name == "SHORT_BINUNICODE" and arg == "_StorageInfo":
        return "info"
    return state


def _changed_after_build(raw: bytes, fqn: str, changes: dict[str, int]) -> bytes:
    """The metadata pickle with the state dict of `fqn`'s _StorageInfo changed after its BUILD."""
    body = _unframed(raw)
    count, state, memo = 0, None, None
    for op, arg, _pos in pickletools.genops(b"\x80\x04" + body):
        if op.name == "MEMOIZE":
            count += 1
        state = _towards_info(state, op, arg, fqn)
        if state == "info" and op.name == "EMPTY_DICT":
            memo = count  # (memoized by the MEMOIZE after it)
            break
    assert memo is not None and body.endswith(b"ub.")
    tail = b"\x8c\x03zzz" + (b"h" + bytes([memo]) if memo < 256 else b"j" + struct.pack("<I", memo))
    for key, value in changes.items():
        tail += b"\x8c" + bytes([len(key)]) + key.encode() + b"J" + struct.pack("<i", value) + b"s"
    body = body[:-3] + tail + b"ub."
    return b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body


def _retarget(folder: Path, fqn: str, torch_place: tuple[int, int], other_place: tuple[int, int],
              shift: int = 0) -> None:
    """Rewrite the folder's metadata: torch reads `fqn` at torch_place, a reader keeping the dict at other_place
    (every other item `shift` bytes further than dcp.save wrote it)."""
    md = pickle.loads((folder / ".metadata").read_bytes())  # (the metadata dcp.save just wrote)
    storage = {}
    for key, info in md.storage_data.items():
        at, length = torch_place if key.fqn == fqn else (info.offset + shift, info.length)
        storage[key] = type(info)(info.relative_path, at, length)
    md.storage_data = storage
    raw = pickle.dumps(md, protocol=4)
    (folder / ".metadata").write_bytes(_changed_after_build(raw, fqn, {"offset": other_place[0],
                                                                        "length": other_place[1]}))


def _place(folder: Path, fqn: str) -> tuple[int, int]:
    md = pickle.loads((folder / ".metadata").read_bytes())
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    return info.offset, info.length


@pytest.mark.parametrize("fast", [True, False], ids=["recognizer", "safe-unpickler"])
def test_a_storage_info_changed_after_its_build_is_read_where_torch_reads_it(tmp_path, monkeypatch, fast):
    folder = tmp_path / "ckpt"
    dcp.save({"a": torch.full((4, 8), 1.0), "b": torch.full((4, 8), 2.0)}, checkpoint_id=str(folder))
    _retarget(folder, "a", _place(folder, "a"), _place(folder, "b"))
    if not fast:
        monkeypatch.setattr(dcp_reader, "_recognized", lambda path, policy: None)
    else:
        assert dcp_reader._recognized(folder / ".metadata", dcp_reader.DEFAULT_POLICY) is not None

    loaded = {"a": torch.zeros(4, 8), "b": torch.zeros(4, 8)}
    dcp.load(loaded, checkpoint_id=str(folder))  # (tensor items: torch.load(weights_only=True))
    assert loaded["a"][0, 0].item() == 1.0  # torch reads a where the metadata put it before the BUILD

    out = tmp_path / "out.safetensors"
    result = run_cli("fix", folder, "-o", out)
    assert result.exit_code == 0, result.stderr
    from safetensors.torch import load_file

    fixed = load_file(str(out))
    assert torch.equal(fixed["a"], loaded["a"]), "ckpt-doctor's a is not the tensor dcp.load gives"


class _Opens:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("fast", [True, False], ids=["recognizer", "safe-unpickler"])
def test_a_value_dcp_load_unpickles_elsewhere_is_not_called_safe(tmp_path, monkeypatch, fast):
    """The value `v` is, for torch, a torch.save archive whose pickle calls open() (DefaultLoadPlanner.load_bytes:
    torch.load(weights_only=False)); a reader keeping the dict sees the innocent int dcp.save wrote. Nothing here
    loads it."""
    folder = tmp_path / "ckpt"
    dcp.save({"v": 5, "w": torch.ones(4, 8)}, checkpoint_id=str(folder))
    buf = io.BytesIO()
    torch.save(_Opens(str(tmp_path / "canary")), buf)
    payload = buf.getvalue()
    shard = folder / "__0_0.distcp"
    items = shard.read_bytes()
    shard.write_bytes(payload + b"\0" + items)  # the payload, a byte, then the items as dcp.save wrote them
    shift = len(payload) + 1
    at, length = _place(folder, "v")
    _retarget(folder, "v", (0, len(payload)), (at + shift, length), shift)
    if not fast:
        monkeypatch.setattr(dcp_reader, "_recognized", lambda path, policy: None)

    result = run_cli("inspect", folder)
    assert result.exit_code != 0, (result.stdout, result.stderr)
    assert not (tmp_path / "canary").exists()


def _get(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


def _slotstate_changed_after_build(raw: bytes, fqn: str, before: dict[str, int], after: dict[str, int]) -> bytes:
    """The metadata pickle with `fqn`'s _StorageInfo BUILT from (its dict, a slotstate dict `before`), that slotstate
    dict then changed to `after` (later memo indices renumbered for the one it takes)."""
    body = _unframed(raw)
    ops = list(pickletools.genops(b"\x80\x04" + body))
    out, count, state, slot = [], 0, None, None
    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(body) + 2
        code = (b"\x80\x04" + body)[pos:end]
        if op.name == "PROTO":
            continue
        if op.name == "MEMOIZE":
            count += 1
        state = _towards_info(state, op, arg, fqn)
        if slot is not None and op.name in ("BINGET", "LONG_BINGET") and arg >= slot:
            code = _get(arg + 1)
        if state == "info" and op.name == "BUILD":
            slot, state = count, "done"
            count += 1
            code = b"}\x94(" + b"".join(b"\x8c" + bytes([len(k)]) + k.encode() + b"J" + struct.pack("<i", v)
                                        for k, v in before.items()) + b"u\x86b"
        out.append(code)
    body = b"".join(out)
    assert slot is not None and body.endswith(b"ub.")
    tail = b"\x8c\x03zzz" + _get(slot) + b"".join(
        b"\x8c" + bytes([len(k)]) + k.encode() + b"J" + struct.pack("<i", v) + b"s" for k, v in after.items())
    body = body[:-3] + tail + b"ub."
    return b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body


def test_a_storage_info_slotstate_changed_after_its_build_is_read_where_torch_reads_it(tmp_path):
    """The same through BUILD's (state, slotstate) form: pickle.load sets the slotstate's attributes when BUILD
    runs; a copy of the state dict alone at BUILD does not cover it (the recognizer declines such a BUILD: this is
    the SafeUnpickler's reading)."""
    folder = tmp_path / "ckpt"
    dcp.save({"a": torch.full((4, 8), 1.0), "b": torch.full((4, 8), 2.0)}, checkpoint_id=str(folder))
    (a_at, a_len), (b_at, b_len) = _place(folder, "a"), _place(folder, "b")
    raw = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(_slotstate_changed_after_build(
        raw, "a", {"offset": a_at, "length": a_len}, {"offset": b_at, "length": b_len}))

    loaded = {"a": torch.zeros(4, 8), "b": torch.zeros(4, 8)}
    dcp.load(loaded, checkpoint_id=str(folder))
    assert loaded["a"][0, 0].item() == 1.0

    out = tmp_path / "out.safetensors"
    result = run_cli("fix", folder, "-o", out)
    assert result.exit_code == 0, result.stderr
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(out))["a"], loaded["a"]), "ckpt-doctor's a is not the tensor dcp.load gives"


def test_a_destructor_error_prints_no_traceback(tmp_path):
    """A .metadata whose MEMOIZE before `Metadata` is turned into BYTEARRAY8: the unpickler's bytearray is freed while
    a view of it is held, and CPython prints that SystemError itself (PyErr_Print). The command says one line."""
    import os
    import subprocess
    import sys

    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.randn(4, 8), "opt": {"step": 3}}, checkpoint_id=str(folder))
    raw = bytearray((folder / ".metadata").read_bytes())
    at = raw.index(b"\x8c\x08Metadata") - 1
    assert raw[at] == 0x94
    raw[at] = 0x96
    (folder / ".metadata").write_bytes(raw)
    env = {k: v for k, v in os.environ.items() if k != "CKPT_DOCTOR_DEBUG"}
    done = subprocess.run([sys.executable, "-m", "ckpt_doctor", "inspect", str(folder)], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("Error: "), done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def _rezipped(path: Path, change) -> None:
    """torch.save's archive at `path` with its data.pkl changed by `change` (the other members as they were)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        members = [(name, archive.read(name)) for name in archive.namelist()]
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members:
            archive.writestr(name, change(data) if name.endswith("/data.pkl") else data)


def _torch_loads(path: Path) -> bool:
    try:
        torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal
        return False
    return True


@pytest.mark.parametrize("plain", [True, False], ids=["state_dict", "with-a-float"])
def test_a_build_that_hides_an_ordered_dicts_methods_is_read(tmp_path, plain) -> None:
    """BUILD puts its state in the OrderedDict's __dict__ (torch.load does so too, and loads the file): a state that
    sets `items` and `keys` hid the methods every reader calls, and inspect, scan and fix stopped on 'internal error
    (TypeError: 'int' object is not callable)'. (A float sends the pickle to the walker and the unpickler rather
    than the one-pass reader: both are checked.)"""
    from collections import OrderedDict

    state = OrderedDict(a=torch.zeros(2), b=torch.ones(3))
    if not plain:
        state["lr"] = 0.5
    state.__dict__.update(itemz=1, keyz=2)  # (pickled as BUILD; renamed below: torch.save itself calls .items())
    path = tmp_path / "shadow.pt"
    torch.save(state, path)
    _rezipped(path, lambda data: data.replace(b"itemz", b"items").replace(b"keyz", b"keys"))
    assert _torch_loads(path)
    result = run_cli("inspect", path)
    assert result.exit_code == 0, result.stderr
    assert "internal error" not in result.stderr and "loads with torch's defaults" in result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()[2:]] == ["a", "b"]
    assert run_cli("scan", path).exit_code == 0
    out = tmp_path / "fixed.pt"
    result = run_cli("fix", path, "-o", out, *([] if plain else ["--select", ""]))
    assert result.exit_code == 0, result.stderr
    assert set(torch.load(out, weights_only=True)) >= {"a", "b"}


def test_a_build_that_sets_a_tensors_fields_is_refused(tmp_path) -> None:
    """BUILD with a slot state on a tensor set the record's shape by setattr: inspect listed shape [1] and said
    torch.load loads the file, which torch refuses (Tensor.set_ takes no such state). It is refused, in one line."""
    path = tmp_path / "slot.pt"
    torch.save({"a": torch.zeros(2)}, path)
    state = b"N}(X\x05\x00\x00\x00shapeK\x01\x85u\x86b"  # BUILD (None, {"shape": (1,)}) on the tensor
    _rezipped(path, lambda data: data[:-2] + state + data[-2:])
    assert not _torch_loads(path)
    result = run_cli("inspect", path)
    assert result.exit_code == 2 and "loads with torch's defaults" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "BUILD on a tensor" in result.stderr
