"""Checkpoints behind https:// and s3:// URLs: read by range requests, as little as needed, with the same verdicts as
the local file; every server that misbehaves ends in one line and exit 2.

Real servers run as processes of their own on localhost ports: RangeHTTPServer (wrapped to count the bytes it sends,
tests/remote_servers.py), misbehaving HTTP servers, and moto's standalone S3 server (`moto_server`), which s3fs is
pointed at through the environment (AWS_ENDPOINT_URL and FSSPEC_S3_ENDPOINT_URL), as s3fs's own tests do.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")
pytest.importorskip("RangeHTTPServer")

ROOT = Path(__file__).resolve().parents[1]
SERVERS = Path(__file__).with_name("remote_servers.py")
BIG = 512 << 20  # big enough that 0.1 % (524 KB) is a real bound; written sparse
MID = 16 << 20  # what S3 (moto) serves: its uploads cost time, the reads counted are the same


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(port: int, proc: subprocess.Popen) -> None:
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("server did not start")


def _start(args: list[str], port: int, **kwargs) -> subprocess.Popen:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=kwargs.pop("stderr", subprocess.DEVNULL),
                            **kwargs)
    _wait(port, proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "ckpt_doctor", *args], capture_output=True, text=True, env=full,
                          timeout=timeout)


def _inspected_here_and_there(local_path: Path, url: str, log: Path) -> tuple:
    """`inspect --json` of a local checkpoint and of the same served at `url` (both exit 0), and the byte counts of
    the requests the remote run made (the server's log)."""
    local = _cli("inspect", str(local_path), "--json")
    assert local.returncode == 0, local.stderr
    before = len(_requests(log))
    remote = _cli("inspect", url, "--json")
    assert remote.returncode == 0, remote.stderr
    return local, remote, _requests(log)[before:]


def _inspect_and_fix_end_in_one_line(url: str, out: Path, *words: str) -> None:
    """`inspect URL` and `fix URL -o OUT` of a remote checkpoint with a part missing: each one `Error:` line holding
    `words`, exit 2, nothing on stdout, no output written."""
    for args in (["inspect", url], ["fix", url, "-o", str(out)]):
        result = _cli(*args)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
        assert all(word in lines[0] for word in words), lines[0]
        assert result.stdout == ""
        assert not out.exists()


def _sparse_torch_zip(path: Path, nbytes: int) -> None:
    """torch.save of a model whose one big tensor is zeros, the zeros left as a hole (no disk written for them)."""
    import numpy as np
    import torch

    class Sparse:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            view = memoryview(data).cast("B")
            if len(view) >= 1 << 20 and not np.frombuffer(view, np.uint8).any():
                self.f.seek(len(view), 1)
            else:
                self.f.write(view)
            return len(view)

        def flush(self):
            self.f.flush()

    state = {"embed.weight": torch.zeros(nbytes // 4 // 1024, 1024), "head.weight": torch.randn(10, 1024),
             "head.bias": torch.randn(10), "step": 7}
    with open(path, "wb") as f:
        torch.save(state, Sparse(f))
        f.truncate()


def _sparse_safetensors(path: Path, nbytes: int) -> None:
    import struct

    rows = nbytes // 4 // 1024
    header = {"embed.weight": {"dtype": "F32", "shape": [rows, 1024], "data_offsets": [0, rows * 4096]},
              "head.bias": {"dtype": "F32", "shape": [10], "data_offsets": [rows * 4096, rows * 4096 + 40]},
              "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.seek(rows * 4096, 1)
        f.write(b"\1" * 40)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A folder of checkpoints behind a range server that logs the bytes of each answer."""
    import torch
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("served")
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    torch.save(net.state_dict(), folder / "small.pt")
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, folder / "small.safetensors")
    torch.save({"model": net.state_dict(), "opt": __import__("collections").OrderedDict(lr=0.1)}, folder / "ckpt.pt")
    _sparse_torch_zip(folder / "big.pt", BIG)
    _sparse_safetensors(folder / "big.safetensors", BIG)
    log = folder.parent / f"{folder.name}.log"
    port = _port()
    proc = _start([sys.executable, str(SERVERS), "range", str(port), str(folder), str(log)], port)
    try:
        yield folder, f"http://127.0.0.1:{port}", log
    finally:
        _stop(proc)


def _requests(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def _same(remote: str, local: str, url: str, path: Path) -> None:
    """The JSON of a remote run equals the local run's, but for the path and what the network cost."""
    a = json.loads(remote.replace(url, str(path)))
    b = json.loads(local)
    used = a.pop("remote")
    assert used["requests"] >= 1
    for d in (a, b):
        if "notes" in d:
            d["notes"] = [n for n in d["notes"] if not n.startswith("over the network")]
    assert a == b


@pytest.mark.parametrize("name", ["small.pt", "small.safetensors", "ckpt.pt", "big.pt", "big.safetensors"])
def test_inspect_over_http_equals_local(served, name):
    folder, base, log = served
    remote = _cli("inspect", f"{base}/{name}", "--json")
    assert remote.returncode == 0, remote.stderr
    local = _cli("inspect", str(folder / name), "--json")
    _same(remote.stdout, local.stdout, f"{base}/{name}", folder / name)


@pytest.mark.parametrize("name", ["big.pt", "big.safetensors"])
@pytest.mark.parametrize("command", ["inspect", "scan"])
def test_big_file_costs_a_few_requests(served, name, command):
    folder, base, log = served
    before = len(_requests(log))
    result = _cli(command, f"{base}/{name}", "--json")
    assert result.returncode == 0, result.stderr
    sent = _requests(log)[before:]
    size = (folder / name).stat().st_size
    assert 1 <= len(sent) <= 4
    assert sum(sent) <= size / 1000
    assert json.loads(result.stdout)["remote"] == {"bytes": sum(sent), "requests": len(sent), "size": size}
    human = _cli(command, f"{base}/{name}")
    assert f"in {len(sent)} request" in human.stderr


def test_scan_over_http_equals_local(served):
    folder, base, _ = served
    remote = _cli("scan", f"{base}/ckpt.pt", "--json")
    local = _cli("scan", str(folder / "ckpt.pt"), "--json")
    assert remote.returncode == local.returncode == 0
    _same(remote.stdout, local.stdout, f"{base}/ckpt.pt", folder / "ckpt.pt")


def test_a_pickle_that_runs_code_is_found_over_http(served):
    folder, base, _ = served
    import torch

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"w": torch.zeros(2), "x": Payload()}, folder / "evil.pt")
    for command in ("scan", "inspect"):
        result = _cli(command, f"{base}/evil.pt")
        assert result.returncode == 1, result.stderr
        assert "os.system" in result.stderr + result.stdout or "posix.system" in result.stderr + result.stdout


def test_credentials_and_query_never_printed(served):
    _, base, _ = served
    url = base.replace("http://", "http://user:s3cret@") + "/small.pt?token=hunter2"
    result = _cli("inspect", url, "--json")
    assert result.returncode == 0, result.stderr
    everything = result.stdout + result.stderr
    assert "s3cret" not in everything and "hunter2" not in everything
    assert json.loads(result.stdout)["path"] == base + "/small.pt"


@pytest.mark.parametrize("mode, words", [
    ("norange", "does not answer range requests"),
    ("wrongrange", "with another range"),
    ("endless", "more than the"),
    ("short", "truncated"),
    ("trickle", "no complete answer within"),
    ("notfound", "not found (404)"),
    ("forbidden", "access denied (403)"),
    ("etag", "changed while it was read"),
])
def test_hostile_servers_end_in_one_line(served, mode, words):
    folder, _, _ = served
    port = _port()
    proc = _start([sys.executable, str(SERVERS), "hostile", str(port), mode, str(folder / "big.pt")], port)
    try:
        result = _cli("inspect", f"http://127.0.0.1:{port}/big.pt", env={"CKPT_DOCTOR_REMOTE_TIMEOUT": "2"},
                      timeout=60)
    finally:
        _stop(proc)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert words in lines[0]
    assert result.stdout == ""


def test_without_the_extra_one_line_says_how_to_install(served, tmp_path):
    _, base, _ = served
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "fsspec.py").write_text("raise ImportError('no fsspec here')\n")
    result = _cli("inspect", f"{base}/small.pt", env={"PYTHONPATH": f"{ROOT}{os.pathsep}{blocker}"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"Error: {base}/small.pt: reading a URL needs fsspec: pip install 'ckpt-doctor[remote]'"]


# --- S3 (moto's standalone server) ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3(served, tmp_path_factory):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    server = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    if not Path(server).exists():
        pytest.skip("moto_server (moto[server]) is not installed")
    folder, _, _ = served
    port = _port()
    log = tmp_path_factory.mktemp("moto") / "requests.log"
    with open(log, "w") as out:
        proc = _start([server, "-p", str(port)], port, stderr=out)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    try:
        import s3fs

        fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=env["AWS_ENDPOINT_URL"])
        fs.mkdir("ckpts")
        # S3 takes the small files and 16 MB ones (an upload of the 512 MB files to moto costs a minute; the 0.1 %
        # bound is checked on them over HTTP)
        _sparse_torch_zip(folder / "mid.pt", MID)
        _sparse_safetensors(folder / "mid.safetensors", MID)
        for name in ("small.pt", "small.safetensors", "mid.pt", "mid.safetensors"):
            fs.put_file(str(folder / name), f"ckpts/{name}")
        yield folder, env, log
    finally:
        _stop(proc)


def _s3_gets(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if 'GET /ckpts/' in line)


@pytest.mark.parametrize("name", ["small.pt", "small.safetensors", "mid.pt", "mid.safetensors"])
def test_s3_equals_local_in_a_few_requests(s3, name):
    folder, env, log = s3
    before = _s3_gets(log)
    remote = _cli("inspect", f"s3://ckpts/{name}", "--json", env=env)
    assert remote.returncode == 0, remote.stderr
    gets = _s3_gets(log) - before
    used = json.loads(remote.stdout)["remote"]
    assert used["requests"] == gets and 1 <= gets <= 4
    assert used["bytes"] <= max(used["size"] / 1000, 512 << 10)
    local = _cli("inspect", str(folder / name), "--json")
    _same(remote.stdout, local.stdout, f"s3://ckpts/{name}", folder / name)


def test_s3_missing_object_and_bucket(s3):
    _, env, _ = s3
    for url in ("s3://ckpts/none.pt", "s3://no-such-bucket/x.pt"):
        result = _cli("inspect", url, env=env)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "not found" in result.stderr, result.stderr


# --- tensor data over the network: fix, diff, verify, inspect --stats ------------------------------------------------

def _net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


@pytest.fixture(scope="module")
def wide(served):
    """24 tensors of 512 KB under a DataParallel prefix: per-tensor requests would be 24, a window is one."""
    import torch

    folder, base, log = served
    torch.manual_seed(1)
    state = {f"module.layer{i}.weight": torch.randn(256, 512) for i in range(24)}
    torch.save(state, folder / "wide.pt")
    return folder / "wide.pt", f"{base}/wide.pt", log


def test_fix_from_a_url_streams_in_few_requests(wide, tmp_path):
    import torch

    path, url, log = wide
    before = len(_requests(log))
    out = tmp_path / "wide_fixed.safetensors"
    result = _cli("fix", url, "-o", str(out), "--strip-prefix", "module.", "--json")
    assert result.returncode == 0, result.stderr
    sent = _requests(log)[before:]
    assert len(sent) <= 3, sent  # the head, the tail (directory), one window of data: never one per tensor
    assert json.loads(result.stdout)["remote"] == {"bytes": sum(sent), "requests": len(sent),
                                                   "size": path.stat().st_size}
    from safetensors.torch import load_file

    got, want = load_file(out), torch.load(path, weights_only=True)
    assert list(got) == [k[len("module."):] for k in want]
    assert all(torch.equal(got[k[len("module."):]], v) for k, v in want.items())


def test_fix_from_a_url_reads_views_in_the_order_it_writes_them(served, tmp_path):
    """Views of one storage written in another order than they lie in the file (forward, then back, then a strided
    view): the streamed bytes land where the local run puts them, byte for byte, and each is torch's tensor."""
    import torch
    from safetensors.torch import load_file

    folder, base, log = served
    torch.manual_seed(2)
    x, y = torch.randn(2, 512, 1024), torch.randn(256, 1024)
    state = {"late": x[1], "other": y, "early": x[0], "strided": x[0, :, ::2]}
    torch.save(state, folder / "views.pt")
    before = len(_requests(log))
    remote = _cli("fix", f"{base}/views.pt", "-o", str(tmp_path / "remote.safetensors"), "--json")
    assert remote.returncode == 0, remote.stderr
    sent = _requests(log)[before:]
    assert json.loads(remote.stdout)["remote"]["bytes"] == sum(sent)
    local = _cli("fix", str(folder / "views.pt"), "-o", str(tmp_path / "local.safetensors"))
    assert local.returncode == 0, local.stderr
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    got = load_file(tmp_path / "remote.safetensors")
    assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())


@pytest.mark.parametrize("mode, words", [
    ("short:big", "truncated"),
    ("endless:big", "more than the"),
    ("wrongrange:big", "with another range"),
    ("etag:big", "changed while it was read"),
    ("trickle:big", "no complete answer within"),
])
def test_a_server_failing_while_fix_streams_ends_in_one_line(wide, tmp_path, mode, words):
    """A server that answers the structure's requests well and misbehaves only on the streamed tensor data: one line,
    exit 2, no output and no temporary file left."""
    path, _, _ = wide
    port = _port()
    proc = _start([sys.executable, str(SERVERS), "hostile", str(port), mode, str(path)], port)
    out = tmp_path / "out" / "wide.safetensors"
    out.parent.mkdir()
    try:
        result = _cli("fix", f"http://127.0.0.1:{port}/wide.pt", "-o", str(out),
                      env={"CKPT_DOCTOR_REMOTE_TIMEOUT": "2"}, timeout=60)
    finally:
        _stop(proc)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and words in lines[0], result.stderr
    assert list(out.parent.iterdir()) == []


def test_diff_and_stats_of_a_url_equal_the_local_run(wide, served):
    path, url, _ = wide
    folder, base, _ = served
    for args in (("diff", "{wide}", "{small}", "--json"), ("inspect", "{wide}", "--stats", "--json")):
        remote = _cli(*(a.format(wide=url, small=f"{base}/small.pt") for a in args))
        local = _cli(*(a.format(wide=str(path), small=str(folder / "small.pt")) for a in args))
        assert remote.returncode == local.returncode, remote.stderr
        a = json.loads(remote.stdout.replace(url, str(path)).replace(f"{base}/small.pt", str(folder / "small.pt")))
        assert a.pop("remote")["requests"] >= 1
        b = json.loads(local.stdout)
        for d in (a, b):
            d.pop("notes", None)
        assert a == b


def test_verify_reads_a_url(served, tmp_path):
    import torch

    folder, base, _ = served
    torch.save(_net().state_dict(), folder / "net.pt")
    (tmp_path / "m.py").write_text("import torch\n\ndef net():\n    return torch.nn.Sequential(torch.nn.Linear(16, 32), "
                                   "torch.nn.ReLU(), torch.nn.Linear(32, 4))\n")
    result = _cli("verify", f"{base}/net.pt", "--model", f"{tmp_path / 'm.py'}:net", "--input-shape", "2,16",
                  "--mode", "single", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ok"] is True


def _printed(text: str) -> list[list[str]]:
    import re
    import shlex

    return [shlex.split(c)[1:] for c in re.findall(r"`(ckpt-doctor [^`]+)`", text)]


def test_every_command_printed_for_a_url_runs_as_printed(served, tmp_path):
    """A DataParallel model pickled whole: inspect's torch.load line, inspect --model's fix line and scan's rescue
    line each name a local output in this folder, and each runs as printed and writes a file torch.load loads."""
    import torch

    folder, base, _ = served
    net = _net()
    torch.save(torch.nn.DataParallel(net), folder / "dp.pt")
    url = f"{base}/dp.pt"
    lines = []
    for args in (("inspect", url), ("inspect", url, "--model", f"{base}/small.pt"), ("scan", url)):
        shown = subprocess.run([sys.executable, "-m", "ckpt_doctor", *args], capture_output=True, text=True,
                               cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
        found = [c for c in _printed(shown.stdout + shown.stderr) if c[0] == "fix"]
        assert found, shown.stderr
        lines += found
    assert len(lines) >= 3
    for argv in lines:
        out = argv[argv.index("-o") + 1]
        assert "://" not in out and "/" not in out, argv
        run = subprocess.run([sys.executable, "-m", "ckpt_doctor", *argv], capture_output=True, text=True,
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert run.returncode == 0, (argv, run.stderr)
        loaded = torch.load(tmp_path / out, weights_only=True)
        keys = {k.removeprefix("module.") for k in loaded}
        assert keys == set(net.state_dict())
        (tmp_path / out).unlink()


def test_a_small_file_costs_one_request(served):
    folder, base, log = served
    before = len(_requests(log))
    result = _cli("inspect", f"{base}/small.pt", "--json")
    assert result.returncode == 0, result.stderr
    assert _requests(log)[before:] == [(folder / "small.pt").stat().st_size]


@pytest.mark.parametrize("url, words", [
    ("s3://", "Error: s3:// names no bucket"),
    ("http://127.0.0.1:{closed}/x.pt", "cannot connect to 127.0.0.1:{closed}"),
])
def test_bad_urls_are_said_in_words(url, words):
    closed = _port()  # nothing listens there
    result = _cli("inspect", url.format(closed=closed))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert words.format(closed=closed) in result.stderr
    assert "Error:" in result.stderr and not any(c in result.stderr for c in ("ClientConnector", "ParamValidation",
                                                                              "Exception"))


# --- remote folders: a shard index and its shards, an s3:// folder ---------------------------------------------------

def _write_sharded(folder: Path, torch_shards: bool = False) -> dict:
    """A Hugging Face sharded checkpoint in `folder` (two shards and their index, as save_pretrained writes them);
    the state_dict it holds."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    sd = _net().state_dict()
    halves = ({k: v for k, v in sd.items() if k.startswith("0.")}, {k: v for k, v in sd.items() if k.startswith("2.")})
    stem, suffix = ("pytorch_model", "bin") if torch_shards else ("model", "safetensors")
    weight_map = {}
    for i, half in enumerate(halves, 1):
        name = f"{stem}-{i:05d}-of-00002.{suffix}"
        if torch_shards:
            torch.save(half, folder / name)
        else:
            save_file({k: v.contiguous() for k, v in half.items()}, folder / name)
        weight_map.update({k: name for k in half})
    index = f"{stem}.{suffix}.index.json"
    (folder / index).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return sd


@pytest.mark.parametrize("torch_shards", [False, True])
def test_a_shard_index_url_reads_its_shards_by_range_as_the_local_folder(served, tmp_path, torch_shards):
    import torch

    folder, base, log = served
    name = "sharded-bin" if torch_shards else "sharded"
    sd = _write_sharded(folder / name, torch_shards)
    index = "pytorch_model.bin.index.json" if torch_shards else "model.safetensors.index.json"
    before = len(_requests(log))
    remote = _cli("inspect", f"{base}/{name}/{index}", "--json")
    assert remote.returncode == 0, remote.stderr
    assert len(_requests(log)) - before == json.loads(remote.stdout)["remote"]["requests"] <= 1 + 2 * 2
    local = _cli("inspect", str(folder / name), "--json")  # the folder: read by its index
    _same(remote.stdout, local.stdout, f"{base}/{name}", folder / name)
    assert {t["key"]: t["shape"] for t in json.loads(remote.stdout)["tensors"]} == \
        {k: list(v.shape) for k, v in sd.items()}
    # its tensor data, streamed from the shards: fix writes what torch.load reads back equal
    out = tmp_path / "whole.safetensors"
    fixed = _cli("fix", f"{base}/{name}/{index}", "-o", str(out))
    assert fixed.returncode == 0, fixed.stderr
    from safetensors.torch import load_file

    loaded = load_file(out)
    assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], v) for k, v in sd.items())
    scan = _cli("scan", f"{base}/{name}/{index}", "--json")
    assert scan.returncode == 0, scan.stderr
    assert sorted(f["path"].rsplit("/", 1)[-1] for f in json.loads(scan.stdout)["files"]) == \
        sorted(p.name for p in (folder / name).iterdir() if not p.name.endswith(".json"))


def test_fix_streams_the_shards_of_an_index_url_in_few_requests(served, tmp_path):
    """Shards bigger than what the structure's requests fetch: a request or two of data each (never one per tensor),
    every byte counted as the server sent it, the output torch's tensors."""
    import torch
    from safetensors.torch import load_file, save_file

    folder, base, log = served
    torch.manual_seed(3)
    shards = [{f"layer{i}.{j}.weight": torch.randn(128, 512) for j in range(12)} for i in range(2)]  # 3 MB each
    (folder / "big-shards").mkdir()
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        save_file(shard, folder / "big-shards" / f"model-{i:05d}-of-00002.safetensors")
        weight_map.update(dict.fromkeys(shard, f"model-{i:05d}-of-00002.safetensors"))
    (folder / "big-shards" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    before = len(_requests(log))
    out = tmp_path / "whole.safetensors"
    fixed = _cli("fix", f"{base}/big-shards/model.safetensors.index.json", "-o", str(out), "--json")
    assert fixed.returncode == 0, fixed.stderr
    sent = _requests(log)[before:]
    assert json.loads(fixed.stdout)["remote"]["bytes"] == sum(sent)
    # the index; per shard its head and tail, and its data: written in the plan's key order (layer0.2 before
    # layer0.10), stored in the header's (layer0.10 before layer0.2), so one request and one more for the jump back
    assert len(sent) <= 1 + 2 * 4 < 24, str(sent)
    loaded = load_file(out)
    want = {k: v for shard in shards for k, v in shard.items()}
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], v) for k, v in want.items())


def test_a_shard_that_runs_code_is_found_through_its_index_url(served, tmp_path):
    from tests.payloads import call

    folder, base, _ = served
    _write_sharded(folder / "sharded-evil", torch_shards=True)
    canary = tmp_path / "CANARY"
    (folder / "sharded-evil" / "pytorch_model-00002-of-00002.bin").write_bytes(
        b"\x80\x02" + call("os", "system", f"touch {canary}") + b".")
    scan = _cli("scan", f"{base}/sharded-evil/pytorch_model.bin.index.json", "--json")
    assert scan.returncode == 1, scan.stderr
    assert [f["verdict"] for f in json.loads(scan.stdout)["files"]] == ["safe", "dangerous"]
    assert not canary.exists()


def test_an_http_folder_cannot_be_listed_and_says_what_to_give(served):
    _, base, _ = served
    for command in ("inspect", "scan"):
        result = _cli(command, f"{base}/sharded/")
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [result.stderr.strip()]
        assert "cannot be listed over HTTP" in result.stderr and "model.safetensors.index.json" in result.stderr
        assert "a DeepSpeed folder's latest" in result.stderr


def test_an_s3_folder_is_read_as_the_local_folder(s3, tmp_path):
    import torch

    folder, env, log = s3
    sd = _write_sharded(folder / "s3-sharded")
    import s3fs

    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=env["AWS_ENDPOINT_URL"])
    for p in (folder / "s3-sharded").iterdir():
        fs.put_file(str(p), f"ckpts/sharded/{p.name}")
    local = _cli("inspect", str(folder / "s3-sharded"), "--json")
    for url in ("s3://ckpts/sharded/", "s3://ckpts/sharded", "s3://ckpts/sharded/model.safetensors.index.json"):
        before = _s3_gets(log)
        remote = _cli("inspect", url, "--json", env=env)
        assert remote.returncode == 0, (url, remote.stderr)
        assert 3 <= _s3_gets(log) - before <= 1 + 2 * 2  # the index, then each shard's header
        shown = json.loads(remote.stdout)
        assert shown["path"] == "s3://ckpts/sharded/model.safetensors.index.json"
        _same(remote.stdout, local.stdout, "s3://ckpts/sharded", folder / "s3-sharded")
    out = tmp_path / "whole.pt"
    fixed = _cli("fix", "s3://ckpts/sharded/", "-o", str(out), env=env)
    assert fixed.returncode == 0, fixed.stderr
    loaded = torch.load(out, weights_only=True)
    assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], v) for k, v in sd.items())
    assert _cli("scan", "s3://ckpts/sharded/", env=env).returncode == 0
    fs.pipe_file("ckpts/sharded/old/notes.txt", b"an object under a sub-prefix")  # a "folder" inside: not an object
    scanned = _cli("scan", "s3://ckpts/sharded/", "--json", env=env)
    assert scanned.returncode == 0 and "404" not in scanned.stderr, scanned.stderr
    assert len(json.loads(scanned.stdout)["files"]) == 2  # the two shards (the index is JSON, skipped)
    for url, words in (("s3://ckpts/nothing-here/", "not found"), ("s3://ckpts/", "holds")):
        result = _cli("inspect", url, env=env)
        assert result.returncode == 2 and words in result.stderr, (url, result.stderr)
        assert result.stderr.strip().splitlines() == [result.stderr.strip()]


def test_a_fix_suggested_for_a_shard_index_url_is_named_after_its_model(tmp_path, monkeypatch):
    from ckpt_doctor.advice import output_beside

    monkeypatch.chdir(tmp_path)
    assert output_beside("https://host/org/model.safetensors.index.json") == "model_fixed.pt"
    assert output_beside("s3://bucket/run/pytorch_model.bin.index.json", "fixed", ".safetensors") == \
        "pytorch_model_fixed.safetensors"
    # a local model folder's index: beside the folder, not one more file in it (which inspect of the folder would
    # then find beside the index)
    (tmp_path / "bert").mkdir()
    assert output_beside("bert/model.safetensors.index.json") == "bert_fixed.pt"
    assert output_beside("model.safetensors.index.json") == "model_fixed.pt"


# --- remote torch.distributed.checkpoint folders: by the URL of their .metadata (https://), an s3:// prefix ----------

@pytest.fixture(scope="module")
def dcp_folder(served):
    """A DCP folder written by torch's dcp.save from two ranks (FSDP2 weights and Adam state, ~12 MB) in the served
    folder, with the state it holds (`dcp.full.pt`) beside it."""
    from tests.dcp_samples import write_remote_sample

    folder, base, log = served
    write_remote_sample(folder / "dcp")
    return folder / "dcp", f"{base}/dcp", log


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def _same_dcp(remote: str, local: str, url: str, folder: Path) -> dict:
    """inspect --json of a remote DCP folder equals the local folder's, but for the path and the network's cost."""
    a = json.loads(remote.replace(url, str(folder)))
    b = json.loads(local)
    used = a.pop("remote")
    a["path"] = a["path"].removesuffix("/.metadata")
    assert a == b
    return used


def _fixed_equal(a: Path, b: Path) -> None:
    import torch

    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert x.keys() == y.keys() and x
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_a_dcp_folder_over_http_by_its_metadata_reads_as_the_local_folder(dcp_folder, tmp_path):
    import torch

    folder, url, log = dcp_folder
    local, remote, sent = _inspected_here_and_there(folder, f"{url}/.metadata", log)
    used = _same_dcp(remote.stdout, local.stdout, url, folder)
    assert used == {"bytes": sum(sent), "requests": len(sent), "size": _folder_bytes(folder)}
    assert used["bytes"] < used["size"] / 4  # metadata and pickled items: not the tensor data
    full = torch.load(folder.with_suffix(".full.pt"), weights_only=True)
    shapes = {t["key"]: t["shape"] for t in json.loads(remote.stdout)["tensors"]}
    assert shapes["model.0.weight"] == list(full["model"]["0.weight"].shape)
    human = _cli("inspect", f"{url}/.metadata")
    assert human.returncode == 0 and "over the network" in human.stdout + human.stderr
    # fix streams the chunks from the rank files: the same file as the local folder's fix
    ours, theirs = tmp_path / "remote.pt", tmp_path / "local.pt"
    assert _cli("fix", f"{url}/.metadata", "-o", str(ours)).returncode == 0
    assert _cli("fix", str(folder), "-o", str(theirs)).returncode == 0
    _fixed_equal(ours, theirs)
    assert all(torch.equal(v, full["model"][k]) for k, v in torch.load(ours, weights_only=True).items())


def test_a_dcp_folder_over_http_is_scanned_by_its_metadata(dcp_folder):
    folder, url, log = dcp_folder
    before = len(_requests(log))
    remote = _cli("scan", f"{url}/.metadata", "--json")
    local = _cli("scan", str(folder), "--json")
    assert remote.returncode == local.returncode == 0, remote.stderr
    sent = _requests(log)[before:]
    a, b = json.loads(remote.stdout), json.loads(local.stdout)
    assert a.pop("remote")["bytes"] == sum(sent) < _folder_bytes(folder) / 2
    assert [(f["path"].rsplit("/", 1)[-1], f["verdict"], sorted(g["global"] for g in f["globals"]))
            for f in a["files"]] == \
        [(f["path"].rsplit("/", 1)[-1], f["verdict"], sorted(g["global"] for g in f["globals"])) for f in b["files"]]
    printed = _printed(_cli("scan", f"{url}/.metadata").stderr)
    assert printed and all(line[1] == f"{url}/.metadata" for line in printed)  # HTTP: the folder by its metadata


def test_a_payload_in_a_remote_dcp_item_is_found(served, tmp_path):
    """A value whose unpickling would call a function, saved by dcp.save as an item: found over HTTP, never run."""
    import functools

    import torch
    import torch.distributed.checkpoint as dcp

    folder, base, _ = served
    dcp.save({"w": torch.ones(3), "hook": functools.partial(print, "payload ran")},
             checkpoint_id=str(folder / "dcp-payload"), no_dist=True)
    for command in ("inspect", "scan"):
        result = _cli(command, f"{base}/dcp-payload/.metadata")
        assert result.returncode == 1, result.stderr
        assert "functools.partial" in result.stdout + result.stderr
        assert "payload ran" not in result.stdout + result.stderr


def test_a_missing_item_file_of_a_remote_dcp_folder_ends_in_one_line(dcp_folder, served):
    folder, _, _ = dcp_folder
    root, base, _ = served
    broken = root / "dcp-broken"
    shutil.copytree(folder, broken)
    (broken / "__1_0.distcp").unlink()  # the server answers 404 for it
    _inspect_and_fix_end_in_one_line(f"{base}/dcp-broken/.metadata", root.parent / "x.pt", "__1_0.distcp is missing",
                                     "404")


def test_an_s3_dcp_folder_reads_scans_and_fixes_as_the_local_folder(s3, dcp_folder, tmp_path):
    import s3fs

    folder, _, _ = dcp_folder
    _, env, log = s3
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=env["AWS_ENDPOINT_URL"])
    for p in folder.iterdir():
        fs.put_file(str(p), f"ckpts/dcp/{p.name}")
    local = _cli("inspect", str(folder), "--json")
    for url in ("s3://ckpts/dcp/", "s3://ckpts/dcp", "s3://ckpts/dcp/.metadata"):
        before = _s3_gets(log)
        remote = _cli("inspect", url, "--json", env=env)
        assert remote.returncode == 0, (url, remote.stderr)
        used = _same_dcp(remote.stdout, local.stdout, "s3://ckpts/dcp", folder)
        assert used["bytes"] < _folder_bytes(folder) / 4
        assert used["requests"] >= _s3_gets(log) - before  # (and one listing, for a prefix)
    scanned = _cli("scan", "s3://ckpts/dcp/", "--json", env=env)
    assert scanned.returncode == 0, scanned.stderr
    assert sorted(f["path"] for f in json.loads(scanned.stdout)["files"]) == \
        sorted(f"s3://ckpts/dcp/{p.name}" for p in folder.iterdir())
    ours, theirs = tmp_path / "remote.pt", tmp_path / "local.pt"
    fixed = _cli("fix", "s3://ckpts/dcp/", "-o", str(ours), env=env)
    assert fixed.returncode == 0, fixed.stderr
    assert _cli("fix", str(folder), "-o", str(theirs)).returncode == 0
    _fixed_equal(ours, theirs)



def test_an_s3_prefix_without_its_slash_is_scanned_as_its_folder(s3, served):
    """`scan s3://bucket/folder` (no object of that name) scans the folder, as `inspect` reads it: its payload is
    found (exit 1), not a 404; a name that is neither an object nor a prefix still ends in one not-found line."""
    import functools

    import s3fs
    import torch
    import torch.distributed.checkpoint as dcp

    root, _, _ = served
    _, env, _ = s3
    dcp.save({"w": torch.ones(3), "hook": functools.partial(print, "payload ran")},
             checkpoint_id=str(root / "dcp-s3-payload"), no_dist=True)
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=env["AWS_ENDPOINT_URL"])
    for p in (root / "dcp-s3-payload").iterdir():
        fs.put_file(str(p), f"ckpts/evil/{p.name}")
    runs = {url: _cli("scan", url, "--json", env=env) for url in ("s3://ckpts/evil", "s3://ckpts/evil/")}
    for url, result in runs.items():
        assert result.returncode == 1, (url, result.stderr)
        files = json.loads(result.stdout)["files"]
        assert sorted(f["path"] for f in files) == sorted(f"s3://ckpts/evil/{p.name}"
                                                          for p in (root / "dcp-s3-payload").iterdir())
        assert any("functools.partial" in (g["global"] for g in f["globals"]) for f in files)
    missing = _cli("scan", "s3://ckpts/no-such-prefix", env=env)
    assert missing.returncode == 2 and "not found" in missing.stderr, missing.stderr



class _Touch:
    """A value whose unpickling runs `touch CANARY` (what torch's dcp.load would do with it)."""

    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def _past_the_end(folder: Path, value, key: str = "extra") -> None:
    """A DCP folder of {"w": ones(4)} to which an item `key` is added: `value`'s torch.save archive appended to the
    end of the rank file, its storage entry saying a length (1 GB) that runs past the end of the file."""
    import io
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(folder), no_dist=True)
    buf = io.BytesIO()
    torch.save(value, buf)
    shard = folder / "__0_0.distcp"
    at = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    meta = pickle.loads((folder / ".metadata").read_bytes())
    meta.state_dict_metadata[key] = BytesStorageMetadata()
    meta.storage_data[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", at, 1 << 30)
    if isinstance(meta.planner_data, dict):
        meta.planner_data[key] = (key,)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def _dcp_load(folder: Path, keys: dict) -> subprocess.CompletedProcess:
    """torch's dcp.load of the folder in a child process of its own (the oracle: it may run what the folder holds)."""
    script = ("import sys, torch, torch.distributed.checkpoint as dcp\n"
              f"sd = {{'w': torch.zeros(4), **{keys!r}}}\n"
              "dcp.load(sd, checkpoint_id=sys.argv[1], no_dist=True)\n"
              "print(repr({k: v for k, v in sd.items() if k != 'w'}))\n")
    return subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, timeout=120)


def test_an_item_said_to_run_past_the_end_of_its_file_is_read_as_torch_reads_it(served, tmp_path):
    """The metadata gives a value's item a length past the end of its file: torch's dcp.load reads it up to the end
    and unpickles it. Local and remote inspect and scan walk those bytes: a payload there is found (exit 1, named),
    and fix refuses for it; a plain value reads as torch reads it (exit 0, with a note)."""
    root, base, _ = served
    canary = tmp_path / "CANARY"
    _past_the_end(root / "dcp-tail", _Touch(canary))
    oracle = _dcp_load(root / "dcp-tail", {"extra": None})
    assert oracle.returncode == 0 and canary.exists(), oracle.stderr  # torch's dcp.load ran it
    canary.unlink()
    for where in (str(root / "dcp-tail"), f"{base}/dcp-tail/.metadata"):
        for command in ("inspect", "scan"):
            result = _cli(command, where)
            assert result.returncode == 1, (where, command, result.stderr)
            assert "posix.system" in result.stdout + result.stderr and "truncated" not in result.stderr
        fixed = _cli("fix", where, "-o", str(tmp_path / "out.pt"))
        assert fixed.returncode == 1 and "posix.system" in fixed.stderr, fixed.stderr
        assert not (tmp_path / "out.pt").exists()
    assert not canary.exists()
    _past_the_end(root / "dcp-tail-plain", {"step": 7, "lr": 0.5})
    oracle = _dcp_load(root / "dcp-tail-plain", {"extra": None})
    assert oracle.returncode == 0 and "{'step': 7, 'lr': 0.5}" in oracle.stdout, oracle.stderr
    for where in (str(root / "dcp-tail-plain"), f"{base}/dcp-tail-plain/.metadata"):
        result = _cli("inspect", where, "--json")
        assert result.returncode == 0, result.stderr
        assert "past the end of __0_0.distcp" in result.stdout
        out = tmp_path / "plain.pt"
        assert _cli("fix", where, "-o", str(out)).returncode == 0
        import torch

        assert torch.load(out, weights_only=True)["extra"] == {"step": 7, "lr": 0.5}
        out.unlink()


def test_a_tensor_item_past_the_end_of_its_file_is_truncated_and_its_payload_still_named(served, tmp_path):
    """A tensor's item torch hands torch.load as a view of the claimed length: past the end of the file, torch's
    dcp.load fails, and so does the reading (exit 2, truncated); a payload elsewhere in the file is still named
    (exit 1), over HTTP as locally."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    root, base, _ = served
    for name, state in (("dcp-cut", {"w": torch.ones(4), "v": 3}),
                        ("dcp-cut-evil", {"w": torch.ones(4), "v": _Touch(tmp_path / "CANARY")})):
        folder = root / name
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
        meta = pickle.loads((folder / ".metadata").read_bytes())
        for index, info in list(meta.storage_data.items()):
            if index.fqn == "w":
                meta.storage_data[index] = _StorageInfo(info.relative_path, info.offset, 1 << 30,
                                                        info.transform_descriptors)
        (folder / ".metadata").write_bytes(pickle.dumps(meta))
    oracle = _dcp_load(root / "dcp-cut", {"v": None})
    assert oracle.returncode != 0  # torch's dcp.load fails on the tensor's item
    for where in (str(root / "dcp-cut"), f"{base}/dcp-cut/.metadata"):
        for command in ("inspect", "fix"):
            result = _cli(command, where, *(["-o", str(tmp_path / "o.pt")] if command == "fix" else []))
            assert result.returncode == 2, result.stderr
            assert result.stderr.count("\n") == 1 and "truncated" in result.stderr, result.stderr
    for where in (str(root / "dcp-cut-evil"), f"{base}/dcp-cut-evil/.metadata"):
        result = _cli("inspect", where)
        assert result.returncode == 1, result.stderr
        assert "truncated" in result.stderr and "posix.system" in result.stderr, result.stderr
    assert not (tmp_path / "CANARY").exists() and not (tmp_path / "o.pt").exists()



def test_a_metadata_naming_one_shard_under_many_names_is_bounded(served, tmp_path):
    """A metadata whose items name 300 files, each a link to the one rank file (2,000 items): the server answers
    every name with the whole shard. Reading it remotely stops in one line (exit 2) once the files have cost more
    than their items, in far fewer requests than a walk of every name; a local scan walks the shard once and gives
    every name its verdict."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    root, base, log = served
    folder = root / "dcp-aliases"
    dcp.save({f"t{i}": torch.ones(64) for i in range(2000)}, checkpoint_id=str(folder), no_dist=True)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    for i, (index, info) in enumerate(sorted(meta.storage_data.items(), key=lambda kv: kv[1].offset)[:300]):
        meta.storage_data[index] = _StorageInfo(f"alias_{i}.distcp", info.offset, info.length)
        (folder / f"alias_{i}.distcp").symlink_to("__0_0.distcp")
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    for command in ("inspect", "scan"):
        before = len(_requests(log))
        result = _cli(command, f"{base}/dcp-aliases/.metadata")
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
        assert len(errors) == 1 and "far more than their items" in errors[0], result.stderr
        assert len(_requests(log)) - before < 150  # each of 300 names walked whole costs ~900 requests
    local = _cli("scan", str(folder), "--json", timeout=300)
    assert local.returncode == 0, local.stderr
    assert len(json.loads(local.stdout)["files"]) == 302  # .metadata, the shard and every link, each with a verdict


# --- remote DeepSpeed folders: by the URL of their `latest` or rank 0's model states (https://), an s3:// prefix ----

@pytest.fixture(scope="module")
def ds_folders(served):
    """DeepSpeed save folders written by DeepSpeed on the CPU (ZeRO-2 fp32 and ZeRO-3 bf16 of a 1 M-parameter TiedNet,
    about 17 and 13 MB) in the served folder."""
    pytest.importorskip("deepspeed", reason="DeepSpeed writes the samples (it is in the test extra)")
    from tests.deepspeed_samples import write_remote_sample

    folder, base, log = served
    write_remote_sample(folder / "ds")
    return folder / "ds", f"{base}/ds", log


def _rank_bytes(save: Path) -> int:
    """What a remote read of a DeepSpeed folder can fetch: its `latest` and its tag folder's files."""
    return (save / "latest").stat().st_size + _folder_bytes(save / "global_step1")


def _same_ds(remote: str, local: str, url: str, folder: Path, named_by: str = "") -> dict:
    """inspect --json of a remote DeepSpeed folder equals the local folder's, but for the path (over HTTP, the URL of
    the file it was named by) and the network's cost."""
    a = json.loads(remote.replace(url, str(folder)))
    b = json.loads(local)
    used = a.pop("remote")
    assert a["path"] == str(folder) + named_by
    a["path"] = str(folder)
    assert a == b
    return used


MODEL0 = {"z2": "mp_rank_00_model_states.pt", "z3_bf16": "zero_pp_rank_0_mp_rank_00_model_states.pt"}


@pytest.mark.parametrize("name", ["z2", "z3_bf16"])
def test_a_deepspeed_folder_over_http_by_its_latest_reads_as_the_local_folder(ds_folders, tmp_path, name):
    import torch

    folder, url, log = ds_folders
    save, base = folder / name, f"{url}/{name}"
    local, remote, sent = _inspected_here_and_there(save, f"{base}/latest", log)
    used = _same_ds(remote.stdout, local.stdout, base, save, "/latest")
    # each answer the server sent is counted; ZeRO-3's rank 0 model states are found after a 404 for ZeRO-1/2's name
    assert used["bytes"] == sum(sent) and used["requests"] == len(sent) + (name == "z3_bf16")
    assert used["size"] == _rank_bytes(save)
    assert used["bytes"] < used["size"] / 4  # each rank file's pickles and directory: not its tensor data
    human = _cli("inspect", f"{base}/latest")
    assert human.returncode == 0 and "over the network" in human.stdout + human.stderr
    # fix streams each parameter's slices from the rank files: the same file as the local folder's fix
    ours, theirs = tmp_path / "remote.pt", tmp_path / "local.pt"
    fixed = _cli("fix", f"{base}/latest", "-o", str(ours))
    assert fixed.returncode == 0, fixed.stderr
    assert _cli("fix", str(save), "-o", str(theirs)).returncode == 0
    _fixed_equal(ours, theirs)
    from tests.deepspeed_samples import TiedNet

    TiedNet(4096, 256).load_state_dict({k: v.float() for k, v in torch.load(ours, weights_only=True).items()})


def test_a_deepspeed_tag_folder_over_http_by_rank_0s_model_states(ds_folders, tmp_path):
    folder, url, _ = ds_folders
    for name, model0 in MODEL0.items():
        tag, base = folder / name / "global_step1", f"{url}/{name}/global_step1"
        local = _cli("inspect", str(tag), "--json")
        remote = _cli("inspect", f"{base}/{model0}", "--json")
        assert remote.returncode == local.returncode == 0, remote.stderr
        _same_ds(remote.stdout, local.stdout, base, tag, f"/{model0}")
    # a lone rank file names its folder by rank 0's model states, and the command runs as printed
    lone = _cli("inspect", f"{url}/z3_bf16/global_step1/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    printed = [c for c in _printed(lone.stdout + lone.stderr) if c[0] == "fix"]
    assert printed == [["fix", f"{url}/z3_bf16/global_step1/{MODEL0['z3_bf16']}", "-o",
                        "global_step1_consolidated.safetensors"]], lone.stdout + lone.stderr
    run = subprocess.run([sys.executable, "-m", "ckpt_doctor", *printed[0]], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    from safetensors.torch import load_file

    assert "embed.weight" in load_file(tmp_path / "global_step1_consolidated.safetensors")


def test_a_deepspeed_folder_over_http_is_scanned_by_its_latest(ds_folders):
    folder, url, log = ds_folders
    for name in ("z2", "z3_bf16"):
        before = len(_requests(log))
        remote = _cli("scan", f"{url}/{name}/latest", "--json")
        local = _cli("scan", str(folder / name / "global_step1"), "--json")
        assert remote.returncode == local.returncode == 0, remote.stderr
        sent = _requests(log)[before:]
        a, b = json.loads(remote.stdout), json.loads(local.stdout)
        assert a.pop("remote")["bytes"] == sum(sent) < _rank_bytes(folder / name) / 4
        assert [(f["path"].rsplit("/", 1)[-1], f["verdict"], sorted(g["global"] for g in f["globals"]))
                for f in a["files"]] == \
            [(f["path"].rsplit("/", 1)[-1], f["verdict"], sorted(g["global"] for g in f["globals"]))
             for f in b["files"]]
        assert [s["path"] for s in a["skipped"]] == [f"{url}/{name}/latest"]  # text, not a checkpoint


def test_a_missing_rank_file_of_a_remote_deepspeed_folder_ends_in_one_line(ds_folders, served):
    folder, _, _ = ds_folders
    root, base, _ = served
    for gone in ("zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        broken = root / "ds-broken"
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(folder / "z2", broken)
        (broken / "global_step1" / gone).unlink()  # the server answers 404 for it
        _inspect_and_fix_end_in_one_line(f"{base}/ds-broken/latest", root.parent / "x.pt", f"{gone} is missing", "404",
                                         "incomplete")


def test_an_s3_deepspeed_folder_reads_scans_and_fixes_as_the_local_folder(s3, ds_folders, tmp_path):
    import s3fs

    folder, _, _ = ds_folders
    _, env, log = s3
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=env["AWS_ENDPOINT_URL"])
    for name in ("z2", "z3_bf16"):
        for p in (folder / name).rglob("*"):
            if p.is_file():
                fs.put_file(str(p), f"ckpts/ds-{name}/{p.relative_to(folder / name)}")
    for name in ("z2", "z3_bf16"):
        save, prefix = folder / name, f"s3://ckpts/ds-{name}"
        local = _cli("inspect", str(save), "--json")
        for url, named_by in ((f"{prefix}/", ""), (prefix, ""), (f"{prefix}/latest", "/latest")):
            before = _s3_gets(log)
            remote = _cli("inspect", url, "--json", env=env)
            assert remote.returncode == 0, (url, remote.stderr)
            used = _same_ds(remote.stdout, local.stdout, prefix, save, named_by)
            assert used["bytes"] < _rank_bytes(save) / 4
            assert used["requests"] >= _s3_gets(log) - before  # (and the listings, for a prefix)
        tag = _cli("inspect", f"{prefix}/global_step1/", "--json", env=env)  # the tag folder itself
        _same_ds(tag.stdout, _cli("inspect", str(save / "global_step1"), "--json").stdout, f"{prefix}/global_step1",
                 save / "global_step1")
    scanned = _cli("scan", "s3://ckpts/ds-z2/", "--json", env=env)
    assert scanned.returncode == 0, scanned.stderr
    data = json.loads(scanned.stdout)
    assert sorted(f["path"] for f in data["files"]) == \
        sorted(f"s3://ckpts/ds-z2/global_step1/{p.name}" for p in (folder / "z2" / "global_step1").iterdir())
    ours, theirs = tmp_path / "remote.pt", tmp_path / "local.pt"
    fixed = _cli("fix", "s3://ckpts/ds-z2/", "-o", str(ours), env=env)
    assert fixed.returncode == 0, fixed.stderr
    assert _cli("fix", str(folder / "z2"), "-o", str(theirs)).returncode == 0
    _fixed_equal(ours, theirs)
    # a lone rank file names its tag folder's prefix, and the command runs as printed
    lone = _cli("inspect", "s3://ckpts/ds-z3_bf16/global_step1/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                env=env)
    printed = [c for c in _printed(lone.stdout + lone.stderr) if c[0] == "fix"]
    assert printed == [["fix", "s3://ckpts/ds-z3_bf16/global_step1", "-o", "global_step1_consolidated.safetensors"]]
    run = subprocess.run([sys.executable, "-m", "ckpt_doctor", *printed[0]], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert run.returncode == 0, run.stderr
