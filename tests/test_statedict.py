"""The one-pass reading of torch.save's state_dict pickles (safepickle.statedict) against the two passes it stands
for — the walker and SafeUnpickler — on checkpoints torch writes, and on those bytes mutated: whatever the one-pass
reader accepts, the two passes read the same way; whatever they would refuse or judge otherwise, it declines."""

from __future__ import annotations

import io
import random
import zipfile
from collections import OrderedDict

import pytest
import torch
from torch import nn

from ckpt_doctor.readers import read_checkpoint
from ckpt_doctor.safepickle import limits
from ckpt_doctor.safepickle.policy import DEFAULT_POLICY
from ckpt_doctor.safepickle.statedict import read_state_dict
from ckpt_doctor.safepickle.unpickler import RawTensor, SafeUnpickler, StorageRef
from ckpt_doctor.safepickle.walker import new_budget, walk


class Net(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)  # a 4-dimensional weight: its shape goes opcode by opcode
        self.norm = nn.BatchNorm2d(4)  # num_batches_tracked: a 0-dimensional int64 tensor
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(blocks))
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.blocks[0].weight  # tied: one storage, fetched again from the memo


def _views(base: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"view{i}": base[i:i + 2] for i in range(300)}  # one storage key, fetched again for every view


def _pickle_of(obj: object, tmp_path, name: str = "ckpt.pt") -> bytes:
    path = tmp_path / name
    torch.save(obj, path)
    with zipfile.ZipFile(path) as archive:
        member = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        return archive.read(member)


def _norm(value: object) -> object:
    """A comparable form of what the unpickler hands back."""
    kind = value.__class__
    if kind is RawTensor:
        return ("tensor", _norm(value.storage), value.dtype, value.offset, value.shape, value.stride,
                value.requires_grad, value.is_parameter, value.device, value.note)
    if kind is StorageRef:
        return ("storage", value.key, value.dtype, value.numel, value.location, value.view_of, value.view_offset)
    if kind is dict or kind is OrderedDict:
        return (kind.__name__, [(k, _norm(v)) for k, v in value.items()],
                sorted((k, _norm(v)) for k, v in vars(value).items()) if kind is OrderedDict else None)
    if kind is tuple:
        return tuple(_norm(v) for v in value)
    if kind is list:
        return ("list", [_norm(v) for v in value])
    if kind is float:  # by its bytes: NaN equal to itself, -0.0 not to 0.0
        import struct

        return ("float", struct.pack(">d", value))
    return (kind.__name__, value)


def _training(optimizer, **options) -> dict:
    """A training checkpoint as scripts save one: the model's state_dict, its optimizer's and scheduler's after a
    step, the epoch, a loss, the RNG state."""
    torch.manual_seed(0)
    net = Net(blocks=40)
    opt = optimizer(net.parameters(), **options)
    for param in net.parameters():
        param.grad = torch.ones_like(param)
    opt.step()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 3)
    return {"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": scheduler.state_dict(),
            "epoch": 3, "loss": 0.25, "rng": torch.get_rng_state()}


def _deep(value: object, levels: int) -> object:
    for _ in range(levels):
        value = [value]
    return value


def _two_passes(data: bytes, name: str = "archive/data.pkl"):
    """What the walker and SafeUnpickler make of `data`: (walk, root, unpickler), root None when it fails."""
    walked = walk(data, name)
    unpickler = SafeUnpickler(io.BytesIO(data), name)
    try:
        root = unpickler.load()
    except Exception:  # noqa: BLE001 - any failure: the one-pass reader must have declined
        root = None
    return walked, root, unpickler


def _same_as_two_passes(data: bytes, name: str = "archive/data.pkl") -> bool:
    """Whether the one-pass reading of `data` matches the two passes (the walk's budget debited alike); False when
    it declined."""
    budget = new_budget()
    fast = read_state_dict(data, name, DEFAULT_POLICY, budget)
    if fast is None:
        return False
    walked_budget = new_budget()
    walk(data, name, budget=walked_budget)
    assert budget == walked_budget, "the walk's opcodes counted otherwise"
    walked, root, unpickler = _two_passes(data, name)
    assert walked.refused is None and walked.broken is None and not walked.findings, "accepted what the walk refuses"
    assert not (walked.notes or walked.anomalies or walked.effects or walked.unresolved)
    assert walked.pickles == fast.walk.pickles and walked.end == fast.walk.end
    assert walked.globals == fast.walk.globals
    assert root is not None, "accepted what SafeUnpickler cannot read"
    assert _norm(root) == _norm(fast.root)
    assert unpickler.globals == fast.globals and unpickler.notes == fast.notes == []
    assert [_norm(r) for r in unpickler.storages.values()] == [_norm(r) for r in fast.storages.values()]
    return True


@pytest.mark.parametrize("make", [
    pytest.param(lambda: Net().state_dict(), id="model-state-dict"),
    pytest.param(lambda: Net(blocks=120).state_dict(), id="past-256-memo-entries"),
    pytest.param(lambda: dict(Net(blocks=80).half().state_dict()), id="plain-dict-float16"),
    pytest.param(lambda: {"model": Net(blocks=70).state_dict(), "epoch": 7, "name": "run-3", "best": True},
                 id="nested-training-checkpoint"),
    pytest.param(lambda: {f"t{i}": torch.zeros(3, dtype=d) for i, d in
                          enumerate([torch.bfloat16, torch.int8, torch.bool, torch.int64, torch.complex64] * 70)},
                 id="dtypes"),
    pytest.param(lambda: _views(torch.arange(400.0)), id="views-of-one-storage"),
    pytest.param(lambda: torch.arange(6.0).reshape(2, 3)[:, 1:], id="one-tensor-saved-alone"),
    pytest.param(lambda: {f"big{i}": torch.zeros(1, 1).expand(70_000, 1) for i in range(300)},
                 id="wide-ints-and-zero-strides"),
    pytest.param(lambda: {"opt": torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1).state_dict()},
                 id="optimizer-lists-and-floats"),
    pytest.param(lambda: _training(torch.optim.Adam, lr=1e-3), id="training-checkpoint-adam"),
    pytest.param(lambda: _training(torch.optim.AdamW, lr=1e-3, amsgrad=True), id="training-checkpoint-adamw"),
    pytest.param(lambda: _training(torch.optim.SGD, lr=0.1, momentum=0.9), id="training-checkpoint-sgd"),
    pytest.param(lambda: {"losses": [0.5, float("inf"), -0.0], "best": None, "tensors": [torch.ones(2)] * 3,
                          "pair": (1, "a", 2.5, None, True), "empty": [], "nested": [[1, 2], {"k": [3]}]},
                 id="lists-tuples-floats-none"),
])
def test_torch_save_pickles_read_in_one_pass_as_two_passes_read_them(make, tmp_path) -> None:
    torch.manual_seed(0)
    assert _same_as_two_passes(_pickle_of(make(), tmp_path))


@pytest.mark.parametrize("make", [
    pytest.param(lambda: {"w": nn.Parameter(torch.zeros(2))}, id="parameter"),
    pytest.param(lambda: {"shape": torch.Size([2, 3])}, id="torch-size"),
    pytest.param(lambda: [torch.zeros(2)], id="list-root"),
    pytest.param(lambda: {"a": (torch.zeros(2),)}, id="tuple-of-a-tensor"),
    pytest.param(lambda: {"a": ([1],)}, id="tuple-of-a-list"),
    pytest.param(lambda: {"a": [(1, 2)]}, id="tuple-in-a-list"),
    pytest.param(lambda: {2**61: torch.zeros(2), 2**62 - 1: torch.zeros(2)}, id="int-keys-of-one-hash"),
    pytest.param(lambda: {-1: torch.zeros(2)}, id="negative-int-key"),
    pytest.param(lambda: {(1, 2): torch.zeros(2)}, id="tuple-key"),
    pytest.param(lambda: {1.5: torch.zeros(2)}, id="float-key"),
    pytest.param(lambda: {"deep": _deep([torch.zeros(1)], 12)}, id="lists-past-the-height-bound"),
])
def test_other_pickles_are_left_to_the_two_passes(make, tmp_path) -> None:
    data = _pickle_of(make(), tmp_path)
    assert read_state_dict(data, "archive/data.pkl", DEFAULT_POLICY) is None
    assert _two_passes(data)[1] is not None  # the two passes read it


def _mutate(data: bytes, what: str) -> bytes:
    if what == "global":  # the rebuild named as a function that runs a command, the same length
        return data.replace(b"torch._utils\n_rebuild_tensor_v2\n", b"os\nsystem\n" + b"_" * 22, 1)
    if what == "trailing":
        return data + b"\x80\x02cos\nsystem\nq\x00."
    if what == "truncated":
        return data[:-1]
    index = data.rindex(b"r", 0, len(data) // 2)
    while data[index + 1:index + 3] != data[index - 9:index - 7]:  # a LONG_BINPUT: its index shares high bytes
        index = data.rindex(b"r", 0, index)
    if what == "put-index":  # one memo index, past the first 256, off by one
        value = int.from_bytes(data[index + 1:index + 5], "little") + 1
        return data[:index + 1] + value.to_bytes(4, "little") + data[index + 5:]
    raise AssertionError(what)


@pytest.mark.parametrize("what", ["global", "trailing", "truncated", "put-index"])
def test_a_pickle_off_the_grammar_is_declined(what, tmp_path) -> None:
    data = _mutate(_pickle_of(Net(blocks=100).state_dict(), tmp_path), what)
    assert read_state_dict(data, "archive/data.pkl", DEFAULT_POLICY) is None


@pytest.mark.parametrize("shared", [{"version": 1}, [1, 2]], ids=["dict", "list"])
def test_a_container_fetched_from_the_memo_is_declined(shared) -> None:
    """A dict or list met twice (the memo's GET): declined, so no container is shared and none holds itself."""
    data = io.BytesIO()
    import pickle

    pickle.dump({"a": shared, "b": shared}, data, protocol=2)
    assert read_state_dict(data.getvalue(), "data.pkl", DEFAULT_POLICY) is None
    loop: list = []
    loop.append(loop)
    data = io.BytesIO()
    pickle.dump({"loop": loop}, data, protocol=2)
    assert read_state_dict(data.getvalue(), "data.pkl", DEFAULT_POLICY) is None


def test_a_tuple_fetched_for_every_value_is_looked_at_once(monkeypatch) -> None:
    """A tuple of scalars stored once and fetched from the memo as the value of every key (an optimizer's betas,
    shared by its param groups, at a file's scale): its items are looked at once, not once a value. They were looked
    at each time, quadratic: a 20,000-item tuple put under 20,000 keys (180 KB) took the one-pass reader 14 s."""
    import builtins
    import struct

    from ckpt_doctor.safepickle import statedict

    looked = [0]

    def counting_set(items=()):
        items = list(items)
        looked[0] += len(items)
        return builtins.set(items)

    monkeypatch.setattr(statedict, "set", counting_set, raising=False)
    n = 2000
    data = (b"\x80\x02}q\x00(K\x00(" + b"K\x01" * n + b"tq\x01"
            + b"".join(b"J" + struct.pack("<i", k) + b"h\x01" for k in range(1, n)) + b"u.")
    read = read_state_dict(data, "data.pkl", DEFAULT_POLICY)
    assert read is not None and read.root == {k: (1,) * n for k in range(n)}
    assert looked[0] <= 4 * len(data), f"{looked[0]:,} items looked at for a {len(data):,}-byte pickle"
    monkeypatch.undo()
    assert _same_as_two_passes(data)


@pytest.mark.parametrize("make", [lambda: Net(blocks=90).state_dict(), lambda: _training(torch.optim.Adam)],
                         ids=["state-dict", "training-checkpoint"])
def test_every_mutation_it_accepts_reads_as_the_two_passes_read_it(make, tmp_path) -> None:
    """Bytes of a real state_dict or training checkpoint pickle changed at random (a byte set, dropped, or
    repeated): each mutant the one-pass reader accepts is read the same by the walker and SafeUnpickler, or the test
    fails."""
    data = _pickle_of(make(), tmp_path)
    rng = random.Random(27)
    accepted = 0
    for _ in range(400):
        at = rng.randrange(2, len(data))
        how = rng.randrange(3)
        if how == 0:
            mutant = data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
        elif how == 1:
            mutant = data[:at] + data[at + 1:]
        else:
            mutant = data[:at] + data[at:at + 1] + data[at:]
        accepted += _same_as_two_passes(mutant)
    assert 0 < accepted < 400  # some changes keep to the grammar (a digit of a key, a shape); most do not


def test_inspect_reads_a_state_dict_the_same_either_way(tmp_path, monkeypatch) -> None:
    """The reader's Checkpoint of a torch.save file is the same with the one-pass reader as without it."""
    from ckpt_doctor.safepickle import statedict

    path = tmp_path / "model.pt"
    torch.save(Net(blocks=100).state_dict(), path)
    reads = []
    monkeypatch.setattr(statedict, "read_state_dict", lambda *args: reads.append(read_state_dict(*args)) or reads[-1])
    fast = read_checkpoint(path)
    assert len(reads) == 1 and reads[0] is not None  # read in one pass
    monkeypatch.setattr(statedict, "read_state_dict", lambda *args: None)
    slow = read_checkpoint(path)
    assert len(fast.tensors) == 208  # 2 + 5 + 100 * 2 + 1 (the head's weight is the first block's)
    assert [fast.tensors[i] for i in range(len(fast.tensors))] == [slow.tensors[i] for i in range(len(slow.tensors))]
    assert fast.globals == slow.globals and fast.notes == slow.notes and fast.hazards == slow.hazards


def test_the_survey_reads_data_pkl_as_the_main_pickle(tmp_path) -> None:
    """The data.pkl torch unpickles is the survey's main pickle — read in one pass, its walk the one the readers
    consult — and bytes after its STOP are noted as torch ignores them."""
    from ckpt_doctor.readers.survey import survey_file

    path = tmp_path / "model.pt"
    torch.save(Net().state_dict(), path)
    survey = survey_file(path)
    assert survey.main_read is not None and survey.main_walk is survey.main_read.walk

    padded = tmp_path / "padded.pt"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(padded, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info)
            target.writestr(info, data + b"\x00\x01" if info.filename.endswith("/data.pkl") else data)
    assert set(torch.load(padded, weights_only=True)) == set(Net().state_dict())  # torch ignores them
    survey = survey_file(padded)
    assert survey.main_walk is not None and survey.main_read is None  # bytes after STOP: the two passes read it
    assert any("holds 2 bytes after its end" in note for note in read_checkpoint(padded).notes)


def _latin1_pickle_naming(module: str, name: str) -> str:
    """A pickle as protocol 2 writes bytes inside a str (latin-1 text): the walker walks such text as a pickle."""
    return (b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"X\x02\x00\x00\x00idR.").decode("latin-1")


@pytest.mark.parametrize("where", ["value", "key"])
def test_text_that_is_a_pickle_is_left_to_the_walk(where, tmp_path) -> None:
    """A str holding a pickle (a payload for pickle.loads) is walked by the walker, which names os.system; the
    one-pass reader declines the file rather than read past it."""
    payload = _latin1_pickle_naming("os", "system")
    state = {f"w{i}": torch.zeros(2) for i in range(300)}
    state.update({"note": payload} if where == "value" else {payload: torch.zeros(2)})
    data = _pickle_of(state, tmp_path)
    assert read_state_dict(data, "archive/data.pkl", DEFAULT_POLICY) is None
    assert [g.qualname for g in walk(data, "archive/data.pkl").findings] == ["os.system"]


def test_the_walks_bounds_hold_for_the_one_pass_reader(tmp_path, monkeypatch) -> None:
    """A pickle past the walk's opcode budget or memo bound is declined, and the walk refuses it."""
    data = _pickle_of({f"w{i}": torch.zeros(2) for i in range(400)}, tmp_path)
    used = new_budget()
    assert read_state_dict(data, "archive/data.pkl", DEFAULT_POLICY, used) is not None
    opcodes = new_budget()[1] - used[1]
    short = new_budget()
    short[1] = opcodes - 1
    assert read_state_dict(data, "archive/data.pkl", DEFAULT_POLICY, short) is None
    short = new_budget()
    short[1] = opcodes - 1
    assert "opcodes" in walk(data, "archive/data.pkl", budget=short).refused
    monkeypatch.setattr(limits, "MAX_MEMO_ENTRIES", 1000)
    monkeypatch.setattr(limits, "MEMO_BYTES_PER_ENTRY", 1 << 30)
    assert read_state_dict(data, "archive/data.pkl", DEFAULT_POLICY) is None
    assert "memo entries" in walk(data, "archive/data.pkl").refused


def test_a_negative_numel_on_a_storage_named_again_is_declined(tmp_path) -> None:
    """SafeUnpickler refuses every persistent id of a negative size, also for a storage it has met: so does the
    one-pass reader, on the template's path too (past the first 256 memo entries)."""
    base = torch.zeros(8)
    data = _pickle_of({**{f"w{i}": torch.zeros(2) for i in range(100)}, "a": base[:4], "b": base[4:]}, tmp_path)
    second = data.rindex(b"X\x01\x00\x00\x00b")  # the key "b": its storage is named again, with its numel
    at = data.index(b"K\x08t", second)
    mutant = data[:at] + b"J\xff\xff\xff\xff" + data[at + 2:]
    assert read_state_dict(data, "archive/data.pkl", DEFAULT_POLICY) is not None
    assert read_state_dict(mutant, "archive/data.pkl", DEFAULT_POLICY) is None
    assert _two_passes(mutant)[1] is None  # SafeUnpickler cannot read it


def test_a_long_get_whose_index_holds_mark_bytes_is_read_as_the_unpickler_reads_it(tmp_path) -> None:
    """The half-precision storage class first stored at memo index 10280 (bytes 28 28 00 00, two MARK opcodes'
    bytes) and fetched by LONG_BINGET for the next tensor: its dtype is read as the unpickler reads it."""
    state = {f"a{i}": torch.zeros(2, 2) for i in range(1281)}
    state["v0"] = state["a0"][1]  # a view: its storage key fetched again, one memo entry fewer
    state.update({f"c{i}": torch.zeros(()) for i in range(3)})
    state.update(h0=torch.zeros(2, 2, dtype=torch.float16), h1=torch.zeros(2, 2, dtype=torch.float16))
    data = _pickle_of(state, tmp_path)
    assert b"j((\x00\x00" in data  # the fetch this test is about (torch's layout of memo indices)
    assert _same_as_two_passes(data)
    assert read_state_dict(data, "archive/data.pkl", DEFAULT_POLICY).root["h1"].dtype == "float16"


def test_build_that_sets_a_dunder_is_left_to_the_unpickler(tmp_path) -> None:
    """A BUILD whose state sets __setstate__ on the state_dict makes CPython's next BUILD call it (SafeUnpickler
    fails on the file): the one-pass reader declines such a state rather than read past it."""
    data = _pickle_of(nn.Sequential(nn.Linear(2, 2)).state_dict(), tmp_path)
    assert data.endswith(b"b.")
    builds = b"}(X\x0c\x00\x00\x00__setstate__K\x01ub}(X\x01\x00\x00\x00yK\x01ub"
    mutant = data[:-1] + builds + b"."
    assert read_state_dict(mutant, "archive/data.pkl", DEFAULT_POLICY) is None
    assert _two_passes(mutant)[1] is None


def test_an_item_past_the_memo_bound_is_counted_once(tmp_path, monkeypatch) -> None:
    """The template stops before an item that would pass the walk's memo bound, and the item is then read opcode
    by opcode: its opcodes are debited from the walk's budget once, as the walk debits them."""
    data = _pickle_of({**{f"w{i}": torch.zeros(2) for i in range(60)}, **{f"s{i}": torch.zeros(()) for i in range(5)}},
                      tmp_path)
    entries = 8 * 60 + 6 * 5 + 16  # what torch's layout stores, about
    for cap in range(entries - 40, entries + 8):
        monkeypatch.setattr(limits, "MAX_MEMO_ENTRIES", cap)
        monkeypatch.setattr(limits, "MEMO_BYTES_PER_ENTRY", 1 << 30)
        fast_budget, walked_budget = new_budget(), new_budget()
        fast = read_state_dict(data, "archive/data.pkl", DEFAULT_POLICY, fast_budget)
        walked = walk(data, "archive/data.pkl", budget=walked_budget)
        assert (fast is None) == (walked.refused is not None)
        if fast is not None:
            assert fast_budget == walked_budget


def _read_both_ways(data: bytes, monkeypatch) -> tuple[object, object]:
    """The one-pass reading of `data` with its runs of items read a column at a time, and with every item read one
    by one (the loop alone): (budget used, comparable result) for each."""
    from ckpt_doctor.safepickle import statedict

    results = []
    for at_once in (True, False):
        with monkeypatch.context() as patch:
            if not at_once:
                patch.setattr(statedict._Reader, "_run", lambda *args: None)
            budget = new_budget()
            read = read_state_dict(data, "archive/data.pkl", DEFAULT_POLICY, budget)
            results.append((budget, None if read is None else (
                _norm(read.root), [_norm(r) for r in read.storages.values()], read.walk.pickles, read.walk.globals,
                read.globals)))
    return results[0], results[1]


@pytest.mark.parametrize("make", [
    pytest.param(lambda: {f"w{i}": torch.zeros(2) for i in range(700)}, id="one-dimensional"),
    pytest.param(lambda: Net(blocks=150).state_dict(), id="scalars-and-4d-between"),
    pytest.param(lambda: {f"s{i}": torch.zeros(()) if i % 3 else torch.zeros(2, 3) for i in range(600)},
                 id="scalars-in-the-run"),
    pytest.param(lambda: {f"v{i}": t for i, t in enumerate(torch.arange(3000.0).split(4))}, id="views-in-the-run"),
    pytest.param(lambda: {**{f"w{i}": torch.zeros(2) for i in range(300)}, "\u00a9 key": torch.zeros(2),
                          "w-after": torch.zeros(2)}, id="key-starting-c2"),
    pytest.param(lambda: {f"{'k' * (i % 300)}{i}": torch.zeros(3, dtype=torch.float16) for i in range(500)},
                 id="long-keys"),
    # keys of 250 to 259 bytes ending in "r" (the byte a PUT starts with), across the 255 the keyed pattern takes
    pytest.param(lambda: {f"{i:04d}" + "r" * (246 + i % 10): torch.zeros(2) for i in range(400)},
                 id="keys-across-255-bytes"),
    # keys the keyed pattern does not take, between keys it does: a line break, a tab, a non-ASCII letter, DEL
    pytest.param(lambda: {f"w{i}" + {100: "\n", 200: "\t", 300: "\u00e9", 301: "\x7f"}.get(i, ""): torch.zeros(2)
                          for i in range(500)}, id="unkeyed-keys-mid-run"),
    # runs of one to five tensors between other values: the shorter ones left to the loop, item by item
    pytest.param(lambda: {f"{k}{i}": torch.zeros(2) if k != "n" or i % 6 < 3 else i for i in range(400)
                          for k in ("t", "n")}, id="short-runs-between-values"),
])
@pytest.mark.parametrize("most", [4096, 7])
def test_a_run_read_at_once_is_read_as_item_by_item(make, most, tmp_path, monkeypatch) -> None:
    """The template's items read a column at a time (statedict._Reader._run, up to `most` at once) give what reading
    them one by one gives, and what the two passes give: the same tree, storages, globals and opcodes counted."""
    from ckpt_doctor.safepickle import statedict

    monkeypatch.setattr(statedict, "_MAX_RUN", most)
    data = _pickle_of(make(), tmp_path)
    at_once, one_by_one = _read_both_ways(data, monkeypatch)
    assert at_once[1] is not None and at_once == one_by_one
    assert _same_as_two_passes(data)


def test_a_run_with_a_bad_item_is_read_as_item_by_item(tmp_path, monkeypatch) -> None:
    """Bytes changed inside the run of items (a digit, a length, an int, a PUT's index): the reading a column at a
    time accepts or declines each mutant as the loop does, with the same result; what it accepts the two passes
    read alike."""
    data = _pickle_of({**{f"w{i}": torch.zeros(2, 2) for i in range(300)},
                       **{f"s{i}": torch.zeros(()) if i % 2 else torch.zeros(3) for i in range(60)}}, tmp_path)
    start = data.index(b"X\x04\x00\x00\x00w100")
    rng = random.Random(3)
    accepted = 0
    for _ in range(300):
        at = rng.randrange(start, len(data) - 200)
        mutant = data[:at] + bytes([rng.choice([0x00, 0x01, 0x2D, 0x4A, 0x58, 0x72, 0xC2, 0xFF,
                                                data[at] ^ 1])]) + data[at + 1:]
        at_once, one_by_one = _read_both_ways(mutant, monkeypatch)
        assert at_once == one_by_one
        if at_once[1] is not None:
            accepted += 1
            assert _same_as_two_passes(mutant)
    assert 0 < accepted < 300


@pytest.mark.parametrize("old, new, accepted", [
    (b"K\x04t", b"J\xfc\xff\xff\xfft", False),  # a negative numel: persistent_load's note, no tensor
    (b"QK\x00", b"QJ\xff\xff\xff\xff", False),  # a negative storage offset, which _rebuild refuses
    (b"K\x02K\x02\x86", b")", True),  # an empty shape with a PUT after it (torch writes none): read by opcode
    (b"K\x02K\x02\x86", b"K\x02K\x03\x86", True),  # a shape of another size: read as any other
])
def test_an_item_off_the_template_in_a_run_is_read_as_item_by_item(old, new, accepted, tmp_path, monkeypatch) -> None:
    """One item in the middle of a run changed: the reading a column at a time leaves it to the loop, which reads
    the items before it and stops at it, as it always has."""
    data = _pickle_of({f"w{i}": torch.zeros(2, 2) for i in range(300)}, tmp_path)
    at = data.index(old, data.index(b"X\x04\x00\x00\x00w150"))
    mutant = data[:at] + new + data[at + len(old):]
    at_once, one_by_one = _read_both_ways(mutant, monkeypatch)
    assert at_once == one_by_one and (at_once[1] is not None) is accepted
    if accepted:
        assert _same_as_two_passes(mutant)
