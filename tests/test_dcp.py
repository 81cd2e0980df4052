"""torch.distributed.checkpoint folders written by torch's own DCP (two gloo ranks): listed with their global shapes,
consolidated bitwise equal to the state every rank saw (and to dcp_to_torch_save), refused when incomplete or unsafe.
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.dcp_samples import Net, load_into_fsdp2, write_samples
from tests.payloads import os_system_pickle
from tests.test_journeys import COMMAND

NET = "tests/dcp_samples.py:Net"


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    return write_samples(tmp_path_factory.mktemp("dcp"))


def flat(tree, prefix: str = "") -> dict:
    """Dotted key -> leaf, as inspect names them (list indices and integer keys written as numbers)."""
    out = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, (dict, list)) and v:
            out.update(flat(v, key))
        else:
            out[key] = v
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                    b.reshape(-1).view(torch.uint8))


def assert_same_tree(got, want, where: str = "") -> None:
    """Same containers (dict vs list, integer vs string keys), same values, tensors equal bit for bit."""
    assert type(got) is type(want) or isinstance(got, dict) and isinstance(want, dict), (where, type(got), type(want))
    if isinstance(want, dict):
        assert list(got) == list(want) or set(got) == set(want), (where, list(got)[:5], list(want)[:5])
        for k in want:
            assert_same_tree(got[k], want[k], f"{where}.{k!r}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_tree(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert same_bits(got, want), where
    else:
        assert got == want, (where, got, want)


# Every variant torch writes that ckpt-doctor reads. nocoll*: saved without collectives (use_collectives=False),
# one metadata file per rank; stformat*: torch's safetensors serialization format.
VARIANTS = ["dtensors", "fsdp2", "ddp", "nocoll", "nocoll_fsdp2", "nocoll_stformat", "nocoll_zstd", "nocoll_ranks",
            "multifile", "zstd", "stformat", "stformat_big", "hf", "sharded_tensor"]


@pytest.mark.parametrize("name", VARIANTS)
def test_inspect_lists_the_global_shapes(samples, name):
    result = run_cli("inspect", samples / name, "--json")
    assert result.exit_code == 0, result.stderr
    data = result.json()
    full = torch.load(samples / f"{name}.full.pt", weights_only=True)
    want = {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in flat(full).items()
            if isinstance(v, torch.Tensor)}
    assert {t["key"]: (t["shape"], t["dtype"]) for t in data["tensors"]} == want
    assert data["format"] == "torch-dcp" and data["distributed"]["ranks"] == 2
    if name.startswith("nocoll") and name != "nocoll_ranks":  # what several ranks stored is the same: one item
        assert "rank_differences" not in data["distributed"], data["distributed"]["rank_differences"]
        assert data["distributed"]["variant"][0].endswith("read as one (the same bytes)")


def test_layouts_say_how_each_tensor_was_split(samples):
    data = run_cli("inspect", samples / "dtensors", "--json").json()
    layout = {t["key"]: t["layout"] for t in data["tensors"]}
    assert layout["s0"] == "Shard(0) 2 ways uneven [3, 2]"
    assert layout["s1"] == "Shard(1) 2 ways uneven [3, 2]"
    assert layout["empty"].endswith("1 empty") and layout["rep"].startswith("whole")
    assert data["metadata"]["step"] == 7
    nocoll = run_cli("inspect", samples / "nocoll", "--json").json()
    assert "per-rank metadata" in nocoll["distributed"]["variant"][0]
    multifile = run_cli("inspect", samples / "multifile", "--json").json()
    assert multifile["distributed"]["files"] > 2 and "one file per item" in multifile["distributed"]["variant"][0]
    table = run_cli("inspect", samples / "fsdp2")
    assert "optim: 18 tensors (optimizer state)" in table.stderr and "model: 9 tensors (model weights)" in table.stderr


@pytest.mark.parametrize("name", VARIANTS)
def test_fix_everything_is_bitwise_the_saved_state(samples, tmp_path, name):
    out = tmp_path / "all.pt"
    result = run_cli("fix", samples / name, "-o", out, "--select", "")
    assert result.exit_code == 0, result.stderr
    assert_same_tree(torch.load(out, weights_only=True), torch.load(samples / f"{name}.full.pt", weights_only=True))


def test_fix_agrees_with_dcp_to_torch_save(samples, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    official = tmp_path / "official.pt"
    dcp_to_torch_save(str(samples / "fsdp2"), str(official))
    mine = tmp_path / "mine.pt"
    assert run_cli("fix", samples / "fsdp2", "-o", mine, "--select", "").exit_code == 0
    theirs, ours = flat(torch.load(official, weights_only=False)), flat(torch.load(mine, weights_only=True))
    assert set(theirs) == set(ours)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert same_bits(ours[key], value), key
        else:
            assert ours[key] == value, key


def test_integer_optimizer_keys_stay_integers(samples, tmp_path):
    """DCP saves an optimizer's integer state keys as strings; Optimizer.load_state_dict would then restore nothing."""
    out = tmp_path / "all.pt"
    assert run_cli("fix", samples / "ddp", "-o", out, "--select", "").exit_code == 0
    optimizer = torch.load(out, weights_only=True)["optimizer"]
    assert sorted(optimizer["state"]) == list(range(6))
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(optimizer)
    first = next(iter(model.parameters()))
    assert same_bits(opt.state[first]["momentum_buffer"], optimizer["state"][0]["momentum_buffer"])


@pytest.mark.parametrize("name", ["fsdp2", "nocoll_fsdp2"])
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_fix_writes_the_model_weights_by_default(samples, tmp_path, suffix, name):
    out = tmp_path / f"model{suffix}"
    result = run_cli("fix", samples / name, "-o", out)
    assert result.exit_code == 0, result.stderr
    assert "--select ''" in result.stderr
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(out)
    else:
        state = torch.load(out, weights_only=True)
    want = torch.load(samples / f"{name}.full.pt", weights_only=True)["model"]
    assert_same_tree(dict(state), dict(want))
    Net().load_state_dict(state, strict=True)


def test_inspect_model_compares_the_model_item(samples):
    result = run_cli("inspect", samples / "fsdp2", "--model", NET, "--json")
    assert result.exit_code == 0, result.stderr
    comparison = result.json()["comparison"]
    assert comparison["strict_load_ok"] is True and comparison["state_dict_root"] == "model"
    assert comparison["loaded_fraction"] == 1.0 and comparison["verdict"].startswith("strict load OK")


def test_verify_runs_a_dcp_folder(samples):
    result = run_cli("verify", samples / "fsdp2", "--model", NET, "--input-shape", "4,10", "--mode", "single")
    assert result.exit_code == 0, result.stderr


def test_missing_or_truncated_files_are_named(samples, tmp_path):
    folder = tmp_path / "fsdp2"
    shutil.copytree(samples / "fsdp2", folder)
    (folder / "__1_0.distcp").unlink()
    out = tmp_path / "out.safetensors"
    for command in (("inspect", folder), ("fix", folder, "-o", out)):
        result = run_cli(*command)
        assert result.exit_code == 2 and "__1_0.distcp is missing" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and not out.exists()
    shutil.copy(samples / "fsdp2" / "__1_0.distcp", folder / "__1_0.distcp")
    data = (folder / "__1_0.distcp").read_bytes()
    (folder / "__1_0.distcp").write_bytes(data[:len(data) // 2])
    result = run_cli("fix", folder, "-o", out)
    assert result.exit_code == 2 and "truncated" in result.stderr and not out.exists(), result.stderr


def test_a_payload_in_an_item_is_reported_not_run(samples, tmp_path, capfd):
    for command in ("scan", "inspect"):
        result = run_cli(command, samples / "payload")
        assert result.exit_code == 1, result.stderr
        assert "functools.partial" in result.stdout + result.stderr
    out = tmp_path / "out.pt"
    result = run_cli("fix", samples / "payload", "-o", out)
    assert result.exit_code == 1 and not out.exists()
    assert "payload ran" not in capfd.readouterr().out


def test_a_payload_in_the_metadata_is_reported_not_run(samples, tmp_path):
    folder = tmp_path / "evil"
    shutil.copytree(samples / "dtensors", folder)
    canary = tmp_path / "canary"
    (folder / ".metadata").write_bytes(os_system_pickle(canary))
    for command in ("scan", "inspect"):
        result = run_cli(command, folder)
        assert result.exit_code in (1, 2) and "os.system" in result.stdout + result.stderr, result.stderr
    assert not canary.exists()


def test_a_folders_metadata_named_alone_points_at_its_folder(samples, tmp_path, monkeypatch):
    """`.metadata` itself is a bare pickle torch.load refuses: inspect says whose it is, and the command it prints
    (and lists in the JSON) lists the folder's whole tensors, from another working directory too."""
    folder = tmp_path / "my run"
    shutil.copytree(samples / "fsdp2", folder)
    monkeypatch.chdir(tmp_path)
    result = run_cli("inspect", "my run/.metadata")
    assert result.exit_code == 0, result.stderr
    (command,) = re.findall(r"`(ckpt-doctor [^`]*)`", result.stderr)
    assert command == "ckpt-doctor inspect 'my run'"
    assert [c["command"] for c in run_cli("inspect", "my run/.metadata", "--json").json()["suggested_commands"]] \
        == [command]
    listed = run_cli(*shlex.split(command)[1:], "--json")
    assert listed.exit_code == 0 and listed.json()["format"] == "torch-dcp"
    assert listed.json()["tensors"] == run_cli("inspect", samples / "fsdp2", "--json").json()["tensors"]


def test_a_lone_shard_names_its_folder_and_fix_refuses_it(samples, tmp_path):
    shard = samples / "fsdp2" / "__0_0.distcp"
    result = run_cli("inspect", shard)
    assert result.exit_code == 0, result.stderr
    assert f"shard of the torch.distributed.checkpoint folder {samples / 'fsdp2'}" in result.stderr
    out = tmp_path / "one.safetensors"
    refused = run_cli("fix", shard, "-o", out)
    assert refused.exit_code == 2 and f"ckpt-doctor fix {samples / 'fsdp2'}" in refused.stderr and not out.exists()
    scan = run_cli("scan", samples / "dtensors")
    assert scan.exit_code == 0, scan.stdout + scan.stderr


def test_a_lone_shard_s_command_is_listed_in_the_json_and_runs_as_printed(samples, tmp_path):
    """The command a shard's note prints is in `suggested_commands` (the JSON lists what the summary prints, for
    inspect and for scan) and, run as printed, writes the folder's whole tensors."""
    folder = tmp_path / "run 1"
    shutil.copytree(samples / "fsdp2", folder)
    shard = folder / "__0_0.distcp"
    for verb in ("inspect", "scan"):
        printed = COMMAND.findall(run_cli(verb, shard).stderr)
        data = run_cli(verb, shard, "--json").json()
        listed = data["suggested_commands"] if verb == "inspect" else data["files"][0]["suggested_commands"]
        assert [s["command"] for s in listed] == printed and len(printed) == 1, (verb, printed, listed)
        assert listed[0]["promise"] == "writes"
    argv = shlex.split(printed[0])
    assert run_cli(*argv[1:]).exit_code == 0
    from safetensors.torch import load_file

    state = load_file(argv[argv.index("-o") + 1])
    assert_same_tree(dict(state), dict(torch.load(samples / "fsdp2.full.pt", weights_only=True)["model"]))


def test_scan_reads_a_folders_metadata_once_for_all_its_shards(samples, tmp_path, monkeypatch):
    """A folder of many ranks: each shard's items are named from the folder's metadata, read once (it was read again
    for every shard, and all its entries gone over each time: quadratic in the ranks), with the same names."""
    from ckpt_doctor.readers import dcp
    from ckpt_doctor.scan import scan

    folder = tmp_path / "ranks"
    shutil.copytree(samples / "fsdp2", folder)
    shards = sorted(p.name for p in folder.glob("*.distcp"))
    assert len(shards) >= 2
    reads: list[str] = []
    real = dcp._read_metadata

    def counted(path, *args, **kwargs):
        reads.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(dcp, "_read_metadata", counted)
    report = scan([str(folder)])
    named = {Path(f.path).name: " ".join(f.notes) for f in report.files}
    for shard in shards:
        assert "parts of" in named[shard], named[shard]  # its items were named from the metadata
    assert reads.count(".metadata") <= 2  # the folder's metadata items (scan) and the shards' names: not per shard


def test_a_folder_without_metadata_says_so(samples, tmp_path):
    bare = tmp_path / "no_metadata"
    shutil.copytree(samples / "fsdp2", bare)
    (bare / ".metadata").unlink()
    result = run_cli("inspect", bare)
    assert result.exit_code == 2 and "no .metadata" in result.stderr, result.stderr


def _edit_metadata(folder: Path, name: str, change) -> None:
    """Rewrite a metadata file this test run wrote (plain pickle: the test trusts its own files)."""
    import pickle

    path = folder / name
    meta = pickle.loads(path.read_bytes())
    change(meta)
    path.write_bytes(pickle.dumps(meta, protocol=4))


def test_metadata_that_stores_a_chunk_it_does_not_list_is_refused(samples, tmp_path):
    """A use_collectives=False folder whose second metadata stores rank 0's chunk in its own file without listing
    it: a reader that took either would hold the wrong rows."""
    folder = tmp_path / "nocoll"
    shutil.copytree(samples / "nocoll", folder)

    def claim(meta):
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = next(v for k, v in meta.storage_data.items() if k.fqn == "s0")
        meta.storage_data[MetadataIndex("s0", torch.Size([0, 0]), 0)] = _StorageInfo(info.relative_path, info.offset,
                                                                                    info.length)

    _edit_metadata(folder, "__1.metadata", claim)
    out = tmp_path / "w.safetensors"
    result = run_cli("fix", folder, "-o", out, "--select", "")
    assert result.exit_code == 2 and "the metadata is inconsistent" in result.stderr and not out.exists(), \
        result.stderr
    assert "__1.metadata" in result.stderr and "s0 at [0, 0]" in result.stderr


def test_without_collectives_fix_is_what_torchs_dcp_load_gives(samples, tmp_path):
    """Two ranks each dcp.load from their own metadata (the oracle, gathered); dcp_to_torch_save reads rank 0's
    metadata alone, so it agrees on everything rank 0 holds whole, and leaves rank 1's rows of a split tensor
    uninitialised."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "all.pt"
    result = run_cli("fix", samples / "nocoll", "-o", out, "--select", "")
    assert result.exit_code == 0, result.stderr
    mine = torch.load(out, weights_only=True)
    assert_same_tree(mine, torch.load(samples / "nocoll.loaded.pt", weights_only=True))
    official = tmp_path / "official.pt"
    dcp_to_torch_save(str(samples / "nocoll"), str(official))
    theirs = flat(torch.load(official, weights_only=False))
    ours = flat(mine)
    assert set(theirs) == set(ours)
    for key, value in theirs.items():
        if key in ("s0", "s1"):  # split over the ranks: rank 1's part is not in rank 0's metadata
            continue
        assert same_bits(ours[key], value) if isinstance(value, torch.Tensor) else ours[key] == value, key
    data = run_cli("inspect", samples / "nocoll", "--json").json()["distributed"]
    assert "rank_differences" not in data and data["variant"][0].endswith("read as one (the same bytes)")


def test_items_ranks_saved_differently_are_named_with_both_ranks(samples, tmp_path):
    """A value and a tensor each rank saved its own (its rank number): reported, both ranks and both copies named;
    the output holds rank 0's, as dcp_to_torch_save writes. A tensor both saved alike is one item, unreported."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    result = run_cli("inspect", samples / "nocoll_ranks", "--json")
    assert result.exit_code == 0, result.stderr
    differences = {d["key"]: d for d in result.json()["distributed"]["rank_differences"]}
    assert set(differences) == {"rank", "noise"}
    assert all(d["ranks"] == [0, 1] and d["kept"] == 0 for d in differences.values())
    assert [f.split("@")[0] for f in differences["noise"]["files"]] == ["__0_0.distcp", "__1_0.distcp"]
    notes = " ".join(result.json()["notes"])
    assert "rank 0 (__0_0.distcp at byte" in notes and "rank 1 (__1_0.distcp at byte" in notes
    assert "holding 0" in notes and "holding 1" in notes
    out = tmp_path / "all.pt"
    fixed = run_cli("fix", samples / "nocoll_ranks", "-o", out, "--select", "")
    assert fixed.exit_code == 0 and "noise was saved with different bytes by rank 0" in fixed.stderr, fixed.stderr
    official = tmp_path / "official.pt"
    dcp_to_torch_save(str(samples / "nocoll_ranks"), str(official))
    theirs, ours = torch.load(official, weights_only=False), torch.load(out, weights_only=True)
    assert ours["rank"] == theirs["rank"] == 0
    assert same_bits(ours["noise"], theirs["noise"]) and same_bits(ours["same"], theirs["same"])


def test_a_copy_changed_behind_its_crc_is_reported(samples, tmp_path):
    """Rank 1's copy of a replicated tensor with one byte changed in place (its archive's crc32 left as written:
    torch.load does not check it, so rank 1 would load the changed value): the copies are compared by their bytes."""
    import io
    import pickle
    import struct
    import zipfile

    folder = tmp_path / "nocoll"
    shutil.copytree(samples / "nocoll", folder)
    meta = pickle.loads((folder / "__1.metadata").read_bytes())
    info = next(v for k, v in meta.storage_data.items() if k.fqn == "plain")
    shard = folder / info.relative_path
    data = bytearray(shard.read_bytes())
    item = zipfile.ZipFile(io.BytesIO(bytes(data[info.offset:info.offset + info.length])))
    entry = next(i for i in item.infolist() if i.filename.endswith("/data/0"))
    nlen, xlen = struct.unpack_from("<HH", data, info.offset + entry.header_offset + 26)
    data[info.offset + entry.header_offset + 30 + nlen + xlen + 5] ^= 0x40
    shard.write_bytes(bytes(data))
    result = run_cli("inspect", folder, "--json")
    assert result.exit_code == 0, result.stderr
    differences = result.json()["distributed"]["rank_differences"]
    assert [(d["key"], d["ranks"]) for d in differences] == [("plain", [0, 1])]


def test_a_payload_in_one_ranks_copy_of_a_value_is_found(samples, tmp_path, capfd):
    """Rank 1's copy of a value every rank stores is what rank 1's dcp.load unpickles: walked, not assumed equal."""
    import functools
    import io

    folder = tmp_path / "nocoll"
    shutil.copytree(samples / "nocoll", folder)
    buf = io.BytesIO()
    torch.save(functools.partial(print, "payload ran"), buf)
    shard = folder / "__1_0.distcp"
    at = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())

    def point(meta):
        index = next(k for k in meta.storage_data if k.fqn == "step")
        info = meta.storage_data[index]
        meta.storage_data[index] = type(info)(info.relative_path, at, len(buf.getvalue()))

    _edit_metadata(folder, "__1.metadata", point)
    for command in ("scan", "inspect"):
        result = run_cli(command, folder)
        assert result.exit_code == 1 and "functools.partial" in result.stdout + result.stderr, result.stderr
    out = tmp_path / "out.pt"
    assert run_cli("fix", folder, "-o", out, "--select", "").exit_code == 1 and not out.exists()
    assert "payload ran" not in capfd.readouterr().out


@pytest.mark.parametrize("name", VARIANTS)
def test_scan_reads_every_variant_inspect_reads(samples, name):
    """Every file of the folder read (none an error), every item walked: clean, as inspect of the folder says."""
    result = run_cli("scan", samples / name, "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    data = result.json()
    assert not data["problems"] and all(f["error"] is None and f["verdict"] == "safe" for f in data["files"])
    assert run_cli("inspect", samples / name).exit_code == 0
    # dcp's reader unpickles the .metadata, torch.load never opens it: no file is one torch.load refuses, so a CI
    # gate built on --require-default-load passes the folder, as inspect's passes it
    assert run_cli("scan", samples / name, "--require-default-load").exit_code == 0
    assert run_cli("inspect", samples / name, "--require-default-load").exit_code == 0


def test_a_safetensors_format_shard_reads_alone(samples):
    """A rank file of torch's safetensors format with a blob past 64 KB: no zip to torch.load or zipfile, a run of
    archives and a blob to ckpt-doctor, read alone as it is in the folder."""
    shard = samples / "stformat_big" / "__1_0.distcp"
    result = run_cli("inspect", shard, "--json")
    assert result.exit_code == 0, result.stderr
    tensors = {t["key"]: t["shape"] for t in result.json()["tensors"]}
    assert tensors["w@[300, 0]"] == [300, 80]
    assert run_cli("scan", shard).exit_code == 0


@pytest.mark.parametrize("paths", [{"s0": ("x",), "rep": ("x",)}, {"s0": ("a", "b"), "rep": ("a",)}])
def test_two_items_at_one_path_are_refused(samples, tmp_path, paths):
    folder = tmp_path / "dtensors"
    shutil.copytree(samples / "dtensors", folder)
    _edit_metadata(folder, ".metadata", lambda meta: meta.planner_data.update(paths))
    result = run_cli("fix", folder, "-o", tmp_path / "out.pt", "--select", "")
    assert result.exit_code == 2 and "two items of the checkpoint claim the path" in result.stderr, result.stderr


def test_two_tensors_of_one_dotted_name_are_refused(samples, tmp_path):
    folder = tmp_path / "dtensors"
    shutil.copytree(samples / "dtensors", folder)
    _edit_metadata(folder, ".metadata", lambda meta: meta.planner_data.update({"rep": ("nested.a", "b")}))
    for suffix in (".safetensors", ".pt"):
        out = tmp_path / f"out{suffix}"
        result = run_cli("fix", folder, "-o", out, "--select", "")
        assert result.exit_code == 2 and "both named 'nested.a.b'" in result.stderr and not out.exists(), result.stderr


def test_a_pipe_for_metadata_is_refused_not_waited_on(samples, tmp_path):
    import os

    folder = tmp_path / "dtensors"
    shutil.copytree(samples / "dtensors", folder)
    (folder / ".metadata").unlink()
    os.mkfifo(folder / ".metadata")
    result = run_cli("inspect", folder)
    assert result.exit_code == 2 and "not a regular file" in result.stderr, result.stderr


def test_a_payload_appended_to_a_shard_is_seen_by_inspect_and_scan(samples, tmp_path):
    """Bytes after the items that only whole-file readers (torch.load, zipfile) see."""
    import io

    folder = tmp_path / "dtensors"
    shutil.copytree(samples / "dtensors", folder)
    buf = io.BytesIO()
    torch.save({"hook": __import__("functools").partial(print, "payload ran")}, buf)
    with open(folder / "__0_0.distcp", "ab") as f:
        f.write(b"\0" * 100 + buf.getvalue())
    for command in ("inspect", "scan"):
        result = run_cli(command, folder)
        assert result.exit_code == 1 and "functools.partial" in result.stdout + result.stderr, result.stderr


def test_a_single_file_becomes_a_dcp_folder_fsdp2_resumes_from(tmp_path):
    """fix --format dcp: torch's dcp.load fills a 2-rank FSDP2 model with exactly the file's tensors."""
    torch.manual_seed(0)
    source = {"module." + k: v for k, v in Net().state_dict().items()}  # saved from DataParallel
    path = tmp_path / "dp.pt"
    torch.save(source, path)
    folder = tmp_path / "resume"
    result = run_cli("fix", path, "-o", folder, "--format", "dcp", "--strip-module")
    assert result.exit_code == 0, result.stderr
    loaded = load_into_fsdp2(folder, tmp_path / "gathered.pt")
    for key, value in source.items():
        assert same_bits(loaded[key.removeprefix("module.")], value), key
    again = run_cli("fix", path, "-o", folder, "--format", "dcp", "--strip-module")
    assert again.exit_code == 2 and "already exists" in again.stderr
    (tmp_path / "notdcp").mkdir()
    (tmp_path / "notdcp" / "keep.txt").write_text("mine")
    refused = run_cli("fix", path, "-o", tmp_path / "notdcp", "--format", "dcp", "--force")
    assert refused.exit_code == 2 and (tmp_path / "notdcp" / "keep.txt").read_text() == "mine"


def test_a_training_checkpoint_streams_into_a_dcp_folder_dcp_load_reads_bit_for_bit(tmp_path):
    """fix --format dcp writes the folder itself, item by item from the source's bytes: torch's dcp.load fills the
    same nested state (bf16, a transposed view, a view at an offset, an empty tensor, integer optimizer state keys,
    param_groups values) with exactly the file's tensors and values, and --dtype converts on the way."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(4, 10)).sum().backward()
    opt.step()
    base = torch.randn(6, 4)
    source = {"model": {**net.state_dict(), "half": torch.randn(3, 5).to(torch.bfloat16), "t": base.t(),
                        "part": base[2:4], "empty": torch.zeros(0, 3)},
              "optimizer": opt.state_dict(), "epoch": 3, "tag": "run-1"}
    torch.save(source, tmp_path / "train.pt")
    folder = tmp_path / "out_dcp"
    result = run_cli("fix", tmp_path / "train.pt", "-o", folder, "--format", "dcp", "--select", "")
    assert result.exit_code == 0, result.stderr
    target = {"model": {k: torch.full_like(v, 7) for k, v in source["model"].items()},
              "optimizer": {"state": {k: {n: torch.zeros_like(x) for n, x in v.items()}
                                      for k, v in source["optimizer"]["state"].items()},
                            "param_groups": [{k: None for k in g} for g in source["optimizer"]["param_groups"]]},
              "epoch": 0, "tag": ""}
    dcp.load(target, checkpoint_id=str(folder), no_dist=True)
    for key, value in source["model"].items():
        assert same_bits(target["model"][key], value.contiguous()), key
    for k, state in source["optimizer"]["state"].items():
        assert same_bits(target["optimizer"]["state"][k]["momentum_buffer"], state["momentum_buffer"])
    assert target["optimizer"]["param_groups"] == source["optimizer"]["param_groups"]
    assert (target["epoch"], target["tag"]) == (3, "run-1")
    half = tmp_path / "half_dcp"
    assert run_cli("fix", tmp_path / "train.pt", "-o", half, "--format", "dcp", "--dtype", "bfloat16").exit_code == 0
    weights = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in net.state_dict().items()
               if v.is_floating_point()}
    dcp.load({"model": weights}, checkpoint_id=str(half), no_dist=True)
    for key, value in weights.items():
        assert same_bits(value, net.state_dict()[key].to(torch.bfloat16)), key


def test_accelerate_fsdp_layout_reads_the_model_folder(samples, tmp_path):
    """accelerate's save_state under FSDP (SHARDED_STATE_DICT): pytorch_model_fsdp_0/ and optimizer_0/ DCP folders
    beside the scheduler and random states (laid out as accelerate does; writing it needs GPUs)."""
    folder = tmp_path / "acc"
    folder.mkdir()
    shutil.copytree(samples / "fsdp2", folder / "pytorch_model_fsdp_0")
    shutil.copytree(samples / "fsdp2", folder / "optimizer_0")
    torch.save({"step_size": 1}, folder / "scheduler.bin")
    torch.save({"step": 1}, folder / "random_states_0.pkl")
    result = run_cli("inspect", folder, "--json")
    assert result.exit_code == 0, result.stderr
    data = result.json()
    assert data["format"] == "torch-dcp" and data["state_dict_root"] == "model"
    assert "pytorch_model_fsdp_0/" in data["notes"][0]


def _zstd_with_step(samples: Path, tmp_path: Path, content: bytes) -> Path:
    """A copy of the zstd sample whose `step` value item is `content`, compressed, appended to its shard."""
    import pickle

    import zstandard

    folder = tmp_path / "zstd"
    shutil.copytree(samples / "zstd", folder)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    index = next(k for k in meta.storage_data if k.fqn == "step")
    info = meta.storage_data[index]
    frame = zstandard.ZstdCompressor().compress(content)
    shard = folder / info.relative_path
    at = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(frame)
    meta.storage_data[index] = type(info)(info.relative_path, at, len(frame), info.transform_descriptors)
    (folder / ".metadata").write_bytes(pickle.dumps(meta, protocol=4))
    return folder


def test_zstd_items_are_read_and_walked(samples, tmp_path):
    """A payload inside a zstd-compressed value item is found by scan and inspect once inflated."""
    import io

    buf = io.BytesIO()
    torch.save(__import__("functools").partial(print, "payload ran"), buf)
    folder = _zstd_with_step(samples, tmp_path, buf.getvalue())
    for command in ("scan", "inspect"):
        result = run_cli(command, folder)
        assert result.exit_code == 1 and "functools.partial" in result.stdout + result.stderr, result.stderr


def test_a_hugging_face_writer_shard_names_its_folder(samples, tmp_path):
    shard = sorted((samples / "hf").glob("*.safetensors"))[0]
    result = run_cli("inspect", shard)
    assert result.exit_code == 0 and "Hugging Face storage writer" in result.stderr, result.stderr
    refused = run_cli("fix", shard, "-o", tmp_path / "one.pt")
    assert refused.exit_code == 2 and f"ckpt-doctor fix {samples / 'hf'}" in refused.stderr


def test_format_dcp_never_replaces_its_input_or_a_foreign_folder(samples, tmp_path):
    folder = tmp_path / "in"
    shutil.copytree(samples / "ddp", folder)
    before = sorted(p.name for p in folder.iterdir())
    sneaky = tmp_path / "x" / ".." / "in"
    (tmp_path / "x").mkdir()
    result = run_cli("fix", folder, "-o", sneaky, "--format", "dcp", "--force")
    assert result.exit_code == 2 and "input" in result.stderr and sorted(p.name for p in folder.iterdir()) == before
    victim = tmp_path / "victim"
    (victim / "precious.distcp").mkdir(parents=True)
    (victim / "precious.distcp" / "thesis.tex").write_text("years of work")
    (victim / ".metadata").write_bytes(b"")
    result = run_cli("fix", folder, "-o", victim, "--format", "dcp", "--force")
    assert result.exit_code == 2 and (victim / "precious.distcp" / "thesis.tex").read_text() == "years of work"


def test_a_zstd_item_that_is_no_archive_is_refused_before_it_is_inflated(samples, tmp_path):
    import glob

    folder = _zstd_with_step(samples, tmp_path, b"\0" * (64 << 20))  # 64 MB of zeros in a few KB
    import subprocess
    import sys

    before = set(glob.glob("/tmp/ckpt-doctor-zstd-*"))
    result = subprocess.run([sys.executable, "-m", "ckpt_doctor", "inspect", str(folder)], capture_output=True,
                            text=True, timeout=120, check=False, env={**__import__("os").environ, "TMPDIR": "/tmp"})
    assert result.returncode == 2 and "other than a torch.save archive" in result.stderr, result.stderr
    assert set(glob.glob("/tmp/ckpt-doctor-zstd-*")) <= before  # the command's temporary folder is gone


def test_scan_walks_the_items_of_metadata_it_finds_odd(samples, tmp_path):
    """A planner_data entry torch's loader ignores must not stop scan from walking the items dcp.load unpickles."""
    folder = tmp_path / "payload"
    shutil.copytree(samples / "payload", folder)
    _edit_metadata(folder, ".metadata", lambda meta: meta.planner_data.update({"zzz": ()}))
    result = run_cli("scan", folder)
    assert result.exit_code == 1 and "functools.partial" in result.stdout, result.stdout + result.stderr


def test_consolidates_into_a_sharded_safetensors_folder(samples, tmp_path):
    import json

    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    result = run_cli("fix", samples / "fsdp2", "-o", out, "--max-shard-size", "200B")
    assert result.exit_code == 0, result.stderr
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    state = {}
    for shard in set(index["weight_map"].values()):
        state.update(load_file(tmp_path / shard))
    assert len(set(index["weight_map"].values())) > 1
    assert_same_tree(state, torch.load(samples / "fsdp2.full.pt", weights_only=True)["model"])


def test_tied_weights_stay_tied_through_a_dcp_folder(tmp_path):
    """dcp.save would write a tied tensor twice and every reader would give back two; fix --format dcp names the
    second as another name of the first's chunks, which dcp.load fills and ckpt-doctor reads back as one tensor."""
    import torch.distributed.checkpoint as dcp

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    torch.manual_seed(0)
    source = Tied().state_dict()
    torch.save(source, tmp_path / "tied.pt")
    folder = tmp_path / "tied_dcp"
    assert run_cli("fix", tmp_path / "tied.pt", "-o", folder, "--format", "dcp").exit_code == 0
    shared = run_cli("inspect", folder, "--json").json()["shared"]
    assert shared == [{"storage": shared[0]["storage"], "keys": ["emb.weight", "head.weight"], "tied": True}]
    back = tmp_path / "back.pt"
    assert run_cli("fix", folder, "-o", back).exit_code == 0
    loaded = torch.load(back, weights_only=True)
    assert loaded["head.weight"].data_ptr() == loaded["emb.weight"].data_ptr()
    assert same_bits(loaded["head.weight"], source["emb.weight"])
    target = {"emb.weight": torch.zeros(5, 3), "head.weight": torch.zeros(5, 3)}
    dcp.load(target, checkpoint_id=str(folder), no_dist=True)
    assert same_bits(target["head.weight"], source["head.weight"])


def _two_items_sharing_bytes(out: Path) -> None:
    """`a` and `b`: two items starting at byte 0 of one shard and sharing its data entry; `b`'s archive goes on with
    a second data.pkl and directory that read the same bytes through strides (1, 2). torch's loader gives two
    different tensors. (Built by the second attack on the DCP reader.)"""
    import io
    import pickle
    import struct
    import zlib

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    def saved(t: torch.Tensor) -> bytes:
        buf = io.BytesIO()
        torch.save(t, buf)
        return buf.getvalue()

    def directory(z: bytes) -> list[tuple[str, bytes]]:
        n, _, at = struct.unpack("<HII", z[z.rfind(b"PK\x05\x06") + 10:z.rfind(b"PK\x05\x06") + 20])
        records = []
        for _ in range(n):
            nlen, xlen, clen = struct.unpack("<HHH", z[at + 28:at + 34])
            end = at + 46 + nlen + xlen + clen
            records.append((z[at + 46:at + 46 + nlen].decode(), z[at:end]))
            at = end
        return records

    def member(z: bytes, name: str) -> bytes:
        record = dict(directory(z))[name]
        (local,), (size,) = struct.unpack("<I", record[42:46]), struct.unpack("<I", record[20:24])
        nlen, xlen = struct.unpack("<HH", z[local + 26:local + 30])
        return z[local + 30 + nlen + xlen:local + 30 + nlen + xlen + size]

    storage = torch.arange(6, dtype=torch.float32)
    first, second = saved(storage.view(2, 3)), saved(torch.as_strided(storage, (2, 3), (1, 2)))
    pkl = next(n for n, _ in directory(first) if n.endswith("data.pkl"))
    other = member(second, pkl)
    name, crc, at = pkl.encode(), zlib.crc32(other), len(first)
    local = b"PK\x03\x04" + struct.pack("<HHHHHIIIHH", 20, 0, 0, 0, 0, crc, len(other), len(other), len(name), 0)
    local += name + other
    central = b""
    for entry, record in directory(first):
        if entry == pkl:
            record = b"PK\x01\x02" + struct.pack("<HHHHHHIIIHHHHHII", 20, 20, 0, 0, 0, 0, crc, len(other), len(other),
                                                  len(name), 0, 0, 0, 0, 0, at) + name
        central += record
    count = len(directory(first))
    end = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, count, count, len(central), at + len(local), 0)
    shard = first + local + central + end
    (out / "__0_0.distcp").write_bytes(shard)
    props = TensorProperties(dtype=torch.float32)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))
    tensors = {k: TensorStorageMetadata(props, torch.Size([2, 3]), [chunk]) for k in ("a", "b")}
    storage_data = {MetadataIndex("a", torch.Size([0, 0]), 0): _StorageInfo("__0_0.distcp", 0, len(first)),
                    MetadataIndex("b", torch.Size([0, 0]), 0): _StorageInfo("__0_0.distcp", 0, len(shard))}
    meta = Metadata(state_dict_metadata=tensors, planner_data={"a": ("a",), "b": ("b",)}, storage_data=storage_data)
    (out / ".metadata").write_bytes(pickle.dumps(meta))

def test_shared_bytes_read_through_other_strides_are_not_a_tie(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "tie"
    folder.mkdir()
    _two_items_sharing_bytes(folder)
    truth = {"a": torch.zeros(2, 3), "b": torch.zeros(2, 3)}
    dcp.load(truth, checkpoint_id=str(folder), no_dist=True)  # torch's own loader
    assert not torch.equal(truth["a"], truth["b"])
    out = tmp_path / "out.pt"
    assert run_cli("fix", folder, "-o", out, "--select", "").exit_code == 0
    mine = torch.load(out, weights_only=True)
    assert same_bits(mine["a"], truth["a"]) and same_bits(mine["b"], truth["b"].contiguous())


def test_hf_chunks_of_different_ranks_are_named(tmp_path):
    import json

    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    for i, (tensor, offsets) in enumerate(((torch.ones(2, 2), [0, 0]), (torch.ones(4), [2])), 1):
        info = json.dumps({"w": {"saved_offsets": offsets}})
        save_file({"w": tensor}, folder / f"shard-0000{i}-model-00001-of-00001.safetensors",
                  metadata={"DCP_SHARDING_INFO": info, "format": "pt"})
    result = run_cli("inspect", folder)
    assert result.exit_code == 2 and "disagree on its number of dimensions" in result.stderr, result.stderr


def test_the_note_on_the_rest_of_a_folder_names_the_rest_and_its_select_runs(tmp_path):
    """fix of a folder writes its model's state_dict; a note names what else the folder holds and the --select that
    writes it (only a part that holds tensors: --select refuses one without), and is not given when there is no
    rest."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    alone, nested = tmp_path / "alone", tmp_path / "nested"
    dcp.save({"model": model.state_dict()}, checkpoint_id=alone, no_dist=True)
    dcp.save({"app": {"model": model.state_dict(), "optim": optimizer.state_dict()}, "step": 7,
              "scale": torch.ones(2)}, checkpoint_id=nested, no_dist=True)  # (a tensor alone: no part to --select)
    result = run_cli("fix", alone, "-o", tmp_path / "alone.pt")
    assert result.exit_code == 0, result.stderr
    assert "beside it" not in result.stderr and "--select" not in result.stderr, result.stderr
    assert torch.load(tmp_path / "alone.pt", weights_only=True).keys() == model.state_dict().keys()
    result = run_cli("fix", nested, "-o", tmp_path / "nested.pt")
    assert result.exit_code == 0, result.stderr
    assert ("wrote the model's state_dict at 'app.model', as load_state_dict takes it; beside it: step, scale, "
            "app.optim (--select app.optim writes app.optim alone, --select '' all of it)") in result.stderr, \
        result.stderr
    assert run_cli("fix", nested, "-o", tmp_path / "scale.pt", "--select", "scale").exit_code == 2  # refused
    assert "integers again" not in result.stderr  # the optimizer, whose keys it names, was not written
    part = run_cli("fix", nested, "-o", tmp_path / "optim.pt", "--select", "app.optim")  # as the note says
    assert part.exit_code == 0 and "optimizer state keys at app.optim.state are integers again" in part.stderr
    optimizer.load_state_dict(torch.load(tmp_path / "optim.pt", weights_only=True))
    everything = run_cli("fix", nested, "-o", tmp_path / "all.pt", "--select", "")
    assert everything.exit_code == 0 and torch.load(tmp_path / "all.pt", weights_only=True)["step"] == 7


def test_selecting_the_optimizer_keeps_it_a_state_dict(samples, tmp_path):
    """--select optim writes {'state', 'param_groups'} as saved (a flat dict of its tensors would load nowhere)."""
    out = tmp_path / "optim.pt"
    result = run_cli("fix", samples / "fsdp2", "-o", out, "--select", "optim")
    assert result.exit_code == 0, result.stderr
    full = torch.load(samples / "fsdp2.full.pt", weights_only=True)
    assert_same_tree(torch.load(out, weights_only=True), full["optim"])
    flat = run_cli("fix", samples / "fsdp2", "-o", tmp_path / "optim.safetensors", "--select", "optim")
    assert flat.exit_code == 0 and "write a .pt to keep it whole" in flat.stderr


def test_a_large_runs_metadata_is_walked_whole_while_a_memo_bomb_is_still_refused(monkeypatch):
    """A .metadata of chunk entries (torch's own classes, pickled as FileSystemWriter pickles them) stores more memo
    entries than the fixed bound, honestly: the walk reaches its end, because the bound grows with the pickle's
    length; a pickle that spends one byte per memo entry is refused at the same count. (At full scale 140,000 chunk
    entries store 2.25 million memo entries against the bound of 2 million; here the bound is scaled down 100 times
    so the test takes a second, not minutes.)"""
    import pickle

    from ckpt_doctor.safepickle import limits

    monkeypatch.setattr(limits, "MAX_MEMO_ENTRIES", limits.MAX_MEMO_ENTRIES // 100)

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    from ckpt_doctor.safepickle.walker import walk

    props = TensorProperties(dtype=torch.float32)
    sdm, storage = {}, {}
    for t in range(14):
        fqn = f"layers.{t}.weight"
        sdm[fqn] = TensorStorageMetadata(props, torch.Size([100, 8]), [
            ChunkStorageMetadata(torch.Size([c, 0]), torch.Size([1, 8])) for c in range(100)])
        for c in range(100):
            storage[MetadataIndex(fqn, [c, 0], c)] = _StorageInfo(f"__{c}_0.distcp", t * 1600, 1600)
    data = pickle.dumps(Metadata(sdm, {f: (f,) for f in sdm}, storage, None, "1.0.0"), protocol=4)
    assert data.count(b"\x94") > limits.MAX_MEMO_ENTRIES
    honest = walk(data, ".metadata")
    assert honest.refused is None and honest.broken is None, honest.refused
    bomb = walk(b"\x80\x04N" + b"\x94" * (limits.MAX_MEMO_ENTRIES + 100_000) + b".", "bomb")
    assert bomb.refused and "memo entries" in bomb.refused


def test_items_alike_are_walked_once_yet_each_pays_the_walks_cost(tmp_path):
    """DCP items with the same data.pkl bytes (every chunk of one shape) share one walk, but the folder's budget is
    debited by each as if it had been walked: a folder of many alike items meets the opcode bound as before, and a
    budget too small for the walk gets a walk of its own, which refuses the item."""
    import io

    from ckpt_doctor.readers.survey import ItemCache
    from ckpt_doctor.safepickle.policy import DEFAULT_POLICY
    from ckpt_doctor.safepickle.walker import new_budget, walk

    buf = io.BytesIO()
    torch.save(torch.zeros(1, 8), buf)
    import zipfile

    data = zipfile.ZipFile(buf).read("archive/data.pkl")
    cost = new_budget()[1] - (lambda b: (walk(data, "archive/data.pkl", budget=b), b[1])[1])(new_budget())
    assert cost > 0
    cache, budget = ItemCache(), new_budget()
    first = cache.walk(data, "archive/data.pkl", budget, DEFAULT_POLICY)
    again = cache.walk(data, "archive/data.pkl", budget, DEFAULT_POLICY)
    assert again is first and first.refused is None
    assert budget[1] == new_budget()[1] - 2 * cost
    budget[1] = cost - 1  # the folder's opcodes all but spent: no reuse, a walk of its own that runs out
    short = cache.walk(data, "archive/data.pkl", budget, DEFAULT_POLICY)
    assert short is not first and short.refused and "opcodes" in short.refused


def _chunked_folder(folder: Path, rows: int = 6) -> torch.Tensor:
    """A DCP folder of one (rows, 8) tensor saved as `rows` chunks of one row, end to end in one file, written with
    torch's own metadata classes as FileSystemWriter writes them: every item a torch.save archive, all alike but
    for their values. Returns the whole tensor."""
    import io
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    folder.mkdir()
    whole = torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8)
    storage, items = {}, b""
    for r in range(rows):
        buf = io.BytesIO()
        torch.save(whole[r:r + 1].clone(), buf)
        storage[MetadataIndex("w", [r, 0], 0)] = _StorageInfo("__0_0.distcp", len(items), len(buf.getvalue()))
        items += buf.getvalue()
    (folder / "__0_0.distcp").write_bytes(items)
    sdm = {"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([rows, 8]), [
        ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, 8])) for r in range(rows)])}
    (folder / ".metadata").write_bytes(pickle.dumps(Metadata(sdm, {"w": ("w",)}, storage, None, "1.0.0")))
    return whole


def test_chunk_items_alike_keep_their_own_bytes(tmp_path):
    """Chunk items that differ only in their values (read once, the rest recognised as alike): each chunk is its own
    item's bytes, crc32 and all — the consolidated tensor is torch's."""
    whole = _chunked_folder(tmp_path / "ckpt")
    result = run_cli("inspect", tmp_path / "ckpt", "--json")
    assert result.exit_code == 0, result.stderr
    assert [(t["key"], t["shape"]) for t in result.json()["tensors"]] == [("w", [6, 8])]
    out = tmp_path / "w.pt"
    result = run_cli("fix", tmp_path / "ckpt", "-o", out)
    assert result.exit_code == 0, result.stderr
    assert torch.equal(torch.load(out, weights_only=True)["w"], whole)


def test_an_item_alike_but_for_its_pickle_is_walked(tmp_path):
    """One chunk item whose data.pkl names another global (the same length, so the archive's layout is the same):
    it is not taken for the items before it, it is walked, and what it names is reported."""
    _chunked_folder(tmp_path / "ckpt")
    import io
    import struct
    import zipfile
    import zlib

    shard = tmp_path / "ckpt" / "__0_0.distcp"
    data = shard.read_bytes()
    size = len(data) // 6
    item = data[4 * size:5 * size]  # the fifth of six: not the archive a zip reader finds at the end of the file
    pkl = zipfile.ZipFile(io.BytesIO(item)).read("archive/data.pkl")
    changed = pkl.replace(b"_utils\n_rebuild_tensor_v2", b"_utils\n_rebuild_tensor_v9")
    old_crc, new_crc = struct.pack("<I", zlib.crc32(pkl)), struct.pack("<I", zlib.crc32(changed))
    assert item.count(pkl) == 1 and item.count(old_crc) == 2  # its data descriptor and its directory entry
    item = item.replace(pkl, changed).replace(old_crc, new_crc)  # crc32 kept right: only the name differs
    shard.write_bytes(data[:4 * size] + item + data[5 * size:])
    for command in ("scan", "inspect"):
        result = run_cli(command, tmp_path / "ckpt")
        assert result.exit_code in (1, 2), result.stderr
        assert "_rebuild_tensor_v9" in result.stdout + result.stderr, (command, result.stdout, result.stderr)


def _forced_crc(data: bytes, target: int) -> bytes:
    """`data` with its last 4 bytes set so that its crc32 is `target` (crc32 is affine in those bits)."""
    import zlib

    base = int.from_bytes(data[-4:], "little")
    def crc(x: int) -> int:
        return zlib.crc32(data[:-4] + x.to_bytes(4, "little"))
    basis: dict[int, tuple[int, int]] = {}  # leading bit -> (crc change, the bits of x that make it)
    for bit in range(32):
        v, m = crc(base ^ 1 << bit) ^ crc(base), 1 << bit
        for b in range(31, -1, -1):
            if v >> b & 1:
                if b not in basis:
                    basis[b] = (v, m)
                    break
                v, m = v ^ basis[b][0], m ^ basis[b][1]
    want, x = crc(base) ^ target, base
    for b in range(31, -1, -1):
        if want >> b & 1:
            want, x = want ^ basis[b][0], x ^ basis[b][1]
    return data[:-4] + x.to_bytes(4, "little")


def _rows_in_one_file(tmp_path, archives: list[bytes], cols: int):
    """A DCP folder of one float32 tensor `w` of len(archives) rows, one row a chunk, each chunk's item one of
    `archives`, back to back in __0_0.distcp (as FileSystemWriter lays out one rank)."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    folder = tmp_path / "ckpt"
    folder.mkdir()
    storage, at = {}, 0
    for r, archive in enumerate(archives):
        storage[MetadataIndex("w", [r, 0], 0)] = _StorageInfo("__0_0.distcp", at, len(archive))
        at += len(archive)
    (folder / "__0_0.distcp").write_bytes(b"".join(archives))
    sdm = {"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([len(archives), cols]), [
        ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, cols])) for r in range(len(archives))])}
    (folder / ".metadata").write_bytes(pickle.dumps(Metadata(sdm, {"w": ("w",)}, storage, None, "1.0.0")))
    return folder


def _only_later_items_fire(tmp_path, archives: list[bytes], canary) -> None:
    """torch's view, the oracle: torch.load(weights_only=False) of the first item runs nothing, of the second it
    runs the payload."""
    from tests.helpers import child_fires

    first, second = tmp_path / "first.pt", tmp_path / "second.pt"
    first.write_bytes(archives[0])
    second.write_bytes(archives[1])
    load = "import sys, torch; torch.load(sys.argv[1], weights_only=False)"
    assert not child_fires(load, first, canary) and child_fires(load, second, canary)


def test_an_item_alike_but_for_a_field_a_comment_disguises_as_a_crc32_is_walked(tmp_path):
    """A template whose data.pkl entry's method and time bytes hold its tensor's crc32, behind a directory signature
    in the previous entry's comment that names the tensor's header (its real entry gives it in a zip64 extra): the
    later items, alike but for those 4 bytes, store data.pkl where the template deflates it — torch.load then runs
    the raw deflate stream as the pickle. Each such item is walked (its real directory entries) and refused."""
    import io
    import struct
    import zipfile
    import zlib

    from tests.payloads import call

    canary = tmp_path / "canary"
    buf = io.BytesIO()
    torch.save(torch.zeros(1, 8), buf)
    body = zipfile.ZipFile(buf).read("archive/data.pkl")[2:]
    # A stored deflate block of 0x4302 bytes: as raw pickle bytes, PROTO 2 then SHORT_BINBYTES of 253 bytes, so the
    # pickle goes on 252 bytes into the block; inflated, a benign tensor pickle whose BINBYTES constant holds that.
    size = 0x4302
    head = b"\x80" + struct.pack("<HH", size, size ^ 0xFFFF)  # non-final stored block: 80 02 43 FD BC
    payload = call("os", "system", f"touch {canary}") + b"."
    filler = size - 8 - len(body)
    constant = b"A" * 245 + payload + b"A" * (filler - 245 - len(payload))
    benign = b"\x80\x02B" + struct.pack("<I", filler) + constant + b"0" + body
    for n in range(1, 64):  # a final block that makes stored and inflated sizes equal
        tail = zlib.compressobj(9, zlib.DEFLATED, -15)
        stream = head + benign + tail.compress(b"\0" * n) + tail.flush()
        if len(stream) == size + n:
            break
    inflated = zlib.decompressobj(-15).decompress(stream)
    assert len(stream) == len(inflated) and inflated[:size] == benign

    def item(values: bytes, later: bool) -> bytes:
        crc = 0 if later else 8  # the tensor's crc32 is data.pkl's method (8, then 0) and time (0)
        values = _forced_crc(values, crc)
        out, offsets = bytearray(), []
        for name, data, method, c, usize in ((b"byteorder", b"little", 0, None, 6),
                                             (b"data.pkl", stream, 8, zlib.crc32(inflated), len(inflated)),
                                             (b"version", b"3\n", 0, None, 2), (b"data/0", values, 0, crc, 32)):
            offsets.append(len(out))
            c = zlib.crc32(data) if c is None else c
            out += struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, method, 0, 0, c, len(data), usize,
                               len(name) + 8, 0) + b"archive/" + name + data
        directory = len(out)
        entries = ((b"byteorder", 0, 6, offsets[0], b"", b"", 0),
                   (b"version", 0, 2, offsets[2], b"", b"PK\x01\x02\0\0", 0),  # a signature 6 bytes before the next
                   (b"data.pkl", 0 if later else 8, len(inflated), offsets[1], b"", b"", offsets[3]),
                   (b"data/0", 0, 32, 0xFFFFFFFF, struct.pack("<HHQ", 1, 8, offsets[3]), b"", 0))
        for (name, method, usize, local, extra, comment, internal), data in zip(entries, (b"little", b"3\n", stream,
                                                                                         values)):
            c = zlib.crc32(data) if name != b"data/0" else 8
            c = zlib.crc32(inflated) if name == b"data.pkl" else c
            out += struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, 0, method, 0, 0, c, len(data), usize,
                               len(name) + 8, len(extra), len(comment), 0, internal, 0, local)
            out += b"archive/" + name + extra + comment
        return bytes(out + struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, 4, 4, len(out) - directory, directory, 0))

    archives = [item(torch.arange(r * 8, r * 8 + 8, dtype=torch.float32).numpy().tobytes(), r > 0) for r in range(3)]
    folder = _rows_in_one_file(tmp_path, archives, 8)
    _only_later_items_fire(tmp_path, archives, canary)
    for command in ("scan", "inspect"):
        result = run_cli(command, folder)
        assert result.exit_code in (1, 2) and "os.system" in result.stdout + result.stderr, (command, result.stderr)
    out = tmp_path / "w.pt"
    result = run_cli("fix", folder, "-o", out)
    assert result.exit_code in (1, 2) and not out.exists(), result.stderr
    assert not canary.exists()


def test_an_item_alike_but_for_a_zip64_record_its_tensor_bytes_hold_is_walked(tmp_path):
    """A template whose zip64 locator (the last directory entry's comment) names a zip64 end record inside its
    tensor's bytes, which names the directory ckpt-doctor and torch read; the end record's own fields name another
    directory, inside the tensor's bytes of the later items. Those items, alike but for their tensor's bytes, hold no
    zip64 record there: torch's reader then takes the end record's directory and runs its data.pkl. Each such item
    is walked (the directory it really has) and refused."""
    import io
    import struct
    import zipfile
    import zlib

    from tests.payloads import call

    canary = tmp_path / "canary"
    buf = io.BytesIO()
    torch.save(torch.zeros(1, 128), buf)
    benign = zipfile.ZipFile(buf).read("archive/data.pkl")
    evil = call("os", "system", f"touch {canary}") + b"."

    def local(name: bytes, data: bytes, crc: int | None = None) -> bytes:
        crc = zlib.crc32(data) if crc is None else crc
        return struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, 0, 0, 0, crc, len(data), len(data), len(name), 0) \
            + name + data

    def entry(name: bytes, data: bytes, at: int, comment: bytes = b"") -> bytes:
        return struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, zlib.crc32(data), len(data), len(data),
                           len(name), 0, len(comment), 0, 0, 0, at) + name + comment

    def item(later: bool) -> bytes:
        out = bytearray()
        records = [(b"archive/data.pkl", benign), (b"archive/byteorder", b"little"), (b"archive/version", b"3\n")]
        offsets = []
        for name, data in records:
            offsets.append(len(out))
            out += local(name, data)
        tensor = len(out) + 30 + len(b"archive/data/0")
        values = bytearray(512)  # 128 float32
        if later:  # another archive: a data.pkl that runs a command, and a directory naming it and the version
            values[8:8 + 46 + len(evil)] = local(b"archive/data.pkl", evil)
            other = entry(b"archive/data.pkl", evil, tensor + 8) + entry(b"archive/version", b"3\n", offsets[2])
            values[200:200 + len(other)] = other
        directory = tensor + len(values)
        locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, tensor + 64, 1)  # names a zip64 record at tensor byte 64
        size = sum(46 + len(n) for n, _ in records) + 46 + len(b"archive/data/0") + len(locator)
        if not later:  # the template's zip64 end record: this item's directory, its four entries
            values[64:120] = struct.pack("<4sQ2H2I4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 4, 4, size, directory)
        out += local(b"archive/data/0", bytes(values))
        for (name, data), at in zip(records, offsets):
            out += entry(name, data, at)
        out += entry(b"archive/data/0", bytes(values), tensor - 30 - len(b"archive/data/0"), locator)
        assert len(out) == directory + size
        # the end record's own fields: the directory inside the tensor's bytes (2 entries)
        inner = 2 * 46 + len(b"archive/data.pkl") + len(b"archive/version")
        return bytes(out + struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, 2, 2, inner, tensor + 200, 0))

    archives = [item(r > 0) for r in range(3)]
    folder = _rows_in_one_file(tmp_path, archives, 128)
    _only_later_items_fire(tmp_path, archives, canary)
    result = run_cli("inspect", folder)
    assert result.exit_code in (1, 2) and "would run code" in result.stdout + result.stderr, result.stderr
    out = tmp_path / "w.pt"
    result = run_cli("fix", folder, "-o", out)
    assert result.exit_code in (1, 2) and not out.exists(), result.stderr
    assert not canary.exists()


def test_chunk_items_saved_big_endian_are_not_rewritten_as_little_endian_values(tmp_path):
    """Chunk items whose byteorder record says big (torch.load swaps their bytes): fix refuses rather than write
    the bytes as little-endian values (it wrote byte-swapped numbers, exit 0); inspect still lists the tensor."""
    import io
    import pickle
    import zipfile

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    folder = tmp_path / "ckpt"
    folder.mkdir()
    whole = torch.arange(16, dtype=torch.float32).reshape(2, 8) + 0.5
    storage, blob = {}, b""
    for r in range(2):
        buf, out = io.BytesIO(), io.BytesIO()
        torch.save(whole[r:r + 1].clone(), buf)
        with zipfile.ZipFile(buf) as src, zipfile.ZipFile(out, "w") as z:
            for info in src.infolist():
                data = src.read(info)
                data = b"big" if info.filename.endswith("/byteorder") else data
                z.writestr(info.filename, whole[r:r + 1].numpy().astype(">f4").tobytes()
                           if info.filename.endswith("/data/0") else data)
        item = out.getvalue()
        assert torch.equal(torch.load(io.BytesIO(item), weights_only=True), whole[r:r + 1])  # torch swaps them
        storage[MetadataIndex("w", [r, 0], 0)] = _StorageInfo("__0_0.distcp", len(blob), len(item))
        blob += item
    (folder / "__0_0.distcp").write_bytes(blob)
    sdm = {"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2, 8]), [
        ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, 8])) for r in range(2)])}
    (folder / ".metadata").write_bytes(pickle.dumps(Metadata(sdm, {"w": ("w",)}, storage, None, "1.0.0")))
    result = run_cli("inspect", folder)
    assert result.exit_code == 0 and "big-endian" in result.stderr + result.stdout, result.stderr
    out = tmp_path / "w.pt"
    result = run_cli("fix", folder, "-o", out)
    assert result.exit_code == 2 and "big-endian" in result.stderr and not out.exists(), result.stderr


def test_a_dcp_folder_fix_writes_is_scanned_and_its_shard_inspected_as_torchs_own(tmp_path):
    """scan of a folder `fix --format dcp` wrote reads its .distcp (its archives end to end, as torch's writer lays
    them: it said NOT READ of ckpt-doctor's own output, exit 2), and a shard opened alone makes no torch.load claim
    (dcp.load reads it from the folder's metadata; torch.load(path) opens at most one archive of it)."""
    torch.manual_seed(0)
    path = tmp_path / "model.pt"
    torch.save({"model": Net().state_dict(), "epoch": 3}, path)
    folder = tmp_path / "out"
    assert run_cli("fix", path, "-o", folder, "--format", "dcp").exit_code == 0
    scanned = run_cli("scan", folder)
    assert scanned.exit_code == 0, scanned.stderr
    assert "NOT READ" not in scanned.stdout + scanned.stderr
    shard = next(folder.glob("*.distcp"))
    alone = run_cli("inspect", shard, "--json")
    assert alone.exit_code == 0 and alone.json()["default_load"]["applies"] is False
    assert "archives end to end" in " ".join(alone.json()["notes"])


def test_a_shard_whose_archives_are_padded_apart_is_read(tmp_path):
    """Archives laid on 64-byte boundaries with zeros between them (as ckpt-doctor's DCP writer once laid them) are
    split as they are laid: each is read, where the file was 'zip central directory is corrupt'."""
    from ckpt_doctor.readers.source import close_source, open_source
    from ckpt_doctor.readers.survey import split_archives

    torch.manual_seed(0)
    path = tmp_path / "model.pt"
    torch.save(Net().state_dict(), path)
    folder = tmp_path / "out"
    assert run_cli("fix", path, "-o", folder, "--format", "dcp").exit_code == 0
    data = next(folder.glob("*.distcp")).read_bytes()
    fd = open_source(next(folder.glob("*.distcp")))
    try:
        items = split_archives(fd, len(data))
    finally:
        close_source(fd)
    assert len(items) > 2
    padded = b""
    for offset, length in items:
        padded += b"\0" * (-len(padded) % 64) + data[offset:offset + length]
    (tmp_path / "alone").mkdir()
    shard = tmp_path / "alone" / "__0_0.distcp"
    shard.write_bytes(padded)
    result = run_cli("inspect", shard, "--json")
    assert result.exit_code == 0, result.stderr
    assert f"{len(items)} torch.save archives end to end" in " ".join(result.json()["notes"])
    assert "safetensors blob" not in " ".join(result.json()["notes"])
