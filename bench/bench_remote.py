"""Benchmark: `ckpt-doctor inspect` / `scan` / `fix` of a 1 GiB checkpoint behind https:// and s3:// (servers started
here, on localhost ports: RangeHTTPServer counting what it sends, moto's standalone S3 server), against downloading it.

    python bench/bench_remote.py [--dir /tmp/ckpt-remote-bench] [--gb 1] [--rounds 3]

Targets (issue 26): inspect and scan of a 1 GiB torch zip or safetensors file read <= 0.1 % of its bytes in <= 4
requests (counted by the servers: the HTTP server's log of what it sent, moto's request log for S3). `fix` from the
URL to a local file (every byte of tensor data read, streamed: readers/source.RemoteSource.expect) takes <= 1.2x the
time of downloading the same object (s3fs `get_file` for s3://, fsspec's HTTP `get_file` for https://: one streamed
request each), at a peak memory (the process's maximum resident set, from wait4) <= 150 MB. Every command and every
download runs as a process of its own (its start-up counted alike), once per round, each fix right after its
download, so a slow spell of this shared machine hits the pair alike; each ratio is of one round's pair, and the
range over the rounds is printed. Beside the wall-time ratio, the ratio of the two processes' CPU time (user +
system, all threads: what the work costs, less swayed by what else the machine runs). The files are written sparse
(their big tensor is zeros, left as a hole), so the bench needs little disk.
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
sys.path.insert(0, str(ROOT))
from _measure import compile_bytecode  # noqa: E402
from test_remote import _port, _sparse_safetensors, _sparse_torch_zip, _start, _stop  # noqa: E402

SERVERS = ROOT / "tests" / "remote_servers.py"

# Runs a command with its stdout in a file, and prints its exit code, peak resident set and CPU time (user + system,
# all its threads): measured from a small process of its own, since a child forked from this one (which wrote the
# files through torch) would start from this one's peak.
_PEAK = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[2:], stdout=open(sys.argv[1], 'wb'), "
         "stderr=subprocess.PIPE); err = p.stderr.read(); _, st, ru = os.wait4(p.pid, 0); "
         "sys.stderr.buffer.write(err[-2000:]); "
         "print(os.waitstatus_to_exitcode(st), ru.ru_maxrss // 1024, ru.ru_utime + ru.ru_stime)")

# The downloads fix is set beside: one streamed GET each, as a user would copy the file first.
_GET = ("import sys, fsspec; url, out = sys.argv[1:]; "
        "fsspec.filesystem('s3' if url.startswith('s3://') else 'http').get_file(url, out)")


def _run(cmd: list[str], env: dict) -> tuple[float, int, int, str, str, float]:
    """(seconds, peak resident MB, exit code, stdout, stderr, CPU seconds) of `python CMD...`, after the disk has
    caught up (os.sync: every run starts with no dirty pages of the last one to write)."""
    os.sync()
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    with tempfile.NamedTemporaryFile() as stdout:
        began = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", _PEAK, stdout.name, sys.executable, *cmd],
                                capture_output=True, text=True, env=full)
        took = time.perf_counter() - began
        code, peak, cpu = result.stdout.split()
        return took, int(peak), int(code), Path(stdout.name).read_text(), result.stderr, float(cpu)


class Counts:
    """Requests (and, over HTTP, bytes) the servers saw since the last call of `since()`."""

    def __init__(self, http_log: Path, moto_log: Path) -> None:
        self.http_log, self.moto_log = http_log, moto_log
        self.marks = self._now()

    def _now(self) -> tuple[int, int]:
        return len(self.http_log.read_text().split()), self.moto_log.read_text().count("GET /bench/")

    def since(self, where: str) -> tuple[int, int | None]:
        """(requests, bytes sent, known over HTTP only) since the last call."""
        before, self.marks = self.marks, self._now()
        if where == "https":
            sent = [int(x) for x in self.http_log.read_text().split()[before[0]:]]
            return len(sent), sum(sent)
        return self.marks[1] - before[1], None


def _span(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}-{hi:{fmt}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ckpt-remote-bench"))
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each fix and its download, in turn")
    args = parser.parse_args()
    compile_bytecode()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    size = int(args.gb * 2**30)
    files = {"torch zip": folder / f"big-{size}.pt", "safetensors": folder / f"big-{size}.safetensors"}
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
    met = []
    try:
        import s3fs

        fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=env["AWS_ENDPOINT_URL"])
        fs.mkdir("bench")
        for path in files.values():
            fs.put_file(str(path), f"bench/{path.name}", chunksize=1 << 31)  # one PUT (moto merges parts slowly)
        counts = Counts(log, moto_log)
        urls = {"https": f"http://127.0.0.1:{hport}/{{}}", "s3": "s3://bench/{}"}
        print(f"{args.gb:g} GiB files, {args.rounds} rounds; every figure a whole process, the range over the rounds")
        print(f"{'case':40} {'time':>11} {'read':>13} {'share':>8} {'requests':>8}")
        for label, path in files.items():
            total = path.stat().st_size
            for command in ("inspect", "scan"):
                for where, url in urls.items():
                    url = url.format(path.name)
                    counts.since(where)
                    took, _, code, out, err, _ = _run(["-m", "ckpt_doctor", command, url, "--json"], env)
                    requests, sent = counts.since(where)
                    if code != 0:
                        print(f"{label} {command} {where}: exit {code}: {err.strip()[-300:]}")
                        met.append(False)
                        continue
                    nbytes = sent if sent is not None else json.loads(out)["remote"]["bytes"]
                    ok = nbytes <= total / 1000 and requests <= 4
                    met.append(ok)
                    print(f"{label + ' ' + command + ' over ' + where:40} {took:10.2f}s {nbytes:13,} "
                          f"{nbytes / total:8.4%} {requests:8}  {'' if ok else 'NOT met: <= 0.1 %, <= 4 requests'}")
        print(f"\n{'fix to a local file, beside its download':40} {'fix':>11} {'download':>11} {'ratio':>11} "
              f"{'requests':>8} {'peak RSS':>10} {'CPU ratio':>10}")
        for label, path in files.items():
            for where, url in urls.items():
                url = url.format(path.name)
                fix, get, ratio, peaks, gets_peak, requests, cpu = [], [], [], [], [], set(), []
                for _ in range(args.rounds):
                    with tempfile.TemporaryDirectory(dir=folder) as tmp:
                        took, peak, code, _, err, get_cpu = _run(["-c", _GET, url, os.path.join(tmp, "copy")], env)
                        if code != 0:
                            sys.exit(f"download of {url}: exit {code}: {err.strip()[-300:]}")
                        get.append(took)
                        gets_peak.append(peak)
                    counts.since(where)
                    with tempfile.TemporaryDirectory(dir=folder) as tmp:
                        took, peak, code, _, err, fix_cpu = _run(["-m", "ckpt_doctor", "fix", url, "-o",
                                                                  os.path.join(tmp, "out" + path.suffix)], env)
                    requests.add(counts.since(where)[0])
                    if code != 0:
                        sys.exit(f"fix {url}: exit {code}: {err.strip()[-300:]}")
                    fix.append(took)
                    peaks.append(peak)
                    ratio.append(took / get[-1])
                    cpu.append(fix_cpu / get_cpu)
                ok = max(ratio) <= 1.2 and max(peaks) <= 150
                met.append(ok)
                peer = "s3fs get" if where == "s3" else "fsspec get"
                print(f"{label + ' over ' + where:40} {_span(fix, '.2f'):>10}s {_span(get, '.2f'):>10}s "
                      f"{_span(ratio, '.2f'):>10}x {_span(sorted(requests), 'd'):>8} {max(peaks):7} MB "
                      f"{_span(cpu, '.2f'):>9}x  "
                      f"(download: {peer}, {max(gets_peak)} MB){'' if ok else '  NOT met: <= 1.2x, <= 150 MB'}")
        print(f"\ntargets: {'all met' if all(met) else 'NOT all met'}")
    finally:
        _stop(http)
        _stop(moto)


if __name__ == "__main__":
    main()
