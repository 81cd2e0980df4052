"""Benchmark: `ckpt-doctor inspect CKPT --model SPEC` on a 1-2 GB checkpoint (target: within 2 s).

    python bench/bench_model_compare.py [--dir /tmp/ckpt-bench] [--gb 1.5] [--tensors 1000]

The model is built on the meta device and no tensor data is read; the figure is printed beside `import torch`
and `torch.load`, measured in the same run.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import bench_args, make_checkpoint, measure, row, tensor_shape  # noqa: E402

MODEL = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, rows, cols):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))


class Layer(nn.Module):
    def __init__(self, rows, cols):
        super().__init__()
        for j in range(8):
            self.add_module(f"block{j}", Block(rows, cols))


class Big(nn.Module):
    """layers.{i}.block{j}.weight, the keys bench_inspect.py writes."""

    def __init__(self, tensors=1000, rows=1, cols=1):
        super().__init__()
        self.layers = nn.ModuleList(Layer(rows, cols) for _ in range(tensors // 8))
'''


def main() -> None:
    args = bench_args(__doc__)
    folder = Path(args.dir)
    ckpt = folder / f"big_{args.gb}gb_{args.tensors}.pt"
    make_checkpoint(ckpt, int(args.gb * 2**30), args.tensors)
    rows, cols = tensor_shape(int(args.gb * 2**30), args.tensors)
    (folder / "bench_big_model.py").write_text(MODEL)
    exe = shutil.which("ckpt-doctor") or os.path.join(os.path.dirname(sys.executable), "ckpt-doctor")
    spec = f"{folder / 'bench_big_model.py'}:Big"
    cmd = [exe, "inspect", str(ckpt), "--model", spec, "--model-arg", f"tensors={args.tensors}",
           "--model-arg", f"rows={rows}", "--model-arg", f"cols={cols}", "--json"]
    t_cmp, rss_cmp = measure(cmd)
    t_imp, rss_imp = measure([sys.executable, "-c", "import torch"])
    t_load, rss_load = measure([sys.executable, "-c", f"import torch; torch.load({str(ckpt)!r}, weights_only=True)"])
    print(f"checkpoint: {ckpt} ({ckpt.stat().st_size / 2**30:.2f} GB); model built on meta")
    print(row("python -c 'import torch'", t_imp, rss_imp))
    print(row("torch.load(weights_only=True)", t_load, rss_load))
    print(row("ckpt-doctor inspect --model (exit 0 expected)", t_cmp, rss_cmp, t_load, "torch.load"))
    print(f"target (<= 2 s): {'met' if t_cmp <= 2 else 'NOT met'}")


if __name__ == "__main__":
    main()
