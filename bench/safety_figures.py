"""The safety figures of docs/security.md: every corpus of tests/ through the installed command, counted.

    python bench/safety_figures.py            # prints the markdown table docs/security.md holds

For each file of the malicious corpus (every payload written opcode by opcode, creating a canary if it ever ran),
the broken corpus and the resource attacks, it runs scan, inspect, fix and verify, each as a child process measured
with wait4, and reports: how many runs executed anything (the canary), how many a payload got past (exit ≠ 1), how
many bad files did not end in one `Error:` line, the slowest run and the largest peak RSS, and whether scan and
inspect agreed on every file.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _measure import figure, record  # noqa: E402
from tests.corpus import broken, make_special, malicious, resource_attacks  # noqa: E402

EXE = shutil.which("ckpt-doctor") or str(Path(sys.executable).parent / "ckpt-doctor")
LAUNCH = """\
import os, sys, time
start = time.monotonic()
pid = os.fork()
if pid == 0:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(os.waitstatus_to_exitcode(status), time.monotonic() - start, usage.ru_maxrss)
"""


def run(*args: object) -> tuple[int, float, float, str]:
    proc = subprocess.run([sys.executable, "-c", LAUNCH, EXE, *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    code, seconds, rss = proc.stdout.split()
    return int(code), float(seconds), int(rss) / 1024, proc.stderr


def commands(path: Path, out: Path) -> dict[str, tuple]:
    return {"scan": ("scan", path), "inspect": ("inspect", path), "fix": ("fix", path, "-o", out),
            "verify": ("verify", path, "--model", "fixtures.models:SmallCNN", "--input-shape", "2,3,8,8",
                       "--mode", "single")}


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ckd-safety-"))
    sys.path.insert(0, str(ROOT))
    from fixtures.make_fixtures import make_all

    fixtures = make_all(tmp / "fixtures")
    canary = tmp / "CANARY"
    corpora: dict[str, list[Path]] = {"malicious": [], "broken": [], "resource": []}
    for kind, samples in (("malicious", malicious(canary, fixtures["legacy"]["path"].read_bytes())),
                          ("broken", broken(tmp, fixtures["plain"]["path"].read_bytes(),
                                            fixtures["legacy"]["path"].read_bytes(),
                                            fixtures["safetensors"]["path"].read_bytes())),
                          ("resource", resource_attacks())):
        (tmp / kind).mkdir()
        for name, data in samples.items():
            path = tmp / kind / name
            if data is None:
                path = make_special(tmp / kind, name)
            else:
                path.write_bytes(data)
            corpora[kind].append(path)
    out = tmp / "out.pt"
    rows = []
    disagree = []
    for kind, paths in corpora.items():
        runs = executed = missed = not_one_line = written = 0
        slowest = peak = 0.0
        for path in paths:
            codes = {}
            for command, args in commands(path, out).items():
                if kind == "resource" and command == "verify":
                    continue
                code, seconds, rss, stderr = run(*args)
                runs += 1
                codes[command] = code
                slowest, peak = max(slowest, seconds), max(peak, rss)
                if canary.exists():
                    executed += 1
                    canary.unlink()
                lines = stderr.strip().splitlines()
                if kind == "malicious" and code != 1:
                    missed += 1
                if kind != "malicious" and (code not in (1, 2) or not lines or not lines[-1].startswith("Error: ")
                                            or "internal error" in stderr or "Traceback" in stderr):
                    not_one_line += 1
                if out.exists():
                    written += 1
                    out.unlink()
            if codes["scan"] != codes["inspect"]:
                disagree.append(f"{path.name}: scan {codes['scan']}, inspect {codes['inspect']}")
        rows.append((kind, len(paths), runs, executed, missed, not_one_line, written, slowest, peak))
    print("| corpus | files | runs | executed | payload missed | not one `Error:` line | output written | "
          "slowest run | peak RSS |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind, files, runs, executed, missed, bad, written, slowest, peak in rows:
        print(f"| {kind} | {files} | {runs} | {executed} | {missed if kind == 'malicious' else '-'} | "
              f"{bad if kind != 'malicious' else '-'} | {written} | {slowest:.1f} s | {peak:.0f} MB |")
    print(f"\nscan and inspect disagreed on {len(disagree)} of {sum(len(p) for p in corpora.values())} files"
          + (": " + "; ".join(disagree) if disagree else ""))
    record([figure(f"{kind}: {files} files, {runs} runs", [slowest], peak,
                   note=f"executed {executed}, " + (f"payload missed {missed}" if kind == "malicious" else
                                                   f"not one Error: line {bad}") + f", output written {written}")
            for kind, files, runs, executed, missed, bad, written, slowest, peak in rows],
           [("nothing executed", sum(r[3] for r in rows) == 0), ("no payload missed", rows[0][4] == 0),
            ("every bad input one Error: line", sum(r[5] for r in rows[1:]) == 0),
            ("no output written", sum(r[6] for r in rows) == 0), ("scan and inspect agree", not disagree)],
           "hostile corpora through every command (time: the slowest run)")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    start = time.monotonic()
    main()
    print(f"({time.monotonic() - start:.0f} s)", file=sys.stderr)
