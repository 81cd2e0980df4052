"""Every bad input ends with exit 2 and one `Error:` line naming the file — never a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def assert_one_error_line(result, name: str) -> None:
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ") and name in lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def make_bad(tmp_path, fixtures) -> dict:
    good = fixtures["plain"]["path"].read_bytes()
    legacy = fixtures["legacy"]["path"].read_bytes()
    st = fixtures["safetensors"]["path"].read_bytes()
    files = {
        "empty.pt": b"",
        "truncated_zip.pt": good[: len(good) // 2],
        "truncated_tail.pt": good[:-10],
        "truncated_legacy.pt": legacy[: len(legacy) - 30],
        "legacy_half.pt": legacy[:200],
        "png.pt": b"\x89PNG\r\n\x1a\n" + b"\0" * 100,
        "text.pt": b"hello, this is not a checkpoint\n",
        "html.bin": b"<!DOCTYPE html><html>404</html>",
        "st_short.safetensors": st[:5],
        "st_trunc.safetensors": st[: len(st) - 7],
        "lfs.bin": b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n",
        "bad_cd.pt": good.replace(b"PK\x01\x02", b"PK\x01\x09", 1),
        "bad_local.pt": good.replace(b"PK\x03\x04", b"PK\x03\x09", 2).replace(b"PK\x03\x09", b"PK\x03\x04", 1),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return files


def test_bad_files(tmp_path, fixtures, cli):
    for name in make_bad(tmp_path, fixtures):
        assert_one_error_line(cli("inspect", tmp_path / name), name)


def test_missing_path_and_dangling_symlink(tmp_path, cli):
    assert_one_error_line(cli("inspect", tmp_path / "nope.pt"), "nope.pt")
    os.symlink(tmp_path / "gone", tmp_path / "link.pt")
    result = cli("inspect", tmp_path / "link.pt")
    assert_one_error_line(result, "link.pt")
    assert "does not exist" in result.stderr


def test_folder_without_checkpoints(tmp_path, cli):
    (tmp_path / "readme.txt").write_text("x")
    result = cli("inspect", tmp_path)
    assert_one_error_line(result, str(tmp_path))
    assert "no checkpoint" in result.stderr


def test_folder_with_several_checkpoints_asks_which(tmp_path, fixtures, cli):
    """fix needs one checkpoint: it names the choices (inspect lists them, one line each: test_listing.py)."""
    for name in ("a.pt", "b.pt"):
        shutil.copy(fixtures["plain"]["path"], tmp_path / name)
    result = cli("fix", tmp_path, "-o", tmp_path.parent / "out.pt")
    assert_one_error_line(result, "a.pt")
    assert cli("inspect", tmp_path).exit_code == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_permission_denied(tmp_path, fixtures, cli):
    path = tmp_path / "locked.pt"
    shutil.copy(fixtures["plain"]["path"], path)
    path.chmod(0)
    assert_one_error_line(cli("inspect", path), "locked.pt")


def test_debug_shows_traceback(tmp_path):
    env = dict(os.environ, CKPT_DOCTOR_DEBUG="1")
    proc = subprocess.run([sys.executable, "-m", "ckpt_doctor", "inspect", str(tmp_path / "nope.pt")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_installed_command_exit_codes(tmp_path, fixtures):
    exe = shutil.which("ckpt-doctor") or os.path.join(os.path.dirname(sys.executable), "ckpt-doctor")
    ok = subprocess.run([exe, "inspect", str(fixtures["plain"]["path"]), "--json"], capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0 and '"format": "torch-zip"' in ok.stdout
    (tmp_path / "empty.pt").write_bytes(b"")
    bad = subprocess.run([exe, "inspect", str(tmp_path / "empty.pt")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("Error: ") and "empty" in bad.stderr


@pytest.mark.parametrize("cut", [b"collections\nOrderedDi", b"collections\n", b"collecti"])
def test_a_pickle_cut_inside_an_opcodes_argument_is_a_broken_file(tmp_path, fixtures, cli, cut):
    """A legacy file cut inside a GLOBAL's text lines: CPython's unpickler stops at the missing newline ("pickle data
    was truncated") before it looks anything up, so `collections.OrderedDi` is no global and no finding: the file is
    broken (exit 2, the byte named), not code (exit 1)."""
    legacy = fixtures["legacy"]["path"].read_bytes()
    at = legacy.index(b"ccollections\nOrderedDict\n") + 1
    path = tmp_path / "cut.pt"
    path.write_bytes(legacy[:at + len(cut)])
    for command in ("inspect", "scan"):
        result = cli(command, path)
        assert result.exit_code == 2, (command, result.stderr)
        assert "at byte" in result.stderr and "OrderedD" not in result.stderr, result.stderr
