"""The --html pages, opened by a real browser: headless Chromium from the system package registry (installed here
when missing and the machine allows it), with the network off. The test reads the rendered DOM and checks that the
screenshot is not blank."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.test_diff import Net

OFFLINE = ["--headless", "--no-sandbox", "--disable-gpu", "--proxy-server=127.0.0.1:9",
           "--proxy-bypass-list=<-loopback>", "--host-resolver-rules=MAP * ~NOTFOUND"]  # no network


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"], capture_output=True,
                       timeout=300, check=False)
        found = shutil.which("chromium")
    if found is None:
        pytest.skip("no Chromium, and it cannot be installed here (apt-get as root)")
    return found


def dom(browser: str, page: Path) -> str:
    proc = subprocess.run([browser, *OFFLINE, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def screenshot_is_drawn(browser: str, page: Path, out: Path) -> bool:
    """Render to a PNG; it is drawn when its pixels take many values (a blank page compresses to a few)."""
    subprocess.run([browser, *OFFLINE, f"--screenshot={out}", "--window-size=1280,1000", page.as_uri()],
                   capture_output=True, timeout=120, check=False)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, idat = 8, b""
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        if kind == b"IDAT":
            idat += data[at + 8:at + 8 + length]
        at += 12 + length
    return len(set(zlib.decompress(idat))) > 40


def test_the_diff_page_shows_the_verdict_and_the_top_change(chromium, tmp_path):
    torch.manual_seed(0)
    model = Net()
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(model.state_dict(), a)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["backbone.2.0.weight"] *= 1.5
    state["head.bias"] += 1e-6
    torch.save(state, b)
    page = tmp_path / "diff.html"
    result = run_cli("diff", a, b, "--html", page)
    assert result.exit_code == 1 and page.exists()
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and "<script" not in text  # nothing to fetch or run
    rendered = dom(chromium, page)
    assert "The checkpoints differ: 2 changed" in rendered
    top = rendered.split('id="top-changes"', 1)[1]
    assert top.index("backbone.2.0.weight") < top.index("head.bias")
    assert 'id="heatmap"' in rendered
    assert screenshot_is_drawn(chromium, page, tmp_path / "diff.png")


def test_the_inspect_page_shows_the_fix_and_flags_a_dead_layer(chromium, tmp_path):
    torch.manual_seed(0)
    state = {"module." + k: v for k, v in Net().state_dict().items()}
    state["module.backbone.1.0.weight"] = torch.zeros_like(state["module.backbone.1.0.weight"])
    state["module.head.weight"][0, 0] = float("nan")
    path = tmp_path / "dp.pt"
    torch.save(state, path)
    reference = tmp_path / "clean.pt"
    torch.save({k.removeprefix("module."): v for k, v in state.items()}, reference)
    page = tmp_path / "inspect.html"
    result = run_cli("inspect", path, "--model", reference, "--html", page)
    assert result.exit_code == 1 and page.exists(), result.stderr
    rendered = dom(chromium, page)
    assert "strict load FAILS" in rendered and "--strip-module" in rendered.split('id="fix"', 1)[1]
    values = rendered.split('id="values"', 1)[1].split("</p>", 1)[0]
    assert "NaN/Inf in 1 tensors: module.head.weight" in values and "module.backbone.1.0.weight" in values
    assert screenshot_is_drawn(chromium, page, tmp_path / "inspect.png")
