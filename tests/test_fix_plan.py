"""The repair planner on its own: options and a checkpoint's structure, built in memory, give the plan. No file is
read or written (the records point at a path that does not exist)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest

from ckpt_doctor.errors import PlanError, UsageError
from ckpt_doctor.fix import FixOptions, OutputFormat, plan_fix
from ckpt_doctor.records import Checkpoint, Format, StorageRecord, TensorRecord
from ckpt_doctor.safepickle.unpickler import RawTensor
from ckpt_doctor.transforms import drop, rename, strip_prefix

NOWHERE = Path("/nonexistent/ckpt-doctor-plan-test/model.pt")
ELEMENT = {"float32": 4, "float16": 2, "int64": 8, "qint8": 1}


def checkpoint(tree: dict, state_dict_root: str | None, device: str = "cpu", shared: dict[str, str] | None = None,
               dtypes: dict[str, str] | None = None) -> Checkpoint:
    """A torch-zip Checkpoint of `tree`, whose leaves are shapes (tuples): each becomes a tensor with a storage of
    its own (or of the key `shared` names), as a reader would list them."""
    records: list[TensorRecord] = []
    storages: dict[str, StorageRecord] = {}
    shared = shared or {}
    dtypes = dtypes or {}

    def walk(node: dict, prefix: str) -> dict:
        out = OrderedDict()
        for name, value in node.items():
            key = prefix + name
            if isinstance(value, dict):
                out[name] = walk(value, key + ".")
            elif isinstance(value, tuple):
                dtype = dtypes.get(key, "float32")
                numel = 1
                for size in value:
                    numel *= size
                owner = shared.get(key, key)
                storage = storages.get(owner)
                if storage is None:
                    storage = storages[owner] = StorageRecord(str(len(storages)), dtype, numel * ELEMENT[dtype],
                                                              device, NOWHERE, 64 * len(storages),
                                                              f"archive/data/{len(storages)}")
                stride = tuple(int(_prod(value[i + 1:])) for i in range(len(value)))
                records.append(TensorRecord(key, dtype, value, stride, 0, storage, device))
                out[name] = RawTensor(None, dtype, 0, value, stride)
            else:
                out[name] = value
        return out

    root = walk(tree, "")
    return Checkpoint(NOWHERE, Format.TORCH_ZIP, tuple(records), {}, (), state_dict_root, root=root,
                      files=(NOWHERE,))


def _prod(sizes: tuple[int, ...]) -> int:
    out = 1
    for size in sizes:
        out *= size
    return out


NET = {"module.conv.weight": (4, 3, 3, 3), "module.conv.bias": (4,), "module.bn.running_mean": (4,),
       "module.bn.num_batches_tracked": ()}


def test_strip_module_renames_every_key_and_keeps_every_tensor():
    ckpt = checkpoint(NET, "", dtypes={"module.bn.num_batches_tracked": "int64"})
    plan = plan_fix(ckpt, Path("out.safetensors"), FixOptions(transforms=(strip_prefix("module."),)))
    assert plan.format is OutputFormat.SAFETENSORS
    assert plan.renamed == {k: k.removeprefix("module.") for k in NET}
    assert [t.key for t in plan.tensors] == [k.removeprefix("module.") for k in NET]
    assert [t.source.key for t in plan.tensors] == list(NET)
    assert plan.dropped == ()
    assert plan.applied == ("--strip-module",)


def test_a_training_checkpoint_gives_its_state_dict_and_lists_the_rest():
    tree = {"model": {"fc.weight": (2, 3), "fc.bias": (2,)}, "optimizer": {"state": {"0": {"exp_avg": (2, 3)}},
                                                                         "param_groups": [{"lr": 0.1}]},
            "epoch": 7}
    plan = plan_fix(checkpoint(tree, "model"), Path("w.safetensors"), FixOptions())
    assert [t.key for t in plan.tensors] == ["fc.weight", "fc.bias"]
    assert set(plan.dropped) == {"optimizer", "epoch"}  # nothing leaves unlisted
    assert any("safetensors holds tensors only" in n for n in plan.notes)


def test_drop_lists_what_it_leaves_out():
    plan = plan_fix(checkpoint(NET, ""), Path("o.pt"), FixOptions(transforms=(drop("running_mean"),)))
    assert "module.bn.running_mean" in plan.dropped
    assert "module.bn.running_mean" not in {t.key for t in plan.tensors}
    assert len(plan.tensors) == len(NET) - 1


def test_dtype_casts_floating_tensors_only_and_map_location_retags():
    ckpt = checkpoint(NET, "", device="cuda:3", dtypes={"module.bn.num_batches_tracked": "int64"})
    plan = plan_fix(ckpt, Path("o.pt"), FixOptions(dtype="float16", map_location=(("*", "cpu"),)))
    by_key = {t.key: t for t in plan.tensors}
    assert by_key["module.conv.weight"].dtype == "float16"
    assert by_key["module.bn.num_batches_tracked"].dtype == "int64"
    assert {t.device for t in plan.tensors} == {"cpu"}
    assert "--dtype float16 (3 tensors)" in plan.applied and "--map-location cpu" in plan.applied


TRAIN = {"model": NET, "optimizer": {"state": {"0": {"step": (), "exp_avg": (4,)}}, "param_groups": [{"lr": 0.1}]},
         "ema": {"conv.weight": (4, 3, 3, 3)}}


@pytest.mark.parametrize("select, cast", [
    (None, {"model.module.conv.weight", "model.module.conv.bias", "model.module.bn.running_mean"}),
    ("", {"model.module.conv.weight", "model.module.conv.bias", "model.module.bn.running_mean",
          "optimizer.state.0.step", "optimizer.state.0.exp_avg", "ema.conv.weight"}),
    ("optimizer", {"state.0.step", "state.0.exp_avg"}),  # the part named: an optimizer's state_dict, whole
    ("ema", {"conv.weight"}),
])
def test_dtype_casts_the_part_written_as_the_state_dict(select, cast):
    """--dtype casts the state_dict found, or the part --select names ('' all of the file); the floating tensors
    beside it are written as saved, counted, and said with the way to cast them."""
    ckpt = checkpoint(TRAIN, "model", dtypes={"model.module.bn.num_batches_tracked": "int64"})
    plan = plan_fix(ckpt, Path("o.pt"), FixOptions(dtype="float16", select=select))
    assert {t.key for t in plan.tensors if t.dtype == "float16"} == cast
    assert plan.cast == (sorted(cast, key=[t.key for t in plan.tensors].index),
                         [t.key for t in plan.tensors if t.key not in cast and t.dtype == "float32"])
    note = [n for n in plan.notes if n.startswith("--dtype casts the model's weights")]
    assert note == (["--dtype casts the model's weights, the state_dict: 3 floating tensors beside it keep their dtype "
                     "(ema, optimizer); --select '' casts all of the file"] if select is None else [])


def test_tied_tensors_are_written_once_in_safetensors_and_shared_in_torch():
    tree = {"emb.weight": (10, 4), "head.weight": (10, 4)}
    ckpt = checkpoint(tree, "", shared={"head.weight": "emb.weight"})
    st = plan_fix(ckpt, Path("o.safetensors"), FixOptions())
    assert st.tied == {"head.weight": "emb.weight"}
    assert st.metadata["ckpt_doctor.tied"] == "head.weight=emb.weight"
    pt = plan_fix(ckpt, Path("o.pt"), FixOptions())
    assert pt.tied == {}
    assert pt.tensors[0].source.storage is pt.tensors[1].source.storage


def test_renames_that_collide_are_refused():
    tree = {"a.weight": (2,), "b.weight": (2,)}
    with pytest.raises(PlanError):
        plan_fix(checkpoint(tree, ""), Path("o.pt"), FixOptions(transforms=(rename("^[ab]=x"),)))


def test_a_select_without_tensors_names_the_entries_that_have_some():
    tree = {"model": {"w": (2,)}, "epoch": 1}
    with pytest.raises(PlanError, match="holds no tensors.*model"):
        plan_fix(checkpoint(tree, "model"), Path("o.pt"), FixOptions(select="epoch"))


def test_quantized_tensors_are_refused_with_the_drop_that_leaves_them_out():
    ckpt = checkpoint({"q.weight": (4,), "fc.weight": (4,)}, "", dtypes={"q.weight": "qint8"})
    with pytest.raises(PlanError, match="quantized") as caught:
        plan_fix(ckpt, Path("o.pt"), FixOptions())
    assert caught.value.reruns[0].add == ("--drop", "^q\\.weight$")


def test_options_that_need_a_model_say_so():
    for opts in (FixOptions(auto=True), FixOptions(reorder=True), FixOptions(allow_missing="^fc")):
        with pytest.raises(UsageError, match="need --model"):
            plan_fix(checkpoint(NET, ""), Path("o.pt"), opts)


def test_the_format_comes_from_the_suffix_unless_named():
    ckpt = checkpoint(NET, "")
    assert plan_fix(ckpt, Path("o.bin"), FixOptions()).format is OutputFormat.TORCH
    assert plan_fix(ckpt, Path("o.bin"), FixOptions(format=OutputFormat.SAFETENSORS)).format is \
        OutputFormat.SAFETENSORS
    with pytest.raises(UsageError, match="suffix"):
        plan_fix(ckpt, Path("o.weights"), FixOptions())


def test_select_everything_in_torch_keeps_the_training_checkpoint_nested():
    tree = {"model": {"fc.weight": (2, 3)}, "optimizer": {"state": {}, "param_groups": []}, "step": 3}
    plan = plan_fix(checkpoint(tree, "model"), Path("o.pt"), FixOptions(select=""))
    assert list(plan.tree) == ["model", "optimizer", "step"]
    assert [t.key for t in plan.tensors] == ["model.fc.weight"]
    assert plan.dropped == ()


def test_one_ranks_shard_is_refused_with_its_folder():
    from ckpt_doctor._record import replace
    from ckpt_doctor.records import DistributedShard

    shard = replace(checkpoint(NET, ""), distributed=DistributedShard("torch.distributed.checkpoint", "/runs/step_9"))
    with pytest.raises(PlanError, match="ckpt-doctor fix /runs/step_9 -o o.pt"):
        plan_fix(shard, Path("o.pt"), FixOptions())


def test_a_distributed_checkpoint_gives_its_model_weights_and_its_own_notes():
    from ckpt_doctor._record import replace
    from ckpt_doctor.records import DeepSpeedFolder

    tree = {"module": {"fc.weight": (0,)}, "fp32_weights": {"fc.weight": (2, 3)}}
    folder = replace(checkpoint(tree, "fp32_weights"),
                     distributed=DeepSpeedFolder(3, 2, "global_step9", 4, ("fp32_weights", "module"), ("ZeRO-3 note",)))
    plan = plan_fix(folder, Path("o.safetensors"), FixOptions())
    assert [t.key for t in plan.tensors] == ["fc.weight"]
    assert plan.notes[0] == "ZeRO-3 note" and "a distributed checkpoint" in plan.notes[1]
    assert folder.distributed.json()["zero_stage"] == 3


def test_a_path_names_a_key_that_holds_dots_before_its_shorter_prefix():
    """`--select a.b.c` of a tree holding both a key "a.b" and a key "a" (whose entry holds "b.c"): the longer key
    is taken first, as the docs say, whichever the container holds first."""
    from ckpt_doctor.fix.rebuild import MISSING, beside, subtree

    tree = {"a": {"b.c": 1, "x": 0}, "a.b": {"c": 2}, "other": 3}
    assert subtree(tree, "a.b.c") == 2
    assert subtree(tree, "a.x") == 0
    assert subtree(tree, "a.b.d") is MISSING
    assert beside(tree, "a.b.c") == ["a", "other"]
