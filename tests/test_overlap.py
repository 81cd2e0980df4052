"""A big data.pkl is walked in a forked child while the reader unpickles it (readers/survey.py, `overlap`). Whatever
the file holds, the outcome must be the one walking first gives: the same output, findings, refusals and errors,
and nothing read is reported unless the walk allows it. Each case runs both ways and compares."""

from __future__ import annotations

import struct

import pytest
import torch

from ckpt_doctor import pool
from ckpt_doctor.readers import survey as survey_module
from ckpt_doctor.readers.survey import survey_file
from ckpt_doctor.safepickle.walker import from_wire, to_wire, walk
from tests.payloads import _str, call, global_op, state_dict_with_payload, stored_zip, torch_zip

pytestmark = pytest.mark.skipif(not pool.can_fork() or pool.workers() < 2,
                                reason="the overlap needs fork and two cores (it is off otherwise)")


@pytest.fixture
def forks(monkeypatch) -> list:
    """Every data.pkl is walked in a child, however small; the children started are listed."""
    started: list = []
    real = pool.Forked.__init__

    def spy(self, *args):
        real(self, *args)
        started.append(self)

    monkeypatch.setattr(survey_module, "OVERLAP_BYTES", (1, 32 << 20))
    monkeypatch.setattr(pool.Forked, "__init__", spy)
    return started


def both_ways(cli, monkeypatch, *args):
    """The command with the overlap, then without it (CKPT_DOCTOR_NO_FORK): (exit code, stdout, stderr) each."""
    forked = cli(*args)
    monkeypatch.setenv("CKPT_DOCTOR_NO_FORK", "1")
    alone = cli(*args)
    monkeypatch.delenv("CKPT_DOCTOR_NO_FORK")
    return (forked.exit_code, forked.stdout, forked.stderr), (alone.exit_code, alone.stdout, alone.stderr)


def _state_dict(n: int = 300) -> dict:
    torch.manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(3, 2) for i in range(n)}
    sd["tied"] = sd["layers.0.weight"]
    sd["view"] = sd["layers.1.weight"][1:]
    return sd


def test_a_checkpoint_reads_the_same_with_the_walk_forked(tmp_path, cli, monkeypatch, forks):
    path = tmp_path / "model.pt"
    torch.save(_state_dict(), path)
    for command in (("inspect", path, "--json"), ("inspect", path), ("scan", path, "--json")):
        forked, alone = both_ways(cli, monkeypatch, *command)
        assert forked == alone, command
        assert forked[0] == 0
    assert len(forks) == 3  # one child per command run with the overlap, none without
    assert all(f.status == 0 for f in forks)


def test_the_walks_findings_win_over_what_was_unpickled(tmp_path, cli, monkeypatch, forks):
    canary = tmp_path / "CANARY"
    path = tmp_path / "payload.pt"
    path.write_bytes(torch_zip(state_dict_with_payload(canary), {"0": struct.pack("<4f", 1, 2, 3, 4)}))
    forked, alone = both_ways(cli, monkeypatch, "inspect", path, "--json")
    assert forked == alone
    assert forked[0] == 1 and "os.system" in forked[1]
    assert forks and not canary.exists()


@pytest.mark.parametrize("trap", [b"Nr\x40\x42\x0f\x000",  # a memo index no honest pickle of its size uses
                                  b"\x8b" + struct.pack("<i", 1025) + b"\x01" * 1025 + b"0"])  # a 8,200-bit int
def test_a_refusal_is_the_same_although_the_reader_went_ahead(tmp_path, cli, monkeypatch, forks, trap):
    """The walk refuses these, so sequentially they are never unpickled; forked, the reader has already tried (under
    its memory cap). What it got must not show: the refusal, and the payload after it, are reported alone."""
    canary = tmp_path / "CANARY"
    path = tmp_path / "refused.pt"
    path.write_bytes(torch_zip(b"\x80\x02" + trap + b"}(" + _str("x") + call("os", "system", f"touch {canary}")
                               + b"u.", {}))
    forked, alone = both_ways(cli, monkeypatch, "inspect", path)
    assert forked == alone
    assert forked[0] == 1 and "refused" in forked[2] and "os.system" in forked[2]
    assert forks and not canary.exists()


def test_a_broken_pickle_fails_with_the_same_message(tmp_path, cli, monkeypatch, forks):
    path = tmp_path / "broken.pt"
    path.write_bytes(torch_zip(b"\x80\x02}(" + _str("a") + global_op("torch", "FloatStorage") + b"t", {}))
    forked, alone = both_ways(cli, monkeypatch, "inspect", path)
    assert forked == alone
    assert forked[0] == 2 and forked[2].count("\n") == 1


def test_every_member_is_walked_in_its_order(tmp_path, cli, monkeypatch, forks):
    """A pickle member after data.pkl, walked in the child after data.pkl as here: findings in the same order."""
    canary = tmp_path / "CANARY"
    path = tmp_path / "two_pickles.pt"
    path.write_bytes(stored_zip({"archive/data.pkl": state_dict_with_payload(canary),
                           "archive/data/0": struct.pack("<4f", 1, 2, 3, 4), "archive/version": b"3\n",
                           "archive/extra.pkl": b"\x80\x02" + call("builtins", "eval", "1") + b"."}))
    forked, alone = both_ways(cli, monkeypatch, "inspect", path, "--json")
    assert forked == alone
    assert forked[0] == 1 and "builtins.eval" in forked[1] and "os.system" in forked[1]
    assert forked[1].index("os.system") < forked[1].index("builtins.eval")
    assert forks


def test_a_data_pkl_the_survey_does_not_take_is_read_again(tmp_path, cli, monkeypatch, forks):
    """A data.pkl that starts as a NumPy array is checked as one (np.load reads any member by its magic), so the
    survey keeps no main pickle: the reader, which was handed data.pkl's bytes early, must read as it would after."""
    import numpy as np
    import io

    npy = io.BytesIO()
    np.save(npy, np.arange(4, dtype=np.float32))
    path = tmp_path / "npy_data.pt"
    path.write_bytes(stored_zip({"archive/data.pkl": npy.getvalue(), "archive/version": b"3\n"}))
    kept = []
    real = survey_module._PendingSurvey.take

    def take(self) -> bool:
        kept.append(real(self))
        return kept[-1]

    monkeypatch.setattr(survey_module._PendingSurvey, "take", take)
    forked, alone = both_ways(cli, monkeypatch, "inspect", path)
    assert forked == alone
    assert kept == [False] and forked[0] == 2


def test_a_child_that_fails_leaves_the_walk_to_this_process(tmp_path, cli, monkeypatch, forks):
    canary = tmp_path / "CANARY"
    path = tmp_path / "payload.pt"
    path.write_bytes(torch_zip(state_dict_with_payload(canary), {"0": struct.pack("<4f", 1, 2, 3, 4)}))

    def fail(self):
        self.close()
        raise pool.ForkFailed("killed")

    monkeypatch.setattr(pool.Forked, "result", fail)
    forked, alone = both_ways(cli, monkeypatch, "inspect", path, "--json")
    assert forked == alone and forked[0] == 1
    assert forks


def test_a_killed_child_is_a_failure_not_an_answer():
    import os
    import signal
    import time

    def sleep():
        time.sleep(30)
        return "late"

    child = pool.Forked(sleep)
    os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(pool.ForkFailed):
        child.result()
    assert pool.Forked(lambda: {"a": [1, (2, None)]}).result() == {"a": [1, (2, None)]}


def test_a_walk_crosses_the_pipe_whole(tmp_path):
    canary = tmp_path / "CANARY"
    data = state_dict_with_payload(canary) + b"\x80\x02" + global_op("os", "popen") + b"."
    result = walk(data, "data.pkl")
    back = from_wire(to_wire(result))
    for name in ("globals", "pickles", "end", "broken", "truncated", "refused", "notes", "anomalies"):
        assert getattr(back, name) == getattr(result, name), name
    assert [g.qualname for g in back.findings] == ["os.system", "os.popen"]


def test_a_survey_left_pending_settles_before_use(tmp_path, monkeypatch, forks):
    path = tmp_path / "model.pt"
    torch.save(_state_dict(50), path)
    pending = survey_file(path, overlap=True)
    assert pending.pending is not None and pending.main_walk is None
    assert pending.settle() is True
    alone = survey_file(path)
    for name in ("globals", "hazards", "notes", "refused", "broken", "budget", "main_pickle"):
        assert getattr(pending, name) == getattr(alone, name), name
    assert pending.main_walk.pickles == alone.main_walk.pickles
