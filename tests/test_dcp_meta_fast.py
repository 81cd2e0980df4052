"""The strict recognizer of DCP `.metadata` (readers/dcp_meta_fast.py): on what torch writes, inspect says exactly
what the safety walk + safe unpickler path says; on anything else (a global, a memo index, an opcode, a frame, a
length changed; bytes cut or added) it declines and that path's verdict stands."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_doctor.readers import dcp
from ckpt_doctor.readers.dcp_meta_fast import recognize
from tests.conftest import run_cli
from tests.dcp_samples import write_samples

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    return write_samples(tmp_path_factory.mktemp("dcp_fast"))


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """bench_dcp.py's folder of torch's own metadata classes: 12 tensors of 100 chunks (1,200 storage entries, more
    than one SETITEMS batch, several frames)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_dcp import MAKE_CHUNKS

    folder = tmp_path_factory.mktemp("dcp_gen") / "folder"
    subprocess.run([sys.executable, "-c", MAKE_CHUNKS, str(folder), "12"], check=True)
    return folder


def both_ways(monkeypatch, folder: Path) -> tuple[list, object, object]:
    """inspect --json of the folder with the recognizer, and with it forced to decline: (what it returned, ...)."""
    real = dcp._recognized
    seen: list = []

    def spy(path, policy):
        parsed = real(path, policy)
        seen.append(parsed)
        return parsed

    monkeypatch.setattr(dcp, "_recognized", spy)
    fast = run_cli("inspect", folder, "--json")
    monkeypatch.setattr(dcp, "_recognized", lambda path, policy: None)
    slow = run_cli("inspect", folder, "--json")
    monkeypatch.setattr(dcp, "_recognized", real)
    return seen, fast, slow


def same(a, b) -> bool:
    return (a.exit_code, a.stdout, a.stderr) == (b.exit_code, b.stdout, b.stderr)


@pytest.mark.parametrize("name", ["dtensors", "fsdp2", "ddp", "nocoll", "nocoll_fsdp2", "nocoll_ranks", "zstd",
                                  "multifile", "sharded_tensor", "stformat", "payload"])
def test_torch_written_metadata_reads_the_same_both_ways(samples, monkeypatch, name):
    seen, fast, slow = both_ways(monkeypatch, samples / name)
    assert seen and all(p is not None for p in seen)  # the recognizer read every metadata file
    assert same(fast, slow)
    assert fast.exit_code == (1 if name == "payload" else 0)  # (payload: a finding in an item, not the metadata)


def test_generated_metadata_reads_the_same_both_ways(generated, monkeypatch):
    seen, fast, slow = both_ways(monkeypatch, generated)
    assert len(seen) == 1 and seen[0] is not None
    assert len(seen[0].storage) == 1200 and sum(len(e[3]) for e in seen[0].sdm) == 1200
    assert same(fast, slow) and fast.exit_code == 0


def frames(raw: bytes) -> bytes:
    """The opcodes of a protocol-4 pickle, its frames removed."""
    assert raw[:2] == b"\x80\x04"
    body, pos = [], 2
    while pos < len(raw):
        assert raw[pos] == 0x95
        n = struct.unpack_from("<Q", raw, pos + 1)[0]
        body.append(raw[pos + 9:pos + 9 + n])
        pos += 9 + n
    return b"".join(body)


def one_frame(body: bytes) -> bytes:
    return b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body


def mutations(raw: bytes) -> dict[str, bytes]:
    body = frames(raw)
    module = b"\x8c\x25torch.distributed.checkpoint.metadata\x94\x8c\x08Metadata\x94"
    assert body.startswith(module)
    size_get = body.index(b"h\x21K")  # a BINGET of torch.Size (memo 33) before its ints
    newobj = body.index(b")\x81")
    return {
        "reframed": one_frame(body),  # (the control: one frame is what the recognizer reads)
        "os.system": one_frame(b"\x8c\x02os\x94\x8c\x06system\x94" + body[len(module):]),
        "memo index": one_frame(body[:size_get] + b"h\x22" + body[size_get + 2:]),
        "unrecorded memo": one_frame(body[:size_get] + b"h\xf0" + body[size_get + 2:]),
        "long binget": one_frame(body[:size_get] + b"j\x21\x00\x00\x00" + body[size_get + 2:]),
        "opcode": one_frame(body[:newobj + 1] + b"R" + body[newobj + 2:]),
        "truncated": raw[:-1],
        "half": raw[:len(raw) // 2],
        "appended": raw + b"N.",
        "frame length": raw[:3] + struct.pack("<Q", struct.unpack_from("<Q", raw, 3)[0] + 1) + raw[11:],
        # a frame ending inside a string: the C unpickler would read the next frame's header as its characters
        "frame inside an opcode": one_frame(body[:5]) + b"\x95" + struct.pack("<Q", len(body) - 5) + body[5:],
    }


def test_mutated_metadata_is_declined(samples):
    raw = (samples / "dtensors" / ".metadata").read_bytes()
    assert recognize(raw) is not None
    for what, data in mutations(raw).items():
        if what in ("reframed", "long binget"):  # the same opcodes as CPython reads them: still torch's metadata
            parsed = recognize(data)
            assert parsed is not None and parsed.storage == recognize(raw).storage
        else:
            assert recognize(data) is None, what


@pytest.mark.parametrize("what", ["os.system", "memo index", "opcode", "truncated", "appended", "frame length"])
def test_mutated_metadata_keeps_the_walks_verdict(samples, tmp_path, monkeypatch, what):
    folder = tmp_path / "copy"
    shutil.copytree(samples / "dtensors", folder)
    data = mutations((folder / ".metadata").read_bytes())[what]
    (folder / ".metadata").write_bytes(data)
    seen, fast, slow = both_ways(monkeypatch, folder)
    assert seen == [None]
    assert same(fast, slow)
    if what in ("os.system", "truncated"):  # (the others the unpickler reads: a REDUCE of a dataclass with no
        assert fast.exit_code in (1, 2)       # arguments, a pickle after STOP, a frame length it does not check)
    if what == "os.system":
        assert "os.system" in fast.stderr + fast.stdout


def test_dangerous_global_allowed_by_no_policy_is_never_read_fast(samples):
    """A global off the recognizer's list is declined even where the policy would allow it (the walk judges it)."""
    from ckpt_doctor.safepickle.policy import DEFAULT_POLICY

    raw = (samples / "dtensors" / ".metadata").read_bytes()
    body = frames(raw)
    swapped = body.replace(b"\x8c\x0b_get_layout\x94", b"\x8c\x0b_get_layouu\x94", 1)
    assert swapped != body and recognize(one_frame(swapped), DEFAULT_POLICY) is None


def folder_with(samples: Path, tmp_path: Path, data: bytes) -> Path:
    folder = tmp_path / "copy"
    shutil.copytree(samples / "dtensors", folder)
    (folder / ".metadata").write_bytes(data)
    return folder


def test_key_that_is_a_latin1_pickle_is_walked_not_read_fast(tmp_path, monkeypatch):
    """A state_dict key the walk walks as a nested pickle (a str of a latin-1 decoded pickle): its os.system is
    reported, as the walk reports it."""
    import torch
    import torch.distributed.checkpoint as dcp_api

    payload = b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00idq\x00\x85R.".decode("latin-1")
    folder = tmp_path / "ckpt"
    dcp_api.save({"w": torch.zeros(2), payload: torch.ones(3)}, checkpoint_id=str(folder))
    assert recognize((folder / ".metadata").read_bytes()) is None
    seen, fast, slow = both_ways(monkeypatch, folder)
    assert seen == [None] and same(fast, slow)
    assert fast.exit_code == 1 and "os.system" in fast.stdout + fast.stderr


def test_str_read_by_the_storage_template_that_is_a_latin1_pickle_is_declined(generated):
    raw = (generated / ".metadata").read_bytes()
    at = raw.rindex(b"\x8c\x0c__5_0.distcp")  # one late entry: read by the template, not the opcode loop
    data = raw[:at] + b"\x8c\x0c\xc2\x805_0.distcp" + raw[at + 14:]
    assert recognize(raw) is not None and recognize(data) is None


def test_non_dtype_torch_global_as_dtype_is_declined(samples, tmp_path, monkeypatch):
    """torch.Size (a global the recognizer admits) where TensorProperties has its dtype: the old path's error."""
    body = frames((samples / "dtensors" / ".metadata").read_bytes())
    swapped = body.replace(b"\x8c\x07float32", b"\x8c\x04Size", 1)
    assert swapped != body and recognize(one_frame(swapped)) is None
    seen, fast, slow = both_ways(monkeypatch, folder_with(samples, tmp_path, one_frame(swapped)))
    assert seen == [None] and same(fast, slow)
    assert fast.exit_code == 2 and "has no torch dtype" in fast.stderr


def test_deep_tuple_in_a_key_the_recognizer_does_not_read_is_declined(samples, tmp_path, monkeypatch):
    """An extra key of the Metadata state holding a tuple nested 20,000 deep: the walk refuses it."""
    body = frames((samples / "dtensors" / ".metadata").read_bytes())
    at = body.index(b"\x8c\x13state_dict_metadata")
    deep = one_frame(body[:at] + b"\x8c\x05extra)" + b"\x85" * 20000 + body[at:])
    assert recognize(deep) is None
    seen, fast, slow = both_ways(monkeypatch, folder_with(samples, tmp_path, deep))
    assert seen == [None] and same(fast, slow)
    assert fast.exit_code == 2 and "nested" in fast.stderr


def test_memoizing_one_object_twice_is_declined(samples):
    body = frames((samples / "dtensors" / ".metadata").read_bytes())
    assert body.endswith(b"b.")
    assert recognize(one_frame(body[:-1] + b"\x94.")) is not None  # (the control: memoizing the root once)
    assert recognize(one_frame(body[:-1] + b"\x94\x94.")) is None
    # the second MEMOIZE in a frame of its own
    split = one_frame(body[:-1] + b"\x94") + b"\x95" + struct.pack("<Q", 2) + b"\x94."
    assert recognize(split) is None


def test_memo_past_the_walks_bound_is_declined(samples, monkeypatch):
    """A memo entry per 4 bytes (more than limits.max_memo_entries allows): the walk refuses, the recognizer too."""
    from ckpt_doctor.safepickle import limits
    from ckpt_doctor.safepickle.walker import walk

    body = frames((samples / "dtensors" / ".metadata").read_bytes())
    assert body.endswith(b"ub.")  # the Metadata state's last SETITEMS, BUILD, STOP: no memo index after it shifts
    many = one_frame(body[:-3] + b"\x8c\x05extra]" + b"h\x00\x94a" * len(body) + b"ub.")
    assert recognize(many) is not None  # under the floor of MAX_MEMO_ENTRIES
    monkeypatch.setattr(limits, "MAX_MEMO_ENTRIES", 0)  # the bound: one entry per MEMO_BYTES_PER_ENTRY bytes
    assert walk(many, ".metadata").refused
    assert recognize(many) is None
    assert recognize((samples / "dtensors" / ".metadata").read_bytes()) is not None  # torch's own stays under it


def metas_both_ways(path: Path) -> tuple[object, object]:
    """The metadata `_read_metadata` merges from `path`: from what the recognizer read (its column-wise runs) and
    from the safe unpickler's tree (each entry one by one)."""
    parsed = recognize(path.read_bytes())
    assert parsed is not None
    fast, slow = dcp._Meta(), dcp._Meta()
    dcp._read_metadata(path, fast, [], parsed=parsed)
    dcp._read_metadata(path, slow, [])
    return fast, slow


def same_meta(a, b) -> bool:
    keys = list(b.storage)
    return (list(a.storage.items()) == list(b.storage.items()) and a.tensors == b.tensors
            and list(a.values) == list(b.values) and a.paths == b.paths and a.version == b.version
            and a.copies == b.copies and [a.holder.get(k) for k in keys] == [b.holder.get(k) for k in keys])


def test_runs_read_column_wise_merge_as_the_unpickled_tree(samples, generated):
    """Every torch-written metadata file: what the runs of entries read at once give is what the unpickler gives."""
    paths = [generated / ".metadata", *sorted(samples.glob("*/.metadata")), *sorted(samples.glob("*/__*.metadata"))]
    for path in paths:
        fast, slow = metas_both_ways(path)
        assert same_meta(fast, slow), path
    assert len(metas_both_ways(generated / ".metadata")[0].storage) == 1200


def test_ranks_merge_column_wise_as_entry_by_entry(samples):
    """Per-rank metadata files merged one after the other: the second file's entries meet the first's."""
    for name in ("nocoll", "nocoll_ranks", "nocoll_fsdp2"):
        paths = sorted((samples / name).glob("__*.metadata"))
        fast, slow = dcp._Meta(), dcp._Meta()
        for path in paths:
            dcp._read_metadata(path, fast, [], parsed=recognize(path.read_bytes()))
            dcp._read_metadata(path, slow, [])
        assert same_meta(fast, slow), name


def storage_strings(raw: bytes) -> list[tuple[int, int, str]]:
    """(byte in the one-frame pickle, memo index, value) of each relative path the generated metadata spells."""
    import pickletools

    found, memo, last = [], 0, None
    for op, arg, pos in pickletools.genops(raw):
        if op.name == "MEMOIZE":
            if last is not None:
                found.append((last[0], memo, last[1]))
            memo += 1
        last = (pos, arg) if op.name == "SHORT_BINUNICODE" and str(arg).endswith(".distcp") else None
    return found


def test_a_run_fetches_no_string_memoized_after_its_place(generated):
    """In a run read at once, an entry's relative path fetched from the memo index a later entry's new path gets:
    the unpickler has no such entry yet (declined), while one fetched from an earlier entry's is read."""
    import pickle

    raw = one_frame(frames((generated / ".metadata").read_bytes()))
    strings = storage_strings(raw)
    (_earlier, earlier_memo, earlier_value), (at, _memo, _value), (_later, later_memo, _v) = strings[-30:-27]
    length = 2 + len(raw[at + 1:at + 2]) + raw[at + 1]  # SHORT_BINUNICODE, its length, its bytes, MEMOIZE
    assert raw[at + length - 1] == 0x94

    def fetching(index: int) -> bytes:
        body = frames(raw)
        at_body = at - 11
        return one_frame(body[:at_body] + b"j" + struct.pack("<I", index) + body[at_body + length:])

    control = fetching(earlier_memo)
    parsed, loaded = recognize(control), pickle.loads(control)  # (torch's classes, as dcp.load reads them)
    assert parsed is not None
    assert parsed.storage.rel == [info.relative_path for info in loaded.storage_data.values()]
    assert parsed.storage.rel.count(earlier_value) == recognize(raw).storage.rel.count(earlier_value) + 1
    forward = fetching(later_memo - 1)  # (the path no longer memoized here: every later index one less)
    with pytest.raises(pickle.UnpicklingError, match="[Mm]emo"):
        pickle.loads(forward)
    assert recognize(forward) is None


def test_offsets_past_4_gib_read_at_once(tmp_path):
    """Storage offsets and lengths past 2**32 (LONG1, a shard file over 4 GiB) in a run: the unpickler's ints."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm, storage = {}, {}
    for t in range(4):
        fqn = f"w{t}"
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([50, 8]), [
            ChunkStorageMetadata(torch.Size([c, 0]), torch.Size([1, 8])) for c in range(50)])
        for c in range(50):
            at = (1 << 40) + t * 4096 + c if c % 3 else t * 4096 + c  # LONG1 and BININT, mixed in one run
            storage[MetadataIndex(fqn, [c, 0], c)] = _StorageInfo("__0_0.distcp", at, (1 << 33) + c)
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(Metadata(sdm, {}, storage, version="1.0.0"), protocol=4))  # (FileSystemWriter's)
    fast, slow = metas_both_ways(path)
    assert same_meta(fast, slow)
    assert fast.storage["w3", (49, 0)] == ("__0_0.distcp", (1 << 40) + 3 * 4096 + 49, (1 << 33) + 49, ())


def test_runs_cut_into_blocks_read_the_same(generated, monkeypatch):
    """A run is read a block of entries at a time (one frame can hold the whole file): several runs then stand
    between one MARK and its APPENDS or SETITEMS, and give the same entries as one."""
    from ckpt_doctor.readers import dcp_meta_fast

    raw = (generated / ".metadata").read_bytes()
    whole = recognize(one_frame(frames(raw)))
    assert whole is not None and len(whole.storage) == 1200
    monkeypatch.setattr(dcp_meta_fast, "_BLOCK", 7)
    for data in (raw, one_frame(frames(raw))):
        cut = recognize(data)
        assert cut is not None and cut.sdm == whole.sdm and cut.storage == whole.storage


@pytest.mark.parametrize("window", [61, 997, 5000])
def test_runs_found_a_window_at_a_time_read_the_same(generated, monkeypatch, window):
    """Runs are found a window of a frame at a time: an entry the window's end cuts is read by the next window (or,
    one longer than a window, opcode by opcode), and the entries are the same."""
    from ckpt_doctor.readers import dcp_meta_fast

    raw = (generated / ".metadata").read_bytes()
    whole = recognize(raw)
    assert whole is not None and len(whole.storage) == 1200
    monkeypatch.setattr(dcp_meta_fast, "_WINDOW", window)
    for data in (raw, one_frame(frames(raw))):
        cut = recognize(data)
        assert cut is not None and cut.sdm == whole.sdm and cut.storage == whole.storage


@pytest.mark.parametrize("block", [4096, 100, 7])
def test_strings_of_a_run_fetched_later_read_the_same(monkeypatch, block):
    """A run's new strings (a relative path each) are held with the run, not in the memo one by one: a later entry
    that fetches one of them (a writer that reuses the path object: a BINGET of it) reads the same string. (Runs cut at
    100 entries: w0's all new, held; w1's all fetched; w2's new and fetched. Whole: one run of them all.)"""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ckpt_doctor.readers import dcp_meta_fast

    monkeypatch.setattr(dcp_meta_fast, "_BLOCK", block)

    sdm, storage, first = {}, {}, []
    props = TensorProperties(dtype=torch.float32)
    for t in range(4):
        fqn = f"w{t}"
        sdm[fqn] = TensorStorageMetadata(props, torch.Size([100, 8]), [
            ChunkStorageMetadata(torch.Size([c, 0]), torch.Size([1, 8])) for c in range(100)])
        for c in range(100):
            if t == 0:
                first.append("".join(["__", str(c), "_0.distcp"]))  # (a new object each)
            # w1 fetches every path of w0's run; w2 every other one (a run of new and fetched); w3 new ones
            rel = first[c] if t == 1 or t == 2 and c % 2 else "".join(["__", str(c), "_0.distcp"])
            storage[MetadataIndex(fqn, [c, 0], c)] = _StorageInfo(rel, t * 1000 + c, 1000)
    raw = pickle.dumps(Metadata(sdm, {}, storage, version="1.0.0"), protocol=4)
    assert raw.count(b"__7_0.distcp") == 3  # (w0's, w2's and w3's: w1 fetches it)
    parsed = recognize(raw)
    assert parsed is not None
    want = [(k.fqn, tuple(k.offset), v.relative_path, v.offset, v.length, ()) for k, v in storage.items()]
    assert list(parsed.storage) == want
