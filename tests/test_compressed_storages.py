"""torch zip files whose storages are deflated members (a torch.save file re-zipped with compression: torch.load
inflates them). Read, fixed, compared and summarised bit for bit as torch.load gives them, inflated a block at a
time; a corrupt or bomb-sized member is an error, never silently wrong bytes."""

from __future__ import annotations

import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.oracle_nets import TiedLM


def rezip(src: Path, dst: Path, only_storages: bool = False) -> Path:
    """The same members, deflated (all of them, or only data/N), as `zip -r` or an upload tool would write them."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            deflate = "/data/" in info.filename or not only_storages
            zout.compression = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
            with zin.open(info) as a, zout.open(info.filename, "w", force_zip64=info.file_size > 1 << 30) as b:
                while block := a.read(16 << 20):
                    b.write(block)
    return dst


def state() -> dict:
    """Tied weights, views at an offset and with a stride, 16-bit, integer, bool, empty and 0-d tensors, and a
    storage big and repetitive enough to inflate over many blocks."""
    torch.manual_seed(0)
    model = TiedLM()
    sd = dict(model.state_dict())
    base = torch.randn(64, 48)
    sd.update({"rows": base[5:9], "cols": base[:, 3::4], "base": base, "half": torch.randn(7, 5).half(),
               "bf16": torch.randn(6).bfloat16(), "ids": torch.arange(-5, 20), "mask": torch.rand(9) > 0.5,
               "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5), "zeros": torch.zeros(3_000_000),
               "tail": torch.arange(1_000_000, dtype=torch.float32)[999_000:]})
    return {"model": sd, "step": 12}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deflated")
    plain = root / "plain.pt"
    torch.save(state(), plain)
    return {"plain": plain, "deflated": rezip(plain, root / "deflated.pt"),
            "storages": rezip(plain, root / "storages.pt", only_storages=True)}


def flat(tree, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(flat(v, key) if isinstance(v, dict) else {key: v})
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                                                    b.contiguous().view(-1).view(torch.uint8))


def test_torch_reads_the_rezipped_files(files):
    """The oracle: torch.load inflates the members and gives the saved tensors back."""
    want = flat(torch.load(files["plain"], weights_only=True))
    for name in ("deflated", "storages"):
        with zipfile.ZipFile(files[name]) as z:
            assert all(i.compress_type == zipfile.ZIP_DEFLATED for i in z.infolist() if "/data/" in i.filename)
        got = flat(torch.load(files[name], weights_only=True))
        assert all(same_bits(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())


@pytest.mark.parametrize("name", ["deflated", "storages"])
def test_inspect_lists_what_torch_loads(files, name):
    result = run_cli("inspect", files[name], "--json")
    assert result.exit_code == 0, result.stderr
    data = result.json()
    want = {k: (list(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in flat(torch.load(files[name], weights_only=True)).items() if isinstance(v, torch.Tensor)}
    assert {t["key"]: (t["shape"], t["dtype"]) for t in data["tensors"]} == want
    assert any("compressed (deflated)" in n for n in data["notes"])


@pytest.mark.parametrize("name", ["deflated", "storages"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_fix_writes_the_tensors_torch_loads(files, tmp_path, name, suffix):
    out = tmp_path / f"out{suffix}"
    result = run_cli("fix", files[name], "-o", out, "--select", "model")
    assert result.exit_code == 0, result.stderr
    want = torch.load(files[name], weights_only=True)["model"]
    if suffix == ".pt":
        got = torch.load(out, weights_only=True, mmap=True)  # written stored: mmap works again
        for key, value in want.items():
            assert same_bits(got[key], value), key
            assert (got[key].stride(), got[key].storage_offset()) == (value.stride(), value.storage_offset()), key
        assert got["wte.weight"].data_ptr() == got["lm_head.weight"].data_ptr()  # still one storage
        assert got["rows"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    else:
        from safetensors.torch import load_file

        got = load_file(out)
        for key, value in want.items():
            if key != "lm_head.weight":  # a tie: safetensors keeps one name
                assert same_bits(got[key], value), key


def test_fix_converts_dtype_while_inflating(files, tmp_path):
    out = tmp_path / "half.safetensors"
    result = run_cli("fix", files["deflated"], "-o", out, "--select", "model", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.stderr
    from safetensors.torch import load_file

    got = load_file(out)
    for key, value in torch.load(files["deflated"], weights_only=True)["model"].items():
        if value.is_floating_point() and key != "lm_head.weight":
            assert same_bits(got[key], value.to(torch.bfloat16)), key


def test_diff_and_stats_read_the_inflated_bytes(files):
    result = run_cli("diff", files["deflated"], files["plain"], "--json")
    assert result.exit_code == 0, result.stderr
    data = result.json()
    assert data["identical"] and data["counts"]["identical"] == len(data["tensors"]) > 10
    stats = [run_cli("inspect", files[name], "--stats", "--json") for name in ("plain", "deflated")]
    assert all(r.exit_code == 0 for r in stats), stats[1].stderr
    plain, deflated = ({t["key"]: t["stats"] for t in r.json()["tensors"]} for r in stats)
    assert plain == deflated and plain["model.rows"]["max"] == pytest.approx(flat(torch.load(
        files["plain"], weights_only=True))["model.rows"].max().item())


def _member_data(path: Path, name: str) -> tuple[zipfile.ZipInfo, int]:
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        nlen, xlen = struct.unpack("<HH", f.read(4))
    return info, info.header_offset + 30 + nlen + xlen


def test_a_corrupt_deflated_storage_is_refused_not_copied(files, tmp_path):
    """torch.load inflates a damaged member silently into wrong values; what ckpt-doctor writes is checked."""
    bad = tmp_path / "bad.pt"
    data = bytearray(files["deflated"].read_bytes())
    info, at = _member_data(files["deflated"], "plain/data/" + _storage_of(files["deflated"], "base"))
    data[at + info.compress_size // 2] ^= 0x10
    bad.write_bytes(bytes(data))
    for suffix in (".pt", ".safetensors"):
        out = tmp_path / f"out{suffix}"
        result = run_cli("fix", bad, "-o", out, "--select", "model")
        assert result.exit_code == 2 and "(the file is corrupt)" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and not out.exists()


def _storage_of(path: Path, key: str) -> str:
    """The data/N entry torch reads `model.<key>` from (its key in data.pkl), from ckpt-doctor's own listing."""
    from ckpt_doctor.readers import read_checkpoint

    return next(t.storage.key for t in read_checkpoint(path).tensors if t.key == f"model.{key}")


def test_a_member_claiming_more_than_deflate_can_give_is_a_bomb(files, tmp_path):
    name = "plain/data/" + _storage_of(files["deflated"], "zeros")
    data = bytearray(files["deflated"].read_bytes())
    with zipfile.ZipFile(files["deflated"]) as z:
        at, info = z.start_dir, z.getinfo(name)
    while data[at + 46:at + 46 + len(name)].decode(errors="replace") != name:  # its central directory entry
        nlen, xlen, clen = struct.unpack_from("<HHH", data, at + 28)
        at += 46 + nlen + xlen + clen
    struct.pack_into("<I", data, at + 24, info.compress_size * 2000)  # its uncompressed size
    bomb = tmp_path / "bomb.pt"
    bomb.write_bytes(bytes(data))
    result = run_cli("inspect", bomb)
    assert result.exit_code == 2 and "zip bomb" in result.stderr, result.stderr


def test_fix_inflates_in_bounded_memory(tmp_path):
    """256 MB of zeros deflated to a quarter of a megabyte: fix writes them without holding them (the peak RSS of
    the command's process)."""
    src = tmp_path / "zeros.pt"
    torch.save({"zeros": torch.zeros(64 << 20)}, src)
    packed = rezip(src, tmp_path / "packed.pt")
    src.unlink()
    out = tmp_path / "out.safetensors"
    probe = ("import resource, subprocess, sys; r = subprocess.run([sys.executable, '-m', 'ckpt_doctor', 'fix', "
             f"{str(packed)!r}, '-o', {str(out)!r}]); "
             "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    code, peak_kb = map(int, subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                            check=True, cwd=Path(__file__).resolve().parent.parent).stdout.split())
    assert code == 0 and out.stat().st_size > 256 << 20
    assert peak_kb < 160 << 10, peak_kb  # well under the tensor's 256 MB
