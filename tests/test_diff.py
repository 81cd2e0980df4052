"""`ckpt-doctor diff A B`: pairs built at run time; every figure checked against torch computing it directly."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cli


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1),
                                                                  torch.nn.BatchNorm2d(3)) for _ in range(3)])
        self.head = torch.nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x).mean((2, 3)))


@pytest.fixture
def base(tmp_path):
    torch.manual_seed(0)
    model = Net()
    path = tmp_path / "a.pt"
    torch.save(model.state_dict(), path)
    return model, path


def test_the_same_weights_in_two_formats_are_identical(base, tmp_path):
    from safetensors.torch import save_file

    model, path = base
    other = tmp_path / "a.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, other)
    result = run_cli("diff", path, other, "--json")
    assert result.exit_code == 0, result.stderr
    data = result.json()
    assert data["identical"] and data["counts"]["identical"] == len(model.state_dict())


def test_a_frozen_backbone_whose_batchnorm_drifted_is_named(base, tmp_path):
    """requires_grad off does not stop BatchNorm's running averages in train mode: the classic fine-tuning slip."""
    model, path = base
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    model.train()
    for _ in range(3):
        opt.zero_grad()
        (model(torch.randn(4, 3, 8, 8)) - 1).pow(2).mean().backward()
        opt.step()
    tuned = tmp_path / "b.pt"
    torch.save(model.state_dict(), tuned)
    result = run_cli("diff", path, tuned, "--json")
    assert result.exit_code == 1
    data = result.json()
    assert data["bn_drift"] == ["backbone.0.1", "backbone.1.1", "backbone.2.1"]
    status = {t["key"]: t["status"] for t in data["tensors"]}
    assert status["backbone.0.0.weight"] == "identical" and status["head.weight"] == "changed"
    assert "3 layers whose running stats changed while their weights stayed bit-identical (a frozen BatchNorm left " \
           "in train mode?): backbone.0.1, backbone.1.1, backbone.2.1" in run_cli("diff", path, tuned).stderr


def test_one_perturbed_tensor_tops_the_list_with_torchs_figures(base, tmp_path):
    model, path = base
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["backbone.1.0.weight"] += 1e-3 * torch.randn_like(state["backbone.1.0.weight"])
    state["head.bias"] += 1e-7
    other = tmp_path / "b.pt"
    torch.save(state, other)
    result = run_cli("diff", path, other, "--json")
    assert result.exit_code == 1
    rows = {t["key"]: t for t in result.json()["tensors"]}
    a, b = model.state_dict()["backbone.1.0.weight"].double(), state["backbone.1.0.weight"].double()
    row = rows["backbone.1.0.weight"]
    assert row["max_abs"] == pytest.approx(float((b - a).abs().max()), rel=1e-12)
    assert row["rel"] == pytest.approx(float((b - a).norm() / a.norm()), rel=1e-9)
    assert row["cosine"] == pytest.approx(float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0)),
                                          rel=1e-9)
    summary = run_cli("diff", path, other).stderr
    assert summary.index("top change  backbone.1.0.weight") < summary.index("top change  head.bias")
    close = run_cli("diff", path, other, "--atol", "1e-6", "--json")  # head.bias within atol, the conv not
    assert {t["key"]: t["status"] for t in close.json()["tensors"]}["head.bias"] == "close"


def test_names_are_matched_as_inspect_matches_them(base, tmp_path):
    model, path = base
    wrapped = tmp_path / "dp.pt"
    torch.save({"module." + k: v for k, v in model.state_dict().items()}, wrapped)
    result = run_cli("diff", wrapped, path, "--json")
    assert result.exit_code == 0, result.stderr
    assert "--strip-module" in result.json()["renamed_by"]


def test_the_names_line_holds_only_the_renames_quoted_and_says_who_chose_them(base, tmp_path):
    """The inferred fix also drops A's extra keys and names the model with --allow-missing for B's: neither maps a
    name (those keys are the table's one-sided rows), and --drop's regex pasted unquoted is a shell syntax error."""
    model, path = base
    state = {"module." + k: v for k, v in model.state_dict().items() if k != "head.bias"}
    state["module.aux.weight"] = torch.ones(2)
    wrapped = tmp_path / "dp.pt"
    torch.save(state, wrapped)
    result = run_cli("diff", wrapped, path, "--json")
    assert result.json()["renamed_by"] == ["--strip-module"], result.stderr
    names = [line.split(None, 1)[1] for line in run_cli("diff", wrapped, path).stderr.splitlines()
             if line.startswith("names")]
    assert names == ["A's names mapped onto B's as `inspect A --model B` infers: --strip-module"]
    other = tmp_path / "renamed.pt"
    torch.save({k.replace("backbone.", "encoder."): v for k, v in model.state_dict().items()}, other)
    given = run_cli("diff", path, other, "--rename", "^backbone\\.=encoder.")
    assert given.exit_code == 0, given.stderr
    assert "A's names mapped onto B's by the flags given: --rename '^backbone\\.=encoder.'" in given.stderr


def test_a_missing_tensor_is_named(base, tmp_path):
    model, path = base
    state = dict(model.state_dict())
    del state["head.bias"]
    other = tmp_path / "b.pt"
    torch.save(state, other)
    result = run_cli("diff", path, other, "--json")
    assert result.exit_code == 1
    assert [t["key"] for t in result.json()["tensors"] if t["status"] == "only-a"] == ["head.bias"]
    assert "only in A  1: head.bias" in run_cli("diff", path, other).stderr


def test_an_unreadable_side_is_one_line_and_exit_2(base, tmp_path):
    _, path = base
    result = run_cli("diff", path, tmp_path / "nope.pt")
    assert result.exit_code == 2 and "no such file" in result.stderr and "Traceback" not in result.stderr


def test_names_can_be_mapped_by_hand(base, tmp_path):
    model, path = base
    other = tmp_path / "renamed.pt"
    torch.save({k.replace("backbone.", "encoder."): v for k, v in model.state_dict().items()}, other)
    result = run_cli("diff", path, other, "--rename", "^backbone\\.=encoder.", "--json")
    assert result.exit_code == 0, result.stderr
    data = result.json()
    assert data["identical"] and data["renamed_by"] == ["--rename", "^backbone\\.=encoder."]
    assert run_cli("diff", path, other, "--strip-prefix", "nothing.").exit_code == 1  # unmapped: one-sided


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_read_in_windows_the_figures_and_tolerance_agree_with_torch(tmp_path, monkeypatch, dtype):
    """Large tensors are read a window at a time and summed in cache-sized blocks: shrink both so one tensor spans
    many, and hold every figure and the --atol/--rtol verdict to torch (isclose, with NaN equal to NaN)."""
    import ckpt_doctor.diff as D

    monkeypatch.setattr(D, "WINDOW", 4096)
    monkeypatch.setattr(D, "BLOCK", 100)
    torch.manual_seed(1)
    a = (torch.randn(3000, dtype=torch.float64) * 50).to(dtype)
    changes = {"far": a + 7 if dtype == torch.int32 else a * 1.5, "near": a + 1 if dtype == torch.int32 else a * 1.01}
    specials = dtype.is_floating_point
    if specials:  # NaN and inf where both sides have them count as equal; an inf against a number does not
        for t in (a, *changes.values()):
            t[10], t[2500] = float("nan"), float("inf")
        changes["inf"] = changes["near"].clone()
        changes["inf"][1234] = float("-inf")
    pa, pb = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"same": a, **{k: a for k in changes}}, pa)
    torch.save({"same": a.clone(), **changes}, pb)
    atol, rtol = (1, 0.002) if dtype == torch.int32 else (1e-3, 0.02)
    rows = {r.key: r for r in D.diff_checkpoints(pa, pb, atol=atol, rtol=rtol).rows}
    assert rows["same"].status == "identical"
    for key, b in changes.items():
        expected_close = bool(torch.isclose(b.double(), a.double(), rtol=rtol, atol=atol, equal_nan=True).all())
        assert rows[key].status == ("close" if expected_close else "changed"), key
        x, y = a.double(), b.double()
        keep = torch.isfinite(x) & torch.isfinite(y)
        stats = rows[key].stats
        if key == "inf":
            assert stats.max_abs == float("inf")
            continue
        d = (y - x)[keep]
        assert stats.max_abs == pytest.approx(float(d.abs().max()), rel=1e-12)
        assert stats.rel == pytest.approx(float(d.norm() / x[keep].norm()), rel=1e-9)
        cos = torch.nn.functional.cosine_similarity(x[keep], y[keep], 0)
        assert stats.cosine == pytest.approx(float(cos), rel=1e-9)
    assert (rows["near"].status, rows["far"].status) == ("close", "changed")


def _many_changed_pairs(tmp_path):
    """Two checkpoints where every pair changed, in several dtypes, with NaN and inf in some, and one the same."""
    torch.manual_seed(2)
    a = {f"t{i}": torch.randn(2500 + 300 * i, dtype=torch.float64) for i in range(8)}
    a["t1"][7], a["t2"][9] = float("nan"), float("inf")
    b = {k: v * 1.01 for k, v in a.items()}
    b["t2"][100] = float("-inf")
    a.update(half=a["t3"].half(), bf16=a["t4"].bfloat16(), f32=a["t5"].float(), ints=(a["t6"] * 99).int(),
             same=a["t0"].float())
    b.update(half=b["t3"].half(), bf16=b["t4"].bfloat16(), f32=a["t5"].float() + 1e-4, ints=(b["t6"] * 99).int(),
             same=a["t0"].float().clone())
    pa, pb = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(a, pa)
    torch.save(b, pb)
    return pa, pb


@pytest.fixture
def small_worker_batches(monkeypatch):
    """Shrink the thresholds so a few KB of changed pairs go through the forked worker, many pieces and batches (on
    one CPU too, where diff itself would not fork)."""
    import os

    import ckpt_doctor.diff as D

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform: diff stays in one process")
    monkeypatch.setattr(D, "_can_fork", lambda: True)
    monkeypatch.setattr(D, "WINDOW", 4096)
    monkeypatch.setattr(D, "BLOCK", 100)
    monkeypatch.setattr(D, "BATCH", 6000)
    monkeypatch.setattr(D, "WORKER_AFTER", 10_000)
    calls = {"sent": 0, "failed": 0, "pids": []}
    send, fail, start = D._Worker.send, D._Figures._fail, D._Worker.__init__

    def count_send(self, batch):
        calls["sent"] += 1
        return send(self, batch)

    def count_fail(self):
        calls["failed"] += 1
        return fail(self)

    def note_pid(self, *args):
        start(self, *args)
        calls["pids"].append(self.pid)

    monkeypatch.setattr(D._Worker, "send", count_send)
    monkeypatch.setattr(D._Figures, "_fail", count_fail)
    monkeypatch.setattr(D._Worker, "__init__", note_pid)
    return calls


def _figures(report):
    return [(r.key, r.status, r.stats) for r in report.rows]


def test_the_worker_process_gives_exactly_the_figures_computed_here(tmp_path, monkeypatch, small_worker_batches):
    """Past WORKER_AFTER changed bytes a forked worker computes batches of pieces while this process computes others;
    every piece's sums are added exactly, so the figures are bit-for-bit those of one process."""
    import os

    import ckpt_doctor.diff as D

    pa, pb = _many_changed_pairs(tmp_path)
    atol, rtol = 1e-3, 0.02
    shared = D.diff_checkpoints(pa, pb, atol=atol, rtol=rtol)
    # the worker gets IN_FLIGHT batches before its first answer is awaited, more only as fast as it answers (a
    # loaded machine may give it no more): those prove the figures travel between the processes
    assert small_worker_batches["sent"] >= D.IN_FLIGHT and small_worker_batches["failed"] == 0
    monkeypatch.setattr(D, "WORKER_AFTER", 1 << 62)
    alone = D.diff_checkpoints(pa, pb, atol=atol, rtol=rtol)
    assert _figures(shared) == _figures(alone)
    assert {r.key: r.status for r in shared.rows}["same"] == "identical"
    assert sum(r.status in ("changed", "close") for r in shared.rows) == 12
    with pytest.raises(ChildProcessError):  # the worker was reaped, not left behind
        os.waitpid(small_worker_batches["pids"][0], os.WNOHANG)
    # Files that cannot be held still (another process has them open for writing, say) are read by pread, in
    # this process and in the worker alike: the same figures, bit for bit.
    monkeypatch.setattr(D, "WORKER_AFTER", 0)
    monkeypatch.setattr(D.Holder, "hold", lambda self, path: False)
    unheld = D.diff_checkpoints(pa, pb, atol=atol, rtol=rtol)
    assert _figures(unheld) == _figures(alone)


def test_a_pair_read_a_few_blocks_at_a_time_gives_the_figures_of_one_read(tmp_path, monkeypatch):
    """The arithmetic reads a pair STAGE bytes a side at a time, a whole number of float64 blocks each, so the
    blocks summed are those of the pair read whole and the figures the same bit for bit, whatever STAGE is: sides
    of one width and of two (float32 against float64, float16 against float32), NaN and inf among them."""
    import ckpt_doctor.diff as D

    torch.manual_seed(3)
    x = torch.randn(5000) * 10
    x[17], x[4000] = float("nan"), float("inf")
    a = {"f32": x, "f16": x[:3001].half(), "widened": x[:4321].clone(), "narrowed": x[:2345].double()}
    b = {"f32": x * 1.01, "f16": (x[:3001] * 1.01).half(), "widened": (x[:4321] * 1.01).double(),
         "narrowed": (x[:2345] * 1.01).float()}
    pa, pb = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(a, pa)
    torch.save(b, pb)
    monkeypatch.setattr(D, "BLOCK", 100)
    monkeypatch.setattr(D, "WORKER_AFTER", 1 << 62)
    monkeypatch.setattr(D, "STAGE", 1 << 30)  # every piece in one read
    whole = _figures(D.diff_checkpoints(pa, pb, atol=1e-3, rtol=0.02))
    assert sum(r[1] in ("changed", "close") for r in whole) == 4
    for stage in (1, 700, 4096):  # under one block a read, a block and a part, a few blocks
        monkeypatch.setattr(D, "STAGE", stage)
        assert _figures(D.diff_checkpoints(pa, pb, atol=1e-3, rtol=0.02)) == whole, stage


def _dies(task_r, answer_w, atol, rtol):
    import os

    os._exit(3)


def _raises(task_r, answer_w, atol, rtol):
    import ckpt_doctor.diff as D

    D._read_message(task_r)
    D._write_message(answer_w, None)  # what the worker answers when computing a batch raised


def _garbles(task_r, answer_w, atol, rtol):
    import os

    os.write(answer_w, (5).to_bytes(8, "little") + b"\x80junk")


def _hangs(task_r, answer_w, atol, rtol):
    import time

    time.sleep(600)


@pytest.mark.parametrize("worker", [_dies, _raises, _garbles, _hangs])
def test_a_worker_that_fails_costs_time_never_the_figures(tmp_path, monkeypatch, small_worker_batches, worker):
    """A worker that dies, raises, answers garbage or goes silent is given up on (killed and reaped) and its
    batches computed in this process: the same figures, no hang, no traceback."""
    import os

    import ckpt_doctor.diff as D

    pa, pb = _many_changed_pairs(tmp_path)
    monkeypatch.setattr(D, "WORKER_AFTER", 1 << 62)
    expected = _figures(D.diff_checkpoints(pa, pb))
    monkeypatch.setattr(D, "WORKER_AFTER", 10_000)
    monkeypatch.setattr(D, "_serve", worker)
    monkeypatch.setattr(D, "WORKER_TIMEOUT", 0.5)
    assert _figures(D.diff_checkpoints(pa, pb)) == expected
    assert small_worker_batches["failed"] == 1 and len(small_worker_batches["pids"]) == 1
    with pytest.raises(ChildProcessError):
        os.waitpid(small_worker_batches["pids"][0], os.WNOHANG)


def test_blas_runs_one_thread_a_process_during_a_diff_then_gets_its_threads_back():
    """diff and its forked worker each keep OpenBLAS to one thread (their threads spun against each other: a 1 GB
    pair took 9-14 s instead of 0.5-0.7 s); a library caller's setting comes back afterwards."""
    import ctypes

    import numpy  # noqa: F401  (its OpenBLAS loaded)

    from ckpt_doctor.pool import one_blas_thread

    paths = {line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower()}
    getters = [getattr(ctypes.CDLL(p), name) for p in paths if p.startswith("/")
               for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads") if
               hasattr(ctypes.CDLL(p), name)]
    if not getters:
        pytest.skip("NumPy here uses no OpenBLAS")
    before = getters[0]()
    with one_blas_thread() as held:
        assert getters[0]() == 1 and held.restore
    assert getters[0]() == before


def _one_size_pair(tmp_path):
    """Two files of one size, every tensor at the same offset in both: one changed in its first element, one in its
    last, one in its middle, one in bfloat16, the rest the same bytes."""
    torch.manual_seed(3)
    a = {f"w{i}": torch.randn(700 + 130 * i) for i in range(6)}
    a["bf16"] = torch.randn(900).bfloat16()
    b = {k: v.clone() for k, v in a.items()}
    b["w1"][0] += 1
    b["w2"][-1] *= 2
    b["w3"][400] = float("nan")
    b["bf16"][450] += 1
    pa, pb = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(a, pa)
    torch.save(b, pb)
    assert pa.stat().st_size == pb.stat().st_size
    return pa, pb


@pytest.fixture
def small_chunks(monkeypatch):
    """Shrink the thresholds so a few KB files are compared ahead by the child, in chunks smaller than a tensor
    (on one CPU too, where diff itself would not fork); count what the child told."""
    import os

    import ckpt_doctor.diff as D

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform: diff stays in one process")
    idle_core = D._idle_core
    monkeypatch.setattr(D, "_can_fork", lambda: True)
    monkeypatch.setattr(D, "_idle_core", lambda: True)
    monkeypatch.setattr(D, "AHEAD_AFTER", 0)
    monkeypatch.setattr(D, "CHUNK", 256)
    monkeypatch.setattr(D, "WINDOW", 4096)
    told = {"differ": 0, "ends": 0, "none": 0, "pids": [], "idle_core": idle_core}
    inner, start = D._Ahead.inner, D._Ahead.__init__

    def count(self, *args):
        answer = inner(self, *args)
        told["none" if answer is None else "differ" if answer[0] is False else "ends"] += 1
        return answer

    def note_pid(self, *args):
        start(self, *args)
        told["pids"].append(self.pid)

    monkeypatch.setattr(D._Ahead, "inner", count)
    monkeypatch.setattr(D._Ahead, "__init__", note_pid)
    return told


def test_two_files_of_one_size_are_compared_ahead_by_a_child_with_the_same_results(tmp_path, monkeypatch,
                                                                                    small_chunks):
    """A child compares two files of one size chunk by chunk while diff reads their structures; a pair is then
    settled by the chunks inside it and its two ends, compared here: the same verdicts and figures as without it,
    whether the change lies in a pair's first element, its last, or inside."""
    import os

    import ckpt_doctor.diff as D

    pa, pb = _one_size_pair(tmp_path)
    ahead = D.diff_checkpoints(pa, pb)
    told = small_chunks
    assert told["ends"] >= 3 and told["differ"] >= 1 and told["ends"] + told["differ"] == 7  # every pair, by the child
    assert len(told["pids"]) == 1
    with pytest.raises(ChildProcessError):  # the child was reaped, not left behind
        os.waitpid(small_chunks["pids"][0], os.WNOHANG)
    monkeypatch.setattr(D, "AHEAD_AFTER", 1 << 62)
    alone = D.diff_checkpoints(pa, pb)
    assert len(small_chunks["pids"]) == 1  # no child for this one
    assert _figures(ahead) == _figures(alone)
    assert {r.key: r.status for r in ahead.rows} == {"w0": "identical", "w1": "changed", "w2": "changed",
                                                      "w3": "changed", "w4": "identical", "w5": "identical",
                                                      "bf16": "changed"}


def _flags_wrong_then_dies(path_a, path_b, size, out):
    import os

    os.write(out, b"\x01" * 3)
    os._exit(3)


def _stays_silent(path_a, path_b, size, out):
    import time

    time.sleep(600)


@pytest.mark.parametrize("child", [_flags_wrong_then_dies, _stays_silent])
def test_a_child_that_dies_or_goes_silent_costs_time_never_the_results(tmp_path, monkeypatch, small_chunks, child):
    import os

    import ckpt_doctor.diff as D

    pa, pb = _one_size_pair(tmp_path)
    monkeypatch.setattr(D, "AHEAD_AFTER", 1 << 62)
    expected = _figures(D.diff_checkpoints(pa, pb))
    monkeypatch.setattr(D, "AHEAD_AFTER", 0)
    monkeypatch.setattr(D, "_compare_chunks", child)
    monkeypatch.setattr(D, "WORKER_TIMEOUT", 0.5)
    assert _figures(D.diff_checkpoints(pa, pb)) == expected
    assert small_chunks["ends"] == 0 and small_chunks["none"] >= 1
    with pytest.raises(ChildProcessError):
        os.waitpid(small_chunks["pids"][0], os.WNOHANG)


def test_the_child_stops_early_where_next_to_nothing_is_equal(tmp_path, monkeypatch, small_chunks):
    """A full fine-tune (every pair changed) gains nothing from the child's flags: past AHEAD_PROBE bytes with under
    one chunk in 16 equal it stops, and the pairs are compared here (a changed pair in its first bytes)."""
    import ckpt_doctor.diff as D

    torch.manual_seed(4)
    a = {f"w{i}": torch.randn(3000) for i in range(8)}
    pa, pb = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(a, pa)
    torch.save({k: v * 1.01 for k, v in a.items()}, pb)
    monkeypatch.setattr(D, "AHEAD_PROBE", 32768)  # of files of about 100 KB
    stopped = D.diff_checkpoints(pa, pb)
    assert small_chunks["differ"] >= 1 and small_chunks["none"] >= 1 and small_chunks["ends"] == 0
    monkeypatch.setattr(D, "AHEAD_AFTER", 1 << 62)
    assert _figures(stopped) == _figures(D.diff_checkpoints(pa, pb))
    assert all(r.status == "changed" for r in stopped.rows)


def test_no_child_compares_ahead_on_a_busy_machine(tmp_path, monkeypatch, small_chunks):
    """With as many threads runnable as there are cores (diff among them), the child would only take turns with
    diff and cost more CPU than it saves: none is forked, and the pairs are compared here."""
    import ckpt_doctor.diff as D

    pa, pb = _one_size_pair(tmp_path)
    assert D._runnable() is None or D._runnable() >= 1  # this process itself is running
    monkeypatch.setattr(D, "_idle_core", small_chunks["idle_core"])
    monkeypatch.setattr(D, "workers", lambda: 2)
    monkeypatch.setattr(D, "_runnable", lambda: 2)
    busy = D.diff_checkpoints(pa, pb)
    assert small_chunks["pids"] == []
    monkeypatch.setattr(D, "_runnable", lambda: 1)
    assert _figures(D.diff_checkpoints(pa, pb)) == _figures(busy)
    assert len(small_chunks["pids"]) == 1


def test_cosine_and_change_match_float64_whatever_the_norms(tmp_path):
    """Σxy comes from Σx², Σy² and Σ(y − x)² where the two norms are near, from its own dot product where they
    are far apart: the cosine is float64's either way (a scaled copy 1, a negated one −1, an orthogonal one 0)."""
    import numpy as np

    import ckpt_doctor.diff as D

    torch.manual_seed(5)
    a = torch.randn(3 * D.BLOCK + 17)
    noise = torch.randn_like(a)
    ortho = noise - a * (noise.double() @ a.double() / (a.double() @ a.double())).float()
    cases = {"tiny_step": a + 1e-6 * noise, "scaled_down": a * 1e-3, "scaled_up": a * 1e3, "negated": -a,
             "orthogonal": ortho, "zeros": torch.zeros_like(a), "noise": noise}
    pa, pb = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({k: a for k in cases}, pa)
    torch.save(cases, pb)
    rows = {r.key: r.stats for r in D.diff_checkpoints(pa, pb).rows}
    x = a.double().numpy()
    for key, b in cases.items():
        y = b.double().numpy()
        stats = rows[key]
        assert stats.rel == pytest.approx(np.linalg.norm(y - x) / np.linalg.norm(x), rel=1e-12), key
        if key == "zeros":
            assert stats.cosine is None
            continue
        cos = float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))
        assert stats.cosine == pytest.approx(cos, rel=1e-12, abs=1e-12), key
    assert rows["scaled_down"].cosine == pytest.approx(1, abs=1e-14)
    assert rows["negated"].cosine == pytest.approx(-1, abs=1e-14)


def test_a_cosine_is_never_past_one():
    """The same values in float16 and float32 summed to a cosine of 1.0000000000000002 in a third of the seeds."""
    import ckpt_doctor.diff as D

    for seed in range(20):
        torch.manual_seed(seed)
        half = torch.randn(1000).half()
        same, negated = D.pair_stats(half, half.float()).cosine, D.pair_stats(half, -half.float()).cosine
        assert 1 - 1e-15 <= same <= 1 and -1 <= negated <= -1 + 1e-15, (seed, same, negated)


def test_cosine_of_a_nearly_orthogonal_or_huge_pair_keeps_float64s_digits(tmp_path):
    """Σxy taken as (Σx² + Σy² − Σ(y − x)²) / 2 cancels away a cosine near 0 (1e-9 came out 9.9999997e-10), and
    Σx² + Σy² past float64's range made it inf (a cosine of inf for a float64 pair of norm 1e154): such blocks
    take their own dot product."""
    import numpy as np

    import ckpt_doctor.diff as D

    big = torch.zeros(1000, dtype=torch.float64)
    big[0] = 1.2e154
    cases = {"near_orthogonal": (torch.tensor([1.0, 0.0], dtype=torch.float64),
                                 torch.tensor([1e-9, 1.0], dtype=torch.float64)),
             "near_orthogonal_f32": (torch.tensor([1.0, 0.0]), torch.tensor([1e-7, 1.0])),
             "huge": (big, big * (1 + 1e-9))}
    pa, pb = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({k: a for k, (a, _) in cases.items()}, pa)
    torch.save({k: b for k, (_, b) in cases.items()}, pb)
    rows = {r.key: r.stats for r in D.diff_checkpoints(pa, pb).rows}
    for key, (a, b) in cases.items():
        x, y = a.double().numpy(), b.double().numpy()
        cos = float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))
        assert rows[key].cosine == pytest.approx(cos, rel=1e-12, abs=0), key


def test_two_optimizer_states_that_differ_are_not_called_identical(tmp_path):
    """A file with no model state_dict (an optimizer's, accelerate's optimizer.bin) is compared whole: comparing
    its state_dict alone compared nothing and called two different files identical, exit 0."""
    paths = []
    for name, scale in (("a", 1.0), ("b", 2.0)):
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.Adam(net.parameters())
        (scale * net(torch.randn(2, 3, 8, 8))).sum().backward()
        opt.step()
        paths.append(tmp_path / f"optimizer_{name}.bin")
        torch.save(opt.state_dict(), paths[-1])
    result = run_cli("diff", *paths, "--json")
    assert result.exit_code == 1, result.stderr
    data = result.json()
    assert not data["identical"] and data["counts"]["changed"] > 0
    assert "state.0.exp_avg" in {t["key"] for t in data["tensors"]}
    same = run_cli("diff", paths[0], paths[0], "--json")
    assert same.exit_code == 0 and same.json()["counts"]["identical"] == len(data["tensors"])


def test_a_cast_that_kept_every_value_is_said_as_such(tmp_path):
    """fix --dtype float32 of a float16 file, then diff: every pair "changed" (its bytes did) with max|Δ| 0; the
    summary says the dtype changed and every value was kept, and lists none of them as a top change."""
    torch.manual_seed(0)
    half = {f"layers.{i}.weight": torch.randn(4, 4, dtype=torch.float16) for i in range(4)}
    a, b, c = tmp_path / "half.pt", tmp_path / "float.pt", tmp_path / "tuned.pt"
    torch.save(half, a)
    torch.save({k: v.float() for k, v in half.items()}, b)
    tuned = {k: v.float() for k, v in half.items()}
    tuned["layers.0.weight"] = tuned["layers.0.weight"] * 2
    torch.save(tuned, c)
    cast = run_cli("diff", a, b)
    lines = dict(line.split(None, 1) for line in cast.stderr.splitlines())
    assert cast.exit_code == 1  # the bytes differ: not the same checkpoints
    assert lines["cast"].startswith("4: dtype changed (float16 → float32), every value kept")
    assert "top change" not in lines and "depth" not in lines
    assert lines["verdict"] == "the checkpoints differ in dtype only: every value kept"
    moved = run_cli("diff", a, c).stderr.splitlines()
    assert [line.split()[2] for line in moved if line.startswith("top change")] == ["layers.0.weight:"]
    assert any(line.startswith("cast ") and line.split()[1] == "3:" for line in moved)
    assert next(line for line in moved if line.startswith("verdict")).endswith("the checkpoints differ")


def test_a_tied_model_and_its_safetensors_copy_are_the_same_weights(tmp_path):
    """safetensors stores a tied tensor once (save_pretrained, fix): the name the .pt holds as embed.weight's tensor
    is `tied`, not `only in A`, and the two files are the same weights (exit 0, as the docs say of `diff model.pt
    model.safetensors`), either way round; an untied copy against fix's export, whose header records the tie, too;
    a name the copy lacks that is no tie still makes them differ."""
    from torch import nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.norm = nn.LayerNorm(4)
            self.lm_head = nn.Linear(4, 10, bias=False)
            self.lm_head.weight = self.embed.weight

    from safetensors.torch import save_file

    torch.manual_seed(0)
    pt, st = tmp_path / "lm.pt", tmp_path / "lm.safetensors"
    torch.save(LM().state_dict(), pt)
    # as save_pretrained writes it: the tied name left out, nothing in the header says so
    save_file({k: v for k, v in torch.load(pt, weights_only=True).items() if k != "lm_head.weight"}, str(st))
    for a, b, holder in ((pt, st, "A"), (st, pt, "B")):
        result = run_cli("diff", a, b, "--json")
        assert result.exit_code == 0, result.stderr
        data = result.json()
        assert data["counts"]["tied"] == 1 and data["counts"]["only-a"] == data["counts"]["only-b"] == 0
        [tied] = [t for t in data["tensors"] if t["status"] == "tied"]
        assert (tied["key"], tied["tied_to"]) == ("lm_head.weight", "embed.weight")
        assert f"lm_head.weight (embed.weight's tensor in {holder}, stored once in" in result.stderr
    untied = tmp_path / "untied.pt"  # two storages, the same bytes; its export stores lm_head.weight once
    torch.save({k: v.clone() for k, v in torch.load(pt, weights_only=True).items()}, untied)
    assert run_cli("fix", untied, "-o", tmp_path / "export.safetensors", "--tie", "lm_head.weight=embed.weight"
                   ).exit_code == 0
    for a, b in ((untied, tmp_path / "export.safetensors"), (tmp_path / "export.safetensors", untied)):
        result = run_cli("diff", a, b, "--json")  # the header's record of the tie (ckpt_doctor.tied) is read
        assert result.exit_code == 0 and result.json()["counts"]["identical"] == 4, result.stderr
    state = LM().state_dict()
    state.pop("norm.bias")
    torch.save(state, tmp_path / "less.pt")
    lacking = run_cli("diff", pt, tmp_path / "less.pt", "--json")
    assert lacking.exit_code == 1 and lacking.json()["counts"]["only-a"] == 1


def test_a_header_alone_makes_no_tie(tmp_path):
    """A safetensors header's ckpt_doctor.tied names the alias as the key's tensor, compared where the other side has
    that name; it never makes the other side's names one tensor: {x} against {y} with the header x=y differ (they
    were called identical, `y` 'tied' to a name B only had in its header)."""
    from safetensors.torch import save_file

    torch.save({"x": torch.arange(4.0)}, tmp_path / "a.pt")
    save_file({"y": torch.arange(4.0)}, str(tmp_path / "b.safetensors"), metadata={"ckpt_doctor.tied": "x=y"})
    for a, b in (("a.pt", "b.safetensors"), ("b.safetensors", "a.pt")):
        result = run_cli("diff", tmp_path / a, tmp_path / b, "--json")
        assert result.exit_code == 1 and result.json()["counts"]["tied"] == 0, result.stderr
