"""Regenerates the example outputs of README.md and docs/*.md from the commands shown beside them, on the example
checkpoints.

Every fenced block of those pages whose first line is `$ ckpt-doctor …` is run as written from the repository's
root (after `examples/make_example.py example`), and the block's output is replaced by what the command printed:
the table (stdout) first, long tables shortened to their first rows and last row around a `…`, then the lines for
a person (stderr). The blocks of a page run in the order they appear, so a `fix` block makes the file a later
`verify` block reads. `--check` changes nothing and exits 1 when a block differs from what its command prints now
(timings and memory figures aside), so a test keeps the pages true.

    python examples/readme_examples.py          # rewrite README.md and docs/*.md
    python examples/readme_examples.py --check  # compare only
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```\n(\$ ckpt-doctor [^\n]*)\n(.*?)^```$", re.S | re.M)
HEAD_ROWS, TAIL_ROWS = 3, 1  # table rows kept around the `…` of a long table
# Figures that differ from run to run: seconds, memory, the DDP rendezvous port.
VOLATILE = re.compile(r"\d+(\.\d+)?( ?(s|ms|KB|MB|GB|B))?\b")


def run(command: str, exe: str) -> str:
    argv = shlex.split(command.removeprefix("$ "))
    argv[0] = exe
    env = dict(os.environ, COLUMNS="120", NO_COLOR="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout.rstrip("\n").split("\n") if proc.stdout.strip() else []
    if len(out) > 2 and set(out[1]) <= {"-", " "}:  # a table: shorten its rows (a row with its wrapped lines)
        lines = out[2:]
        blank = lines.index("") if "" in lines else len(lines)  # notes below a table are kept whole
        rows: list[list[str]] = []
        for line in lines[:blank]:
            if line.startswith(" ") and rows:
                rows[-1].append(line)
            else:
                rows.append([line])
        if len(rows) > HEAD_ROWS + TAIL_ROWS + 1:
            rows = rows[:HEAD_ROWS] + [["…"]] + rows[-TAIL_ROWS:]
        out = out[:2] + [line for row in rows for line in row] + lines[blank:]
    err = proc.stderr.rstrip("\n").split("\n") if proc.stderr.strip() else []
    return "\n".join(out + err) + "\n"


def _normal(text: str) -> str:
    """The words of an output, its run-to-run figures masked: a figure one digit longer wraps a cell elsewhere."""
    return " ".join(VOLATILE.sub("#", text).split())


def regenerate(text: str, exe: str) -> tuple[str, list[str]]:
    """The page with every example block's output as its command prints it now, and the commands whose block
    changed (figures that differ from run to run aside)."""
    changed: list[str] = []

    def replace(match: re.Match) -> str:
        command, old = match.group(1), match.group(2)
        new = run(command, exe)
        if _normal(new) != _normal(old):
            changed.append(command)
        return f"```\n{command}\n{new}```"

    return BLOCK.sub(replace, text), changed


def main(argv: list[str]) -> int:
    check = "--check" in argv
    exe = str(Path(sys.executable).with_name("ckpt-doctor"))
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_example.py"), "example"], cwd=ROOT, check=True,
                   capture_output=True)
    stale = 0
    for page in PAGES:
        # outputs the examples write or suggest, so that `fix` runs as shown and suggests the names shown
        for leftover in [ROOT / "example" / "clean.safetensors", *(ROOT / "example").rglob("*_fixed*")]:
            leftover.unlink(missing_ok=True)
        name = page.relative_to(ROOT)
        text = page.read_text()
        new, changed = regenerate(text, exe)
        stale += len(changed)
        if check:
            for command in changed:
                print(f"{name}: example out of date: {command}", file=sys.stderr)
            continue
        if new != text:
            page.write_text(new)
        if BLOCK.search(text):
            print(f"{name}: {len(BLOCK.findall(text))} examples regenerated ({len(changed)} changed)", file=sys.stderr)
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
