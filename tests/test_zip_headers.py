"""A big archive's local headers are read by a forked child while its data.pkl is walked (zipindex._Headers): the
index, the survey and what the commands print are the same as when this process reads them all itself."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from ckpt_doctor.errors import ReadError
from ckpt_doctor.readers import survey as survey_mod
from ckpt_doctor.readers import zipindex
from ckpt_doctor.readers.survey import survey_file

COUNT = zipindex.FORK_AT + 8  # members enough for the child


def _big_archive(path, npy_payload: bool = False):
    """torch.save of COUNT small tensors (its storages spread over the file, past what is read whole), one of them
    a NumPy .npy of an object array when `npy_payload` (np.load would unpickle it)."""
    import numpy as np
    import torch

    pad = torch.zeros(1 << 11)  # 8 KB a tensor: the file (~35 MB) is past the size read whole (16 MB)
    state = {f"layers.{i}.weight": pad + i for i in range(COUNT)}
    if npy_payload:
        buf = io.BytesIO()
        np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
        state["blob"] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).clone()
    torch.save(state, path)
    return path


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return _big_archive(tmp_path_factory.mktemp("zip") / "big.pt", npy_payload=True)


@pytest.fixture(autouse=True)
def forks(monkeypatch):
    """The pids of the children forked here. A test before these in this process may have left a thread running
    (fsspec's, for a remote read), where ckpt-doctor forks no child (pool.can_fork): here it may, for its own."""
    pids = []
    real_fork = os.fork

    def fork():
        pid = real_fork()
        if pid:
            pids.append(pid)
        return pid

    monkeypatch.setattr(zipindex, "can_fork", lambda: True)
    monkeypatch.setattr(os, "fork", fork)
    return pids


def _gone(pid: int) -> bool:
    """Whether the child `pid` was waited for (no zombie, nothing running)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def _index(path, defer: bool):
    fd = os.open(path, os.O_RDONLY)
    try:
        index = zipindex.read_zip_index(fd, os.fstat(fd).st_size, str(path), defer=defer)
        pending = index.pending is not None
        index.settle()
        return index, pending
    finally:
        os.close(fd)


def test_the_child_reads_the_same_headers_as_this_process(big, forks):
    assert os.path.getsize(big) > 16 << 20  # (not read whole: the headers are read by pread)
    deferred, pending = _index(big, defer=True)
    here, _ = _index(big, defer=False)
    assert pending and len(forks) == 1 and _gone(forks[0])  # the child was started, and waited for
    assert deferred.members == here.members  # every offset the child found is the one found here
    assert deferred.npy_heads == here.npy_heads and len(here.npy_heads) == 1  # the .npy storage, seen by both
    assert min(m.offset for m in here.members if not m.is_dir) > 0


def test_the_survey_and_the_commands_say_the_same_with_and_without_the_child(big, forks):
    alone = dict(os.environ, CKPT_DOCTOR_NO_FORK="1")
    outputs = []
    for env in (dict(os.environ), alone):
        run = subprocess.run([sys.executable, "-m", "ckpt_doctor", "scan", str(big), "--json"], env=env,
                             capture_output=True, text=True, timeout=120)
        outputs.append((run.returncode, json.loads(run.stdout), run.stderr))
    assert outputs[0] == outputs[1]
    code, report, err = outputs[0]
    assert code == 0 and "np.load(allow_pickle=True) would unpickle" in err  # the .npy storage, found via the child
    surveyed = survey_file(big)
    assert len(forks) == 1 and surveyed.zip.pending is None
    assert any("a NumPy array whose data np.load" in note for note in surveyed.notes)


def test_a_child_that_fails_only_means_the_headers_are_read_here(big, monkeypatch, forks):
    parent = os.getpid()
    real = zipindex._local_headers

    def failing_in_the_child(*args):
        if os.getpid() != parent:
            raise RuntimeError("the child breaks")
        return real(*args)

    monkeypatch.setattr(zipindex, "_local_headers", failing_in_the_child)
    deferred, pending = _index(big, defer=True)
    monkeypatch.setattr(zipindex, "_local_headers", real)
    here, _ = _index(big, defer=False)
    assert pending and len(forks) == 1 and deferred.members == here.members and deferred.npy_heads == here.npy_heads


def test_a_file_cut_short_meanwhile_is_one_error(big, monkeypatch, forks):
    real = zipindex._Headers.result

    def cut(self):  # the child's blocks came back short
        real(self)
        return None

    monkeypatch.setattr(zipindex._Headers, "result", cut)
    with pytest.raises(ReadError, match="changed while it was read"):
        survey_file(big)
    assert len(forks) == 1 and _gone(forks[0])  # the child was waited for: none is left behind


def test_a_survey_that_fails_before_the_headers_leaves_no_child(big, monkeypatch, forks):
    def broken(*args, **kwargs):
        raise RuntimeError("the walk breaks")

    monkeypatch.setattr(survey_mod, "_survey_member", broken)
    with pytest.raises(RuntimeError):
        survey_file(big)
    assert len(forks) == 1 and _gone(forks[0])  # killed and reaped when its index went


def test_ctrl_c_ends_the_command_and_its_child_at_once(big, tmp_path):
    """Ctrl-C while the child reads the headers: the command ends (exit 130) and the child with it, rather than
    reading on as an orphan that holds the caller's pipes open."""
    import signal
    import time

    slow = tmp_path / "slow.py"
    slow.write_text(
        "import os, sys, time\n"
        "from ckpt_doctor.readers import zipindex\n"
        "real, parent = zipindex._local_headers, os.getpid()\n"
        "def slow(*args):\n"
        "    if os.getpid() != parent:\n"
        "        time.sleep(30)\n"
        "    return real(*args)\n"
        "zipindex._local_headers = slow\n"
        "from ckpt_doctor.cli import main\n"
        "sys.argv[0] = 'ckpt-doctor'\n"
        "main()\n")
    proc = subprocess.Popen([sys.executable, str(slow), "inspect", str(big), "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(3)  # past start-up, the child forked (the parent waits for it in settle)
    proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    out, err = proc.communicate(timeout=25)  # the pipes close once both processes are gone
    assert time.monotonic() - started < 10
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "Error: interrupted" and out == ""
