"""Issue 11: what torch.load(weights_only=False) would run is found — by scan and inspect alike, in every container —
and is never run, never written by fix, never verified. Each finding of the issue has a test here.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

from tests.payloads import (MAGIC_PICKLE, _str, call, global_op, stored_zip, tar_checkpoint, tar_legacy_polyglot,
                            torch_zip)

MODEL = "fixtures.models:SmallCNN"

# Callables that run a command, evaluate text, open or write a file, or unpickle more — from the standard library,
# torch, numpy and popular ML packages — none on the old built-in list of dangerous modules, and a plain unknown.
REACHING_CODE = [
    ("subprocess", "getoutput", "echo {canary}"), ("timeit", "timeit", "open({canary!r}, 'w')"),
    ("numpy.testing._private.utils", "runstring", "open({canary!r}, 'w')"), ("torch.serialization", "load", "{canary}"),
    ("torch.utils.cpp_extension", "load_inline", "x"), ("pandas", "read_pickle", "{canary}"), ("joblib", "load", "x"),
    ("yaml", "unsafe_load", "x"), ("builtins", "open", "{canary}"), ("io", "open", "{canary}"),
    ("pathlib", "Path.write_text", "x"), ("torch", "hub.load", "x"), ("numpy", "load", "{canary}"),
    ("code", "InteractiveInterpreter", "x"), ("pdb", "run", "open({canary!r}, 'w')"),
    ("torch._inductor.codecache", "PyCodeCache.load", "x"), ("mypkg.trainer", "Callback", "x"),
]


def payload(module: str, name: str, arg: str, canary) -> bytes:
    return call(module, name, arg.format(canary=str(canary)))


def state_dict_pickle(entry: bytes, legacy: bool = False) -> bytes:
    """{'w': a real float tensor, 'x': <entry>} at protocol 2 (the legacy format's storage ids hold a view field)."""
    view = b"N" if legacy else b""
    tensor = (global_op("torch._utils", "_rebuild_tensor_v2") + b"((" + _str("storage") +
              global_op("torch", "FloatStorage") + _str("0") + _str("cpu") + b"K\x04" + view +
              b"tQK\x00K\x04\x85K\x01\x85\x89" +
              global_op("collections", "OrderedDict") + b")RtR")
    return b"\x80\x02}(" + _str("w") + tensor + _str("x") + entry + b"u."


def legacy_file(object_pickle: bytes) -> bytes:
    """The legacy sequence: magic, 1001, sys info, the object pickle, the storage keys, each storage."""
    return (MAGIC_PICKLE + b"\x80\x02M\xe9\x03." + b"\x80\x02}." + object_pickle + b"\x80\x02]" + _str("0") + b"a." +
            struct.pack("<q", 4) + b"\0" * 16)


def containers(entry: bytes, tmp_path) -> dict[str, object]:
    """The same payload in every container: bare pickle, torch zip, legacy, TorchScript-like zip, tar, sharded."""
    sd = state_dict_pickle(entry)
    shard = tmp_path / "sharded"
    shard.mkdir(exist_ok=True)
    (shard / "model-00001.bin").write_bytes(torch_zip(sd, {"0": b"\0" * 16}))
    (shard / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {"w": "model-00001.bin"}}))
    return {
        "bare.pkl": b"\x80\x02" + entry + b".",
        "zip.pt": torch_zip(sd, {"0": b"\0" * 16}),
        "legacy.pt": legacy_file(state_dict_pickle(entry, legacy=True)),
        "script.pt": stored_zip({"m/data.pkl": state_dict_pickle(b"N"), "m/data/0": b"\0" * 16,
                                  "m/constants.pkl": b"\x80\x02" + entry + b".", "m/version": b"3\n",
                                  "m/code/__torch__.py": b"class M(Module):\n  pass\n"}),
        "tar.tar": tar_checkpoint({"w": [0.0] * 4}, storages_payload=entry),
        "sharded": shard,
    }


def write(tmp_path, name, data) -> object:
    if not isinstance(data, (bytes, bytearray)):
        return data
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_every_callable_off_the_allow_list_is_a_finding_in_every_container(tmp_path, cli):
    canary = tmp_path / "CANARY"
    failures = []
    for module, name, arg in REACHING_CODE:
        for cname, data in containers(payload(module, name, arg, canary), tmp_path).items():
            path = write(tmp_path, cname, data)
            out = tmp_path / "out.pt"
            scan = cli("scan", path, "--json")
            inspect = cli("inspect", path, "--json")
            fix = cli("fix", path, "-o", out)
            verify = cli("verify", path, "--model", MODEL, "--input-shape", "2,3,8,8", "--mode", "single")
            label = f"{module}.{name} in {cname}"
            if scan.exit_code != 1 or inspect.exit_code != 1:
                failures.append(f"{label}: scan {scan.exit_code}, inspect {inspect.exit_code}")
            flagged = {f["global"] for f in scan.json()["files"][0]["globals"] if f["verdict"] != "safe"} \
                if scan.stdout else set()
            if f"{module}.{name}" not in flagged and cname != "sharded":
                failures.append(f"{label}: scan does not name it ({flagged})")
            if fix.exit_code == 0:  # only tensors and plain data may come out (the weights of a TorchScript archive)
                if cli("scan", out).exit_code != 0 or f"{module}\n{name}".encode() in out.read_bytes():
                    failures.append(f"{label}: fix wrote the global into its output")
                torch.load(out, weights_only=True)
                out.unlink()
            elif out.exists():
                failures.append(f"{label}: fix failed (exit {fix.exit_code}) but left an output")
            if verify.exit_code != 1 or "refusing to verify" not in verify.stderr:
                failures.append(f"{label}: verify exit {verify.exit_code}: {verify.stderr[-200:]}")
            assert not canary.exists(), label
    assert failures == [], '\n'.join(failures)


def test_the_payloads_are_live(tmp_path):
    """The containers above really run their payload under torch.load(weights_only=False): a canary appears."""
    canary = tmp_path / "CANARY"
    entry = call("os", "system", f"touch {canary}")
    for cname, data in containers(entry, tmp_path).items():
        if cname in ("sharded", "script.pt"):
            continue  # an index is not loaded by torch.load; TorchScript goes to torch.jit.load
        path = write(tmp_path, cname, data)
        code = ("import torch,sys\ntry:\n    torch.load(sys.argv[1], weights_only=False)\nexcept Exception:\n"
                "    pass\n")
        subprocess.run([sys.executable, "-c", code, str(path)], timeout=120, capture_output=True)
        assert canary.exists(), cname
        canary.unlink()


@pytest.mark.parametrize("module,name,verdict", [
    ("torch", "os.system", "dangerous"), ("torch", "serialization.os.system", "dangerous"),
    ("collections", "OrderedDict.fromkeys", "code"), ("torch", "nn.parameter.Parameter", "safe"),
    ("builtins", "str.join", "code"), ("__builtin__", "eval", "dangerous"), ("torch", "_C._jit_pass", "dangerous"),
])
def test_dotted_names_are_judged_hop_by_hop(tmp_path, cli, module, name, verdict):
    stack_global = b"\x80\x04" + _str(module) + _str(name) + b"\x93."
    text_global = b"\x80\x04" + global_op(module, name) + b"."
    for i, data in enumerate((stack_global, text_global)):
        path = tmp_path / f"g{i}.pkl"
        path.write_bytes(data)
        globals_ = cli("scan", path, "--json", "--all").json()["files"][0]["globals"]
        assert [(g["global"], g["verdict"]) for g in globals_] == [(f"{module}.{name}", verdict)]


def test_a_whole_pickled_model_is_flagged_listed_and_rescued(fixtures, cli, tmp_path):
    path = fixtures["whole_model"]["path"]
    scan = cli("scan", path, "--json")
    assert scan.exit_code == 1 and scan.json()["files"][0]["verdict"] == "code"
    inspect = cli("inspect", path, "--json")
    assert inspect.exit_code == 1 and inspect.json()["tensors"]
    out = tmp_path / "rescued.pt"
    fix = cli("fix", path, "-o", out)
    assert fix.exit_code == 0, fix.stderr
    assert cli("scan", out).exit_code == 0
    assert set(torch.load(out, weights_only=True)) == {t["key"] for t in inspect.json()["tensors"]}
    verify = cli("verify", path, "--model", MODEL, "--input-shape", "2,3,8,8")
    assert verify.exit_code == 1 and "rescue its weights first" in verify.stderr.lower()


def test_fix_never_writes_a_global_off_the_allow_list(tmp_path, cli):
    import argparse

    path = tmp_path / "train.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1), "epoch": 3}, path)
    # argparse.Namespace is inert (scan and inspect pass it) but torch.load(weights_only=True) refuses it.
    assert cli("scan", path).exit_code == 0
    out = tmp_path / "out.pt"
    refused = cli("fix", path, "-o", out)
    assert refused.exit_code == 2 and not out.exists()
    assert "argparse.Namespace" in refused.stderr and "--drop '^args$'" in refused.stderr
    assert cli("fix", path, "-o", out, "--drop", "^args$").exit_code == 0
    assert torch.load(out, weights_only=True)["epoch"] == 3
    kept = tmp_path / "kept.pt"
    assert cli("fix", path, "-o", kept, "--allow-global", "argparse.Namespace").exit_code == 0
    with torch.serialization.safe_globals([argparse.Namespace]):
        assert torch.load(kept, weights_only=True)["args"].lr == 0.1


def test_allow_global_is_like_add_safe_globals_and_refuses_what_runs_code(tmp_path, cli):
    path = tmp_path / "cfg.pkl"
    path.write_bytes(b"\x80\x02}(" + _str("cfg") + global_op("mypkg.config", "TrainConfig") + b")\x81u.")
    assert cli("scan", path).exit_code == 1
    assert cli("scan", path, "--allow-global", "mypkg.config.TrainConfig").exit_code == 0
    assert cli("scan", path).exit_code == 1  # the allowance was that command's, not the process's
    refused = cli("scan", path, "--allow-global", "os.system")
    assert refused.exit_code == 2 and "refused" in refused.stderr


def test_the_allow_list_is_a_value_passed_in(tmp_path):
    """A Policy is passed to what reads: one that allows a global makes it safe for that call only, and the default
    call before and after is unaffected (no policy is "in force" anywhere)."""
    from ckpt_doctor import read_checkpoint
    from ckpt_doctor._record import FrozenInstanceError
    from ckpt_doctor.errors import UsageError
    from ckpt_doctor.safepickle.policy import DEFAULT_POLICY, Policy, Verdict, classify
    from ckpt_doctor.scan import scan

    mine = Policy.allowing(["mypkg.config.TrainConfig"])
    assert mine.classify("mypkg.config", "TrainConfig")[0] is Verdict.SAFE
    assert DEFAULT_POLICY.classify("mypkg.config", "TrainConfig")[0] is Verdict.CODE
    assert classify("mypkg.config", "TrainConfig", mine)[0] is Verdict.SAFE
    assert classify("mypkg.config", "TrainConfig")[0] is Verdict.CODE
    assert mine.writable("mypkg.config", "TrainConfig") and not DEFAULT_POLICY.writable("mypkg.config", "TrainConfig")
    with pytest.raises(FrozenInstanceError):
        mine.extra = frozenset()  # type: ignore[misc]
    with pytest.raises(UsageError, match="refused"):
        Policy.allowing(["os.system"])

    path = tmp_path / "cfg.pkl"
    path.write_bytes(b"\x80\x02}(" + _str("cfg") + global_op("mypkg.config", "TrainConfig") + b")\x81u.")
    zipped = tmp_path / "cfg.pt"  # the same global inside a torch zip: walked, then unpickled
    zipped.write_bytes(stored_zip({"archive/data.pkl": b"\x80\x02}(" + _str("cfg") + global_op("mypkg.config",
                                  "TrainConfig") + b")\x81u.", "archive/version": b"3\n"}))
    for p in (path, zipped):
        assert [g.qualname for g in read_checkpoint(p).unsafe_globals] == ["mypkg.config.TrainConfig"]
        allowed = read_checkpoint(p, policy=mine)
        assert not allowed.unsafe_globals
        assert [g.verdict for g in allowed.globals if g.qualname == "mypkg.config.TrainConfig"] == [Verdict.SAFE]
        assert [g.qualname for g in read_checkpoint(p).unsafe_globals] == ["mypkg.config.TrainConfig"]
    assert scan([str(path)], policy=mine).exit_code == 0
    assert scan([str(path)]).exit_code == 1


def test_a_cached_walk_is_never_served_under_another_policy():
    """DCP items alike are walked once (ItemCache): the walk of the same bytes under another policy is its own."""
    from ckpt_doctor.readers.survey import ItemCache
    from ckpt_doctor.safepickle.policy import DEFAULT_POLICY, Policy, Verdict
    from ckpt_doctor.safepickle.walker import new_budget

    data = b"\x80\x02}(" + _str("cfg") + global_op("mypkg.config", "TrainConfig") + b")\x81u."
    cache = ItemCache()
    mine = Policy.allowing(["mypkg.config.TrainConfig"])
    budget = new_budget()
    assert [g.verdict for g in cache.walk(data, "data.pkl", budget, DEFAULT_POLICY).globals] == [Verdict.CODE]
    assert [g.verdict for g in cache.walk(data, "data.pkl", budget, mine).globals] == [Verdict.SAFE]
    assert [g.verdict for g in cache.walk(data, "data.pkl", budget, DEFAULT_POLICY).globals] == [Verdict.CODE]


@pytest.mark.parametrize("module, name", [("transformers.training_args", "TrainingArguments"),
                                          ("accelerate.state", "PartialState"),
                                          ("accelerate.utils.dataclasses", "AcceleratorConfig")])
def test_classes_whose_construction_runs_code_are_not_allow_listed(module, name):
    """Called by REDUCE, a dataclass runs __post_init__ with arguments the file chooses (TrainingArguments opens a
    path of the file's choosing; PartialState rewrites process-wide state): they are findings, not safe."""
    from ckpt_doctor.safepickle.policy import Verdict, classify

    assert classify(module, name)[0] is not Verdict.SAFE


def test_fix_keeps_a_frozenset_only_when_allowed(tmp_path, cli):
    path, out = tmp_path / "f.pt", tmp_path / "out.pt"
    torch.save({"w": torch.zeros(2), "meta": frozenset({1, 2})}, path)
    refused = cli("fix", path, "-o", out)
    assert refused.exit_code == 2 and "--drop '^meta$'" in refused.stderr and not out.exists()
    assert cli("fix", path, "-o", out, "--allow-global", "builtins.frozenset").exit_code == 0
    with torch.serialization.safe_globals([frozenset]):
        assert torch.load(out, weights_only=True)["meta"] == frozenset({1, 2})
    dropped = tmp_path / "dropped.pt"
    assert cli("fix", path, "-o", dropped, "--drop", "^meta$").exit_code == 0
    assert list(torch.load(dropped, weights_only=True)) == ["w"]

# --- scan and inspect agree: the cases where two walkers used to disagree ------------------------------------

def legacy_protocol_1_payload(tmp_path, canary) -> bytes:
    """A real legacy file saved with pickle_protocol=1, its object pickle replaced by a protocol-1 payload."""
    real = tmp_path / "p1.pt"
    torch.save({"w": torch.ones(2)}, real, _use_new_zipfile_serialization=False, pickle_protocol=1)
    from tests.corpus import _legacy_with_payload

    return _legacy_with_payload(real.read_bytes(), b"cos\nsystem\n(S'touch " + str(canary).encode() + b"'\ntR")


@pytest.mark.parametrize("case", ["protocol1_legacy", "pop_between", "memoize_numbering", "cut_decoy", "ext_code"])
def test_scan_and_inspect_give_the_same_verdict(tmp_path, cli, case):
    canary = tmp_path / "CANARY"
    if case == "protocol1_legacy":
        data = legacy_protocol_1_payload(tmp_path, canary)
    elif case == "pop_between":  # the last two strings seen are "os", "system"; the stack holds "posix", "system"
        data = (b"\x80\x04" + _str("posix") + _str("os") + b"0" + _str("system") + b"\x93" + b"(" +
                _str(f"touch {canary}") + b"tR.")
    elif case == "memoize_numbering":  # memo 0 is None, not a string: BINGET 1 is "system"
        data = b"\x80\x04N\x94" + _str("system") + b"\x94" + _str("posix") + b"h\x01\x93(" + _str("x") + b"tR."
    elif case == "cut_decoy":  # a harmless first pickle, then a payload cut by one byte
        data = b"\x80\x02}." + (b"\x80\x02" + call("os", "system", f"touch {canary}") + b".")[:-1]
    else:  # EXT codes are not corruption: a registered code is a global (none is registered here)
        data = b"\x80\x02" + global_op("posix", "system") + b"(" + _str("x") + b"tR."
    path = tmp_path / "f.pkl"
    path.write_bytes(data)
    scan, inspect = cli("scan", path), cli("inspect", path)
    assert scan.exit_code == inspect.exit_code == 1, (scan.stderr, inspect.stderr)
    assert "system" in scan.stderr and "system" in inspect.stderr
    assert not canary.exists()


# --- torch's own decisions, mirrored -------------------------------------------------------------------------

def test_tar_comes_before_the_legacy_pickles(tmp_path, cli):
    canary = tmp_path / "CANARY"
    path = tmp_path / "model.pt"
    path.write_bytes(tar_checkpoint({"w": [1.0, 2.0]}, storages_payload=call("os", "system", f"touch {canary}")))
    for command in ("scan", "inspect"):
        result = cli(command, path)
        assert result.exit_code == 1 and "os.system" in result.stderr, result.stderr
    clean = tmp_path / "clean.tar"
    clean.write_bytes(tar_checkpoint({"w": [1.0, 2.0], "b": [3.0]}))
    data = cli("inspect", clean, "--json").json()
    assert data["format"] == "torch-tar"
    assert {t["key"]: t["shape"] for t in data["tensors"]} == {"w": [2], "b": [1]}
    out = tmp_path / "out.pt"
    assert cli("fix", clean, "-o", out).exit_code == 0
    loaded, theirs = torch.load(out, weights_only=True), torch.load(clean, weights_only=False)
    assert list(loaded) == list(theirs) and all(torch.equal(loaded[k], theirs[k]) for k in theirs)
    assert not canary.exists()


def test_a_file_that_is_both_a_tar_and_a_legacy_checkpoint_is_flagged(tmp_path, cli):
    canary = tmp_path / "CANARY"
    obj = b"\x80\x02}(" + _str("x") + call("os", "system", f"touch {canary}") + b"u."
    path = tmp_path / "polyglot.pt"
    path.write_bytes(tar_legacy_polyglot(obj, {"w": [1.0]}))
    for command in ("scan", "inspect"):
        result = cli(command, path)
        assert result.exit_code == 1, result.stderr
        assert "os.system" in result.stderr and "both a tar archive and a pickle" in result.stderr
    assert not canary.exists()


def test_zip_members_are_found_as_torch_finds_them(tmp_path, cli):
    canary = tmp_path / "CANARY"
    evil = state_dict_pickle(call("os", "system", f"touch {canary}"))
    good = state_dict_pickle(b"N")
    # Two members named data.pkl: torch's reader picks one by miniz's sort order, zipfile the last; flagged either
    # way, and both copies walked.
    for order in ((good, evil), (evil, good)):
        path = tmp_path / "dup.pt"
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z, pytest.warns(UserWarning):
            z.writestr("archive/data.pkl", order[0])
            z.writestr("archive/data.pkl", order[1])
            z.writestr("archive/data/0", b"\0" * 16)
            z.writestr("archive/version", "3\n")
        path.write_bytes(buf.getvalue())
        for command in ("scan", "inspect"):
            result = cli(command, path)
            assert result.exit_code == 1 and "os.system" in result.stderr and "members named" in result.stderr
    # A name in another case: torch's lookup ignores ASCII case, so torch loads this file.
    upper = tmp_path / "upper.pt"
    upper.write_bytes(stored_zip({"archive/DATA.PKL": evil, "archive/data/0": b"\0" * 16, "archive/version": b"3\n"}))
    assert cli("inspect", upper).exit_code == 1 and "os.system" in cli("inspect", upper).stderr
    # Bytes after the end record: torch loads the archive; so does ckpt-doctor, and names the payload.
    for extra in (10, 1024, 65_000):
        trailing = tmp_path / f"trailing{extra}.pt"
        trailing.write_bytes(torch_zip(evil, {"0": b"\0" * 16}) + b"\0" * extra)
        result = cli("inspect", trailing, "--json")
        assert result.exit_code == 1 and result.json()["unsafe_globals"] == ["os.system"], extra
    assert not canary.exists()


def test_torch_reads_what_ckpt_doctor_reads(tmp_path, cli):
    """The archives above that torch loads, ckpt-doctor lists the same tensors for (the differential)."""
    sd = {"w": torch.arange(4.0)}
    base = tmp_path / "base.pt"
    torch.save(sd, base)
    raw = base.read_bytes()
    for name, data in {"trailing": raw + b"x" * 1000, "comment": raw[:-2] + struct.pack("<H", 5) + b"hello"}.items():
        path = tmp_path / f"{name}.pt"
        path.write_bytes(data)
        assert torch.equal(torch.load(path, weights_only=True)["w"], sd["w"])
        result = cli("inspect", path, "--json")
        assert result.exit_code == 0, result.stderr
        assert [t["key"] for t in result.json()["tensors"]] == ["w"]


# --- folders, as torch and the Hub see them ------------------------------------------------------------------

def test_scan_folder_follows_symlinks_and_sniffs_every_file(tmp_path, cli, fixtures):
    canary = tmp_path / "CANARY"
    snapshot = tmp_path / "models--org--name" / "snapshots" / "abc"
    blobs = tmp_path / "models--org--name" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "1111").write_bytes(fixtures["safetensors"]["path"].read_bytes())
    os.symlink("../../blobs/1111", snapshot / "model.safetensors")
    assert cli("scan", snapshot).exit_code == 0  # a Hugging Face snapshot is all symlinks: scanned, clean
    evil = b"\x80\x02" + call("os", "system", f"touch {canary}") + b"."
    for name in ("checkpoint", "model.pt.1"):
        (blobs / name).write_bytes(evil)
        os.symlink(f"../../blobs/{name}", snapshot / name)
        result = cli("scan", snapshot, "--json")
        assert result.exit_code == 1, name  # one benign file beside it does not make the folder clean
        assert any(f["verdict"] == "dangerous" for f in result.json()["files"])
        (snapshot / name).unlink()
    import numpy as np

    np.save(snapshot / "weights.npy", np.array([None, {"a": 1}], dtype=object), allow_pickle=True)
    raw = (snapshot / "weights.npy").read_bytes()
    (snapshot / "weights.npy").write_bytes(raw[:raw.index(b"\x80")] + b"\x80\x03" +
                                           call("posix", "system", f"touch {canary}") + b".")
    result = cli("scan", snapshot)
    assert result.exit_code == 1 and "posix.system" in result.stderr
    (snapshot / "README.md").write_text("# a model card\n")
    assert cli("scan", snapshot).exit_code == 1
    assert not canary.exists()


def test_dcp_metadata_is_not_a_false_alarm(tmp_path, cli):
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 2)
    dcp.save({"model": model.state_dict(), "step": 3}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    metadata = tmp_path / "dcp" / ".metadata"
    result = cli("scan", metadata, "--json")
    assert result.exit_code == 0, result.stderr
    allowed = {g["global"] for g in result.json()["files"][0]["globals"]}
    assert "torch.distributed.checkpoint.metadata.Metadata" in allowed and "pathlib.PosixPath" in allowed


def test_the_policy_holds_torchs_own_allow_list():
    from torch._weights_only_unpickler import _get_allowed_globals

    from ckpt_doctor.safepickle.policy import CURATED, TORCH_WEIGHTS_ONLY, classify

    assert TORCH_WEIGHTS_ONLY == set(_get_allowed_globals())
    assert not TORCH_WEIGHTS_ONLY & set(CURATED)
    for name in TORCH_WEIGHTS_ONLY | set(CURATED):
        module, _, attr = name.rpartition(".")
        assert classify(module, attr)[0].value == "safe", name
    assert all(reason for reason in CURATED.values())


def test_safe_unpickler_stand_ins_are_all_on_the_allow_list():
    from ckpt_doctor.safepickle.policy import ALLOWED
    from ckpt_doctor.safepickle.unpickler import _SAFE_CALLABLES

    assert set(_SAFE_CALLABLES) <= ALLOWED


def test_inspect_of_a_folder_reports_what_its_other_files_would_run(tmp_path, cli, fixtures):
    canary = tmp_path / "CANARY"
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(fixtures["safetensors"]["path"].read_bytes())
    (folder / "config.json").write_text("{}")
    assert cli("inspect", folder).exit_code == cli("scan", folder).exit_code == 0
    (folder / "training_args.bin").write_bytes(torch_zip(state_dict_pickle(call("os", "system", f"touch {canary}")),
                                                         {"0": b"\0" * 16}))
    inspect, scan = cli("inspect", folder), cli("scan", folder)
    assert inspect.exit_code == scan.exit_code == 1
    assert "training_args.bin" in inspect.stderr and "os.system" in inspect.stderr
    assert inspect.stdout.count("\n") > 2  # the model's tensors are still listed
    assert not canary.exists()
