"""Globals whose name is a dotted attribute path. Protocol 4 resolves `module` + `a.b.c` one attribute at a time, and
an attribute of a module is whatever that module imported: `torch.serialization.os.remove` is os.remove. Such a name
is judged by its worst reading, by default and under --allow-global; and a nested class the user allows is written
so that torch loads it. torch is the oracle: what each name resolves to, and that a payload through one runs."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
import torch

from payloads import _str, global_op, torch_zip

# (module, dotted name, the object it reaches, as Python code)
ALIASED = [
    ("torch.serialization", "os.posix_spawnp", "os.posix_spawnp"),
    ("torch.serialization", "os.remove", "os.remove"),
    ("torch.serialization", "shutil.rmtree", "shutil.rmtree"),
    ("torch.serialization", "pickle.Unpickler", "pickle.Unpickler"),
    ("torch.functional", "torch.hub._import_module", "torch.hub._import_module"),
    ("torch.functional", "torch.hub.download_url_to_file", "torch.hub.download_url_to_file"),
    ("torch.functional", "torch.utils.cpp_extension.load_inline", "torch.utils.cpp_extension.load_inline"),
    ("torch.functional", "torch.jit.mobile._load_for_lite_interpreter",
     "torch.jit.mobile._load_for_lite_interpreter"),
    ("torch.functional", "torch.package.PackageImporter", "torch.package.PackageImporter"),
]
IDS = [f"{m}.{n}" for m, n, _ in ALIASED]


def _checkpoint(module: str, name: str, args: bytes = b")") -> bytes:
    """A torch.save-like zip whose data.pkl is {'w': a tensor, 'p': module.name(*args)}, the global by STACK_GLOBAL
    under protocol 4 (as pickle.dumps(protocol=4) names a nested qualname)."""
    tensor = (global_op("torch._utils", "_rebuild_tensor_v2") + b"((" + _str("storage")
              + global_op("torch", "FloatStorage") + _str("0") + _str("cpu") + b"K\x04tQK\x00K\x04\x85K\x01\x85\x89"
              + global_op("collections", "OrderedDict") + b")RtR")
    pkl = b"\x80\x04}(" + _str("w") + tensor + _str("p") + _str(module) + _str(name) + b"\x93" + args + b"Ru."
    return torch_zip(pkl, {"0": struct.pack("<4f", 1, 2, 3, 4)})


def test_each_dotted_name_reaches_what_it_spells():
    """The oracle: CPython's unpickler (torch.load(weights_only=False)'s) resolves each name to the dangerous object
    it spells, through the modules the first one imported, in a process that has imported what it reaches (plain
    `import torch` does for all but torch.utils.cpp_extension and torch.jit.mobile). Only looked up, never called,
    in a child process."""
    code = "\n".join([
        "import pickle, os, shutil, torch, torch.hub, torch.utils.cpp_extension, torch.jit.mobile, torch.package",
        f"cases = {[(m, n, e) for m, n, e in ALIASED]!r}",
        "found = [pickle.loads(b'\\x80\\x04\\x8c' + bytes([len(m)]) + m.encode() + b'\\x8c' + bytes([len(n)])",
        "                      + n.encode() + b'\\x93.') for m, n, _ in cases]",
        "for (m, n, e), obj in zip(cases, found):",
        "    print(m + '.' + n, obj is eval(e))",
    ])
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [w for i in IDS for w in (i, "True")]


def test_a_dotted_payload_runs_under_torch_load(tmp_path):
    """And a checkpoint that calls one runs it: torch.load(weights_only=False), in a child process, removes the
    canary through torch.serialization.os.remove. ckpt-doctor calls that file dangerous (next tests)."""
    canary = tmp_path / "canary"
    canary.write_text("alive")
    path = tmp_path / "remove.pt"
    path.write_bytes(_checkpoint("torch.serialization", "os.remove", b"(" + _str(str(canary)) + b"t"))
    code = f"import torch; torch.load({str(path)!r}, weights_only=False)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert not canary.exists()


@pytest.mark.parametrize("module,name", [(m, n) for m, n, _ in ALIASED], ids=IDS)
def test_a_dotted_name_is_dangerous_by_default_and_cannot_be_allowed(tmp_path, cli, module, name):
    full = f"{module}.{name}"
    path = tmp_path / "alias.pt"
    path.write_bytes(_checkpoint(module, name))

    scanned = cli("scan", path, "--json")
    assert scanned.exit_code == 1
    assert scanned.json()["files"][0]["dangerous"] == [full]

    inspected = cli("inspect", path)
    assert inspected.exit_code == 1
    assert f"DANGEROUS   {full} in archive/data.pkl" in inspected.stderr

    refused = cli("fix", path, "-o", tmp_path / "out.pt")  # exit 1: the file would run code
    assert refused.exit_code == 1 and "refusing to rewrite" in refused.stderr
    assert "--allow-global" not in refused.stderr
    assert not (tmp_path / "out.pt").exists()

    for command in (("scan", path), ("inspect", path), ("fix", path, "-o", tmp_path / "out.pt")):
        allowed = cli(*command, "--allow-global", full)
        assert allowed.exit_code == 2, (command, allowed.stdout)
        assert allowed.stderr.startswith(f"Error: --allow-global {full}: refused, ")
        assert allowed.stderr.count("\n") == 1 and "Traceback" not in allowed.stderr
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("name", [
    "torch.serialization.os.system", "torch.serialization.torch.load", "mypkg.np.load", "six.moves.cPickle.loads",
    "mypkg.builtins.eval", "torch.serialization.__globals__.update", "mypkg.loads",
    "torch.functional.torch.jit._load_for_lite_interpreter",
])
def test_allow_global_refuses_every_reading_that_reaches_code(cli, tmp_path, name):
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, path)
    refused = cli("scan", path, "--allow-global", name)
    assert refused.exit_code == 2 and refused.stderr.startswith(f"Error: --allow-global {name}: refused")


def test_an_allowed_name_split_to_reach_code_stays_dangerous(tmp_path, cli):
    """A name that is harmless as a module path (mypkg.modules is mypkg's own module) may be allowed, but a pickle
    that splits it so `modules` becomes an attribute step (sys.modules, when mypkg imported it) is still dangerous:
    the verdict is taken before the allowance is looked at."""
    path = tmp_path / "split.pt"
    path.write_bytes(_checkpoint("mypkg", "modules.update"))
    allowed = cli("scan", path, "--json", "--allow-global", "mypkg.modules.update")
    assert allowed.exit_code == 1 and allowed.json()["files"][0]["dangerous"] == ["mypkg.modules.update"]
    assert cli("fix", path, "-o", tmp_path / "out.pt", "--allow-global", "mypkg.modules.update").exit_code == 1
    assert not (tmp_path / "out.pt").exists()


def test_numpy_random_own_pickle_module_is_code_not_dangerous(tmp_path, cli):
    """numpy.random._pickle is numpy's module, not the standard library's _pickle: a pickled numpy Generator names
    it, and it is code (allowable), as any class off the allow-list; what follows it is still judged."""
    import numpy as np

    path = tmp_path / "rng.pt"
    torch.save({"w": torch.ones(2), "rng": np.random.default_rng(0)}, path)
    scanned = cli("scan", path, "--json")
    assert scanned.exit_code == 1 and scanned.json()["files"][0]["dangerous"] == []
    names = [g["global"] for g in scanned.json()["files"][0]["globals"] if g["verdict"] == "code"]
    assert any(n.startswith("numpy.random._pickle.") for n in names)
    assert cli("scan", path, *[a for n in names for a in ("--allow-global", n)]).exit_code == 0
    bad = tmp_path / "bad.pt"
    bad.write_bytes(_checkpoint("numpy.random._pickle", "os.system"))
    assert cli("scan", bad, "--json").json()["files"][0]["dangerous"] == ["numpy.random._pickle.os.system"]


NESTED = '''
class Outer:
    class Inner:
        def __init__(self, lr):
            self.lr = lr
'''


def test_an_allowed_nested_class_is_written_so_that_torch_loads_it(tmp_path, cli):
    """A nested class the user allows (its name is dotted: Outer.Inner) is written so that both loaders take it:
    torch.load(weights_only=False) with the class importable, and weights_only=True under safe_globals."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "ckd_nested_cfg.py").write_text(NESTED)
    src, out = tmp_path / "nested.pt", tmp_path / "nested_fixed.pt"
    save = (f"import sys, torch; sys.path.insert(0, {str(pkg)!r}); import ckd_nested_cfg as m; "
            f"torch.save({{'w': torch.arange(4.), 'cfg': m.Outer.Inner(0.5)}}, {str(src)!r}, pickle_protocol=4)")
    subprocess.run([sys.executable, "-c", save], check=True, timeout=300)

    refused = cli("fix", src, "-o", out)
    assert refused.exit_code == 2 and "--allow-global ckd_nested_cfg.Outer.Inner" in refused.stderr
    fixed = cli("fix", src, "-o", out, "--allow-global", "ckd_nested_cfg.Outer.Inner")
    assert fixed.exit_code == 0, fixed.stderr

    load = "\n".join([
        "import sys, warnings, torch",
        f"sys.path.insert(0, {str(pkg)!r})",
        "import ckd_nested_cfg as m",
        f"full = torch.load({str(out)!r}, weights_only=False)",
        "print(type(full['cfg']) is m.Outer.Inner, full['cfg'].lr, full['w'].tolist())",
        "warnings.simplefilter('ignore')  # torch notes that protocol 4 is not the one it writes",
        "with torch.serialization.safe_globals([m.Outer.Inner]):",
        f"    safe = torch.load({str(out)!r}, weights_only=True)",
        "print(type(safe['cfg']) is m.Outer.Inner, safe['cfg'].lr, safe['w'].tolist())",
    ])
    run = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["True 0.5 [0.0, 1.0, 2.0, 3.0]"] * 2
    assert cli("scan", out, "--allow-global", "ckd_nested_cfg.Outer.Inner").exit_code == 0
