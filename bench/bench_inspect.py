"""Benchmark: `ckpt-doctor inspect --json` against `torch.load` + listing, on a 1-2 GB checkpoint.

    python bench/bench_inspect.py [--dir /tmp/ckpt-bench] [--gb 1.5] [--tensors 1000]

Prints each figure beside its baseline measured in the same run, as a ratio. Targets (DESIGN.md):
inspect >= 30x faster than torch.load, peak RSS <= 60 MB; 20,000 tensors in <= 0.5 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import measure, row  # noqa: E402


MAKE = """
import sys, torch
path, total, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
per = max(total // n // 4, 1)
side = int(per ** 0.5)
torch.save({f"layers.{i // 8}.block{i % 8}.weight": torch.randn(side, per // side) for i in range(n)}, path)
"""


def make_checkpoint(path: Path, total_bytes: int, n_tensors: int) -> None:
    # In a child process: a parent that held the tensors would pass its peak RSS on to every child it forks.
    subprocess.run([sys.executable, "-c", MAKE, str(path), str(total_bytes), str(n_tensors)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/ckpt-bench")
    parser.add_argument("--gb", type=float, default=1.5)
    parser.add_argument("--tensors", type=int, default=1000)
    args = parser.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    big = folder / f"big_{args.gb}gb_{args.tensors}.pt"
    many = folder / "many_20000.pt"
    if not big.exists():
        print(f"writing {big} …", file=sys.stderr)
        make_checkpoint(big, int(args.gb * 2**30), args.tensors)
    if not many.exists():
        make_checkpoint(many, 20_000 * 64, 20_000)
    py = sys.executable
    exe = shutil.which("ckpt-doctor") or os.path.join(os.path.dirname(py), "ckpt-doctor")
    listing = ("import sys, torch; sd = torch.load(sys.argv[1], map_location='cpu', weights_only=True); "
               "print([(k, tuple(v.shape), v.dtype) for k, v in sd.items()])")
    size_gb = big.stat().st_size / 2**30
    print(f"checkpoint: {big} ({size_gb:.2f} GB, {args.tensors} tensors); 20,000-tensor file: {many}")
    os.system(f"cat {big} > /dev/null")  # warm the page cache for both sides alike
    t_load, rss_load = measure([py, "-c", listing, str(big)])
    t_doc, rss_doc = measure([exe, "inspect", str(big), "--json"])
    t_import, rss_import = measure([py, "-c", "import torch"])
    t_many, rss_many = measure([exe, "inspect", str(many), "--json"])
    t_many_load, rss_many_load = measure([py, "-c", listing, str(many)])
    print(row("torch.load(weights_only=True) + listing", t_load, rss_load))
    print(row("ckpt-doctor inspect --json", t_doc, rss_doc, t_load, "torch.load"))
    print(row("python -c 'import torch' (for scale)", t_import, rss_import))
    print(row("torch.load + listing, 20,000 tensors", t_many_load, rss_many_load))
    print(row("ckpt-doctor inspect --json, 20,000 tensors", t_many, rss_many, t_many_load, "torch.load"))
    ok = t_load / t_doc >= 30 and rss_doc <= 60 and t_many <= 0.5
    print(f"targets (>=30x, <=60 MB, 20k tensors <=0.5 s): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
