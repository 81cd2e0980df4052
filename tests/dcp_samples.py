"""torch.distributed.checkpoint folders written by torch's own DCP with two gloo ranks on the CPU, and beside each
the full (unsharded) state every rank saw, saved with torch.save: what consolidating the folder must give back."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too
from tests.helpers import spawn_two  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(10, 7)
        self.bn = torch.nn.BatchNorm1d(7)
        self.l2 = torch.nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.bn(self.l1(x))))


def _full(obj):
    """The unsharded value of a state: DTensors gathered, containers kept."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: _full(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_full(v) for v in obj]
    return obj


def _save(state: dict, folder: Path, rank: int, **kwargs) -> None:
    full = _full(state)
    if "storage_writer" in kwargs:
        dcp.save(state, **kwargs)
    else:
        dcp.save(state, checkpoint_id=str(folder), **kwargs)
    if rank == 0:
        torch.save(full, folder.with_suffix(".full.pt"))


def _rank(rank: int, out: str, port: int) -> None:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    root = Path(out)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    # Bare DTensors: uneven Shard(0), Shard(1) in bf16, Replicate int64, an empty shard, a 0-d tensor, values.
    _save({"s0": distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)]),
           "s1": distribute_tensor(torch.randn(3, 5).to(torch.bfloat16), mesh, [Shard(1)]),
           "rep": distribute_tensor(torch.arange(6, dtype=torch.int64), mesh, [Replicate()]),
           "empty": distribute_tensor(torch.ones(1, 4), mesh, [Shard(0)]),
           "scalar": torch.tensor(3.5), "step": 7, "nested": {"a.b": torch.ones(2)}}, root / "dtensors", rank)
    # FSDP2 (fully_shard on a CPU mesh) with Adam, through get_state_dict: FQN keys, a param_groups list.
    torch.manual_seed(0)
    model = Net()
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 10)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    _save({"model": msd, "optim": osd, "epoch": 3}, root / "fsdp2", rank)
    # DDP-style: every rank holds the same plain tensors; the raw optimizer state_dict keeps integer keys.
    torch.manual_seed(0)
    plain = Net()
    popt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain(torch.randn(4, 10)).sum().backward()
    popt.step()
    _save({"model": plain.state_dict(), "optimizer": popt.state_dict()}, root / "ddp", rank)
    # Saved without collectives: one __R.metadata per rank, each describing only its own chunks; what a rank holds
    # whole (values, replicated and plain tensors) every rank stores, with the same bytes. torch's dcp.load, each
    # rank reading its own metadata, is the oracle (dcp_to_torch_save reads rank 0's alone: the other rows are
    # left uninitialised).
    _save(_nocoll_state(mesh), root / "nocoll", rank, use_collectives=False)
    loaded = _nocoll_state(mesh, zeroed=True)
    dcp.load(loaded, checkpoint_id=str(root / "nocoll"))
    full = _full(loaded)
    if rank == 0:
        torch.save(full, root / "nocoll.loaded.pt")
    # ... FSDP2 training state so saved (its optimizer's param_groups are values both ranks store) ...
    _save({"model": msd, "optim": osd, "epoch": 3}, root / "nocoll_fsdp2", rank, use_collectives=False)
    # ... in torch's safetensors format (values, then one blob per rank), and zstd-compressed ...
    _save(_nocoll_state(mesh), root / "nocoll_stformat", rank, use_collectives=False,
          storage_writer=FileSystemWriter(str(root / "nocoll_stformat"),
                                          serialization_format=SerializationFormat.SAFETENSORS))
    _save(_nocoll_state(mesh), root / "nocoll_zstd", rank, use_collectives=False,
          storage_writer=FileSystemWriter(str(root / "nocoll_zstd"), _extensions=[ZStandard()]))
    # ... and with items whose bytes differ by rank (a rank number, a per-rank tensor): torch gives each rank its
    # own; one file holds rank 0's, as dcp_to_torch_save writes (the .full.pt here is rank 0's state).
    _save({"w": distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)]), "rank": rank,
           "noise": torch.full((3,), float(rank)), "same": torch.arange(3.0)}, root / "nocoll_ranks", rank,
          use_collectives=False)
    # A value whose unpickling would call a function (functools.partial of print): a payload in a real item.
    _save({"w": torch.ones(3), "hook": functools.partial(print, "payload ran")}, root / "payload", rank)
    # A ShardedTensor, what FSDP1's SHARDED_STATE_DICT holds (FSDP1 itself needs an accelerator to run; the tensor
    # it would hand DCP is made here directly, chunked on dim 0 over the two ranks).
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    torch.manual_seed(0)
    whole = torch.randn(7, 4)
    st = sharded_tensor.empty(ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"]), 7, 4)
    for shard in st.local_shards():
        at, rows = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        shard.tensor.copy_(whole[at:at + rows])
    dcp.save({"model": {"w": st, "b": torch.arange(3.0)}}, checkpoint_id=str(root / "sharded_tensor"))
    if rank == 0:
        torch.save({"model": {"w": whole, "b": torch.arange(3.0)}}, root / "sharded_tensor.full.pt")
    # One file per item (single_file_per_rank=False): __R_0.distcp, __R_1.distcp, ...
    _save({"w": distribute_tensor(torch.randn(7, 2), mesh, [Shard(0)]), "b": torch.arange(3.0)},
          root / "multifile", rank, storage_writer=FileSystemWriter(str(root / "multifile"),
                                                                    single_file_per_rank=False))
    # torch's ZStandard extension: every item a zstd frame around its archive (transform_descriptors).
    _save({"w": distribute_tensor(torch.randn(6, 5), mesh, [Shard(1)]), "zeros": torch.zeros(1000), "step": 2},
          root / "zstd", rank, storage_writer=FileSystemWriter(str(root / "zstd"), _extensions=[ZStandard()]))
    # DCP's Hugging Face storage writer, every rank saving its own shard: safetensors files, no .metadata.
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    _save({"w": distribute_tensor(torch.randn(7, 4), mesh, [Shard(0)]), "b": torch.arange(5.0)}, root / "hf", rank,
          storage_writer=HuggingFaceStorageWriter(str(root / "hf"), save_distributed=True))
    # torch's safetensors-format writer: each rank file is its value items, then one safetensors blob.
    _save({"w": distribute_tensor(torch.randn(7, 4), mesh, [Shard(0)]), "b": torch.arange(5.0), "step": 3},
          root / "stformat", rank, storage_writer=FileSystemWriter(
              str(root / "stformat"), serialization_format=SerializationFormat.SAFETENSORS))
    # ... with a blob past 64 KB after several values: read whole, the rank file is no zip (the end record of its
    # last item is too far from the file's end), only a run of items and a blob.
    _save({"w": distribute_tensor(torch.randn(600, 80), mesh, [Shard(0)]), "b": torch.arange(5.0), "step": 3,
           "meta": {"epoch": 1, "names": ["a", "b"]}}, root / "stformat_big", rank, storage_writer=FileSystemWriter(
               str(root / "stformat_big"), serialization_format=SerializationFormat.SAFETENSORS))
    dist.barrier()
    dist.destroy_process_group()


def _nocoll_state(mesh, zeroed: bool = False) -> dict:
    """Uneven Shard(0), Shard(1) in bf16, a replicated DTensor, plain tensors, an empty shard, values in nests."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    state = {"s0": distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)]),
             "s1": distribute_tensor(torch.randn(3, 5).to(torch.bfloat16), mesh, [Shard(1)]),
             "rep": distribute_tensor(torch.arange(6, dtype=torch.int64), mesh, [Replicate()]),
             "empty": distribute_tensor(torch.ones(1, 4), mesh, [Shard(0)]),
             "plain": torch.randn(4, 4), "scalar": torch.tensor(3.5),
             "meta": {"epoch": 3, "names": ["a", "b"], "lr": 0.5}, "step": 7}
    if zeroed:
        for value in state.values():
            if isinstance(value, torch.Tensor):
                (value.to_local() if hasattr(value, "to_local") else value).zero_()
        state["meta"] = {"epoch": 0, "names": [], "lr": 0.0}
        state["step"] = 0
    return state


def _load_rank(rank: int, folder: str, out: str, port: int) -> None:
    """Resume as FSDP2 training would: shard a fresh Net over 2 ranks, dcp.load into its sharded state_dict."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(1)
    model = Net()
    fully_shard(model, mesh=mesh)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, out)
    dist.barrier()
    dist.destroy_process_group()


def load_into_fsdp2(folder: Path, out: Path) -> dict:
    """What a 2-rank FSDP2 Net holds after dcp.load from `folder`, gathered."""
    spawn_two(_load_rank, str(folder), str(out))
    return torch.load(out, weights_only=True)


def _remote_rank(rank: int, out: str, port: int) -> None:
    """An FSDP2 model with 2 MB weights and its Adam state, saved by two ranks: the tensor data outweighs the
    metadata and pickles a remote read fetches (tests/test_remote.py)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    _save({"model": msd, "optim": osd, "epoch": 3}, Path(out), rank)
    dist.barrier()
    dist.destroy_process_group()


def write_remote_sample(out: Path) -> Path:
    """`out`: a DCP folder (two ranks' files, about 12 MB), and beside it `out`.full.pt, the state it holds."""
    spawn_two(_remote_rank, str(out))
    return out


def write_samples(out: Path) -> Path:
    spawn_two(_rank, str(out))
    return out


if __name__ == "__main__":
    write_samples(Path(sys.argv[1]))
