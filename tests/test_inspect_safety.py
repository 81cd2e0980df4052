"""inspect lists what a hostile file would run, runs none of it, and still lists the tensors."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.payloads import state_dict_with_payload, torch_zip


def test_payload_in_zip_is_reported_not_run(tmp_path, cli):
    canary = tmp_path / "canary"
    path = tmp_path / "evil.pt"
    path.write_bytes(torch_zip(state_dict_with_payload(canary), {"0": b"\0" * 16}))
    result = cli("inspect", path, "--json")
    assert result.exit_code == 1
    data = result.json()
    assert data["unsafe_globals"] == ["os.system"]
    assert [t["key"] for t in data["tensors"]] == ["fc.weight"]
    assert not canary.exists()
    # The same file really is a working payload: torch itself refuses it only because of weights_only.
    assert path.read_bytes().count(b"os\nsystem") == 1


def test_payload_in_legacy_object_pickle(tmp_path, cli):
    canary = tmp_path / "canary"
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    from tests.corpus import _legacy_with_payload
    from tests.payloads import call

    path = tmp_path / "evil_legacy.pt"
    # The object pickle (the 4th of five) is replaced by one with a payload; the rest of the file is kept.
    path.write_bytes(_legacy_with_payload(legacy.read_bytes(), call("os", "system", f"touch {canary}")))
    result = cli("inspect", path)
    assert result.exit_code == 1
    assert "os.system" in result.stderr
    assert not canary.exists()


def test_human_output_warns(tmp_path, cli):
    path = tmp_path / "evil.pt"
    path.write_bytes(torch_zip(state_dict_with_payload(tmp_path / "c"), {"0": b"\0" * 16}))
    result = cli("inspect", path)
    assert result.exit_code == 1
    assert "UNSAFE" in result.stderr and "os.system" in result.stderr
    assert "fc.weight" in result.stdout


def test_inspect_does_not_import_torch(fixtures):
    code = ("import sys\nfrom ckpt_doctor.cli import main\n"
            "try:\n    main(['inspect', sys.argv[1], '--json'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    for name in ("plain", "legacy", "safetensors", "torchscript", "whole_model", "sharded_bin"):
        proc = subprocess.run([sys.executable, "-c", code, str(fixtures[name]["path"])], capture_output=True,
                              text=True, timeout=60)
        assert proc.stderr.strip().splitlines()[-1] == "False", (name, proc.stderr)
