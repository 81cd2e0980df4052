"""Files that are not checkpoints (HDF5, NumPy, images, archives, text) are named as what they are: exit 2 when
named alone, skipped with a line in a folder — unless they name a global off the allow-list, as an object array's
pickle can: then they are a finding like any unsafe pickle (exit 1)."""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import pickle
import subprocess
import sys
import tarfile
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_doctor.errors import NotACheckpoint
from ckpt_doctor.readers import read_checkpoint
from ckpt_doctor.safepickle.walker import unresolvable, walk
from tests.helpers import child_fires
from tests.payloads import object_npy

RECORD = b"cpu/__init__.py,sha256=abc,12\nckpt/x.py,sha256=def,3\n"


def _npz(arrays: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _npy(array, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return buf.getvalue()


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def not_checkpoints() -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, what the message must call it)."""
    return {
        "model.h5": (b"\x89HDF\r\n\x1a\n" + b"\0" * 600, "HDF5 file (Keras/h5py)"),
        "weights.npy": (_npy(np.arange(6, dtype=np.float32).reshape(2, 3)),
                        "NumPy array (.npy, float32, shape (2, 3))"),
        "objects.npy": (_npy(np.array([{"lr": 0.1}, None], dtype=object), allow_pickle=True),
                        "NumPy array of Python objects"),
        "arrays.npz": (_npz({"a": np.arange(3), "b": np.ones(2)}), "NumPy .npz archive of 2 arrays (a, b)"),
        "plot.png": (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + b"\0" * 40, "PNG image"),
        "photo.jpg": (b"\xff\xd8\xff\xe0\0\x10JFIF" + b"\0" * 40, "JPEG image"),
        "anim.gif": (b"GIF89a\x01\0\x01\0\x80\0\0" + b"\0" * 40, "GIF image"),
        "logs.gz": (gzip.compress(b"step 1 loss 0.5\n"), "gzip archive"),
        "bundle.7z": (b"7z\xbc\xaf\x27\x1c\0\x04" + b"\0" * 40, "7z archive"),
        "texts.zip": (_zip({"a.txt": b"hi", "dir/b.txt": b"ho"}), "zip archive of 2 files (a.txt, dir/b.txt)"),
        "texts.tar": (_tar({"a.txt": b"hi"}), "tar archive of 1 file (a.txt)"),
        "RECORD": (RECORD, "CSV text (a wheel's RECORD)"),
        "config.json": (json.dumps({"hidden_size": 8}).encode(), "JSON text"),
        "hparams.yaml": (b"lr: 0.1\nbatch_size: 8\n", "YAML text"),
        "metrics.csv": (b"col1,col2\n1,2\n", "CSV text"),
        "train.py": (b"class Net:\n    pass\n", "Python source"),
        "notes.txt": (b"hello\nthere\n", "text"),
        # read as a pickle, a memo index of gigabytes (refused as a memory bomb): still text
        "LICENSE": (b"Copyright (c) 1992-2013 The University of Tennessee and The University\n" + b" " * 24 +
                    b"of Tennessee Research Foundation.  All rights\n" + b" " * 24 + b"reserved.\n", "text"),
        "entry_points.txt": (b"[console_scripts]\nckpt-doctor = ckpt_doctor.cli:main\n", "INI text"),
    }


def _write_all(folder) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    files = not_checkpoints()
    for name, (data, _) in files.items():
        (folder / name).write_bytes(data)
    return files


def test_each_kind_named_alone_is_named_as_what_it_is(tmp_path, cli):
    for name, (_, what) in _write_all(tmp_path).items():
        path = tmp_path / name
        with pytest.raises(NotACheckpoint) as info:
            read_checkpoint(path)
        assert not info.value.findings, name
        assert str(info.value).startswith(f"{path}: not a PyTorch checkpoint: ") and what in str(info.value), name
        for command in ("inspect", "scan"):
            result = cli(command, path)
            assert result.exit_code == 2, (command, name, result.stderr)
            assert result.stdout == "", (command, name, result.stdout)  # no table, no "(no globals …)" claim
            assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"Error: {path}: not a PyTorch")


def test_what_reads_it_instead_is_said(tmp_path):
    _write_all(tmp_path)
    advice = {"model.h5": "h5py.File", "weights.npy": "numpy.load", "arrays.npz": "numpy.load",
              "objects.npy": "allow_pickle=True", "logs.gz": "gunzip"}
    for name, hint in advice.items():
        with pytest.raises(NotACheckpoint, match=hint):
            read_checkpoint(tmp_path / name)
    # the oracle: what it says reads them does
    assert np.load(tmp_path / "weights.npy").shape == (2, 3)
    assert sorted(np.load(tmp_path / "arrays.npz").files) == ["a", "b"]
    assert np.load(tmp_path / "objects.npy", allow_pickle=True)[0] == {"lr": 0.1}


@pytest.mark.parametrize("command", ["inspect", "scan"])
def test_a_folder_skips_them_with_a_line_each_and_its_checkpoints_decide(tmp_path, cli, command):
    folder = tmp_path / "run"
    files = _write_all(folder)
    torch.save({"w": torch.ones(2)}, folder / "a.pt")
    torch.save({"w": torch.zeros(3)}, folder / "b.pt")
    result = cli(command, folder, "--json")
    assert result.exit_code == 0, result.stderr
    data = result.json()
    skipped = {s["path"].split("run/")[1]: s["reason"] for s in data["skipped"]}
    assert sorted(skipped) == sorted(files)
    for name, (_, what) in files.items():
        assert what in skipped[name], (name, skipped[name])
    assert sorted(f["path"].split("run/")[1] for f in data["files"]) == ["a.pt", "b.pt"]
    table = cli(command, folder)
    assert table.exit_code == 0
    for name in files:
        assert f"skipped {name if command == 'inspect' else folder / name}: not a PyTorch checkpoint" in table.stderr
    assert "Error" not in table.stderr


@pytest.mark.parametrize("command", ["inspect", "scan"])
def test_a_folder_with_no_checkpoint_at_all_is_still_exit_2(tmp_path, cli, command):
    folder = tmp_path / "data"
    _write_all(folder)
    result = cli(command, folder)
    assert result.exit_code == 2 and "Error:" in result.stderr


def test_a_numpy_file_beside_a_checkpoint_does_not_hide_it(tmp_path, cli):
    folder = tmp_path / "model"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "model.pt")
    np.savez(folder / "stats.npz", mean=np.zeros(3))
    result = cli("inspect", folder, "--json")
    assert result.exit_code == 0 and result.json()["tensor_count"] == 1  # the folder's one checkpoint, read


def _evil_object_array(canary) -> bytes:
    return object_npy(b"\x80\x02cposix\nsystem\n(S'touch " + str(canary).encode() + b"'\ntR.")


def _np_load_runs_it(path, canary) -> bool:
    code = ("import numpy, sys\np = sys.argv[1]\ntry:\n    x = numpy.load(p, allow_pickle=True)\n"
            "    [x[k] for k in x.files] if hasattr(x, 'files') else None\nexcept Exception:\n    pass\n")
    return child_fires(code, path, canary)


@pytest.mark.parametrize("name", ["evil.npy", "evil.npz"])
def test_an_object_array_that_runs_code_is_a_finding_not_skipped(tmp_path, cli, name):
    canary = tmp_path / "CANARY"
    folder = tmp_path / "run"
    _write_all(folder)
    torch.save({"w": torch.ones(2)}, folder / "a.pt")
    torch.save({"w": torch.ones(2)}, folder / "b.pt")
    npy = _evil_object_array(canary)
    (folder / name).write_bytes(npy if name.endswith(".npy") else _zip({"arr.npy": npy}))
    assert _np_load_runs_it(folder / name, canary)
    for command in ("inspect", "scan"):
        alone = cli(command, folder / name)
        assert alone.exit_code == 1 and "posix.system" in alone.stderr, (command, alone.stderr)
        result = cli(command, folder, "--json")
        assert result.exit_code == 1, (command, result.stderr)
        data = result.json()
        assert name not in {s["path"].split("run/")[1] for s in data["skipped"]}
        listed = {f["path"].split("run/")[1]: f for f in data["files"]}
        assert listed[name]["verdict"] == "dangerous"
    assert not canary.exists()


def test_an_object_array_of_allowed_globals_is_walked_and_judged(tmp_path):
    path = tmp_path / "objects.npy"
    path.write_bytes(_npy(np.array([{"lr": 0.1}], dtype=object), allow_pickle=True))
    from ckpt_doctor.readers.survey import survey_file

    survey = survey_file(path)
    assert survey.globals and not survey.findings  # numpy's own reconstructors: the allow-list's
    with pytest.raises(NotACheckpoint, match="allow-list"):
        read_checkpoint(path)


# --- A text file read as a pickle, against CPython's own unpickler ------------------------------------------------

def test_a_wheels_record_is_text_that_cpython_cannot_unpickle(tmp_path, cli):
    with pytest.raises(Exception) as info:
        pickle.loads(RECORD)  # the GLOBAL opcode 'c', then two lines no import finds: CPython stops there
    assert isinstance(info.value, (ImportError, AttributeError, ValueError))
    result = walk(RECORD, "RECORD")
    assert result.globals == [] and result.unresolved is not None
    path = tmp_path / "RECORD"
    path.write_bytes(RECORD)
    for command in ("scan", "inspect"):
        out = cli(command, path)
        assert out.exit_code == 2 and "CSV text" in out.stderr and "code" not in out.stderr


_LINE = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\0"), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(module=_LINE, name=_LINE)
def test_what_the_walker_takes_for_unresolvable_cpython_cannot_look_up(module, name):
    """The authority: CPython's own find_class (as torch.load(weights_only=False) calls it) fails on every global
    `unresolvable` lets the walker pass over."""
    if not unresolvable(module, name):
        return
    unpickler = pickle.Unpickler(io.BytesIO(b"."))
    with pytest.raises((ImportError, AttributeError, ValueError)):
        unpickler.find_class(module, name)


def test_no_python_name_alone_does_not_make_a_global_harmless():
    """CPython checks no name: a module that is no identifier still imports (a namespace package of the standard
    library, a prefix cut at NUL); only both parts being none lets the walk pass over a global."""
    assert not unresolvable("lib-dynload", "__loader__")
    assert not unresolvable("os\0x", "x y")
    assert not unresolvable("os.x y", "a b")  # os is imported before its part `x y` fails
    assert unresolvable("pu/__init__.py,sha256=abc,12", "ckpt/x.py,sha256=def,3")


@pytest.mark.skipif(importlib.util.find_spec("lib-dynload") is None, reason="no lib-dynload folder on sys.path")
def test_a_global_whose_module_is_no_identifier_can_still_run_code(tmp_path, cli):
    """`lib-dynload` imports as a namespace package: CPython reads on past it (to a payload after it), and its
    __loader__ leads to the builtins, so to eval. A rule "no Python name: not a pickle" would miss both."""
    canary = tmp_path / "CANARY"
    command = f"__import__('os').system('touch {canary}')"
    payloads = {
        "after.pkl": b"clib-dynload\n__name__\n0cposix\nsystem\n(S'touch " + str(canary).encode() + b"'\ntR.",
        "eval.pkl": (b"\x80\x04clib-dynload\n__loader__.__init__.__builtins__.get\n(S'eval'\ntR(S\"" +
                     command.encode() + b"\"\ntR."),
    }
    for name, data in payloads.items():
        path = tmp_path / name
        path.write_bytes(data)
        subprocess.run([sys.executable, "-c", "import sys, torch; torch.load(sys.argv[1], weights_only=False)",
                        str(path)], capture_output=True, timeout=120, cwd=tmp_path)
        assert canary.exists(), name  # live
        canary.unlink()
        assert cli("scan", path).exit_code == cli("inspect", path).exit_code == 1, name


def test_the_walk_goes_on_past_a_global_cpython_cannot_look_up(tmp_path, cli):
    """A loader that found such a name (a zip on sys.path) would read on: what follows is judged all the same."""
    data = b"cpu/x,y\nck/z,w\n0cposix\nsystem\n(S'true'\ntR."
    path = tmp_path / "after.pkl"
    path.write_bytes(data)
    assert cli("scan", path).exit_code == cli("inspect", path).exit_code == 1
    assert "posix.system" in cli("scan", path).stdout


def test_scan_makes_no_claim_about_a_file_it_could_not_read(tmp_path, cli):
    torch.save({"w": torch.ones(2)}, tmp_path / "good.pt")
    data = (tmp_path / "good.pt").read_bytes()
    folder = tmp_path / "cut"
    folder.mkdir()
    for name in ("a.pt", "b.pt"):
        (folder / name).write_bytes(data[:300])
    for path in (folder / "a.pt", folder):
        result = cli("scan", path)
        assert result.exit_code == 2 and result.stdout == "", (path, result.stdout)
    (folder / "c.pt").write_bytes(data)
    result = cli("scan", folder)
    assert result.exit_code == 2 and "(no globals off the allow-list in the 1 file(s) read)" in result.stdout
