"""Benchmark: consolidating a torch.distributed.checkpoint folder, against torch's own `dcp_to_torch_save` and `cp -r`.

    python bench/bench_dcp.py [--dir /tmp/ckpt-bench] [--rounds 3]

The folder is written by torch's DCP from two gloo ranks on the CPU: an FSDP2 (`fully_shard`) model of 16
Linear(2048, 2048) layers plus its Adam state, 805 MB. Targets: `fix` ≤ 0.5× the time of `dcp_to_torch_save` and
≤ 1.5× `cp -r` of the folder, peak RSS ≤ 150 MB; `inspect` of the folder ≤ 0.3 s. Every command runs once per
round, in turn; the best time of each is printed beside its baseline from the same rounds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import bench_args, compile_bytecode, consolidation_report  # noqa: E402

WRITE = '''
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.distributed.checkpoint as dcp

def rank(r, out):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    dist.init_process_group("gloo", rank=r, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(16)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank, args=(sys.argv[1],), nprocs=2)
'''


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def main() -> None:
    args = bench_args(__doc__)
    work = Path(args.dir)
    ckpt = work / "fsdp2_adam_dcp"
    if not (ckpt / ".metadata").exists():
        script = work / "write_dcp.py"
        script.write_text(WRITE)
        subprocess.run([sys.executable, str(script), str(ckpt)], check=True)
    compile_bytecode()
    exe = shutil.which("ckpt-doctor") or os.path.join(os.path.dirname(sys.executable), "ckpt-doctor")
    outputs = [work / "dcp_model.safetensors", work / "dcp_all.pt", work / "dcp_official.pt", work / "dcp_copy"]

    def clean() -> None:
        for out in outputs:
            if out.is_dir():
                shutil.rmtree(out)
            elif out.exists():
                out.unlink()
        os.sync()

    official = ("from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                f"dcp_to_torch_save({str(ckpt)!r}, {str(outputs[2])!r})")
    cmds = {
        "dcp_to_torch_save (everything)": [sys.executable, "-c", official],
        "cp -r + sync": ["sh", "-c", f"cp -r {ckpt} {outputs[3]} && sync"],
        "fix --select '' -o all.pt (everything)": [exe, "fix", str(ckpt), "-o", str(outputs[1]), "--select", ""],
        "fix -o model.safetensors (weights)": [exe, "fix", str(ckpt), "-o", str(outputs[0])],
        "inspect FOLDER --json": [exe, "inspect", str(ckpt), "--json"],
    }
    print(f"checkpoint: {ckpt} ({folder_bytes(ckpt) / 2**20:.0f} MB in {len(os.listdir(ckpt))} files; FSDP2 on 2 "
          f"gloo ranks, model + Adam); best of {args.rounds} interleaved rounds")
    consolidation_report(cmds, args.rounds, clean, "dcp_to_torch_save (everything)", "cp -r + sync",
                         "fix --select '' -o all.pt (everything)", "inspect FOLDER --json")
    clean()


if __name__ == "__main__":
    main()
