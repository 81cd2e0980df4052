"""ckpt-doctor fix: exact round trips, every transform, safe writes, --auto on every comparison case."""

from __future__ import annotations

import hashlib
import os
import shlex
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fixtures.models import RenamedCNN, SmallCNN, TinyTransformer, make_cnn

CNN = "fixtures.models:SmallCNN"


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def run_fix(cli, src, out, *flags, code=0):
    result = cli("fix", src, "-o", out, *flags, "--json")
    assert result.exit_code == code, result.stderr
    return result.json() if code == 0 else result


def test_add_then_strip_module_is_bitwise_identity(fixtures, cli, tmp_path):
    src = fixtures["plain"]["path"]
    before = sha(src)
    run_fix(cli, src, tmp_path / "wrapped.pt", "--add-module")
    wrapped = torch.load(tmp_path / "wrapped.pt", weights_only=True)
    assert all(k.startswith("module.") for k in wrapped)
    data = run_fix(cli, tmp_path / "wrapped.pt", tmp_path / "back.pt", "--strip-module")
    assert data["verified"] is True and data["tensors"] == 16
    orig = torch.load(src, weights_only=True)
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert list(back) == list(orig)
    assert all(bitwise_equal(back[k], orig[k]) for k in orig)
    assert sha(src) == before


def test_torch_to_safetensors_to_torch(fixtures, cli, tmp_path):
    src = fixtures["dtypes"]["path"]
    run_fix(cli, src, tmp_path / "a.safetensors")
    run_fix(cli, tmp_path / "a.safetensors", tmp_path / "b.pth")
    orig = torch.load(src, weights_only=True)
    st = load_file(str(tmp_path / "a.safetensors"))
    back = torch.load(tmp_path / "b.pth", weights_only=True)
    for k, v in orig.items():
        assert bitwise_equal(st[k], v.contiguous()), k
        assert bitwise_equal(back[k], v.contiguous()), k


def test_views_survive_a_torch_rewrite(fixtures, cli, tmp_path):
    src = fixtures["dtypes"]["path"]
    run_fix(cli, src, tmp_path / "same.pt")
    back = torch.load(tmp_path / "same.pt", weights_only=True)
    orig = torch.load(src, weights_only=True)
    assert back["view"].stride() == orig["view"].stride() and torch.equal(back["view"], orig["view"])
    assert torch.load(tmp_path / "same.pt", weights_only=True, mmap=True)["f64"].shape == (2, 2)


def test_legacy_becomes_zip_with_identical_tensors(fixtures, cli, tmp_path):
    src = fixtures["legacy"]["path"]
    run_fix(cli, src, tmp_path / "new.pt")
    assert open(tmp_path / "new.pt", "rb").read(4) == b"PK\x03\x04"
    orig = torch.load(src, weights_only=True)
    new = torch.load(tmp_path / "new.pt", weights_only=True, mmap=True)
    assert list(new) == list(orig) and all(bitwise_equal(new[k], orig[k]) for k in orig)


def test_whole_model_becomes_a_loadable_state_dict(fixtures, cli, tmp_path):
    info = fixtures["whole_model"]
    run_fix(cli, info["path"], tmp_path / "sd.pt")
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert {k: (list(v.shape), str(v.dtype)[6:]) for k, v in sd.items()} == \
        {k: tuple(v) for k, v in info["expected"].items()}
    # A fresh instance of the same class (its module is gone; define it again from the same source) loads it.
    from fixtures.make_fixtures import GONE_MODEL_SOURCE

    namespace: dict = {}
    exec(GONE_MODEL_SOURCE, namespace)  # the test's own model source, not anything from the checkpoint
    namespace["GoneNet"]().load_state_dict(sd, strict=True)
    run_fix(cli, info["path"], tmp_path / "features.pt", "--select", "features")
    assert list(torch.load(tmp_path / "features.pt", weights_only=True))[:2] == ["0.weight", "0.bias"]


def test_training_checkpoint_select_drop_and_metadata(fixtures, cli, tmp_path):
    src = fixtures["training"]["path"]
    run_fix(cli, src, tmp_path / "all.pt")
    whole = torch.load(tmp_path / "all.pt", weights_only=True)
    assert whole["epoch"] == 7 and whole["args"] == {"arch": "cnn", "batch_size": 64}
    assert whole["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    data = run_fix(cli, src, tmp_path / "noopt.pt", "--drop", "^optimizer")
    noopt = torch.load(tmp_path / "noopt.pt", weights_only=True)
    assert "optimizer" not in noopt and noopt["epoch"] == 7 and data["tensors"] == 16
    # what was dropped is listed, outside the state_dict too: every optimizer tensor, by its path
    opt_tensors = {f"optimizer.state.{i}.{name}" for i in whole["optimizer"]["state"] for name in
                   ("exp_avg", "exp_avg_sq", "step") if torch.is_tensor(whole["optimizer"]["state"][i].get(name))}
    assert opt_tensors and set(data["dropped"]) == opt_tensors | {"optimizer"}  # its param_groups with it
    # a --drop naming the state_dict itself drops all of it (and says so), the rest is written
    data = run_fix(cli, src, tmp_path / "nosd.pt", "--drop", "^state_dict$")
    nosd = torch.load(tmp_path / "nosd.pt", weights_only=True)
    assert "state_dict" not in nosd and nosd["epoch"] == 7 and len(data["dropped"]) == 16
    run_fix(cli, src, tmp_path / "sd.pt", "--select", "state_dict")
    SmallCNN().load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True), strict=True)
    # the summary names what is left out where a count alone would hide it: a few keys, or the entries they were in
    summary = cli("fix", src, "-o", tmp_path / "sd2.pt", "--select", "state_dict").stderr
    named = summary.split(" dropped (", 1)[1].split(")", 1)[0].removeprefix("under ")
    assert set(named.split(", ")) == set(whole) - {"state_dict"}, summary


def test_map_location_and_dtype(fixtures, cli, tmp_path):
    run_fix(cli, fixtures["cuda3"]["path"], tmp_path / "cpu.pt", "--map-location", "cpu", "--dtype", "float16")
    data = cli("inspect", tmp_path / "cpu.pt", "--json").json()
    assert {t["device"] for t in data["tensors"]} == {"cpu"}
    dtypes = {t["key"]: t["dtype"] for t in data["tensors"]}
    assert dtypes["features.0.weight"] == "float16" and dtypes["features.1.num_batches_tracked"] == "int64"
    sd = torch.load(tmp_path / "cpu.pt", weights_only=True)
    ref = torch.load(fixtures["cuda3"]["path"], map_location="cpu", weights_only=True)
    assert torch.equal(sd["features.0.weight"], ref["features.0.weight"].half())
    run_fix(cli, fixtures["plain"]["path"], tmp_path / "c1.pt", "--map-location", "cpu=cuda:1")
    assert cli("inspect", tmp_path / "c1.pt", "--json").json()["devices"] == ["cuda:1"]


def test_tied_weights_in_safetensors_are_written_once(fixtures, cli, tmp_path):
    data = run_fix(cli, fixtures["tied"]["path"], tmp_path / "lm.safetensors")
    assert data["tied"] == {"lm_head.weight": "embed.weight"}
    dry = cli("fix", fixtures["tied"]["path"], "-o", tmp_path / "again.safetensors", "--dry-run")
    assert "1 tied, stored once (lm_head.weight = embed.weight)" in dry.stderr, dry.stderr  # (the table said
    assert "lm_head.weight (stored once, as embed.weight)" in dry.stdout, dry.stdout  # `lm_head.weight = lm_head.weight`)
    st = load_file(str(tmp_path / "lm.safetensors"))
    assert "lm_head.weight" not in st
    model = TinyTransformer()
    missing, unexpected = model.load_state_dict(st, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []
    assert model.lm_head.weight is model.embed.weight  # the tie survives: it is the same parameter


def test_a_tie_safetensors_stored_once_is_one_storage_again_back_in_torch_format(fixtures, cli, tmp_path):
    """fix writes a tied name once in safetensors and records it (ckpt_doctor.tied); fix of that file back to .pt
    wrote the other name alone (a strict load then failed), saying the header's metadata had no place in a torch
    file. The tie is written again, under the output's names, and a drop of the alias keeps it out."""
    run_fix(cli, fixtures["tied"]["path"], tmp_path / "lm.safetensors")
    data = run_fix(cli, tmp_path / "lm.safetensors", tmp_path / "back.pt", "--add-prefix", "model.")
    assert data["tied"] == {"model.lm_head.weight": "model.embed.weight"}
    sd = torch.load(tmp_path / "back.pt", weights_only=True)
    assert sd["model.embed.weight"].data_ptr() == sd["model.lm_head.weight"].data_ptr()
    plain = run_fix(cli, tmp_path / "lm.safetensors", tmp_path / "plain.pt")
    assert not any("__metadata__" in n for n in plain["notes"]), plain["notes"]
    TinyTransformer().load_state_dict(torch.load(tmp_path / "plain.pt", weights_only=True), strict=True)
    assert cli("diff", fixtures["tied"]["path"], tmp_path / "plain.pt").exit_code == 0
    again = run_fix(cli, tmp_path / "lm.safetensors", tmp_path / "renamed.safetensors", "--add-prefix", "m.")
    assert again["tied"] == {"m.lm_head.weight": "m.embed.weight"}
    with safe_open(str(tmp_path / "renamed.safetensors"), "pt") as f:
        assert f.metadata()["ckpt_doctor.tied"] == "m.lm_head.weight=m.embed.weight"
    with safe_open(str(tmp_path / "lm.safetensors"), "pt") as f:  # a header naming a key no module could have
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(tmp_path / "odd.safetensors"),
              metadata={"ckpt_doctor.tied": "a..b=embed.weight,lm_head.weight=embed.weight"})
    odd = run_fix(cli, tmp_path / "odd.safetensors", tmp_path / "odd.pt")
    assert odd["tied"] == {"lm_head.weight": "embed.weight"}  # written as a tie; `a..b` is not written
    # under --select the header's names are the file's paths: those under the part written, relative to it; a chain
    # b=a, a=y is followed
    save_file({"y": torch.zeros(2), "model.y": torch.ones(2)}, str(tmp_path / "sel.safetensors"),
              metadata={"ckpt_doctor.tied": "x=y,model.a=model.y,model.b=model.a"})
    sel = run_fix(cli, tmp_path / "sel.safetensors", tmp_path / "sel.pt", "--select", "model")
    assert sel["tied"] == {"a": "y", "b": "y"} or sel["tied"] == {"a": "y", "b": "a"}, sel["tied"]
    loaded = torch.load(tmp_path / "sel.pt", weights_only=True)
    assert sorted(loaded) == ["a", "b", "y"] and torch.equal(loaded["b"], torch.ones(2))
    assert loaded["a"].data_ptr() == loaded["b"].data_ptr() == loaded["y"].data_ptr()
    dropped = run_fix(cli, tmp_path / "lm.safetensors", tmp_path / "headless.pt", "--drop", "^lm_head")
    assert "lm_head.weight" not in torch.load(tmp_path / "headless.pt", weights_only=True) and not dropped["tied"]


def test_tied_weights_stay_shared_in_torch_format(fixtures, cli, tmp_path):
    data = run_fix(cli, fixtures["tied"]["path"], tmp_path / "lm.pt", "--add-prefix", "model.")
    assert data["tied"] == {"model.lm_head.weight": "model.embed.weight"}
    said = cli("fix", fixtures["tied"]["path"], "-o", tmp_path / "again.pt", "--add-prefix", "model.").stderr
    assert "1 tied (model.lm_head.weight = model.embed.weight)" in said, said  # the summary names what --json does
    sd = torch.load(tmp_path / "lm.pt", weights_only=True)
    assert sd["model.embed.weight"].data_ptr() == sd["model.lm_head.weight"].data_ptr()
    data = cli("inspect", tmp_path / "lm.pt", "--json").json()
    assert data["tensor_count"] == 43 and len({t["storage"] for t in data["tensors"]}) == 42


def test_sharded_input_becomes_one_file(fixtures, cli, tmp_path):
    run_fix(cli, fixtures["sharded_safetensors"]["path"], tmp_path / "one.safetensors")
    one = load_file(str(tmp_path / "one.safetensors"))
    assert set(one) == set(fixtures["sharded_safetensors"]["expected"])
    run_fix(cli, fixtures["sharded_bin"]["path"], tmp_path / "one.pt")
    SmallCNN().load_state_dict(torch.load(tmp_path / "one.pt", weights_only=True), strict=True)


def test_torchscript_weights_without_running_it(fixtures, cli, tmp_path):
    run_fix(cli, fixtures["torchscript"]["path"], tmp_path / "ts.safetensors")
    written = load_file(str(tmp_path / "ts.safetensors"))
    assert {k: (list(v.shape), str(v.dtype)[6:]) for k, v in written.items()} == \
        {k: tuple(v) for k, v in fixtures["torchscript"]["expected"].items()}


@pytest.mark.parametrize("name", ["dataparallel", "ddp", "compiled", "lightning", "training", "plain", "cuda3"])
def test_auto_yields_a_strict_load(fixtures, cli, tmp_path, name):
    data = run_fix(cli, fixtures[name]["path"], tmp_path / "auto.pt", "--model", CNN, "--auto")
    assert data["verified"]
    SmallCNN().load_state_dict(torch.load(tmp_path / "auto.pt", map_location="cpu", weights_only=True), strict=True)
    assert cli("inspect", tmp_path / "auto.pt", "--model", CNN).exit_code == 0


def test_auto_mid_key_wrapper_and_non_persistent(cli, tmp_path):
    sd = make_cnn().state_dict()
    torch.save({k.replace("features.", "features.module."): v for k, v in sd.items()}, tmp_path / "mid.pt")
    run_fix(cli, tmp_path / "mid.pt", tmp_path / "mid_fixed.pt", "--model", CNN, "--auto")
    SmallCNN().load_state_dict(torch.load(tmp_path / "mid_fixed.pt", weights_only=True), strict=True)
    lm = TinyTransformer().state_dict()
    lm["positions"] = torch.arange(32)
    torch.save({"module." + k: v for k, v in lm.items()}, tmp_path / "lm.pt")
    run_fix(cli, tmp_path / "lm.pt", tmp_path / "lm_fixed.pt", "--model", "fixtures.models:TinyTransformer", "--auto")
    TinyTransformer().load_state_dict(torch.load(tmp_path / "lm_fixed.pt", weights_only=True), strict=True)


def test_auto_adds_module_for_a_wrapped_model(fixtures, cli, tmp_path):
    (tmp_path / "wrap.py").write_text("from torch import nn\nfrom fixtures.models import SmallCNN\n"
                                      "def wrapped():\n    return nn.DataParallel(SmallCNN())\n")
    run_fix(cli, fixtures["plain"]["path"], tmp_path / "dp.pt", "--model", f"{tmp_path}/wrap.py:wrapped", "--auto")
    assert all(k.startswith("module.") for k in torch.load(tmp_path / "dp.pt", weights_only=True))


def test_map_by_order(fixtures, cli, tmp_path):
    src = fixtures["plain"]["path"]
    refused = run_fix(cli, src, tmp_path / "r.pt", "--model", "fixtures.models:RenamedCNN", "--map-by-order", code=2)
    assert "neighbour of the same shape" in refused.stderr and not (tmp_path / "r.pt").exists()
    run_fix(cli, src, tmp_path / "r.pt", "--model", "fixtures.models:RenamedCNN", "--map-by-order", "--force")
    model = RenamedCNN()
    model.load_state_dict(torch.load(tmp_path / "r.pt", weights_only=True), strict=True)
    ref = make_cnn().eval()
    x = torch.randn(2, 3, 8, 8)
    assert torch.allclose(model.eval()(x), ref(x), atol=1e-6)
    bad = run_fix(cli, src, tmp_path / "t.pt", "--model", "fixtures.models:TinyTransformer", "--map-by-order", code=2)
    assert "--map-by-order" in bad.stderr


def test_collision_is_refused_and_nothing_written(cli, tmp_path):
    torch.save({"module.fc.weight": torch.ones(2), "fc.weight": torch.zeros(2)}, tmp_path / "clash.pt")
    result = run_fix(cli, tmp_path / "clash.pt", tmp_path / "out.pt", "--strip-module", code=2)
    assert "same name" in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "out.pt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["clash.pt"]


def test_strip_prefix_leaves_other_keys_alone(cli, tmp_path):
    torch.save({"module.a": torch.ones(1), "b.module.c": torch.ones(1), "modulex": torch.ones(1)}, tmp_path / "m.pt")
    data = run_fix(cli, tmp_path / "m.pt", tmp_path / "o.pt", "--strip-module")
    assert data["renamed"] == {"module.a": "a"}
    assert list(torch.load(tmp_path / "o.pt", weights_only=True)) == ["a", "b.module.c", "modulex"]


def test_dry_run_lists_every_key_and_writes_nothing(fixtures, cli, tmp_path):
    result = cli("fix", fixtures["training"]["path"], "-o", tmp_path / "x.pt", "--select", "state_dict",
                 "--rename", r"^features\.=backbone.", "--drop", "classifier", "--dry-run")
    assert result.exit_code == 0
    assert "features.0.weight" in result.stdout and "backbone.0.weight" in result.stdout
    assert "(dropped)" in result.stdout and "classifier.bias" in result.stdout
    assert "nothing written" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_dry_run_says_what_the_write_would_stop_at_and_the_command_past_it(fixtures, cli, tmp_path):
    """A dry run onto an existing output passes (nothing is written) but says, last, that the write would stop
    there, with the write's own command (no --dry-run, with --force); that command then writes the file."""
    import shlex

    out = tmp_path / "o.pt"
    out.write_bytes(b"keep me")
    dry = cli("fix", fixtures["plain"]["path"], "-o", out, "--dry-run")
    assert dry.exit_code == 0 and out.read_bytes() == b"keep me"
    last = dry.stderr.strip().splitlines()[-1]
    assert last.startswith("note: without --dry-run the write would stop: ") and "already exists" in last
    command = shlex.split(last.split("`")[1])
    assert command[:2] == ["ckpt-doctor", "fix"] and "--force" in command and "--dry-run" not in command
    written = cli(*command[1:])
    assert written.exit_code == 0, written.stderr
    assert torch.load(out, weights_only=True)
    data = cli("fix", fixtures["plain"]["path"], "-o", tmp_path / "missing" / "o.pt", "--dry-run", "--json").json()
    assert data["dry_run"] and "folder" in data["write_refusal"] and "does not exist" in data["write_refusal"]
    fresh = cli("fix", fixtures["plain"]["path"], "-o", tmp_path / "new.pt", "--dry-run", "--json")
    assert fresh.json()["write_refusal"] is None and "would stop" not in fresh.stderr


def test_existing_output_needs_force_and_input_is_never_the_output(fixtures, cli, tmp_path):
    out = tmp_path / "o.pt"
    out.write_bytes(b"keep me")
    result = run_fix(cli, fixtures["plain"]["path"], out, code=2)
    assert "--force" in result.stderr and out.read_bytes() == b"keep me"
    run_fix(cli, fixtures["plain"]["path"], out, "--force")
    assert torch.load(out, weights_only=True)
    copy = tmp_path / "in.pt"
    copy.write_bytes(fixtures["plain"]["path"].read_bytes())
    before = sha(copy)
    result = run_fix(cli, copy, copy, "--force", code=2)
    assert "never modified" in result.stderr and sha(copy) == before


def test_output_symlink_is_replaced_not_written_through(fixtures, cli, tmp_path):
    target = tmp_path / "target.bin"
    target.write_bytes(b"precious")
    link = tmp_path / "link.pt"
    os.symlink(target, link)
    assert run_fix(cli, fixtures["plain"]["path"], link, code=2).exit_code == 2
    run_fix(cli, fixtures["plain"]["path"], link, "--force")
    assert target.read_bytes() == b"precious" and not link.is_symlink()


def test_output_mode_follows_umask(fixtures, cli, tmp_path):
    old = os.umask(0o022)
    try:
        run_fix(cli, fixtures["plain"]["path"], tmp_path / "m.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "m.safetensors").st_mode) == 0o644


def test_corrupt_input_storage_fails_verification(fixtures, cli, tmp_path):
    raw = bytearray(fixtures["plain"]["path"].read_bytes())
    # Flip a byte inside the first tensor's data (torch.load would not notice: it does not check CRCs).
    data = cli("inspect", fixtures["plain"]["path"], "--json").json()
    del data
    from ckpt_doctor import read_checkpoint

    offset = read_checkpoint(fixtures["plain"]["path"]).tensors[0].storage.offset
    raw[offset] ^= 0xFF
    (tmp_path / "flipped.pt").write_bytes(bytes(raw))
    result = run_fix(cli, tmp_path / "flipped.pt", tmp_path / "out.pt", code=2)
    assert "verification failed" in result.stderr and not (tmp_path / "out.pt").exists()
    assert not any(p.name.endswith(".ckpt-doctor-tmp") for p in tmp_path.iterdir())


def test_usage_errors(fixtures, cli, tmp_path):
    src = fixtures["plain"]["path"]
    for flags, words in [(["--rename", "nope"], "REGEX=REPL"), (["--drop", "("], "not a valid regular"),
                         (["--dtype", "int8"], "--dtype"), (["--map-location", "gpu7"], "not a device"),
                         (["--auto"], "need --model"), (["--select", "nothing"], "holds no tensors")]:
        result = cli("fix", src, "-o", tmp_path / "o.pt", *flags)
        assert result.exit_code == 2 and words in result.stderr, (flags, result.stderr)
    result = cli("fix", src, "-o", tmp_path / "o.weird")
    assert result.exit_code == 2 and "--format" in result.stderr
    assert cli("fix", src, "-o", tmp_path / "o.weird", "--format", "safetensors").exit_code == 0


def test_max_shard_size_writes_shards_and_an_index(fixtures, cli, tmp_path):
    import json

    data = run_fix(cli, fixtures["training"]["path"], tmp_path / "model.safetensors", "--select", "state_dict",
                   "--max-shard-size", "2KB")
    assert data["output"].endswith("model.safetensors.index.json") and len(data["shards"]) == 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    merged = {}
    for shard in data["shards"]:
        merged.update(load_file(shard))
    SmallCNN().load_state_dict(merged, strict=True)
    again = cli("inspect", tmp_path, "--json").json()
    assert again["format"] == "sharded" and again["tensor_count"] == 16
    tied = run_fix(cli, fixtures["tied"]["path"], tmp_path / "lm.pt", "--max-shard-size", "8KiB")
    sd = {}
    for shard in tied["shards"]:
        sd.update(torch.load(shard, weights_only=True))
    assert sd["embed.weight"].data_ptr() == sd["lm_head.weight"].data_ptr()  # tied tensors share one shard
    assert cli("fix", fixtures["plain"]["path"], "-o", tmp_path / "x.pt", "--max-shard-size", "lots").exit_code == 2
    # a missing folder is said of the OUT given, not of the first shard's name (which the user never typed)
    missing = cli("fix", fixtures["plain"]["path"], "-o", tmp_path / "nowhere" / "m.safetensors", "--max-shard-size",
                  "1KB")
    assert missing.exit_code == 2 and missing.stderr.startswith(f"Error: {tmp_path / 'nowhere' / 'm.safetensors'}: "
                                                                 "folder"), missing.stderr


@pytest.mark.parametrize("nested", [False, True])
def test_keys_of_a_state_dict_that_are_no_strings_are_said_to_become_text(cli, tmp_path, nested):
    """A state_dict keyed by ints is written keyed by their text (as its tensors are named): said of the root's,
    and of a nested one's, which went without a word."""
    state = {0: torch.ones(1), 1: torch.zeros(1)}
    torch.save({"model": state, "epoch": 1} if nested else state, tmp_path / "ints.pt")
    result = cli("fix", tmp_path / "ints.pt", "-o", tmp_path / "out.pt")
    assert result.exit_code == 0
    assert "2 keys of the state_dict are no strings (0, 1): written as the text they are listed by ('0', '1')" \
        in result.stderr
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(out["model"] if nested else out) == ["0", "1"]


@pytest.mark.parametrize("kind", ["zero", "fifo"])
def test_an_index_beside_the_output_that_is_no_file_is_not_read(cli, tmp_path, kind):
    """NAME.EXT.index.json as a link to /dev/zero (no end, and a size of 0) or a FIFO (a read waits for a writer):
    reading it to find its shards took memory without limit, or hung. It names no shards, and is replaced."""
    torch.save({"w": torch.ones(2)}, tmp_path / "src.pt")
    index = tmp_path / "model.safetensors.index.json"
    index.symlink_to("/dev/zero") if kind == "zero" else os.mkfifo(index)
    for flags in (("--dry-run",), ()):
        result = cli("fix", tmp_path / "src.pt", "-o", tmp_path / "model.safetensors", "--force", *flags)
        assert result.exit_code == 0, result.stderr
    assert not os.path.lexists(index) and (tmp_path / "model.safetensors").is_file()
    assert cli("inspect", tmp_path).exit_code == 0


def test_a_safetensors_header_s_metadata_is_said_to_be_left_out_of_a_torch_output(cli, tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors", metadata={"author": "me", "step": "1000"})
    result = cli("fix", tmp_path / "m.safetensors", "-o", tmp_path / "m.pt")
    assert result.exit_code == 0
    assert "the safetensors header's __metadata__ (author, step) is not kept: a torch output has no place for it" \
        in result.stderr
    kept = cli("fix", tmp_path / "m.safetensors", "-o", tmp_path / "m2.safetensors")
    assert "__metadata__" not in kept.stderr


def test_python_attributes_of_a_tensor_are_named_where_fix_leaves_them_out(cli, tmp_path):
    """torch.save keeps a tensor's __dict__ (Megatron's `partition_dim` on a Parameter) and torch.load sets it
    again; fix writes the values without them: inspect names them, and fix says it leaves them out."""
    t = torch.ones(3)
    t.my_attr = 5
    p = torch.nn.Parameter(torch.ones(2))
    p.partition_dim, p.tensor_model_parallel = 1, True
    torch.save({"t": t, "p": p, "d": torch.zeros(1)}, tmp_path / "attrs.pt")
    notes = cli("inspect", tmp_path / "attrs.pt", "--json").json()["notes"]
    assert "t: Python attributes set on it (my_attr), which torch.load sets again and fix does not write" in notes
    assert not any("tensor subclass torch.Tensor" in n for n in notes)  # a plain tensor given attributes
    result = cli("fix", tmp_path / "attrs.pt", "-o", tmp_path / "out.pt")
    assert result.exit_code == 0
    assert "2 tensors carry Python attributes (my_attr, partition_dim, tensor_model_parallel: on t, p), which are " \
        "not written" in result.stderr
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(out["p"], p.detach()) and isinstance(out["p"], torch.nn.Parameter)


def _lazy_views(path):
    """A lazy conjugate view and a lazy negative one (`z.conj().imag`), as torch.save records them: the bytes of
    the plain tensors, and the bits torch.load sets again."""
    z, w = (torch.complex(torch.randn(3), torch.randn(3)) for _ in range(2))
    torch.save({"w": torch.ones(2), "conj": z.conj(), "neg": w.conj().imag}, path)
    return torch.load(path, weights_only=True)


def test_a_lazy_conjugate_or_negative_view_is_refused_not_written_with_other_values(cli, tmp_path):
    """fix copies bytes: a `z.conj()` saved as such came back as z (and `-x` as x), verified by crc. It is named
    and refused, with the --drop that leaves them out; inspect says what torch.load makes of them."""
    path = tmp_path / "lazy.pt"
    source = _lazy_views(path)
    assert source["conj"].is_conj() and source["neg"].is_neg()
    notes = cli("inspect", path, "--json").json()["notes"]
    assert "conj: conjugate bit set (a lazy view): torch.load gives the conjugate of its bytes" in notes
    assert "neg: negative bit set (a lazy view): torch.load gives the negation of its bytes" in notes
    refused = cli("fix", path, "-o", tmp_path / "out.pt")
    assert refused.exit_code == 2 and not (tmp_path / "out.pt").exists()
    assert "2 tensors saved as lazy conjugate or negative views (conj, neg)" in refused.stderr
    drop = refused.stderr.split("leave them out with `", 1)[1].split("`", 1)[0]
    assert cli(*shlex.split(drop)[1:]).exit_code == 0
    assert list(torch.load(tmp_path / "out.pt", weights_only=True)) == ["w"]


def _saved_with_metadata(path, tensor, metadata):
    """torch.save of `tensor` as if it carried `metadata` (the conjugate and negative bits torch.load sets again)."""
    import torch._utils as U

    real = U.get_tensor_metadata
    U.get_tensor_metadata = lambda t: metadata if t.data_ptr() == tensor.data_ptr() else real(t)
    try:
        torch.save({"model": {"w": tensor, "ok": torch.ones(2)}}, path)
    finally:
        U.get_tensor_metadata = real


def test_a_lazy_view_inside_a_nested_state_dict_is_refused_and_read_as_torch_does(cli, tmp_path):
    """The state_dict's keys are relative to it: a neg view at model.w was missed (written un-negated, exit 0).
    torch sets a bit wherever its key is there ({'neg': False} too); where it cannot (a conjugate bit on a real
    tensor, a negative one on a bool tensor) torch.load fails, and so does reading here: one line, exit 2."""
    for name, tensor, metadata in (("view", torch.tensor([1.0, -2.0])._neg_view(), None),
                                   ("false", torch.tensor([1.0, -2.0]), {"neg": False})):
        path = tmp_path / f"{name}.pt"
        if metadata is None:
            torch.save({"model": {"w": tensor, "ok": torch.ones(2)}}, path)
        else:
            _saved_with_metadata(path, tensor, metadata)
        assert torch.load(path, weights_only=True)["model"]["w"].tolist() == [-1.0, 2.0]
        for flags in ((), ("--select", "model")):
            refused = cli("fix", path, "-o", tmp_path / "out.pt", *flags)
            assert refused.exit_code == 2 and "1 tensor saved as lazy conjugate or negative views (model.w)" in \
                refused.stderr, (name, flags, refused.stderr)
        stats = cli("inspect", path, "--stats", "--json").json()["tensors"]
        assert [t["stats"]["min"] for t in stats if t["key"] == "model.w"] == [-1.0]
    for name, tensor, metadata in (("conj_real", torch.ones(2), {"conj": True}),
                                   ("not_bool", torch.ones(2), {"neg": "yes"})):
        path = tmp_path / f"{name}.pt"
        _saved_with_metadata(path, tensor, metadata)
        with pytest.raises(Exception):
            torch.load(path, weights_only=True)
        result = cli("inspect", path)
        assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "Error:" in result.stderr, name
    # a negative bit on a bool tensor: torch.load reads it, and fails on its values: diff says so in one line
    path = tmp_path / "neg_bool.pt"
    _saved_with_metadata(path, torch.tensor([True, False]), {"neg": True})
    assert torch.load(path, weights_only=True)["model"]["w"].is_neg()
    assert cli("inspect", path).exit_code == 0
    torch.save({"model": {"w": torch.tensor([True, False]), "ok": torch.ones(2)}}, tmp_path / "plain_bool.pt")
    result = cli("diff", path, tmp_path / "plain_bool.pt")
    assert result.exit_code == 2 and "no bool can be negated" in result.stderr and "internal" not in result.stderr


def test_diff_compares_what_torch_load_gives_of_a_lazy_view(cli, tmp_path):
    path = tmp_path / "lazy.pt"
    source = _lazy_views(path)
    resolved, raw = tmp_path / "resolved.pt", tmp_path / "raw.pt"
    torch.save({k: v.resolve_conj().resolve_neg() for k, v in source.items()}, resolved)
    torch.save({k: (v.conj() if k == "conj" else -v if k == "neg" else v).resolve_conj().resolve_neg()
                for k, v in source.items()}, raw)  # the stored bytes, read as plain tensors
    assert cli("diff", path, resolved).exit_code == 0  # the same values, whatever the bits
    rows = {r["key"]: r for r in cli("diff", path, raw, "--json").json()["tensors"]}
    for key in ("conj", "neg"):
        a = source[key].resolve_conj().resolve_neg()
        b = torch.load(raw, weights_only=True)[key]
        d = torch.view_as_real(b - a) if a.is_complex() else b - a
        assert rows[key]["status"] == "changed"
        assert rows[key]["rel"] == pytest.approx(float(torch.linalg.vector_norm(b - a) / torch.linalg.vector_norm(a)))
        assert rows[key]["max_abs"] == pytest.approx(float(d.abs().max()))


def test_metadata_dtypes_and_devices_survive(cli, tmp_path):
    torch.save({"w": torch.ones(2), "b": torch.ones(1), "c": torch.ones(1), "d": torch.ones(1), "dtype": torch.float16,
                "device": torch.device("cpu"), "size": torch.Size([2, 3])},
               tmp_path / "meta.pt")
    data = cli("inspect", tmp_path / "meta.pt", "--json").json()
    assert data["metadata"]["dtype"] == "torch.float16"
    run_fix(cli, tmp_path / "meta.pt", tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["dtype"] is torch.float16 and out["device"] == torch.device("cpu") and tuple(out["size"]) == (2, 3)


@pytest.mark.parametrize("flags", [(), ("--dtype", "float16"), ("--drop", r"\.2\.")])
def test_torch_output_is_a_valid_zip_whatever_is_copied_or_converted(cli, tmp_path, flags):
    # Storages back to back in the source are copied as one range, headers included; converted or dropped
    # ones break the runs. Every way must give a zip whose every member checks, and that torch maps.
    import zipfile

    state = {}
    for i in range(6):
        state[f"module.{i}.weight"] = torch.randn(300 + i, 70)
        state[f"module.{i}.steps"] = torch.tensor(i)
    torch.save(state, tmp_path / "src.pt")
    run_fix(cli, tmp_path / "src.pt", tmp_path / "out.pt", "--strip-module", *flags)
    with zipfile.ZipFile(tmp_path / "out.pt") as z:
        assert z.testzip() is None
    out = torch.load(tmp_path / "out.pt", weights_only=True, mmap=True)
    expected = {k.removeprefix("module."): v for k, v in state.items() if not ("--drop" in flags and ".2." in k)}
    assert list(out) == list(expected)
    for key, value in expected.items():
        want = value.half() if "--dtype" in flags and value.is_floating_point() else value
        assert bitwise_equal(out[key], want), key


def _data_offsets(path) -> dict[str, int]:
    """Where each member's data starts, by its name inside the archive folder."""
    from ckpt_doctor.readers.zipindex import read_zip_index

    fd = os.open(path, os.O_RDONLY)
    try:
        index = read_zip_index(fd, os.fstat(fd).st_size, str(path))
    finally:
        os.close(fd)
    return {member.name.split("/", 1)[1]: member.offset for member in index.members}


@pytest.mark.parametrize("flags", [(), ("--add-module",), ("--drop", r"^module\.1\."), ("--dtype", "float16")])
def test_big_storages_keep_their_phase_and_their_bytes(cli, tmp_path, flags):
    # Runs of 8 MB and more start at the source's offset modulo 64 KB (the kernel copies whole page-cache folios
    # so), smaller ones 64-byte aligned; whatever the padding, the zip checks and loads exact.
    import zipfile

    from ckpt_doctor.writers.stream import FOLIO

    # 700 keys change the pickle's length by more than a page, so the padding has to make up for it
    state = {f"module.small.{i}": torch.tensor([i]) for i in range(700)}
    state.update({f"module.{i}.weight": torch.randn(768, 1024 + i) for i in range(4)})  # ~3 MB each
    torch.save(state, tmp_path / "src.pt")
    run_fix(cli, tmp_path / "src.pt", tmp_path / "out.pt", "--strip-module", *flags)
    with zipfile.ZipFile(tmp_path / "out.pt") as z:
        assert z.testzip() is None
    out = torch.load(tmp_path / "out.pt", weights_only=True, mmap=True)
    dropped = "--drop" in flags
    for key, value in state.items():
        if dropped and key.startswith("module.1."):
            continue
        want = value.half() if "--dtype" in flags and value.is_floating_point() else value
        assert bitwise_equal(out[key if "--add-module" in flags else key.removeprefix("module.")], want), key
    src, dst = _data_offsets(tmp_path / "src.pt"), _data_offsets(tmp_path / "out.pt")
    copied = [k for k in src if k.startswith("data/") and k in dst and "--dtype" not in flags]
    assert copied or "--dtype" in flags
    for member in copied:
        assert dst[member] % 64 == 0, member
        assert dropped or (dst[member] - src[member]) % FOLIO == 0, member


def test_entries_beside_a_flat_state_dict_keep_their_place(cli, tmp_path):
    # A state_dict at the top with a version and a nested dict of tensors: the nested tensors stay where they
    # were (once), the renames act on the state_dict's own keys, and every entry keeps its place in the order.
    state = {f"module.{name}": torch.full((2,), float(i)) for i, name in enumerate(["a", "b", "c"])}
    torch.save({"version": 2, "module.a": state["module.a"], "module.b": state["module.b"],
                "extra": {"inner": torch.arange(4)}, "module.c": state["module.c"]}, tmp_path / "src.pt")
    assert cli("inspect", tmp_path / "src.pt", "--json").json()["state_dict_root"] == ""
    data = run_fix(cli, tmp_path / "src.pt", tmp_path / "out.pt", "--strip-module")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(out) == ["version", "a", "b", "extra", "c"] and out["version"] == 2
    assert bitwise_equal(out["extra"]["inner"], torch.arange(4)) and data["tensors"] == 4


def test_an_optimizer_state_dict_is_not_taken_for_the_weights(cli, tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    data = cli("inspect", path, "--json").json()
    assert data["state_dict_root"] is None
    assert any("optimizer's state_dict" in n for n in data["notes"])
    # Adam's moments are no model's parameters: counted as elements, and as 0 parameters in --json and a listing
    assert (data["parameter_count"], data["buffer_count"]) == (0, 0)
    elements = sum(v.numel() for s in opt.state_dict()["state"].values() for v in s.values())
    assert f"· {elements:,} elements (no state_dict) ·" in cli("inspect", path).stderr
    refused = cli("fix", path, "-o", tmp_path / "o.safetensors")
    assert refused.exit_code == 2 and "--select" in refused.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_torch_size_values_stay_torch_size(cli, tmp_path):
    path = tmp_path / "shapes.pt"
    torch.save({"w": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(1),
                "param_shapes": [{"w": torch.Size([8, 4])}], "empty": torch.Size([])}, path)
    out = tmp_path / "out.pt"
    assert cli("fix", path, "-o", out).exit_code == 0
    loaded = torch.load(out, weights_only=True)
    assert type(loaded["param_shapes"][0]["w"]) is torch.Size and loaded["param_shapes"][0]["w"].numel() == 32
    assert type(loaded["empty"]) is torch.Size


@pytest.mark.parametrize("flags", [(), ("--strip-prefix", "zzz."), ("--select", "model")])
def test_a_state_dict_keeps_its_container_type(cli, tmp_path, flags):
    """torch.save of a plain dict loads back as a dict, a module's state_dict() as an OrderedDict with its
    `_metadata`: a repaired file gives back the type its source did (code may test `type(sd) is dict`)."""
    plain = {"w": torch.ones(2), "epoch": 3}
    module = torch.nn.BatchNorm1d(2).state_dict()
    for name, root in (("plain", plain), ("module", module), ("nested", {"model": plain, "step": 1}),
                       ("listed", [plain, module])):
        if "--select" in flags and name != "nested":
            continue
        src, out = tmp_path / f"{name}.pt", tmp_path / f"{name}_out.pt"
        torch.save(root, src)
        assert cli("fix", src, "-o", out, *flags).exit_code == 0, name
        source, loaded = torch.load(src, weights_only=True), torch.load(out, weights_only=True)
        if "--select" in flags:
            source = source["model"]
        pairs = list(zip(source, loaded)) if isinstance(source, list) else [(source, loaded)]
        pairs += [(source[k], loaded[k]) for k in source if isinstance(source, dict) and isinstance(source[k], dict)]
        for was, got in pairs:
            assert type(got) is type(was), name
            assert getattr(got, "_metadata", None) == getattr(was, "_metadata", None), name


def test_every_unwritable_entry_is_named_at_once_and_drops_are_counted(cli, tmp_path):
    import argparse
    import datetime

    path = tmp_path / "train.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1),
                "hparams": {"when": datetime.date(2024, 1, 1), "n": 3}}, path)
    result = cli("fix", path, "-o", tmp_path / "out.pt")
    assert result.exit_code == 2
    assert "args" in result.stderr and "hparams.when" in result.stderr
    assert "--drop '^(args|hparams\\.when)$'" in result.stderr
    fixed = cli("fix", path, "-o", tmp_path / "out.pt", "--drop", "^(args|hparams)$", "--json")
    assert fixed.exit_code == 0
    assert set(fixed.json()["dropped"]) == {"args", "hparams"}



def test_a_tensor_dropped_beside_the_state_dict_is_counted_once(cli, tmp_path):
    """--drop of a tensor outside the state_dict ('extra.npy') listed it twice: '2 dropped' for one tensor."""
    path = tmp_path / "train.pt"
    torch.save({"model": {"w": torch.ones(2)}, "extra": {"npy": torch.zeros(3), "n": 1}}, path)
    fixed = cli("fix", path, "-o", tmp_path / "out.pt", "--drop", "^extra\\.npy$", "--json")
    assert fixed.exit_code == 0 and fixed.json()["dropped"] == ["extra.npy"]
    summary = cli("fix", path, "-o", tmp_path / "out2.pt", "--drop", "^extra\\.npy$").stderr
    assert "0 keys renamed, 1 dropped" in summary


def test_two_tensors_of_one_dotted_name_in_a_torch_file_are_refused(tmp_path):
    """{'nested': {'a.b': x}, 'nested.a': {'b': y}}: both are 'nested.a.b' once joined; neither output may keep one
    and silently lose (or duplicate) the other."""
    import torch

    from tests.conftest import run_cli

    path = tmp_path / "clash.pt"
    torch.save({"nested": {"a.b": torch.ones(2)}, "nested.a": {"b": torch.arange(3)}}, path)
    for suffix in (".pt", ".safetensors"):
        out = tmp_path / f"out{suffix}"
        result = run_cli("fix", path, "-o", out)
        assert result.exit_code == 2 and "two tensors are both named" in result.stderr and not out.exists()


def _nest(depth: int, leaf, wrap):
    for i in range(depth):
        leaf = wrap(leaf, i)
    return leaf


def _depth_and_leaf(obj, step):
    depth = 0
    while True:
        inner = step(obj)
        if inner is None:
            return depth, obj
        obj, depth = inner, depth + 1


@pytest.mark.parametrize("kind,depth", [("tuple", 800), ("dict", 400), ("list", 400)])
def test_containers_nested_as_deep_as_torch_save_writes(cli, tmp_path, kind, depth):
    # torch.save pickles containers as deep as Python's recursion limit allows (tuples ~1,000 levels, dicts and lists
    # ~500: its persistent_id runs per object) and torch.load reads them back. inspect refused tuples past ~330 levels
    # ("nests too deeply"), and fix failed on all three with an internal RecursionError.
    wrap = {"tuple": lambda x, i: (x, i), "dict": lambda x, i: {"x": x}, "list": lambda x, i: [x]}[kind]
    step = {"tuple": lambda x: x[0] if isinstance(x, tuple) else None,
            "dict": lambda x: x["x"] if isinstance(x, dict) and "x" in x else None,
            "list": lambda x: x[0] if isinstance(x, list) else None}[kind]
    weight = torch.arange(3.0)
    torch.save({"w": weight, "deep": _nest(depth, torch.ones(2), wrap)}, tmp_path / "deep.pt")
    src = tmp_path / "deep.pt"

    data = cli("inspect", src, "--json")
    assert data.exit_code == 0, data.stderr
    keys = [t["key"] for t in data.json()["tensors"]]
    assert keys[0] == "w" and len(keys) == 2 and keys[1].count(".") == depth

    run_fix(cli, src, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(out["w"], weight)
    assert _depth_and_leaf(out["deep"], step)[0] == depth
    assert torch.equal(_depth_and_leaf(out["deep"], step)[1], torch.ones(2))
    diff = cli("diff", src, tmp_path / "out.pt")
    assert diff.exit_code == 0 and "identical" in diff.stderr


def test_a_container_holding_itself_is_refused_with_the_drop_that_fixes_it(cli, tmp_path):
    meta: dict = {"epoch": 3}
    meta["back"] = meta
    torch.save({"w": torch.ones(2), "meta": meta}, tmp_path / "cyc.pt")
    inspected = cli("inspect", tmp_path / "cyc.pt")
    assert inspected.exit_code == 0 and "meta.back=<cycle>" in inspected.stderr
    result = cli("fix", tmp_path / "cyc.pt", "-o", tmp_path / "out.pt")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == ("Error: meta.back: the dict holds itself (a cycle): torch.save "
                                                      "writes that, fix writes trees; leave the repeat out with "
                                                      "--drop 'meta\\.back$'")
    assert not (tmp_path / "out.pt").exists()
    run_fix(cli, tmp_path / "cyc.pt", tmp_path / "out.pt", "--drop", "meta\\.back$")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["meta"] == {"epoch": 3} and torch.equal(out["w"], torch.ones(2))


def test_a_whole_models_non_persistent_buffer_is_listed_as_dropped(fixtures, cli, tmp_path):
    """Written as its state_dict, a pickled model leaves out what model.state_dict() leaves out — and says so."""
    out = tmp_path / "whole_fixed.pt"
    result = cli("fix", fixtures["whole_model"]["path"], "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    assert "scratch" in result.json()["dropped"] and "scratch" not in torch.load(out)


def test_an_object_that_holds_itself_is_not_offered_to_keep(cli, tmp_path):
    """--allow-global cannot keep a cycle (omegaconf's nodes point back to their parents): only the --drop way out is
    printed, and it runs."""
    import argparse
    import shlex

    config = argparse.Namespace(lr=0.1)
    config.me = [config]
    src = tmp_path / "cyclic.pt"
    torch.save({"w": torch.ones(2), "cfg": config}, src)
    refused = cli("fix", src, "-o", tmp_path / "out.pt")
    assert refused.exit_code == 2 and "holds itself (a cycle)" in refused.stderr
    assert "--allow-global" not in refused.stderr
    command = refused.stderr.split("`")[1]
    assert cli(*shlex.split(command)[1:]).exit_code == 0
    assert set(torch.load(tmp_path / "out.pt")) == {"w"}


def test_fix_says_when_a_tensor_it_copies_holds_a_pickle(tmp_path, cli):
    """fix --allow-unsafe copies a tensor's bytes as they are: where they hold an .npy object array (a pickle
    np.load would run), the summary says so and names the --drop that leaves it out, rather than a bare
    'verified' for an output scan flags as it flagged the input."""
    import io
    import json

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.array([os.system], dtype=object), allow_pickle=True)
    src = tmp_path / "npy_func.pt"
    torch.save({"w": torch.randn(4, 4), "meta": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).clone()},
               src)
    kept = cli("fix", src, "-o", tmp_path / "kept.pt", "--allow-unsafe", "--json")
    assert kept.exit_code == 0
    [note] = [n for n in json.loads(kept.stdout)["notes"] if n.startswith("meta:")]
    assert "np.load(allow_pickle=True) would unpickle" in note and "--drop '^meta$'" in note
    assert cli("scan", tmp_path / "kept.pt").exit_code == 1  # as the note says
    dropped = cli("fix", src, "-o", tmp_path / "dropped.pt", "--allow-unsafe", "--drop", "^meta$", "--json")
    assert dropped.exit_code == 0 and not any(n.startswith("meta:") for n in json.loads(dropped.stdout)["notes"])
    assert cli("scan", tmp_path / "dropped.pt").exit_code == 0


def test_a_rename_that_matches_no_key_is_said(tmp_path, cli):
    """A typo in --strip-prefix or --rename renamed nothing and said only '0 keys renamed': each such flag now has
    a note; a flag that does rename has none."""
    import json

    src = tmp_path / "dp.pt"
    torch.save({"module.a.weight": torch.ones(2), "module.b.bias": torch.ones(2)}, src)
    typo = cli("fix", src, "-o", tmp_path / "typo.pt", "--strip-prefix", "modul.", "--rename", "xyz=abc", "--json")
    assert typo.exit_code == 0
    notes = json.loads(typo.stdout)["notes"]
    assert "--strip-prefix modul. renamed no key: none of the 2 names starts with 'modul.'" in notes
    assert "--rename xyz=abc renamed no key: the pattern matches none of the 2 names" in notes
    done = cli("fix", src, "-o", tmp_path / "done.pt", "--strip-module", "--json")
    assert done.exit_code == 0 and not any("renamed no key" in n for n in json.loads(done.stdout)["notes"])
    assert set(torch.load(tmp_path / "done.pt", weights_only=True)) == {"a.weight", "b.bias"}


def test_the_drop_fix_names_for_a_held_pickle_in_a_tuple_runs(tmp_path, cli):
    """An .npy tensor that is an item of a tuple: the --drop fix's note names leaves out the tuple with it (the item
    alone shifted the next one into its place, and fix's check of the output refused the write), and that runs."""
    import io
    import json
    import shlex

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.array([os.system], dtype=object), allow_pickle=True)
    src = tmp_path / "npy_tuple.pt"
    w = torch.randn(4, 4)
    torch.save({"w": w, "extra": (torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).clone(),
                                  torch.ones(2))}, src)
    kept = cli("fix", src, "-o", tmp_path / "kept.pt", "--allow-unsafe", "--json")
    assert kept.exit_code == 0
    [note] = [n for n in json.loads(kept.stdout)["notes"] if n.startswith("extra.0:")]
    assert "with all of extra" in note
    drop = shlex.split(note.split("--drop ", 1)[1])[0]
    assert cli("fix", src, "-o", tmp_path / "dropped.pt", "--allow-unsafe", "--drop", drop).exit_code == 0
    assert cli("scan", tmp_path / "dropped.pt").exit_code == 0
    loaded = torch.load(tmp_path / "dropped.pt", weights_only=True)
    assert set(loaded) == {"w"} and torch.equal(loaded["w"], w)


def test_the_held_pickle_note_is_said_of_a_selected_part_and_only_of_a_torch_output(tmp_path, cli):
    """--select model keys the part's tensors relative to it: the note was missing for the .npy tensor it copied (the
    output scanned DANGEROUS after a bare 'verified'), and its --drop names the key the input has. A safetensors
    output holds the bytes where no loader unpickles them and scans clean: no note says it is flagged."""
    import io
    import json
    import shlex

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.array([os.system], dtype=object), allow_pickle=True)
    src = tmp_path / "npy_model.pt"
    torch.save({"model": {"w": torch.randn(4, 4), "meta": torch.frombuffer(bytearray(buf.getvalue()),
                                                                          dtype=torch.uint8).clone()}, "epoch": 3}, src)
    kept = cli("fix", src, "-o", tmp_path / "kept.pt", "--allow-unsafe", "--select", "model", "--json")
    assert kept.exit_code == 0 and cli("scan", tmp_path / "kept.pt").exit_code == 1
    [note] = [n for n in json.loads(kept.stdout)["notes"] if "np.load" in n]
    drop = shlex.split(note.split("--drop ", 1)[1])[0]
    dropped = tmp_path / "dropped.pt"
    assert cli("fix", src, "-o", dropped, "--allow-unsafe", "--select", "model", "--drop", drop).exit_code == 0
    assert cli("scan", dropped).exit_code == 0 and set(torch.load(dropped, weights_only=True)) == {"w"}
    flat = tmp_path / "npy_flat.pt"
    torch.save(torch.load(src, weights_only=True)["model"], flat)
    st = cli("fix", flat, "-o", tmp_path / "out.safetensors", "--allow-unsafe", "--json")
    assert st.exit_code == 0 and cli("scan", tmp_path / "out.safetensors").exit_code == 0
    assert not any("np.load" in n for n in json.loads(st.stdout)["notes"])


def test_a_rename_that_renames_only_an_entry_of_no_tensor_is_no_idle_rename(tmp_path, cli):
    """A --rename that renames only an `_extra_state` beside the tensors did rename a key: the note that it renamed
    none contradicted the '1 key renamed' above it."""
    import json

    src = tmp_path / "extra.pt"
    torch.save({"body.weight": torch.ones(2), "body._extra_state": {"k": 1}}, src)
    out = tmp_path / "out.pt"
    done = cli("fix", src, "-o", out, "--rename", "_extra_state$=_xs", "--json")
    assert done.exit_code == 0 and "body._xs" in torch.load(out, weights_only=True)
    assert not any("renamed no key" in n for n in json.loads(done.stdout)["notes"])


def test_a_rename_written_for_the_names_before_the_strip_is_told_why_it_renamed_nothing(tmp_path, cli):
    """--rename acts on the names --strip-prefix leaves: a pattern written for the file's own names renamed nothing,
    and the note said it 'matches none of the 2 names' though every name in the file matched it."""
    import json

    src = tmp_path / "dp.pt"
    torch.save({"module.a.weight": torch.ones(2), "module.b.bias": torch.ones(2)}, src)
    done = cli("fix", src, "-o", tmp_path / "out.pt", "--rename", r"^module\.a\.=c.", "--strip-module", "--json")
    assert done.exit_code == 0
    [note] = [n for n in json.loads(done.stdout)["notes"] if "renamed no key" in n]
    assert "--strip-module" in note and "after" in note


def test_a_drop_of_one_item_of_a_list_is_refused_by_the_plan(tmp_path, cli):
    """--drop '^extras\\.0$' left out the first of two tensors in a list: the one after it moved into its place (a
    tensor under another name), which the dry run did not say and the write refused only after writing it, with
    'verification failed: keys differ from the plan'. The plan refuses it now, dry run included, and names the
    --drop that leaves out the whole list; the last item alone shifts nothing and is written."""
    src = tmp_path / "train.pt"
    torch.save({"model": {"w": torch.ones(2)}, "extras": [torch.zeros(3), torch.arange(4)], "epoch": 3}, src)
    before = sha(src)
    for dry in ((), ("--dry-run",)):
        refused = cli("fix", src, "-o", tmp_path / "out.pt", "--drop", r"^extras\.0$", *dry)
        assert refused.exit_code == 2, refused.stderr
        assert "extras.1 would be written as extras.0" in refused.stderr and "--drop '^extras$'" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and "verification failed" not in refused.stderr
    assert not (tmp_path / "out.pt").exists() and sha(src) == before
    last = run_fix(cli, src, tmp_path / "last.pt", "--drop", r"^extras\.1$")
    assert last["dropped"] == ["extras.1"]
    loaded = torch.load(tmp_path / "last.pt", weights_only=True)
    assert len(loaded["extras"]) == 1 and torch.equal(loaded["extras"][0], torch.zeros(3))


def test_a_dry_run_of_a_dcp_output_refuses_what_the_write_refuses(tmp_path, cli):
    """A DCP folder cannot hold a tuple of tensors: the write refused it (exit 2) while `--dry-run` of the same
    command said the folder would be written (exit 0); the dry run now says the same line."""
    src = tmp_path / "train.pt"
    torch.save({"model": {"w": torch.ones(2)}, "tup": (torch.zeros(2),), "epoch": 3}, src)
    dry = cli("fix", src, "-o", tmp_path / "dry", "--format", "dcp", "--dry-run")
    real = cli("fix", src, "-o", tmp_path / "real", "--format", "dcp")
    assert real.exit_code == 2 and "tup is a tuple holding tensors" in real.stderr
    assert dry.exit_code == 2 and dry.stderr == real.stderr
    assert not (tmp_path / "dry").exists() and not (tmp_path / "real").exists()


def test_a_dry_run_of_a_sharded_output_names_the_shards_and_refuses_what_the_write_refuses(tmp_path, cli):
    """--max-shard-size: the dry run said `out.pt would hold …` (the write makes out-0000N-of-… and the index, never
    out.pt), and said so, exit 0, of a training checkpoint the write then refused ('writes a state_dict'). With
    --format dcp the write made folders and an index of them that inspect refused ('shard … is missing'): refused."""
    import json

    src = tmp_path / "plain.pt"
    torch.save({"a.weight": torch.ones(40), "b.weight": torch.ones(40)}, src)
    out = tmp_path / "out.pt"
    dry = cli("fix", src, "-o", out, "--max-shard-size", "200B", "--dry-run", "--json")
    real = cli("fix", src, "-o", out, "--max-shard-size", "200B", "--json")
    assert dry.exit_code == 0 and real.exit_code == 0, real.stderr
    said, wrote = json.loads(dry.stdout), json.loads(real.stdout)
    assert said["output"] == wrote["output"] == str(tmp_path / "out.pt.index.json")
    assert said["shards"] == wrote["shards"] and len(wrote["shards"]) == 2
    assert "2 shards:" in dry.stderr and not out.exists()
    train = tmp_path / "train.pt"
    torch.save({"model": {"w": torch.ones(40)}, "epoch": 3}, train)
    for dry_run in ((), ("--dry-run",)):
        nested = cli("fix", train, "-o", tmp_path / "t.pt", "--max-shard-size", "200B", *dry_run)
        assert nested.exit_code == 2 and "--max-shard-size writes a state_dict" in nested.stderr
        dcp = cli("fix", src, "-o", tmp_path / "dcp", "--format", "dcp", "--max-shard-size", "200B", *dry_run)
        assert dcp.exit_code == 2 and "a DCP folder is written whole" in dcp.stderr, dcp.stderr
        assert len(dcp.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out-00001-of-00002.pt", "out-00002-of-00002.pt",
                                                          "out.pt.index.json", "plain.pt", "train.pt"]


@pytest.mark.parametrize("out, select, drop", [("out.safetensors", (), "epoch"),
                                              ("out.pt", ("--select", "model"), "optimizer")])
def test_a_drop_of_what_is_left_out_anyway_keeps_it_listed(tmp_path, cli, out, select, drop):
    """An entry beside the written state_dict is listed as dropped; a --drop naming it too took it off the list
    (`epoch` left the safetensors output unlisted; of `optimizer` only its tensors were listed, not its
    param_groups): nothing leaves unlisted, whatever --drop adds."""
    src = tmp_path / "train.pt"
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(1, 2)).sum().backward()
    opt.step()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, src)
    without = run_fix(cli, src, tmp_path / out, *select)["dropped"]
    dropped = run_fix(cli, src, tmp_path / ("dropped" + out[3:]), *select, "--drop", f"^{drop}$")["dropped"]
    assert drop in without and set(without) <= set(dropped), (without, dropped)


def test_a_drop_that_matches_nothing_is_said(tmp_path, cli):
    """A --drop whose pattern matches no key or entry (a typo, a key as another tool names it) left nothing out and
    said nothing: '0 dropped' and no note, as a rename that renamed nothing once did. Each such --drop has a note; a
    --drop that leaves something out, even only an entry beside the tensors, has none."""
    import json

    src = tmp_path / "train.pt"
    torch.save({"model": {"fc.weight": torch.ones(2), "fc.bias": torch.ones(2)}, "epoch": 3}, src)
    typo = run_fix(cli, src, tmp_path / "typo.pt", "--drop", "^fc_weight", "--drop", "^epoch$")
    assert typo["dropped"] == ["epoch"]
    assert [n for n in typo["notes"] if "dropped nothing" in n] == \
        ["--drop '^fc_weight' dropped nothing: the pattern matches none of the file's keys and entries"]
    for flags in (("--drop", r"^fc\."), ("--drop", r"^model\.fc\.bias$"), ("--select", "model", "--drop", "epoch")):
        done = cli("fix", src, "-o", tmp_path / "done.pt", *flags, "--json", "--force")
        assert done.exit_code == 0 and not any("dropped nothing" in n for n in json.loads(done.stdout)["notes"])


def test_a_drop_of_an_item_of_a_list_of_plain_values_leaves_it_out(tmp_path, cli):
    """A list of plain values (a config's sizes) was written whole whatever --drop named in it: the item stayed, and
    neither `dropped` nor a note said so."""
    src = tmp_path / "train.pt"
    torch.save({"model": {"w": torch.ones(2)}, "cfg": {"sizes": [1, 2, 3]}}, src)
    done = run_fix(cli, src, tmp_path / "out.pt", "--drop", r"^cfg\.sizes\.2$")
    assert done["dropped"] == ["cfg.sizes.2"]
    assert torch.load(tmp_path / "out.pt", weights_only=True)["cfg"]["sizes"] == [1, 2]


def test_a_map_location_that_rewrites_no_tag_is_said(tmp_path, cli):
    """--map-location cuda:3=cuda:0 of a file saved on cpu (a rank's number guessed wrong) rewrote nothing and said
    only 'applied: --map-location cuda:3=cuda:0': each rule that rewrote no tag has a note naming the saved tags."""
    src = tmp_path / "cpu.pt"
    torch.save({"w": torch.ones(2), "b": torch.zeros(2)}, src)
    done = run_fix(cli, src, tmp_path / "out.pt", "--map-location", "cuda:3=cuda:0", "--map-location", "cpu")
    assert [n for n in done["notes"] if "rewrote no" in n] == [
        "--map-location cuda:3=cuda:0 rewrote no device tag: the output's tensors are saved on cpu",
        "--map-location cpu rewrote no device tag: the output's tensors are saved on cpu"]
    assert all(t.device.type == "cpu" for t in torch.load(tmp_path / "out.pt", weights_only=True).values())


def test_a_sharded_write_over_a_single_file_of_its_name_is_refused_or_replaces_it(fixtures, cli, tmp_path):
    """-o model.safetensors --max-shard-size when model.safetensors exists: the shards and the index would be written
    beside the old file, which a loader that looks for it first (transformers) would read. Refused without --force
    (dry run included: its note), and with --force the old file goes once the index is written; the input never."""
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"old weights")
    source = fixtures["plain"]["path"]
    refused = cli("fix", source, "-o", out, "--max-shard-size", "2KB")
    assert refused.exit_code == 2 and "a loader that looks for model.safetensors first" in refused.stderr
    assert out.read_bytes() == b"old weights" and sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    dry = cli("fix", source, "-o", out, "--max-shard-size", "2KB", "--dry-run")
    assert dry.exit_code == 0 and "without --dry-run the write would stop: " in dry.stderr.splitlines()[-1]
    forced = cli("fix", source, "-o", out, "--max-shard-size", "2KB", "--force")
    assert forced.exit_code == 0, forced.stderr
    assert not out.exists() and (tmp_path / "model.safetensors.index.json").exists()
    copy = tmp_path / "in.pt"
    copy.write_bytes(source.read_bytes())
    own = cli("fix", copy, "-o", copy, "--max-shard-size", "2KB", "--force")
    assert own.exit_code == 2 and copy.read_bytes() == source.read_bytes()


def _with_last_storage_flipped(src, dst):
    """A copy of `src` whose last storage has one byte flipped: the storages before it copy and verify, it fails."""
    from ckpt_doctor import read_checkpoint

    raw = bytearray(src.read_bytes())
    raw[max(t.storage.offset for t in read_checkpoint(src).tensors)] ^= 0xFF
    dst.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_sharded_write_that_fails_partway_leaves_nothing_it_wrote(tmp_path, cli, suffix):
    """The last shard's storage does not match its crc: the shards before it were left in the folder, without an
    index, under 'nothing written'; with --force over an earlier output of the same shard names, those were
    replaced by the new shards before the failure. Nothing is left, and what --force would replace stays as it was
    until the whole output is verified."""
    torch.manual_seed(0)
    src = tmp_path / "sd.pt"
    torch.save(torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]).state_dict(), src)
    bad = _with_last_storage_flipped(src, tmp_path / "bad.pt")
    out = tmp_path / "out" / f"x{suffix}"
    out.parent.mkdir()
    failed = cli("fix", bad, "-o", out, "--max-shard-size", "100B")
    assert failed.exit_code == 2 and "verification failed" in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1 and list(out.parent.iterdir()) == []
    other = tmp_path / "other.pt"  # the same shapes, other values: an earlier output of the same shard names
    torch.save(torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]).state_dict(), other)
    assert run_fix(cli, other, out, "--max-shard-size", "100B")["shards"]
    before = {p.name: (p.read_bytes(), p.stat().st_ino) for p in out.parent.iterdir()}
    forced = cli("fix", bad, "-o", out, "--max-shard-size", "100B", "--force")
    assert forced.exit_code == 2 and "verification failed" in forced.stderr
    assert {p.name: (p.read_bytes(), p.stat().st_ino) for p in out.parent.iterdir()} == before


def _linear_stack(path, dtype=torch.float32):
    torch.save(torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]).to(dtype).state_dict(), path)
    return path


def test_a_sharded_write_stopped_between_its_renames_leaves_no_old_index_over_new_shards(tmp_path, monkeypatch):
    """Shards are renamed into place one by one: stopped after the first, the old index named one new shard and
    the rest old (a mix of two models that loads). The old index goes first: the folder is left with none."""
    import ckpt_doctor.writers.atomic as atomic
    from ckpt_doctor import FixOptions, fix_checkpoint
    from ckpt_doctor.errors import WriteError

    out = tmp_path / "o" / "m.safetensors"
    out.parent.mkdir()
    fix_checkpoint(_linear_stack(tmp_path / "a.pt"), out, FixOptions(max_shard_size=1000))
    index = out.with_name("m.safetensors.index.json")
    assert index.exists()
    real, calls = os.replace, []

    def stop_after_one(src, dst):
        calls.append(dst)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", stop_after_one)
    with pytest.raises(WriteError):
        fix_checkpoint(_linear_stack(tmp_path / "b.pt"), out, FixOptions(max_shard_size=1000, force=True))
    assert len(calls) == 2 and not index.exists()  # no index names a mix of the two models
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".ckpt-doctor-tmp")]


def test_sharding_a_training_checkpoint_prints_the_select_that_shards_its_state_dict(tmp_path, cli):
    """--max-shard-size into a torch file writes a state_dict in shards: a training checkpoint was refused with
    'add --select (e.g. --select state_dict)' where its state_dict is at `model`; the line now runs as printed."""
    _training_checkpoint(tmp_path / "train.pt")
    (tmp_path / "hub").mkdir()
    for flags in ((), ("--select", "")):
        refused = cli("fix", tmp_path / "train.pt", "-o", tmp_path / "hub" / "pytorch_model.bin", "--max-shard-size",
                      "4KB", *flags)
        assert refused.exit_code == 2, refused.stderr
        command = refused.stderr.split("`", 2)[1]
        assert command.endswith("--max-shard-size 4KB --select model"), command
    assert cli(*shlex.split(command)[1:]).exit_code == 0
    assert (tmp_path / "hub" / "pytorch_model.bin.index.json").is_file()


def test_an_earlier_sharded_output_of_its_name_is_refused_or_replaced_whole(tmp_path, cli):
    """An index of the output's name counts as an existing output, as a single file does under a sharded write.
    Re-sharding with --force left the 8 old shards beside the 2 new ones; a single file was written, without
    --force, beside the old index and its shards, which inspect of the folder (and any loader that follows the
    index) read instead: the old float32 weights. Refused without --force (dry run included: its note, whose
    command runs), and with --force the old index and the shards it names go once the new output is written."""
    import shlex

    src = _linear_stack(tmp_path / "sd.pt")
    out = tmp_path / "resharded" / "m.safetensors"
    out.parent.mkdir()
    run_fix(cli, src, out, "--max-shard-size", "100B")
    old = sorted(p.name for p in out.parent.iterdir())
    again = run_fix(cli, src, out, "--max-shard-size", "1KB", "--force")
    assert len(again["shards"]) == 2 and sorted(p.name for p in out.parent.iterdir()) == \
        sorted([*(os.path.basename(s) for s in again["shards"]), "m.safetensors.index.json"])
    # what went is said: the old shards the new ones did not overwrite (--json "removed", and the summary)
    gone = sorted(set(old) - {os.path.basename(s) for s in again["shards"]} - {"m.safetensors.index.json"})
    assert sorted(os.path.basename(p) for p in again["removed"]) == gone and len(gone) == 8
    out = tmp_path / "single" / "m.safetensors"
    out.parent.mkdir()
    run_fix(cli, src, out, "--max-shard-size", "100B")
    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    refused = cli("fix", src, "-o", out, "--dtype", "float16")
    assert refused.exit_code == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "m.safetensors.index.json already exists beside it" in refused.stderr, refused.stderr
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before
    dry = cli("fix", src, "-o", out, "--dtype", "float16", "--dry-run")
    last = dry.stderr.strip().splitlines()[-1]
    assert dry.exit_code == 0 and last.startswith("note: without --dry-run the write would stop: ")
    command = shlex.split(last.split("`")[1])
    assert "--force" in command and "--dry-run" not in command
    written = cli(*command[1:])
    assert written.exit_code == 0, written.stderr
    assert [p.name for p in out.parent.iterdir()] == ["m.safetensors"]
    assert cli("inspect", out.parent, "--json").json()["tensors"][0]["dtype"] == "float16"


def test_a_forced_write_over_an_earlier_index_removes_only_its_own_shards(tmp_path, cli):
    """What an old index names is removed only when it is a shard of the output in its folder (NAME-0000k-of-0000N):
    a hostile index naming ../victim.txt, an absolute path, another file of the folder, a shard-like name in a
    subfolder, or the input itself leaves each alone; a symlink named as a shard goes, never its target."""
    import json

    src = _linear_stack(tmp_path / "sd.pt")
    folder = tmp_path / "out"
    (folder / "sub").mkdir(parents=True)
    out = folder / "m.safetensors"
    shards = run_fix(cli, src, out, "--max-shard-size", "1KB")["shards"]
    own = cli("fix", folder / "m.safetensors.index.json", "-o", out, "--force")  # the input: never removed
    assert own.exit_code == 2 and "m.safetensors.index.json beside it is the input" in own.stderr, own.stderr
    kept = {tmp_path / "victim.txt": b"victim", folder / "notes.txt": b"notes",
            folder / "sub" / "m-00001-of-00002.safetensors": b"sub"}
    for path, data in kept.items():
        path.write_bytes(data)
    (folder / "m-00003-of-00009.safetensors").symlink_to(tmp_path / "victim.txt")
    index = json.loads((folder / "m.safetensors.index.json").read_text())
    index["weight_map"].update({"a": "../victim.txt", "b": str(tmp_path / "victim.txt"), "c": "notes.txt",
                                "d": "sub/m-00001-of-00002.safetensors", "e": "m-00003-of-00009.safetensors",
                                "f": 7})
    (folder / "m.safetensors.index.json").write_text(json.dumps(index))
    # a shard of the model as the input: the index is that model's, not an earlier output; --force would take the
    # model apart around the input (its index and every other shard removed), so it is refused
    within = cli("fix", shards[0], "-o", out, "--force")
    assert within.exit_code == 2 and "names the input as one of its shards" in within.stderr, within.stderr
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(Path(shards[0]).read_bytes())
    forced = cli("fix", copy, "-o", out, "--force")
    assert forced.exit_code == 0, forced.stderr
    assert all(path.read_bytes() == data for path, data in kept.items())
    assert sorted(p.name for p in folder.iterdir()) == ["m.safetensors", "notes.txt", "sub"]
    assert set(load_file(out)) == set(load_file(copy))


def _training_checkpoint(path, weight: float = 0.5, step: float = 3.0) -> dict:
    """{"model", "optimizer" (Adam: moments and a float step per parameter), "epoch"}, one weight set to `weight`."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 64))
    with torch.no_grad():
        net[2].weight[3, 4] = weight
        net[2].weight[0, 0] = -weight
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(4, 64)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    for state in sd["state"].values():
        state["step"].fill_(step)
    ckpt = {"model": net.state_dict(), "optimizer": sd, "epoch": 3}
    torch.save(ckpt, path)
    return ckpt


def _deflated(src, dst):
    """The same torch file with every member deflated (a re-zipped upload): its storages are inflated as read."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    return dst


def _dcp_folder(ckpt, folder):
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": ckpt["model"]}, checkpoint_id=str(folder), no_dist=True)
    return folder


@pytest.mark.parametrize("source, flags", [
    ("plain", ("-o", "out.pt")),  # converted in chunks as read
    ("plain", ("-o", "out.safetensors")),  # loaded whole
    ("plain", ("-o", "out.safetensors", "--max-shard-size", "9KB")),  # a later shard: the earlier one removed
    ("plain", ("-o", "out_dcp", "--format", "dcp")),
    ("deflated", ("-o", "out.pt")),  # inflated, then converted
    ("dcp", ("-o", "out.safetensors")),  # assembled from a DCP folder's pieces
])
def test_a_cast_that_would_write_inf_is_refused_with_nothing_written(cli, tmp_path, monkeypatch, source, flags):
    """--dtype float16 of a weight of 1e6 (float16 holds up to 65504) wrote inf with exit 0 and "ok": true. Every way
    a storage is converted refuses it: one line naming the tensor, how many values, the largest |x|, and the command
    that keeps them (bfloat16, float32's range); nothing written, no temporary file left."""
    import shlex

    monkeypatch.chdir(tmp_path)
    ckpt = _training_checkpoint(tmp_path / "plain.pt", weight=1e6)
    src = {"plain": "plain.pt", "deflated": _deflated(tmp_path / "plain.pt", tmp_path / "deflated.pt").name,
           "dcp": _dcp_folder(ckpt, tmp_path / "dcp").name}[source]
    before = sorted(p.name for p in tmp_path.iterdir())
    refused = cli("fix", src, *flags, "--dtype", "fp16")
    assert refused.exit_code == 2 and refused.stdout == ""
    line, = refused.stderr.splitlines()
    assert line.startswith("Error: ") and "2.weight: 2 finite values beyond float16's range (largest |x| 1e+06; " \
        "float16 holds up to 65504) would be written as inf; nothing written; bfloat16 keeps float32's range: `" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    way_out = shlex.split(line.split("`")[1])
    assert way_out == ["ckpt-doctor", "fix", src, *flags, "--dtype", "bfloat16"]
    done = cli(*way_out[1:])
    assert done.exit_code == 0, done.stderr
    assert "--max-shard-size" not in flags or (tmp_path / "out-00002-of-00002.safetensors").exists()
    if flags[1] == "out.pt":
        written = torch.load(tmp_path / "out.pt", weights_only=True)["model"]["2.weight"]
        assert bitwise_equal(written, ckpt["model"]["2.weight"].to(torch.bfloat16)) and written.isfinite().all()


def test_a_dtype_that_holds_no_value_beyond_its_range_says_how_to_keep_it(cli, tmp_path):
    """float64 values past float32's range: no narrower dtype holds them; the way out is the command without
    --dtype. The refusal names the key the output would hold."""
    torch.save({"w": torch.tensor([1e39, 1.0], dtype=torch.float64), "n": torch.tensor(3)}, tmp_path / "d.pt")
    refused = cli("fix", tmp_path / "d.pt", "-o", tmp_path / "out.pt", "--dtype", "float32")
    assert refused.exit_code == 2 and not (tmp_path / "out.pt").exists()
    assert "Error: w: 1 finite value beyond float32's range (largest |x| 1e+39; float32 holds up to 3.40282e+38) " \
        "would be written as inf; nothing written; only float64 holds it; without --dtype: `" in refused.stderr
    assert "--dtype" not in refused.stderr.split("`")[1]


def test_dtype_casts_the_model_weights_not_the_optimizer_beside_them(cli, tmp_path):
    """--dtype cast every floating tensor of the file: Adam's moments, and its step, which as float16 stops counting at
    2048 once training resumes. It casts the state_dict (the model's weights); the rest is written as saved, said in
    a note and counted in --json; integer buffers are untouched. --select '' asks for all of the file."""
    ckpt = _training_checkpoint(tmp_path / "train.pt", step=70001.0)
    data = run_fix(cli, tmp_path / "train.pt", tmp_path / "half.pt", "--dtype", "float16")
    out = torch.load(tmp_path / "half.pt", weights_only=True)
    model = ckpt["model"]
    for key, value in model.items():
        want = value.half() if value.is_floating_point() else value
        assert bitwise_equal(out["model"][key], want), key
    for index, state in ckpt["optimizer"]["state"].items():
        for name, value in state.items():
            assert bitwise_equal(out["optimizer"]["state"][index][name], value), (index, name)
    assert out["optimizer"]["state"][0]["step"] == 70001.0
    floating = sum(v.is_floating_point() for v in model.values())
    assert data["dtype"] == {"to": "float16", "cast": floating, "left": 18}
    assert f"--dtype float16 ({floating} tensors)" in data["applied"]
    assert "--dtype casts the model's weights, the state_dict: 18 floating tensors beside it keep their dtype " \
        "(optimizer); --select '' casts all of the file" in data["notes"]
    # all of the file, when asked: the step of 70001 would be inf, and is refused
    refused = run_fix(cli, tmp_path / "train.pt", tmp_path / "all.pt", "--dtype", "float16", "--select", "", code=2)
    assert "optimizer.state.0.step: 1 finite value beyond float16's range (largest |x| 70001;" in refused.stderr
    _training_checkpoint(tmp_path / "train.pt", step=12.0)
    everything = run_fix(cli, tmp_path / "train.pt", tmp_path / "all.pt", "--dtype", "float16", "--select", "")
    out = torch.load(tmp_path / "all.pt", weights_only=True)
    assert out["optimizer"]["state"][0]["exp_avg"].dtype == torch.float16
    assert out["model"]["1.num_batches_tracked"].dtype == torch.int64
    assert everything["dtype"] == {"to": "float16", "cast": floating + 18, "left": 0}
    assert any(n.startswith("optimizer.state.0.step, optimizer.state.1.step, …: an optimizer's step cast to float16 "
                            "stops counting at 2048") for n in everything["notes"])


def test_dtype_of_a_flat_state_dict_casts_all_of_it(cli, tmp_path):
    """A file that is the state_dict: every floating tensor is the model's, cast; nothing is left, no note."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    torch.save(net.state_dict(), tmp_path / "sd.pt")
    data = run_fix(cli, tmp_path / "sd.pt", tmp_path / "out.safetensors", "--dtype", "bf16")
    assert data["dtype"] == {"to": "bfloat16", "cast": 6, "left": 0} and data["notes"] == []
    out = load_file(tmp_path / "out.safetensors")
    assert {k: str(v.dtype) for k, v in out.items()} == {
        k: "torch.int64" if k.endswith("num_batches_tracked") else "torch.bfloat16" for k in net.state_dict()}
