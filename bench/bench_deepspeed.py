"""Benchmark: consolidating DeepSpeed ZeRO-2 and ZeRO-3 checkpoints, against DeepSpeed's own zero_to_fp32 and `cp -r`.

    python bench/bench_deepspeed.py [--dir /tmp/ckpt-bench] [--rounds 3]
    python bench/bench_deepspeed.py --ranks 8,16,64 [--rounds 1]

--ranks: folders of that many ranks (ZeRO-2 and ZeRO-3, 800 parameters of a 400-layer model, written as DeepSpeed
writes them by _zero_folders.py: 64 gloo ranks do not fit this machine); `inspect` and `fix` of each beside
zero_to_fp32 and a torch.load of every rank file, with the ratios. Both peers unpickle every rank file; fix walks every
one (what it would import) and unpickles the optimizer states and rank 0's model states (a ZeRO-3 folder has one per
rank, each listing every parameter: the others are walked only, in forked processes, unless frozen parameters are
saved): the figures should grow with the ranks as theirs do (linearly), not faster. Targets at 64 ranks: `fix` ≤ 0.5×
zero_to_fp32 and ≤ 150 MB.

The checkpoints are written by DeepSpeed itself (DS_ACCELERATOR=cpu, two gloo ranks, Adam): a model of 16
Linear(2048, 2048) layers, 268 MB of fp32 weights. Targets: `fix` ≤ 0.5× the time of `zero_to_fp32` and ≤ 1.5×
`cp -r` of the tag folder, peak RSS ≤ 150 MB; `inspect` of the folder ≤ 0.3 s. Every command runs once per round, in
turn; the best time of each is printed beside its baselines from the same rounds.
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
import os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch, torch.multiprocessing as mp

def rank(r, out, stage):
    import deepspeed
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29640 + stage), RANK=str(r), LOCAL_RANK=str(r),
                      WORLD_SIZE="2")
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(16)])
    config = {"train_batch_size": 2, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(torch.randn(1, 2048)).sum())
    engine.step()
    engine.save_checkpoint(out, tag="global_step1")
    torch.distributed.barrier()
    os._exit(0)  # skip the C++ destructors of DeepSpeed's CPU comm op (they can abort at exit)

if __name__ == "__main__":
    mp.spawn(rank, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
'''


def folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def by_ranks(args, exe: str) -> None:
    """inspect and fix of ZeRO-2/-3 folders of each rank count in --ranks, beside their peers."""
    from _measure import figure, measure_rounds, record, row

    work = Path(args.dir)
    # torch's default load of every rank file, the DeepSpeed records they name allowed as torch asks for them
    load_all = ("import os, sys, glob, torch; os.environ['DS_ACCELERATOR'] = 'cpu'; "
                "from deepspeed.runtime.zero.config import ZeroStageEnum; "
                "from deepspeed.utils.tensor_fragment import fragment_address; "
                "from deepspeed.runtime.fp16.loss_scaler import LossScaler; "
                "torch.serialization.add_safe_globals([ZeroStageEnum, fragment_address, LossScaler]); "
                "[torch.load(f, weights_only=True) for f in sorted(glob.glob(sys.argv[1] + '/global_step1/*.pt'))]")
    for stage in (2, 3):
        for ranks in (int(r) for r in args.ranks.split(",")):
            ckpt = work / f"zero{stage}_r{ranks}"
            if not (ckpt / "latest").exists():
                subprocess.run([sys.executable, str(Path(__file__).parent / "_zero_folders.py"), str(ckpt), str(stage),
                                str(ranks), "400", "32"], check=True, stderr=subprocess.DEVNULL)
            out = work / f"zero{stage}_r{ranks}.safetensors"
            official = ("import os, sys; os.environ['DS_ACCELERATOR'] = 'cpu'; "
                        "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as g; "
                        "g(sys.argv[1])")
            cmds = {"zero_to_fp32 (state_dict in memory)": [sys.executable, "-c", official, str(ckpt)],
                    "torch.load of every rank file": [sys.executable, "-c", load_all, str(ckpt)],
                    "inspect FOLDER --json": [exe, "inspect", str(ckpt), "--json"],
                    "fix -o fp32.safetensors": [exe, "fix", str(ckpt), "-o", str(out)]}
            results = measure_rounds(cmds, args.rounds, before=lambda out=out: out.unlink(missing_ok=True))
            best = {k: (min(t), rss) for k, (t, rss) in results.items()}
            out.unlink(missing_ok=True)
            t_off, t_load = best["zero_to_fp32 (state_dict in memory)"][0], best["torch.load of every rank file"][0]
            print(f"ZeRO-{stage}, {ranks} ranks ({folder_mb(ckpt / 'global_step1'):.1f} MB), best of {args.rounds}:")
            for label, (seconds, rss) in best.items():
                extra = f"  {seconds / t_off:.2f}x zero_to_fp32, {seconds / t_load:.2f}x torch.load all" \
                    if not label.startswith(("zero", "torch")) else ""
                print("  " + row(label, seconds, rss) + extra)
            official_times = results["zero_to_fp32 (state_dict in memory)"][0]
            ours = ("fix", "inspect")
            record([figure(label, times, rss, "zero_to_fp32 (state_dict in memory)" if label.startswith(ours) else None,
                           official_times if label.startswith(ours) else None, by="best")
                    for label, (times, rss) in results.items()],
                   [("fix <= 0.5x zero_to_fp32", best["fix -o fp32.safetensors"][0] <= 0.5 * t_off),
                    ("fix peak RSS <= 150 MB", best["fix -o fp32.safetensors"][1] <= 150)],
                   f"a ZeRO-{stage} folder of {ranks} ranks")


def main() -> None:
    import argparse

    ranks = argparse.ArgumentParser(add_help=False)
    ranks.add_argument("--ranks", default=None)
    known, rest = ranks.parse_known_args()
    argv = list(sys.argv)
    sys.argv[1:] = rest
    args = bench_args(__doc__)
    sys.argv[:] = argv  # (record() writes the command as it was given, --ranks included)
    args.ranks = known.ranks
    if args.ranks:
        compile_bytecode()
        by_ranks(args, shutil.which("ckpt-doctor") or os.path.join(os.path.dirname(sys.executable), "ckpt-doctor"))
        return
    work = Path(args.dir)
    exe = shutil.which("ckpt-doctor") or os.path.join(os.path.dirname(sys.executable), "ckpt-doctor")
    compile_bytecode()
    for stage in (2, 3):
        ckpt = work / f"zero{stage}"
        if not (ckpt / "latest").exists():
            script = work / "write_zero.py"
            script.write_text(WRITE)
            subprocess.run([sys.executable, str(script), str(ckpt), str(stage)], check=True,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        outputs = [work / f"zero{stage}_fp32.safetensors", work / f"zero{stage}_official.pt", work / "zero_copy"]

        def clean() -> None:
            for out in outputs:
                if out.is_dir():
                    shutil.rmtree(out)
                elif out.exists():
                    out.unlink()
            os.sync()

        official = ("import os; os.environ['DS_ACCELERATOR'] = 'cpu'; "
                    "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c; "
                    f"c({str(ckpt)!r}, {str(outputs[1])!r}, safe_serialization=False)")
        cmds = {
            "zero_to_fp32 (deepspeed's own)": [sys.executable, "-c", official],
            "cp -r tag folder + sync": ["sh", "-c", f"cp -r {ckpt / 'global_step1'} {outputs[2]} && sync"],
            "fix -o fp32.safetensors": [exe, "fix", str(ckpt), "-o", str(outputs[0])],
            "inspect FOLDER --json": [exe, "inspect", str(ckpt), "--json"],
        }
        print(f"ZeRO-{stage}: {ckpt} ({folder_mb(ckpt / 'global_step1'):.0f} MB in the tag folder, 268 MB of fp32 "
              f"weights; 2 gloo ranks, Adam); best of {args.rounds} interleaved rounds")
        consolidation_report(cmds, args.rounds, clean, "zero_to_fp32 (deepspeed's own)", "cp -r tag folder + sync",
                             "fix -o fp32.safetensors", "inspect FOLDER --json",
                             f"consolidating a ZeRO-{stage} folder written by DeepSpeed")
        clean()


if __name__ == "__main__":
    main()
