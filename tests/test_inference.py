"""Issue 23: the inference matches the real cases.

A submodule that is really named `module` (transkun 2.0's ResBlock beside its LayerScale) is no wrapper's prefix;
keys a refactoring moved (pesto's `prefilt_layers.0` → `prefilt_layers.0.0`) are renamed onto the model's by shape,
not dropped; and no check passes on a file that fills nothing. torch is the oracle throughout: the printed fix is run
through the command line and its output loaded strictly into the model, tensor for tensor equal to the source.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import torch_filled_fraction

NETS = '''
import torch
from torch import nn


class VGGish(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 8, 3))
        self.classifier = nn.Linear(8, 10)


class Wrap(nn.Module):
    """A real submodule named `module`, beside a head of its own."""

    def __init__(self):
        super().__init__()
        self.module = VGGish()
        self.head = nn.Linear(10, 2)


class ResBlock(nn.Module):
    """transkun 2.0's residual block: the wrapped layer is `self.module`, its LayerScale `self.scale` beside it."""

    def __init__(self, module, size):
        super().__init__()
        self.module = module
        self.scale = nn.Parameter(torch.ones(size) * 1e-2)


class Transkunish(nn.Module):
    def __init__(self, layers=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "attnF": ResBlock(nn.Linear(8, 8), 8), "fnnF": ResBlock(nn.Sequential(nn.Linear(8, 16), nn.GELU(),
                                                                                  nn.Linear(16, 8)), 8),
            "attnT": ResBlock(nn.Linear(8, 8), 8)}) for _ in range(layers))
        self.out = nn.Linear(8, 3)


class WrappedFeatures(nn.Module):
    """A submodule wrapped by DataParallel, and one compiled: their keys carry the wrapper's token mid-key."""

    def __init__(self):
        super().__init__()
        self.features = nn.DataParallel(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)))
        self.head = torch.compile(nn.Linear(4, 2))


class PrefiltOld(nn.Module):
    """pesto's encoder as mir-1k.ckpt was saved: the first prefiltering layer a bare Conv1d."""

    def __init__(self):
        super().__init__()
        self.prefilt_layers = nn.ModuleList([nn.Conv1d(1, 4, 3), nn.Sequential(nn.Conv1d(4, 4, 3))])
        self.fc = nn.Linear(4, 2)


class PrefiltNew(nn.Module):
    """pesto's encoder today: every prefiltering layer a Sequential (conv, activation); optionally a module the old
    file never had (pesto's confidence classifier)."""

    def __init__(self, confidence=False):
        super().__init__()
        self.prefilt_layers = nn.ModuleList([nn.Sequential(nn.Conv1d(1, 4, 3), nn.ReLU()),
                                             nn.Sequential(nn.Conv1d(4, 4, 3))])
        self.fc = nn.Linear(4, 2)
        if confidence:
            self.confidence = nn.Linear(3, 1)


class Block(nn.Module):
    def __init__(self, new):
        super().__init__()
        self.attn = nn.Linear(6, 6)
        setattr(self, "ln" if new else "norm", nn.LayerNorm(6))


class Deep(nn.Module):
    """Twelve blocks whose `norm` a later version calls `ln`."""

    def __init__(self, new=False):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.layers = nn.ModuleList([Block(new) for _ in range(12)])
        self.head = nn.Linear(6, 3)


class TwoOld(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.fc = nn.Linear(4, 2)


class TwoNew(nn.Module):
    """TwoOld's layers of one shape under other names, and a module of its own."""

    def __init__(self, extra=True):
        super().__init__()
        self.x = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.fc = nn.Linear(4, 2)
        if extra:
            self.y = nn.Linear(3, 3)


class OddOld(nn.Module):
    """Module names that regexes and the command line treat specially: `=`, a backslash, regex syntax."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(2, 3)
        self.body = nn.ModuleDict({"w=1": nn.Linear(3, 5), "a\\\\b": nn.Linear(5, 7), "c+(d)": nn.Linear(7, 2)})


class OddNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(2, 3)
        self.body = nn.ModuleDict({"w=2": nn.Linear(3, 5), "a\\\\c": nn.Linear(5, 7), "c+(e)": nn.Linear(7, 2)})


class Backbone(nn.Module):
    """PrefiltNew inside a bigger model: the fix adds `backbone.` and renames under it."""

    def __init__(self):
        super().__init__()
        self.backbone = PrefiltNew()
        self.extra_head = nn.Linear(2, 9)


class BNOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(20, 8)
        self.block = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 20, bias=False)
        self.lm_head.weight = self.wte.weight
'''


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """The models above as a module a SPEC names (`path/nets.py:Class`) and this process imports."""
    import importlib.util

    folder = tmp_path_factory.mktemp("nets")
    path = folder / "nets.py"
    path.write_text(NETS)
    spec = importlib.util.spec_from_file_location("inference_nets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SPEC = f"{path}:"
    return module


def save(path: Path, state_dict) -> Path:
    torch.save(state_dict, path)
    return path


def comparison(cli, path: Path, *args: str) -> tuple[int, dict]:
    result = cli("inspect", path, "--model", *args, "--json")
    return result.exit_code, result.json()["comparison"]


def prefix_lines(cli, path: Path, *args: str) -> list[str]:
    """inspect's `prefix` lines, their spacing evened out."""
    return [" ".join(line.split()) for line in cli("inspect", path, *args).stderr.splitlines()
            if line.startswith("prefix")]


def run_fix(path: Path, out: Path, flags: list[str], spec: list[str]) -> subprocess.CompletedProcess:
    """The printed fix as a user runs it: `ckpt-doctor fix FILE -o OUT --model SPEC <flags>`."""
    model = [] if "--model" in flags else spec
    return subprocess.run([sys.executable, "-m", "ckpt_doctor", "fix", str(path), "-o", str(out), *flags, *model],
                          capture_output=True, text=True)


def assert_fix_loads(path: Path, comp: dict, model: nn.Module, spec: str, tmp_path: Path,
                     *model_args: str) -> OrderedDict:
    """Run the suggested fix through the command line; torch loads its output strictly (or fails only on what the
    line's --allow-missing accepts), and every tensor is bit for bit the source's, through the renames."""
    flags = comp["suggested_fix"]
    out = tmp_path / "fixed.pt"
    out.unlink(missing_ok=True)
    result = run_fix(path, out, flags, ["--model", spec, *model_args])
    assert result.returncode == 0, result.stderr
    fixed = torch.load(out, weights_only=True)
    allow = flags[flags.index("--allow-missing") + 1] if "--allow-missing" in flags else None
    incompatible = model.load_state_dict(fixed, strict=allow is None)
    if allow is not None:
        assert not incompatible.unexpected_keys and all(re.search(allow, k) for k in incompatible.missing_keys)
    source = torch.load(path, weights_only=True)
    origin = {r["new"]: r["old"] for r in comp["renames"]}
    assert set(fixed) == (set(source) - set(comp["dropped"]) - set(origin.values())) | set(origin)
    for key, tensor in fixed.items():
        src = source[origin.get(key, key)]
        assert tensor.dtype == src.dtype and torch.equal(tensor, src), key
    return fixed


# --- 1. a submodule named `module` is no wrapper's prefix -----------------------------------------------------------

def test_a_submodule_named_module_beside_a_head_is_not_called_a_wrapper(cli, nets, tmp_path):
    path = save(tmp_path / "wrap.pth", nets.Wrap().state_dict())
    lines = prefix_lines(cli, path)
    assert len(lines) == 1 and "possibly a wrapper's, or a submodule named module" in lines[0]
    assert "(leading)" not in lines[0]
    # the model shows it is real: no prefix line at all, and the file loads as it is
    assert prefix_lines(cli, path, "--model", nets.SPEC + "Wrap") == []
    code, comp = comparison(cli, path, nets.SPEC + "Wrap")
    assert code == 0 and comp["suggested_fix"] == []
    # the same file saved from DataParallel: that outer `module.` is a wrapper's, with the model or without
    dp = save(tmp_path / "dp.pth", nn.DataParallel(nets.Wrap()).state_dict())
    for args in ((), ("--model", nets.SPEC + "Wrap")):
        assert prefix_lines(cli, dp, *args) == ["prefix module. (leading) on 13 of 13 keys"]
    code, comp = comparison(cli, dp, nets.SPEC + "Wrap")
    assert code == 1 and comp["suggested_fix"] == ["--strip-module"]


def test_a_module_beside_its_siblings_at_every_depth_is_no_wrapper(cli, nets, tmp_path):
    """transkun 2.0: `blocks.N.attnF.module.weight` beside `blocks.N.attnF.scale`, at every block; one prefix line
    per place used to be printed, 24 of them for the real file."""
    model = nets.Transkunish()
    assert any(".module." in k for k in model.state_dict())
    path = save(tmp_path / "transkun.pt", model.state_dict())
    assert prefix_lines(cli, path) == []
    assert comparison(cli, path, nets.SPEC + "Transkunish")[0] == 0
    # wrapped in DataParallel as a whole: the outer prefix only, and stripping it is the fix torch accepts
    dp = save(tmp_path / "transkun_dp.pt", nn.DataParallel(model).state_dict())
    assert prefix_lines(cli, dp) == [f"prefix module. (leading) on {len(model.state_dict())} of "
                                     f"{len(model.state_dict())} keys"]
    code, comp = comparison(cli, dp, nets.SPEC + "Transkunish")
    assert code == 1 and comp["suggested_fix"] == ["--strip-module"]
    assert_fix_loads(dp, comp, nets.Transkunish(), nets.SPEC + "Transkunish", tmp_path)


def test_a_wrapped_submodule_is_still_found_mid_key(cli, nets, tmp_path):
    model = nets.WrappedFeatures()
    sd = model.state_dict()
    assert "features.module.0.weight" in sd and "head._orig_mod.weight" in sd
    path = save(tmp_path / "wrapped.pt", sd)
    lines = prefix_lines(cli, path)
    assert "prefix module. (after 'features.') on 4 of 6 keys" in lines
    assert "prefix _orig_mod. (after 'head.') on 2 of 6 keys" in lines


# --- 2. keys a refactoring moved are renamed by shape ---------------------------------------------------------------

def test_a_moved_layer_is_renamed_not_dropped(cli, nets, tmp_path):
    """pesto's mir-1k.ckpt against today's model: the rename fills everything, where dropping the old keys filled
    17% and a mapping of the whole file by order was refused as ambiguous."""
    torch.manual_seed(0)
    path = save(tmp_path / "mir.ckpt", nets.PrefiltOld().state_dict())
    code, comp = comparison(cli, path, nets.SPEC + "PrefiltNew")
    assert code == 1
    assert comp["fix_kind"] == "rename" and comp["ambiguous"] == []
    assert comp["suggested_fix"] == ["--rename", r"^prefilt_layers\.0\.(weight|bias)$=prefilt_layers.0.0.\1"]
    assert sorted((r["old"], r["new"]) for r in comp["renames"]) == [
        ("prefilt_layers.0.bias", "prefilt_layers.0.0.bias"), ("prefilt_layers.0.weight", "prefilt_layers.0.0.weight")]
    assert comp["dropped"] == [] and comp["fix_loaded_fraction"] == 1.0
    model = nets.PrefiltNew()
    fixed = assert_fix_loads(path, comp, model, nets.SPEC + "PrefiltNew", tmp_path)
    assert torch_filled_fraction(nets.PrefiltNew(), fixed) == 1.0
    human = cli("inspect", path, "--model", nets.SPEC + "PrefiltNew")
    assert "prefilt_layers.0.weight → prefilt_layers.0.0.weight" in human.stdout
    assert "2 paired by shape alone" in human.stderr and "ambiguous" not in human.stderr
    # fix --auto applies the same renames
    auto = tmp_path / "auto.pt"
    assert cli("fix", path, "-o", auto, "--auto", "--model", nets.SPEC + "PrefiltNew").exit_code == 0
    assert torch.load(auto, weights_only=True).keys() == fixed.keys()
    nets.PrefiltNew().load_state_dict(torch.load(auto, weights_only=True), strict=True)


def test_a_moved_layer_beside_a_new_module(cli, nets, tmp_path):
    """As the real pesto model: it also has a module the file never had; the line renames and accepts that one."""
    path = save(tmp_path / "mir.ckpt", nets.PrefiltOld().state_dict())
    spec = nets.SPEC + "PrefiltNew"
    code, comp = comparison(cli, path, spec, "--model-arg", "confidence=True")
    assert code == 1 and comp["fix_kind"] == "allowed"
    flags = comp["suggested_fix"]
    assert flags[:2] == ["--rename", r"^prefilt_layers\.0\.(weight|bias)$=prefilt_layers.0.0.\1"]
    assert flags[flags.index("--allow-missing") + 1] == r"^(confidence\.weight|confidence\.bias)$"
    model = nets.PrefiltNew(confidence=True)
    fixed = assert_fix_loads(path, comp, model, spec, tmp_path)
    assert comp["fix_loaded_fraction"] == pytest.approx(torch_filled_fraction(nets.PrefiltNew(confidence=True), fixed))
    assert comp["fix_loaded_fraction"] > comp["loaded_fraction"]


def test_renames_that_differ_by_layer_number_are_one(cli, nets, tmp_path):
    path = save(tmp_path / "deep.pt", nets.Deep().state_dict())
    code, comp = comparison(cli, path, nets.SPEC + "Deep", "--model-arg", "new=True")
    assert code == 1 and comp["fix_kind"] == "rename"
    assert comp["suggested_fix"] == ["--rename", r"^layers\.(\d+)\.norm\.(weight|bias)$=layers.\1.ln.\2"]
    assert comp["ambiguous"] == []  # twelve LayerNorms of one shape, told apart by their layer numbers
    assert len(comp["renames"]) == 24
    assert_fix_loads(path, comp, nets.Deep(new=True), nets.SPEC + "Deep", tmp_path, "--model-arg", "new=True")


def test_renames_after_a_prefix_is_stripped_or_added(cli, nets, tmp_path):
    torch.manual_seed(1)
    old = nets.PrefiltOld().state_dict()
    dp = save(tmp_path / "dp.pt", OrderedDict(("module." + k, v) for k, v in old.items()))
    code, comp = comparison(cli, dp, nets.SPEC + "PrefiltNew")
    assert comp["suggested_fix"] == ["--strip-module", "--rename",
                                     r"^prefilt_layers\.0\.(weight|bias)$=prefilt_layers.0.0.\1"]
    assert_fix_loads(dp, comp, nets.PrefiltNew(), nets.SPEC + "PrefiltNew", tmp_path)
    plain = save(tmp_path / "plain.pt", old)
    code, comp = comparison(cli, plain, nets.SPEC + "Backbone")
    assert comp["suggested_fix"][:4] == ["--rename", r"^prefilt_layers\.0\.(weight|bias)$=prefilt_layers.0.0.\1",
                                         "--add-prefix", "backbone."]
    assert_fix_loads(plain, comp, nets.Backbone(), nets.SPEC + "Backbone", tmp_path)


def test_names_that_regexes_and_shells_treat_specially(cli, nets, tmp_path):
    """`=` splits --rename REGEX=REPL, a backslash escapes in a replacement, `+(` are regex syntax: each rename
    still names exactly its key and writes exactly the model's name."""
    torch.manual_seed(2)
    path = save(tmp_path / "odd.pt", nets.OddOld().state_dict())
    code, comp = comparison(cli, path, nets.SPEC + "OddNew")
    assert code == 1 and comp["fix_kind"] == "rename" and comp["ambiguous"] == []
    assert {(r["old"], r["new"]) for r in comp["renames"]} == {
        (f"body.{o}.{leaf}", f"body.{n}.{leaf}") for o, n in (("w=1", "w=2"), ("a\\b", "a\\c"), ("c+(d)", "c+(e)"))
        for leaf in ("weight", "bias")}
    assert_fix_loads(path, comp, nets.OddNew(), nets.SPEC + "OddNew", tmp_path)


def test_pairs_by_position_are_reported_as_ambiguous(cli, nets, tmp_path):
    """Two layers of one shape moved to two others: which goes where is a guess by position, said as a mapping by
    order says it."""
    torch.manual_seed(3)
    path = save(tmp_path / "two.pt", nets.TwoOld().state_dict())
    code, comp = comparison(cli, path, nets.SPEC + "TwoNew")
    assert code == 1 and comp["fix_kind"] == "allowed"
    assert comp["suggested_fix"][:4] == ["--rename", r"^a\.(weight|bias)$=x.0.\1", "--rename",
                                         r"^b\.(weight|bias)$=x.1.\1"]
    assert comp["ambiguous"] == ["0: a.weight → x.0.weight [4, 4]", "1: a.bias → x.0.bias [4]",
                                 "2: b.weight → x.1.weight [4, 4]", "3: b.bias → x.1.bias [4]"]
    stderr = cli("inspect", path, "--model", nets.SPEC + "TwoNew").stderr
    assert "4 of them by position among keys of one shape" in stderr
    assert "ambiguous   4 positions share their shape with another (e.g. 0: a.weight → x.0.weight [4, 4]): any " \
           "permutation of them fits" in stderr
    assert_fix_loads(path, comp, nets.TwoNew(), nets.SPEC + "TwoNew", tmp_path)
    # The same guess over the whole file, when it has the model's keys and shapes in order: the mapping by order,
    # which fix refuses until --force, fills as much and is no more ambiguous, so it stays the suggestion.
    code, comp = comparison(cli, path, nets.SPEC + "TwoNew", "--model-arg", "extra=False")
    assert comp["fix_kind"] == "map-by-order" and comp["suggested_fix"][-1] == "--map-by-order"


# --- 3. no check passes on nothing ----------------------------------------------------------------------------------

def test_allowances_that_name_every_parameter_require_everything(cli, nets, tmp_path):
    """A pattern matching every parameter (not every buffer) names nothing in particular either."""
    sd = nets.BNOnly().state_dict()
    path = save(tmp_path / "buffers.pt", OrderedDict((k, v) for k, v in sd.items() if k.startswith("bn.running")
                                                     or k.endswith("num_batches_tracked")))
    spec = nets.SPEC + "BNOnly"
    code, comp = comparison(cli, path, spec, "--allow-missing", "weight|bias")
    assert torch_filled_fraction(nets.BNOnly(), torch.load(path, weights_only=True)) == comp["loaded_fraction"] == 0
    assert code == 1 and comp["missing"] == [] and comp["ok"] is False
    assert "names every parameter; name the keys you mean, or set --min-loaded" in comp["verdict"]


def test_allowances_that_name_keys_require_the_rest(cli, nets, tmp_path):
    """Naming the head accepts it missing; everything else must still come from the file."""
    sd = nets.BNOnly().state_dict()
    path = save(tmp_path / "headless.pt", OrderedDict((k, v) for k, v in sd.items() if not k.startswith("fc.")))
    code, comp = comparison(cli, path, nets.SPEC + "BNOnly", "--allow-missing", r"^fc\.")
    model = nets.BNOnly()
    assert comp["loaded_fraction"] == pytest.approx(torch_filled_fraction(model, torch.load(path, weights_only=True)))
    assert code == 0 and comp["ok"] is True and comp["verdict"].startswith("OK with the allowances given")


def test_the_required_share_counts_a_tied_parameter_once(nets):
    from ckpt_doctor.compare import required_share
    from ckpt_doctor.modelspec import model_keys

    model = nets.Tied()
    keys = model_keys(model)
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once
    named_both = required_share(keys, r"^(wte|lm_head)\.")[0]
    assert named_both == pytest.approx(1 - model.wte.weight.numel() / total)
    # one of its two names is not all of it: the Parameter is still required through the other
    assert required_share(keys, r"^lm_head\.")[0] == 1.0
    assert required_share(keys, r"^block\.")[0] == pytest.approx(1 - (8 * 8 + 8) / total)
    assert required_share(keys, ".*")[0] == required_share(keys, "")[0] == 1.0
    assert required_share(keys, ".*", min_loaded=0.25)[0] == 0.25
    assert required_share(keys, None) == (None, "")
