"""Benchmark: `ckpt-doctor inspect CKPT --model SPEC`, whose verdict runs torch's own load_state_dict on the model
built on the meta device (no tensor data is read).

    python bench/bench_model_compare.py [--dir /tmp/ckpt-bench] [--gb 1.5] [--tensors 1000]

Targets: a 1-2 GB checkpoint within 2 s; a small model (a wrapped DataParallel file, so the fix is searched and
checked by torch too) within 1.1x `python -c "import torch"`. Each figure is printed beside its baseline measured
in the same run.
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


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3))
        self.classifier = nn.Linear(16, 10)


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

    # A small model, its state_dict saved from DataParallel: the verdict, the fix search and the check of the fix.
    small = folder / "small_dp.pt"
    make_small = (f"import sys, torch; sys.path.insert(0, {str(folder)!r}); from bench_big_model import Small; "
                  f"torch.save({{'module.' + k: v for k, v in Small().state_dict().items()}}, {str(small)!r})")
    os.system(f"{sys.executable} -c \"{make_small}\"")
    t_small, rss_small = measure([exe, "inspect", str(small), "--model", f"{folder / 'bench_big_model.py'}:Small",
                                  "--json"], repeat=5)
    t_imp5, rss_imp5 = measure([sys.executable, "-c", "import torch"], repeat=5)
    print(row("python -c 'import torch' (best of 5)", t_imp5, rss_imp5))
    ratio = f"  {t_small / t_imp5:.2f}x import torch"
    print(row("inspect --model, small DataParallel file", t_small, rss_small) + ratio)
    print(f"target (<= 1.1x import torch): {'met' if t_small <= 1.1 * t_imp5 else 'NOT met'}")


if __name__ == "__main__":
    main()
