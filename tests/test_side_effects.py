"""Issue 24: what torch's own load path does with allow-listed names. BUILD (or setattr by another route) on a
function, a class, a module or an enum member changes the process; with `dump_patches` and `__name__` set that way,
a legacy or tar module record makes torch's `_check_container_source` write a `.patch` file of the file's choosing.
Each route is built by hand, shown to fire under torch.load(weights_only=False) in a child process, and must be a
finding (exit 1) of scan and inspect, and never be written by fix.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile

import pytest

from tests.corpus import module_record, side_effect_routes
from tests.payloads import MAGIC_PICKLE, _str, global_op, tar_members, torch_zip
from tests.test_safety import legacy_file, state_dict_pickle

TARGET = "evil-target"  # a .patch file lands at <tmp>/evil-target.patch


def route_file(tmp_path, fmt: str, payload: bytes):
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
    path = tmp_path / f"route.{'tar' if fmt == 'tar' else 'pt'}"
    path.write_bytes(data)
    return path


def fires(path, effect: str, cwd) -> bool:
    """Whether torch.load(weights_only=False) of `path`, in a child process working in `cwd`, has the effect."""
    code = ("import os, sys, warnings, torch, torch.distributed.checkpoint.metadata\nwarnings.simplefilter('ignore')\n"
            "try:\n    torch.load(sys.argv[1], weights_only=False)\nexcept Exception as exc:\n"
            "    print('load failed:', type(exc).__name__, exc)\n"
            f"print('FIRED' if ({effect}) else 'quiet')\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=cwd,
                          timeout=120)
    return "FIRED" in proc.stdout


ROUTES = side_effect_routes(TARGET)


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_side_effect_of_torchs_load_path_is_a_finding(tmp_path, cli, route):
    fmt, payload, effect = ROUTES[route]
    work = tmp_path / "work"
    work.mkdir()
    path = route_file(tmp_path, fmt, payload)
    assert fires(path, effect, work), route
    for leftover in work.iterdir():
        leftover.unlink()
    for command in ("scan", "inspect"):
        result = cli(command, path)
        assert result.exit_code == 1, (command, result.stderr)
        assert "dangerous" in result.stderr.lower(), result.stderr
    out = tmp_path / "out.pt"
    result = cli("fix", path, "-o", out)
    assert result.exit_code != 0 and not out.exists(), result.stderr
    assert not list(work.iterdir())  # nothing ckpt-doctor did wrote a file
