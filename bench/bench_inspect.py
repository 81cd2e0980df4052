"""Benchmark: `ckpt-doctor inspect --json` against `torch.load` + listing, on a 1-2 GB checkpoint.

    python bench/bench_inspect.py [--dir /tmp/ckpt-bench] [--gb 1.5] [--tensors 1000]

Prints each figure beside its baseline measured in the same run, as a ratio. Targets (docs/performance.md): inspect of a
1-2 GB file <= 0.05 s whole process and <= 30 MB; 20,000 tensors in <= 0.2 s. bench_startup.py measures the same
against the safetensors library's own listing and `torch.load(mmap=True)`, as medians of interleaved rounds.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import bench_args, compile_bytecode, make_checkpoint, measure, row  # noqa: E402


def main() -> None:
    args = bench_args(__doc__)
    folder = Path(args.dir)
    big = folder / f"big_{args.gb}gb_{args.tensors}.pt"
    many = folder / "many_20000.pt"
    make_checkpoint(big, int(args.gb * 2**30), args.tensors)
    make_checkpoint(many, 20_000 * 64, 20_000)
    compile_bytecode()
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
    print(f"targets: <= 0.05 s: {'met' if t_doc <= 0.05 else 'NOT met'}; <= 30 MB: "
          f"{'met' if rss_doc <= 30 else 'NOT met'}; 20,000 tensors <= 0.2 s: {'met' if t_many <= 0.2 else 'NOT met'}")


if __name__ == "__main__":
    main()
