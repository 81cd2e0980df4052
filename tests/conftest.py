"""Shared test set-up: fixture checkpoints are generated once per session from the models in fixtures/."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from ckpt_doctor.cli import main  # noqa: E402


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from fixtures.make_fixtures import make_all

    return make_all(tmp_path_factory.mktemp("fixtures"))


class Result:
    def __init__(self, exit_code: int, stdout: str, stderr: str) -> None:
        self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr

    def json(self) -> dict:
        return json.loads(self.stdout)


def run_cli(*args: object) -> Result:
    """The CLI's entry point in this process, with stdout and stderr captured apart."""
    out, err = io.StringIO(), io.StringIO()
    code: object = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):  # --allow-global lasts for its command
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code
    return Result(code if isinstance(code, int) else (0 if code is None else 1), out.getvalue(), err.getvalue())


@pytest.fixture
def cli():
    return run_cli
