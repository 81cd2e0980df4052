"""Summary lines carry their severity: the terminal colours a line by it (render/lines.py), never by its words."""

from __future__ import annotations

import collections

import torch

from ckpt_doctor.render.lines import Severity, color_of


def test_inspect_marks_the_lines_that_make_the_exit_code(tmp_path):
    from ckpt_doctor.render.table import inspect_summary
    from ckpt_doctor.report import inspect_checkpoint

    clean = tmp_path / "clean.pt"
    torch.save({"w": torch.ones(2)}, clean)
    report = inspect_checkpoint(clean)
    assert report.exit_code == 0
    assert {line.severity for line in inspect_summary(report)} == {Severity.INFO}

    unsafe = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2), unsafe)  # a whole pickled model: its class is code
    report = inspect_checkpoint(unsafe)
    assert report.exit_code == 1
    problems = [line for line in inspect_summary(report) if line.severity is Severity.PROBLEM]
    assert problems and all(color_of(line) == "red" for line in problems)
    assert any("torch.nn.modules.linear.Linear" in line for line in problems)


def test_diff_marks_its_verdict_only_when_the_files_differ(tmp_path):
    from ckpt_doctor.diff import diff_checkpoints
    from ckpt_doctor.render.diff_out import diff_summary

    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(collections.OrderedDict(w=torch.ones(3)), a)
    torch.save(collections.OrderedDict(w=torch.ones(3)), b)
    assert all(line.severity is Severity.INFO for line in diff_summary(diff_checkpoints(a, b)))
    torch.save(collections.OrderedDict(w=torch.zeros(3)), b)
    problems = [line for line in diff_summary(diff_checkpoints(a, b)) if line.severity is Severity.PROBLEM]
    assert [line.split()[0] for line in problems] == ["verdict"]


def test_a_plain_string_is_information():
    assert color_of("DANGEROUS  but only a word") is None
