"""The malicious and broken corpora through the installed command: nothing runs, nothing crashes, nothing tears.

The figures these tests establish are the ones docs/security.md publishes.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.corpus import broken, make_special, malicious, resource_attacks, slow_inputs, sparse_attacks

EXE = shutil.which("ckpt-doctor") or os.path.join(os.path.dirname(sys.executable), "ckpt-doctor")
MODEL = "fixtures.models:SmallCNN"


def run(*args, timeout=60):
    from tests.conftest import ROOT

    return subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def commands(path, out):
    return {"scan": ("scan", path), "inspect": ("inspect", path),
            "fix": ("fix", path, "-o", out, "--strip-module"),
            "verify": ("verify", path, "--model", MODEL, "--input-shape", "2,3,8,8", "--mode", "single")}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, fixtures):
    tmp = tmp_path_factory.mktemp("corpora")
    canary = tmp / "CANARY"
    evil = malicious(canary, fixtures["legacy"]["path"].read_bytes())
    bad = broken(tmp, fixtures["plain"]["path"].read_bytes(), fixtures["legacy"]["path"].read_bytes(),
                 fixtures["safetensors"]["path"].read_bytes())
    (tmp / "evil").mkdir()
    (tmp / "bad").mkdir()
    for name, data in evil.items():
        (tmp / "evil" / name).write_bytes(data)
    bad_paths = {}
    for name, data in bad.items():
        if data is None:
            bad_paths[name] = make_special(tmp / "bad", name)
        else:
            (tmp / "bad" / name).write_bytes(data)
            bad_paths[name] = tmp / "bad" / name
    (tmp / "resource").mkdir()
    for name, data in resource_attacks().items():
        (tmp / "resource" / name).write_bytes(data)
    sparse_attacks(tmp / "resource")
    (tmp / "slow").mkdir()
    for name, data in slow_inputs().items():
        (tmp / "slow" / name).write_bytes(data)
    return {"canary": canary, "evil": sorted((tmp / "evil").iterdir()), "bad": bad_paths, "tmp": tmp,
            "resource": sorted((tmp / "resource").iterdir()), "slow": sorted((tmp / "slow").iterdir())}


def run_measured(*args):
    """(exit code, CPU seconds, peak RSS in MB, stderr) of one run of the installed command, measured from a launcher
    small enough that the child's peak is its own. CPU time (user + system), not wall time: the work an input can
    make the tool do, whatever else the machine runs meanwhile; a hang still ends the run at the 90 s timeout."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE_WAIT, EXE, *map(str, args)], capture_output=True, text=True,
                          timeout=90)
    code, seconds, rss_kb = proc.stdout.split()
    return int(code), float(seconds), int(rss_kb) / 1024, proc.stderr


_MEASURE_WAIT = """\
import os, sys, time
pid = os.fork()
if pid == 0:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime, usage.ru_maxrss)
"""


def test_resource_attacks_end_fast_in_bounded_memory_with_a_named_error(corpora):
    """Each file costs a naive reader minutes or gigabytes (issue 11): here ≤ 30 s of CPU, ≤ 1 GB, exit 1 or 2, one
    line; scan and inspect give the same verdict."""
    failures = []
    for path in corpora["resource"]:
        codes = {}
        for args in (("scan", path), ("inspect", path), ("fix", path, "-o", corpora["tmp"] / "r_out.pt")):
            code, seconds, rss, stderr = run_measured(*args)
            codes[args[0]] = code
            lines = stderr.strip().splitlines()
            named = lines and lines[-1].startswith("Error: ") and "internal error" not in stderr
            if code not in (1, 2) or not named or seconds > 30 or rss > 1024 or "Traceback" in stderr:
                failures.append(f"{path.name} {args[0]}: exit {code}, {seconds:.1f} s, {rss:.0f} MB: {stderr[-200:]}")
        if codes["scan"] != codes["inspect"]:
            failures.append(f"{path.name}: scan {codes['scan']}, inspect {codes['inspect']}")
        assert not (corpora["tmp"] / "r_out.pt").exists()
    assert failures == []


def test_inputs_that_were_quadratic_list_fast(corpora):
    for path in corpora["slow"]:
        for args in (("scan", path), ("inspect", path), ("inspect", path, "--json")):
            code, seconds, rss, stderr = run_measured(*args)
            assert code == 0 and seconds < 30 and rss < 1024, (path.name, args[0], code, seconds, rss, stderr[-300:])


def test_scan_and_inspect_agree_on_every_file_of_every_corpus(corpora):
    """One survey serves both commands: in a folder of each corpus they give every file the same verdict (one file
    at a time, the payload, broken-file and resource tests compare their exit codes)."""
    import json

    for corpus in ("evil", "bad", "resource"):
        folder = corpora["tmp"] / corpus
        scan, inspect = run("scan", folder, "--json", timeout=300), run("inspect", folder, "--json", timeout=300)
        assert scan.returncode == inspect.returncode != 0, (corpus, scan.stderr[-300:], inspect.stderr[-300:])
        verdicts = [{f["path"]: (f["verdict"], bool(f.get("error"))) for f in json.loads(r.stdout)["files"]}
                    for r in (scan, inspect)]
        assert verdicts[0] == verdicts[1], corpus
        assert len(verdicts[0]) >= 10


def test_the_payload_corpus_covers_every_route_to_a_call(corpora):
    """The corpus the other tests run over reaches code by each opcode that imports a global (GLOBAL, STACK_GLOBAL,
    INST) and each that calls one (REDUCE, INST, OBJ), in raw pickles and in torch zip files: a corpus that lost a
    route would let the walker lose it too, unseen."""
    import io
    import pickletools

    from ckpt_doctor.readers.table import sniff_head

    containers, opcodes = set(), set()
    for path in corpora["evil"]:
        data = path.read_bytes()
        containers.add(sniff_head(data[:512], len(data)).name)
        try:
            opcodes.update(op.name for op, _, _ in pickletools.genops(io.BytesIO(data)))
        except ValueError:  # not a pickle from its first byte (a zip), or one that breaks after its call
            pass
    assert {"PICKLE", "ZIP"} <= containers, containers
    assert {"GLOBAL", "STACK_GLOBAL", "INST", "REDUCE", "OBJ"} <= opcodes, opcodes


def test_every_payload_is_flagged_and_none_runs(corpora):
    missed, ran, tracebacks = [], [], []
    for path in corpora["evil"]:
        for command, args in commands(path, corpora["tmp"] / "out.pt").items():
            result = run(*args)
            if result.returncode != 1:
                missed.append(f"{path.name} {command} → {result.returncode}: {result.stderr.strip()[-200:]}")
            if "Traceback" in result.stderr:
                tracebacks.append(f"{path.name} {command}")
            if corpora["canary"].exists():
                ran.append(f"{path.name} {command}")
                corpora["canary"].unlink()
        assert not (corpora["tmp"] / "out.pt").exists(), f"fix wrote an output for {path.name}"
    assert ran == []
    assert tracebacks == []
    assert missed == []


def test_scan_names_the_payload(corpora):
    result = run("scan", corpora["tmp"] / "evil", "--json")
    assert result.returncode == 1
    import json

    files = {os.path.basename(f["path"]): f for f in json.loads(result.stdout)["files"]}
    assert len(files) == len(corpora["evil"])
    assert all(f["dangerous"] for f in files.values()), [n for n, f in files.items() if not f["dangerous"]]
    assert "os.system" in files["state_dict_payload.pt"]["dangerous"]
    assert "os.system" in files["pickle_then_zip.pt"]["dangerous"]
    assert "posix.system" in files["stack_global_memo.pkl"]["dangerous"] or \
        "os.system" in files["stack_global_memo.pkl"]["dangerous"]
    assert "os.system" in files["concatenated.pkl"]["dangerous"]
    assert any("nested pickle" in g["source"] for g in files["nested_pickle_loads.pkl"]["globals"])


def test_every_broken_file_is_one_line_and_exit_2(corpora):
    failures = []
    for name, path in corpora["bad"].items():
        for command, args in commands(path, corpora["tmp"] / "out.pt").items():
            start = time.monotonic()
            result = run(*args)
            lines = result.stderr.strip().splitlines()
            ok = (result.returncode == 2 and len(lines) == 1 and lines[0].startswith("Error: ")
                  and "Traceback" not in result.stderr and "internal error" not in result.stderr)
            if not ok:
                failures.append(f"{name} {command} → {result.returncode}: {result.stderr.strip()[-300:]}")
            assert time.monotonic() - start < 30, f"{name} {command} took too long"
        assert not (corpora["tmp"] / "out.pt").exists()
    assert failures == []


def test_mutated_files_never_crash(fixtures, tmp_path, cli):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    sources = {name: fixtures[name]["path"].read_bytes() for name in ("plain", "legacy", "safetensors", "tied")}

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(name=st.sampled_from(sorted(sources)), cuts=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)),
                                                               min_size=1, max_size=6),
           truncate=st.one_of(st.none(), st.floats(0, 1)))
    def check(name, cuts, truncate):
        data = bytearray(sources[name])
        for where, value in cuts:
            data[int(where * (len(data) - 1))] = value
        if truncate is not None:
            data = data[: int(truncate * len(data))]
        path = tmp_path / f"m_{name}"
        path.write_bytes(bytes(data))
        result = cli("inspect", path, "--json")
        assert result.exit_code in (0, 1, 2)
        assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
        if result.exit_code == 2:
            assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1

    check()


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_killing_fix_never_tears_the_output(tmp_path):
    src = tmp_path / "big.pt"
    torch.manual_seed(0)
    sd = {f"module.layer{i}.weight": torch.randn(256, 1024) for i in range(48)}  # 48 MB
    torch.save(sd, src)
    before = sha(src)
    rng = random.Random(0)
    outcomes = {"absent": 0, "complete": 0}
    for i in range(12):
        out = tmp_path / f"out{i}.pt"
        proc = subprocess.Popen([EXE, "fix", str(src), "-o", str(out), "--strip-module"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out.exists():
            loaded = torch.load(out, weights_only=True)
            assert list(loaded) == [k[len("module."):] for k in sd]
            assert all(torch.equal(loaded[k[7:]], v) for k, v in sd.items())
            outcomes["complete"] += 1
        else:
            outcomes["absent"] += 1
    assert sha(src) == before
    assert sum(outcomes.values()) == 12
    # The next run clears temporary files that killed runs left behind.
    result = run("fix", src, "-o", tmp_path / "out0.pt", "--strip-module", "--force")
    assert result.returncode == 0
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out0.pt.")]
    assert leftovers == []


def test_file_size_limit_leaves_nothing(tmp_path, fixtures):
    import resource

    src = tmp_path / "m.pt"
    torch.save({f"w{i}": torch.randn(64, 64) for i in range(16)}, src)  # ~260 KB
    out = tmp_path / "out.pt"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    result = subprocess.run([EXE, "fix", str(src), "-o", str(out)], capture_output=True, text=True, timeout=60,
                            preexec_fn=limit)
    assert result.returncode == 2
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1
    assert "space" in result.stderr or "limit" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
