"""Benchmark: consolidating a torch.distributed.checkpoint folder, against torch's own `dcp_to_torch_save` and `cp -r`.

    python bench/bench_dcp.py [--dir /tmp/ckpt-bench] [--rounds 3] [--chunks 1000000] [--fix-gb 1.0]

`--chunks N`: a folder whose `.metadata` holds N chunk entries (N/100 tensors of 100 chunks, one per rank file),
written with torch's own metadata classes and pickled as FileSystemWriter.finish pickles it, every item a real
torch.save archive of its chunk; `inspect --json` of it beside torch's `FileSystemReader.read_metadata()`.
`--fix-gb G`: `fix --format dcp` of a G GiB torch file (1,000 tensors) beside `cp` + `sync` of it; peak RSS <= 150 MB.

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
from _measure import (compile_bytecode, consolidation_report, figure, make_checkpoint, measure_rounds,  # noqa: E402
                      record, row)

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


MAKE_CHUNKS = '''
import io, os, pickle, sys
from pathlib import Path
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

folder, tensors, chunks, cols = Path(sys.argv[1]), int(sys.argv[2]), 100, 8
folder.mkdir(parents=True, exist_ok=True)
buf = io.BytesIO()
torch.save(torch.zeros(1, cols), buf)  # what FileSystemWriter writes for a (1, 8) chunk: its own torch.save archive
item = buf.getvalue()
sdm, storage, planner = {}, {}, {}
props = TensorProperties(dtype=torch.float32)
for t in range(tensors):
    fqn = f"model.layers.{t // 10}.block{t % 10}.weight"
    sdm[fqn] = TensorStorageMetadata(props, torch.Size([chunks, cols]), [
        ChunkStorageMetadata(torch.Size([c, 0]), torch.Size([1, cols])) for c in range(chunks)])
    planner[fqn] = ("model", fqn[len("model."):])
    for c in range(chunks):  # rank c holds row c of every tensor, in its own file
        storage[MetadataIndex(fqn, [c, 0], c)] = _StorageInfo(f"__{c}_0.distcp", t * len(item), len(item))
for c in range(chunks):
    (folder / f"__{c}_0.distcp").write_bytes(item * tensors)
md = Metadata(sdm, planner, storage, StorageMeta(checkpoint_id=str(folder), save_id="bench"), "1.0.0")
with open(folder / ".metadata.tmp", "wb") as f:  # FileSystemWriter.finish: pickle.dump, fsync, rename
    pickle.dump(md, f)
    os.fsync(f.fileno())
os.rename(folder / ".metadata.tmp", folder / ".metadata")
'''


def bench_args(doc: str):
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/ckpt-bench")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each command (the best counts)")
    parser.add_argument("--chunks", type=int, default=0, help="also a folder of this many chunk entries")
    parser.add_argument("--fix-gb", type=float, default=0, help="also fix --format dcp of a file this big")
    parser.add_argument("--skip-fsdp2", action="store_true", help="only the --chunks / --fix-gb figures")
    args = parser.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    return args


def chunks_report(work: Path, exe: str, chunks: int, rounds: int) -> None:
    folder = work / f"dcp_{chunks}_chunks"
    if not (folder / ".metadata").exists():
        print(f"writing {folder} …", file=sys.stderr)
        subprocess.run([sys.executable, "-c", MAKE_CHUNKS, str(folder), str(max(chunks // 100, 1))], check=True)
    peer = ("from torch.distributed.checkpoint import FileSystemReader; "
            f"FileSystemReader({str(folder)!r}).read_metadata()")
    cmds = {"torch FileSystemReader.read_metadata()": [sys.executable, "-c", peer],
            "inspect FOLDER --json": [exe, "inspect", str(folder), "--json"]}
    results = measure_rounds(cmds, rounds)
    base = min(results["torch FileSystemReader.read_metadata()"][0])
    size = (folder / ".metadata").stat().st_size
    print(f"DCP folder of {chunks:,} chunk entries (.metadata {size / 2**20:.0f} MB); best of {rounds}")
    for label, (times, rss) in results.items():
        print(row(label, min(times), rss) + f"  {min(times) / base:.2f}x read_metadata")
    t, rss = min(results["inspect FOLDER --json"][0]), results["inspect FOLDER --json"][1]
    print(f"target (inspect <= 10 s and <= 1 GB): {'met' if t <= 10 and rss <= 1024 else 'NOT met'}")
    peer = "torch FileSystemReader.read_metadata()"
    record([figure(label, times, rss, peer if label != peer else None, results[peer][0] if label != peer else None,
                   by="best") for label, (times, rss) in results.items()],
           [("inspect <= 10 s and <= 1 GB", t <= 10 and rss <= 1024)],
           f"inspect of a DCP folder of {chunks:,} chunk entries")


def fix_dcp_report(work: Path, exe: str, gb: float, rounds: int) -> None:
    source = work / f"big_{gb}gb_1000.pt"
    make_checkpoint(source, int(gb * 2**30), 1000)
    out, copy = work / "fix_dcp_out", work / "fix_dcp_copy.pt"

    def clean() -> None:
        shutil.rmtree(out, ignore_errors=True)
        if copy.exists():
            copy.unlink()
        os.sync()

    cmds = {"cp + sync": ["sh", "-c", f"cp {source} {copy} && sync"],
            "fix --format dcp": [exe, "fix", str(source), "-o", str(out), "--format", "dcp"]}
    results = measure_rounds(cmds, rounds, before=clean)
    clean()
    base = min(results["cp + sync"][0])
    print(f"fix --format dcp of {source} ({source.stat().st_size / 2**20:.0f} MB); best of {rounds}")
    for label, (times, rss) in results.items():
        print(row(label, min(times), rss) + f"  {min(times) / base:.2f}x cp + sync")
    rss = results["fix --format dcp"][1]
    print(f"target (peak RSS <= 150 MB, flat in the file's size): {'met' if rss <= 150 else 'NOT met'}")
    record([figure(label, times, peak, "cp + sync" if label != "cp + sync" else None,
                   results["cp + sync"][0] if label != "cp + sync" else None, by="best")
            for label, (times, peak) in results.items()],
           [("fix --format dcp peak RSS <= 150 MB", rss <= 150)],
           f"fix --format dcp of a {gb} GB file")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def main() -> None:
    args = bench_args(__doc__)
    work = Path(args.dir)
    ckpt = work / "fsdp2_adam_dcp"
    if not args.skip_fsdp2 and not (ckpt / ".metadata").exists():
        script = work / "write_dcp.py"
        script.write_text(WRITE)
        subprocess.run([sys.executable, str(script), str(ckpt)], check=True)
    compile_bytecode()
    exe = shutil.which("ckpt-doctor") or os.path.join(os.path.dirname(sys.executable), "ckpt-doctor")
    if args.chunks:
        chunks_report(work, exe, args.chunks, args.rounds)
    if args.fix_gb:
        fix_dcp_report(work, exe, args.fix_gb, args.rounds)
    if args.skip_fsdp2:
        return
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
                         "fix --select '' -o all.pt (everything)", "inspect FOLDER --json",
                         "consolidating a DCP folder (an FSDP2 model and its Adam state)")
    clean()


if __name__ == "__main__":
    main()
