"""Issue 24: what torch's own load path does with allow-listed names. BUILD (or setattr by another route) on a
function, a class, a module or an enum member changes the process; with `dump_patches` and `__name__` set that way,
a legacy or tar module record makes torch's `_check_container_source` write a `.patch` file of the file's choosing.
Each route is built by hand, shown to fire under torch.load(weights_only=False) in a child process, and must be a
finding (exit 1) of scan and inspect, never be written by fix, and fire nothing while ckpt-doctor reads it.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch
import torch.distributed.checkpoint.metadata  # noqa: F401  (named by the enum routes' effects)

from tests.corpus import module_record, side_effect_routes
from tests.payloads import global_op, tar_members, torch_zip
from tests.test_safety import legacy_file, state_dict_pickle


def route_file(folder, fmt: str, payload: bytes):
    """The route's payload in a checkpoint of its format (one real float tensor "w" beside it)."""
    if fmt == "legacy":
        data = legacy_file(state_dict_pickle(payload, legacy=True))
    elif fmt == "legacy-sysinfo":
        rebuild = global_op("torch._utils", "_rebuild_tensor_v2")
        data = legacy_file(state_dict_pickle(rebuild + b"q\x100" + module_record(0x10), legacy=True))
        data = data.replace(b"\x80\x02}.", payload, 1)  # the system-info pickle
    elif fmt == "tar":
        members = tar_members({"w": [0.0] * 4})
        members["pickle"] = payload
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, member in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(member)
                tar.addfile(info, io.BytesIO(member))
        data = buf.getvalue()
    else:
        data = torch_zip(state_dict_pickle(payload), {"0": b"\0" * 16})
    path = folder / f"route.{'tar' if fmt == 'tar' else 'pt'}"
    path.write_bytes(data)
    return path


# torch.load(weights_only=False) of each file, each in a process forked from one that imported torch once (a route
# changes functions for the whole process: the next must not see it), in the route's own working folder.
_FIRES = """
import json, os, sys, warnings, torch, torch.distributed.checkpoint.metadata
warnings.simplefilter("ignore")
fired = {}
for name, (path, effect, work) in json.loads(sys.argv[1]).items():
    pid = os.fork()
    if pid == 0:
        os.chdir(work)
        try:
            torch.load(path, weights_only=False)
        except Exception:
            pass
        os._exit(0 if eval(effect) else 1)
    fired[name] = os.waitpid(pid, 0)[1] == 0
print(json.dumps(fired))
"""


@pytest.fixture(scope="module")
def routes(tmp_path_factory):
    """name -> (checkpoint, effect, working folder), each route shown to fire under torch.load in a child."""
    root = tmp_path_factory.mktemp("routes")
    made = {}
    for index, name in enumerate(side_effect_routes("evil-target")):
        folder = root / f"route{index}"
        (folder / "work").mkdir(parents=True)
        fmt, payload, effect = side_effect_routes(str(folder / "evil-target"))[name]  # <folder>/evil-target.patch
        made[name] = (route_file(folder, fmt, payload), effect, folder / "work")
    plan = {name: (str(path), effect, str(work)) for name, (path, effect, work) in made.items()}
    proc = subprocess.run([sys.executable, "-c", _FIRES, json.dumps(plan)], capture_output=True, text=True,
                          timeout=300, check=True)
    fired = json.loads(proc.stdout.splitlines()[-1])
    assert all(fired.values()), {name: ok for name, ok in fired.items() if not ok}
    for _, _, work in made.values():
        for leftover in (work.parent / "evil-target.patch", work / "_reconstructor.patch"):
            if leftover.exists():
                leftover.unlink()
    return made


@pytest.mark.parametrize("route", list(side_effect_routes("evil-target")))
def test_a_side_effect_of_torchs_load_path_is_a_finding(routes, cli, monkeypatch, route):
    path, effect, work = routes[route]
    monkeypatch.chdir(work)  # where a route writes a .patch file of a relative name
    for command in ("scan", "inspect"):
        result = cli(command, path)
        assert result.exit_code == 1, (command, result.stderr)
        assert "dangerous" in result.stderr.lower(), result.stderr
    out = work.parent / "out.pt"
    result = cli("fix", path, "-o", out)
    if result.exit_code == 0:  # a rescue: only tensors and plain data come out
        assert cli("scan", out).exit_code == 0 and b"module" not in out.read_bytes()
        torch.load(out, weights_only=True)
        out.unlink()
    assert not out.exists(), result.stderr
    assert not eval(effect, {"os": os, "torch": torch})  # nothing ckpt-doctor did fired it in this process
    assert not list(work.iterdir())
