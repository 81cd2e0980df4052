"""--allow-global is part of how a file is read: every command printed for a file read with it re-reads the file
with it (run as printed, it exits 0), and what the sentence says of the output's loading is what torch does — with
its defaults where the rescue leaves the allowed objects out, within safe_globals where a fix keeps them. The user's
class lives in a module in tmp_path, importable only by the torch processes that play the user (the oracle)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_cli

from tests.test_journeys import json_commands, printed_commands

USER_MODULE = textwrap.dedent('''
    class Config:
        def __init__(self, name):
            self.name = name
''')

NET = textwrap.dedent('''
    import torch


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))
''')

ALLOW = ("--allow-global", "usercfg.Config")


def _user_torch(tmp: Path, code: str) -> dict:
    """Run `code` in a torch process that can import the user's module; it prints one JSON line."""
    env = {**os.environ, "PYTHONPATH": str(tmp / "user")}
    done = subprocess.run([sys.executable, "-c", "import json, torch, usercfg\n" + textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _loads(tmp: Path, path: Path) -> dict:
    """How torch loads `path`: with its defaults, and within safe_globals([usercfg.Config]); the config's name."""
    return _user_torch(tmp, f'''
        out = {{}}
        try:
            torch.load({str(path)!r})
            out["defaults"] = True
        except Exception:
            out["defaults"] = False
        with torch.serialization.safe_globals([usercfg.Config]):
            data = torch.load({str(path)!r})
        out["keys"] = sorted(data)
        out["cfg"] = data["cfg"].name if "cfg" in data else None
        print(json.dumps(out))
    ''')


@pytest.fixture
def user_files(tmp_path):
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "usercfg.py").write_text(USER_MODULE)
    (tmp_path / "nets.py").write_text(NET)
    _user_torch(tmp_path, f'''
        torch.save({{"w": torch.ones(4), "cfg": usercfg.Config("a")}}, {str(tmp_path / "cfg.pt")!r})
        torch.save({{"module.w": torch.ones(4), "cfg": usercfg.Config("a")}}, {str(tmp_path / "dp.pt")!r})
        print("{{}}")
    ''')
    return tmp_path


def _run_printed(tmp: Path, command: str, suggestion: dict) -> dict:
    """Run a printed command as printed (exit 0) and check its output loads as its sentence says."""
    argv = shlex.split(command)
    assert argv[0] == "ckpt-doctor" and argv[1] == "fix"
    assert " ".join(ALLOW) in command, command  # the file is read again as the command that printed it read it
    result = run_cli(*argv[1:])
    assert result.exit_code == 0, (command, result.stderr)
    loads = _loads(tmp, Path(argv[argv.index("-o") + 1]))
    trusted = suggestion.get("safe_globals", [])
    if "torch.load loads with its defaults" in suggestion["why"]:
        assert loads["defaults"] and not trusted, (command, loads)
    else:
        assert trusted == ["usercfg.Config"] and "safe_globals([usercfg.Config])" in suggestion["why"] + \
            suggestion.get("shown", ""), suggestion
    if not trusted:
        assert loads["defaults"], (command, loads)
    return loads


@pytest.mark.parametrize("command", ["inspect", "scan"])
def test_the_rescue_under_allow_global_runs_as_printed_and_loads_with_torch_s_defaults(user_files, command):
    path = user_files / "cfg.pt"
    table = run_cli(command, path, *ALLOW)
    data = run_cli(command, path, *ALLOW, "--json")
    assert table.exit_code == data.exit_code == 0, table.stderr  # allowed: nothing to run, a fact to tell
    suggested = json_commands(data.json())
    assert sorted(printed_commands(table.stderr)) == sorted(s["command"] for s in suggested), table.stderr
    (rescue,) = suggested
    loads = _run_printed(user_files, rescue["command"], rescue)
    assert loads["keys"] == ["w"] and loads["cfg"] is None  # the config is left out, and the output says so
    assert "usercfg.Config" in rescue["why"]


def test_fix_under_allow_global_keeps_the_object_and_says_how_torch_loads_it(user_files):
    out = user_files / "kept.pt"
    result = run_cli("fix", user_files / "cfg.pt", "-o", out, *ALLOW)
    assert result.exit_code == 0, result.stderr
    assert "torch.serialization.safe_globals([usercfg.Config])" in result.stderr
    loads = _loads(user_files, out)
    assert loads == {"defaults": False, "keys": ["cfg", "w"], "cfg": "a"}
    # inspect of the output, read with the same allowance: its printed command runs as printed
    again = run_cli("inspect", out, *ALLOW, "--json")
    for s in json_commands(again.json()):
        _run_printed(user_files, s["command"], s)
    # without the allowance, fix refuses it and says both ways out; each runs as printed
    refused = run_cli("fix", user_files / "cfg.pt", "-o", user_files / "two.pt")
    assert refused.exit_code == 2
    drop, keep = printed_commands(refused.stderr)
    assert run_cli(*shlex.split(drop)[1:]).exit_code == 0
    assert _loads(user_files, user_files / "two.pt")["defaults"]
    (user_files / "two.pt").unlink()
    assert run_cli(*shlex.split(keep)[1:]).exit_code == 0
    assert _loads(user_files, user_files / "two.pt")["cfg"] == "a"


def _strict(tmp: Path, path: Path) -> dict:
    """torch's verdict on `path`: loaded with its defaults, then load_state_dict(strict=True) into nets.Net."""
    return _user_torch(tmp, f'''
        import sys
        sys.path.insert(0, {str(tmp)!r})
        from nets import Net
        data = torch.load({str(path)!r})
        Net().load_state_dict(data, strict=True)
        print(json.dumps({{"keys": sorted(data)}}))
    ''')


@pytest.mark.parametrize("allow", [(), ALLOW], ids=["code", "allowed"])
@pytest.mark.parametrize("name", ["dp.pt", "cfg.pt"])
def test_the_model_fix_leaves_the_object_out_and_loads_strictly(user_files, allow, name):
    """A config beside the state_dict's tensors is a key the model does not take: the model-fix line leaves it out
    (a code object fix would refuse; an allowed one a strict load would), so that, run as printed, its output loads
    with torch's defaults and strictly into the model, as its sentence says."""
    path, spec = user_files / name, f"{user_files / 'nets.py'}:Net"
    table = run_cli("inspect", path, "--model", spec, *allow)
    data = run_cli("inspect", path, "--model", spec, *allow, "--json")
    suggested = [s for s in json_commands(data.json()) if "--model" in s["command"]]
    assert sorted(c for c in printed_commands(table.stderr) if "--model" in c) == \
        sorted(s["command"] for s in suggested), table.stderr
    (fix,) = suggested
    assert "safe_globals" not in fix and "safe_globals" not in table.stderr, table.stderr
    assert "then a strict load succeeds" in table.stderr
    argv = shlex.split(fix["command"])
    assert " ".join(allow) in fix["command"]
    result = run_cli(*argv[1:])
    assert result.exit_code == 0, (fix["command"], result.stderr)
    assert _strict(user_files, Path(argv[argv.index("-o") + 1])) == {"keys": ["w"]}


def test_fix_s_model_check_counts_an_entry_that_holds_no_tensor(user_files):
    """fix --model keeping the allowed config beside the tensors would write a file a strict load refuses
    (Unexpected key(s) "cfg"): it says so and writes nothing; --allow-unexpected accepts it, as torch's
    strict=False would."""
    spec = f"{user_files / 'nets.py'}:Net"
    out = user_files / "kept.pt"
    refused = run_cli("fix", user_files / "cfg.pt", "-o", out, "--model", spec, *ALLOW)
    assert refused.exit_code == 1 and "1 unexpected (cfg)" in refused.stderr, refused.stderr
    assert not out.exists()
    accepted = run_cli("fix", user_files / "cfg.pt", "-o", out, "--model", spec, *ALLOW, "--allow-unexpected", "^cfg$")
    assert accepted.exit_code == 0, accepted.stderr
    assert _loads(user_files, out)["keys"] == ["cfg", "w"]
