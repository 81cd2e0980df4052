"""Benchmark: `ckpt-doctor inspect` / `scan` of a 1 GiB checkpoint behind https:// and s3:// (servers started here, on
localhost ports: RangeHTTPServer counting what it sends, moto's standalone S3 server), against downloading it.

    python bench/bench_remote.py [--dir /tmp/ckpt-remote-bench] [--gb 1]

Targets (issue 26): inspect and scan of a 1 GiB torch zip or safetensors file read <= 0.1 % of its bytes in <= 4
requests (counted by the HTTP server; by moto's request log for S3). Each time is printed beside the time s3fs takes
to `get` the same object, measured in the same run, as a ratio. `fix` from the URL to a local file (every byte of
tensor data read, in windows of readers/source.DATA_SPAN) takes <= 1.2x the time of downloading the object (s3fs
`get_file` for s3://, fsspec's HTTP `get_file` for https://: one streamed request each), at a peak memory (the
process's maximum resident set, from wait4) <= 150 MB. The files are written sparse (their big tensor is
zeros, left as a hole), so the bench needs little disk.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_remote import _port, _sparse_safetensors, _sparse_torch_zip, _start, _stop  # noqa: E402

SERVERS = ROOT / "tests" / "remote_servers.py"


def _cli(*args: str, env: dict | None = None) -> tuple[float, subprocess.CompletedProcess]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "ckpt_doctor", *args], capture_output=True, text=True, env=full)
    return time.perf_counter() - began, result


# Runs the command and prints its peak resident set: measured from a small process of its own, since a child
# forked from this one (which wrote the files through torch) would start from this one's peak.
_PEAK = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL); "
         "_, st, ru = os.wait4(p.pid, 0); print(os.waitstatus_to_exitcode(st), ru.ru_maxrss // 1024)")


def _fix(url: str, out: str, env: dict) -> tuple[float, int, int, str]:
    """(seconds, peak resident MB, exit code, stderr) of `ckpt-doctor fix URL -o OUT`."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, "-m", "ckpt_doctor", "fix", url, "-o", out,
                             "--force"], capture_output=True, text=True, env=full)
    took = time.perf_counter() - began
    code, peak = (int(x) for x in result.stdout.split())
    return took, peak, code, result.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ckpt-remote-bench"))
    parser.add_argument("--gb", type=float, default=1.0)
    args = parser.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    size = int(args.gb * 2**30)
    files = {"torch zip": folder / "big.pt", "safetensors": folder / "big.safetensors"}
    if not files["torch zip"].exists():
        _sparse_torch_zip(files["torch zip"], size)
    if not files["safetensors"].exists():
        _sparse_safetensors(files["safetensors"], size)
    log = folder / "http.log"
    log.write_text("")
    hport, sport = _port(), _port()
    http = _start([sys.executable, str(SERVERS), "range", str(hport), str(folder), str(log)], hport)
    moto_log = folder / "moto.log"
    with open(moto_log, "w") as out:
        moto = _start([str(Path(sys.executable).with_name("moto_server")), "-p", str(sport)], sport, stderr=out)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{sport}", "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{sport}"}
    try:
        import s3fs

        fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=env["AWS_ENDPOINT_URL"])
        fs.mkdir("bench")
        print(f"{'case':44} {'time':>8} {'bytes':>12} {'share':>8} {'requests':>8}  vs s3fs get")
        for label, path in files.items():
            fs.put_file(str(path), f"bench/{path.name}", chunksize=1 << 31)  # one PUT (moto merges parts slowly)
            began = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                fs.get_file(f"bench/{path.name}", os.path.join(tmp, "copy"))
            get = time.perf_counter() - began
            total = path.stat().st_size
            for command in ("inspect", "scan"):
                for where, url in (("https", f"http://127.0.0.1:{hport}/{path.name}"),
                                   ("s3", f"s3://bench/{path.name}")):
                    before = len(log.read_text().split())
                    moto_before = moto_log.read_text().count('GET /bench/')
                    took, result = _cli(command, url, "--json", env=env)
                    if result.returncode != 0:
                        print(f"{label} {command} {where}: exit {result.returncode}: {result.stderr.strip()}")
                        continue
                    used = json.loads(result.stdout)["remote"]
                    if where == "https":
                        sent = [int(x) for x in log.read_text().split()[before:]]
                        nbytes, requests = sum(sent), len(sent)  # counted by the server
                    else:
                        nbytes, requests = used["bytes"], moto_log.read_text().count('GET /bench/') - moto_before
                    print(f"{label + ' ' + command + ' over ' + where:44} {took:7.2f}s {nbytes:12,} "
                          f"{nbytes / total:8.4%} {requests:8}  {took / get:.3f}x of {get:.2f}s")
            import fsspec

            began = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                fsspec.filesystem("http").get_file(f"http://127.0.0.1:{hport}/{path.name}", os.path.join(tmp, "c"))
            http_get = time.perf_counter() - began
            for where, url, ref, ref_name in (("s3", f"s3://bench/{path.name}", get, "s3fs get"),
                                              ("https", f"http://127.0.0.1:{hport}/{path.name}", http_get,
                                               "fsspec http get")):
                with tempfile.TemporaryDirectory(dir=folder) as tmp:
                    took, peak, code, err = _fix(url, os.path.join(tmp, "out" + path.suffix), env)
                if code != 0:
                    print(f"{label} fix {where}: exit {code}: {err.strip()[-300:]}")
                    continue
                print(f"{label + ' fix over ' + where + ' to a local file':44} {took:7.2f}s {'peak ' + str(peak):>12}"
                      f" MB{'':6} {'':8}  {took / ref:.3f}x of {ref:.2f}s ({ref_name})")
    finally:
        _stop(http)
        _stop(moto)


if __name__ == "__main__":
    main()
