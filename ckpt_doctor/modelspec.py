"""Builds the model a checkpoint is compared with, from `package.module:attr`, `file.py:attr`, a Hugging Face config
(`hf:PATH`, see hfspec.py) or a reference checkpoint."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from math import prod
from pathlib import Path
from typing import Any

from ._record import field, record, replace
from .errors import ModelSpecError, UsageError, one_line
from .readers import read_checkpoint
from .safepickle.policy import DEFAULT_POLICY, Policy


@record
class ModelEntry:
    key: str
    shape: tuple[int, ...]
    dtype: str
    is_parameter: bool


@record
class ModelKeys:
    """What a strict load needs: the state_dict keys in order, and the non-persistent buffers it skips; with the
    model itself (built on meta) when there is one, so that torch's own loading code can be asked."""

    source: str
    entries: tuple[ModelEntry, ...]
    non_persistent: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()  # how `fix` is told about this model: --model SPEC [--model-arg k=v ...]
    model: Any = field(default=None, compare=False, repr=False)  # the nn.Module on meta; None for a checkpoint
    tied: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False)  # name -> its other names
    groups: tuple[tuple[int, tuple[str, ...]], ...] = ()  # (numel, names) per distinct Parameter
    # The name the model's own library loads a checkpoint key under (transformers renames older names as it
    # loads: ViT's `attention.attention.query` is `attention.q_proj`); None where keys load under their own names.
    load_name: Any = field(default=None, compare=False, repr=False)

    def by_key(self) -> dict[str, ModelEntry]:
        return {e.key: e for e in self.entries}

    def parameter_groups(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """(elements, its names) for each distinct Parameter: a tied one counts once. A model without parameters
        (buffers only: statistics, a lookup table) is measured by its buffers, so that a load of nothing into it
        is no 100% load."""
        if self.groups:
            return self.groups
        params = tuple((prod(e.shape), (e.key,)) for e in self.entries if e.is_parameter)
        return params or tuple((prod(e.shape), (e.key,)) for e in self.entries)


def parse_model_args(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """`key=value` pairs; values are Python literals (`10`, `'resnet'`, `[1, 2]`), else taken as strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--model-arg {pair!r}: expected key=value, e.g. --model-arg num_classes=10")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def is_checkpoint_spec(spec: str) -> bool:
    """A SPEC naming an existing file or folder (without `:attr`) is a reference checkpoint."""
    return not is_hf_spec(spec) and (os.path.exists(spec) or spec.startswith(("https://", "http://", "s3://"))) \
        and not spec.endswith(".py")


def is_hf_spec(spec: str) -> bool:
    """`hf:PATH`: a Hugging Face config.json (or its folder), built with transformers."""
    return spec.startswith("hf:")


def resolve_spec(spec: str, checkpoint: str | os.PathLike | None) -> str:
    """The SPEC with what it leaves to the checkpoint filled in: `hf:` alone is the config.json beside it."""
    if not is_hf_spec(spec):
        return spec
    # hfspec (the Hugging Face config reader, a few ms) is imported only for an hf: SPEC, here and below: a model
    # of the user's own code never pays for it
    from .hfspec import resolve

    return resolve(spec, checkpoint)


def example_inputs(spec: str, model_args: dict[str, Any] | None, seed: int) -> tuple[Any, ...] | None:
    """Inputs the model itself says it takes, where its SPEC says (a Hugging Face config); None for code."""
    if not is_hf_spec(spec):
        return None
    from .hfspec import example_inputs as from_config  # only for an hf: SPEC

    return from_config(spec, model_args, seed)


def resolve_attr(spec: str) -> Any:
    """The class or factory a SPEC names. Importing the user's own model code is the point here."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ModelSpecError(f"--model {spec!r}: expected package.module:attr or path/to/file.py:attr "
                             "(or the path of a reference checkpoint)")
    try:
        if target.endswith(".py") or os.sep in target:
            path = Path(target).resolve()
            if not path.is_file():
                raise ModelSpecError(f"--model {spec!r}: {target} does not exist")
            name = f"_ckpt_doctor_model_{abs(hash(str(path)))}"
            module = sys.modules.get(name)
            if module is None:
                module_spec = importlib.util.spec_from_file_location(name, path)
                assert module_spec is not None and module_spec.loader is not None
                module = importlib.util.module_from_spec(module_spec)
                sys.modules[name] = module
                sys.path.insert(0, str(path.parent))
                try:
                    module_spec.loader.exec_module(module)
                except BaseException:
                    sys.modules.pop(name, None)
                    raise
                finally:
                    sys.path.remove(str(path.parent))
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(target)
    except ModelSpecError:
        raise
    except Exception as exc:  # the user's module can raise anything while importing
        raise ModelSpecError(f"--model {spec!r}: importing {target} failed: {type(exc).__name__}: {exc}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelSpecError(f"--model {spec!r}: {target} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def build_model(spec: str, model_args: dict[str, Any] | None = None, device: str = "meta") -> Any:
    """Instantiate the model; on `meta` no memory is allocated, so a 70B model costs nothing."""
    import contextlib

    import torch

    with contextlib.redirect_stdout(sys.stderr):  # stdout carries data: what the model's module prints is no JSON
        if is_hf_spec(spec):  # the config's fields are the model's arguments: given to the config, not the call
            from .hfspec import factory as hf_factory  # only for an hf: SPEC

            factory, call_args = hf_factory(spec, model_args), {}
        else:
            factory, call_args = resolve_attr(spec), model_args or {}
    if not callable(factory):
        raise ModelSpecError(f"--model {spec!r} is not a class or a factory function")
    import warnings

    try:
        with torch.device(device), warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")  # a constructor copying into meta parameters: "... is a no-op"
            model = factory(**call_args)
    except Exception as exc:  # the user's constructor can raise anything
        if device == "meta":
            # Some constructors read their own weights back (`.item()`, `.numpy()`), which meta tensors cannot
            # do: build that model on the CPU (its own code, its own memory) rather than not at all.
            return build_model(spec, model_args, "cpu")
        args = ", ".join(f"{k}={v!r}" for k, v in (model_args or {}).items())
        raise ModelSpecError(f"--model {spec!r}: building {getattr(factory, '__name__', spec)}({args}) failed: "
                             f"{type(exc).__name__}: {exc}") from None
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"--model {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def model_keys(model: Any, source: str = "") -> ModelKeys:
    sd = model.state_dict(keep_vars=True)
    named = model.named_parameters(remove_duplicate=False)
    by_object: dict[int, list[str]] = {}
    sizes: dict[int, int] = {}
    for name, p in named:
        by_object.setdefault(id(p), []).append(name)
        sizes[id(p)] = p.numel()
    params = {n for names in by_object.values() for n in names}
    entries = tuple(ModelEntry(k, tuple(v.shape), str(v.dtype).removeprefix("torch."), k in params)
                    for k, v in sd.items() if hasattr(v, "shape"))  # `_extra_state` may be any object
    buffers = [name for name, _ in model.named_buffers(remove_duplicate=False)]
    non_persistent = tuple(b for b in buffers if b not in sd)
    tied = {k: tuple(v) for k, v in tied_names(model).items() if k in sd}
    groups = tuple((sizes[i], tuple(n for n in names if n in sd)) for i, names in by_object.items()
                   if any(n in sd for n in names))
    return ModelKeys(source or type(model).__name__, entries, non_persistent, model=model, tied=tied, groups=groups)


def tied_names(model: Any) -> dict[str, list[str]]:
    """Every state_dict name of a Parameter or buffer reachable under more than one name, with its other names."""
    by_object: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        by_object.setdefault(id(tensor), []).append(name)
    out: dict[str, list[str]] = {}
    for names in by_object.values():
        if len(names) > 1:
            for name in names:
                out[name] = [n for n in names if n != name]
    return out


def keys_from_spec(spec: str, model_args: dict[str, Any] | None = None, *,
                   checkpoint: str | os.PathLike | None = None, policy: Policy = DEFAULT_POLICY) -> ModelKeys:
    """ModelKeys from a model SPEC (built on meta) or from a reference checkpoint's state_dict. `checkpoint` is the
    file compared: what `hf:` alone names is beside it. `policy`: the allow-list a reference checkpoint is read
    under."""
    spec = resolve_spec(spec, checkpoint)
    if is_checkpoint_spec(spec):
        ref = read_checkpoint(spec, policy=policy)
        if ref.state_dict_root is None:
            raise ModelSpecError(f"--model {spec}: the reference checkpoint holds no state_dict")
        entries = tuple(ModelEntry(t.key, t.shape, t.dtype, t.is_parameter or t.dtype.startswith(("float", "bf")))
                        for t in ref.state_dict_tensors())
        return ModelKeys(spec, entries, flags=spec_flags(spec))
    model = build_model(spec, model_args, "meta")
    lazy = lazy_names(model)
    if lazy:
        raise ModelSpecError(f"--model {spec!r}: its lazy modules ({', '.join(lazy[:3])}) have no shapes until a "
                             "first forward, and inspect and fix compare names and shapes without running the "
                             "model; verify runs that forward on its --input-shape, or build the model with its "
                             "sizes (nn.Linear instead of nn.LazyLinear)")
    keys = model_keys(model, spec)
    return replace(keys, flags=spec_flags(spec, model_args), load_name=library_names(spec, model))


def library_names(spec: str, model: Any) -> Any:
    """How the model's library renames checkpoint keys as it loads them (see ModelKeys.load_name); None for code
    of the user's own."""
    if not is_hf_spec(spec):
        return None
    from .hfspec import load_name  # only for an hf: SPEC

    return load_name(model)


def spec_flags(spec: str, model_args: dict[str, Any] | None = None) -> tuple[str, ...]:
    """How a command line names this model: --model SPEC [--model-arg k=v ...]."""
    flags = ["--model", "./" + spec if spec.startswith("-") else spec]  # `-m.py:Net` is no option
    for k, v in (model_args or {}).items():
        flags += ["--model-arg", f"{k}={v!r}"]
    return tuple(flags)


def deepcopy_sharing(model: Any, memo: dict[int, Any]) -> Any:
    """`copy.deepcopy(model, memo)`, for models that hold what cannot be copied: a tensor computed from parameters
    (the old `torch.nn.utils.weight_norm` keeps `weight` so), a lock, an open file, a generator. Such an attribute
    becomes a meta tensor of its shape in the copy (a tensor), or the same object shared with the model (anything
    else): a copy made to be loaded into, never run, needs neither."""
    import copy

    import torch

    try:
        return copy.deepcopy(model, dict(memo))
    except Exception:  # copying runs the model's own __deepcopy__/__reduce__: anything can fail
        pass
    own = set(vars(torch.nn.Module()))  # Module's bookkeeping (parameters, buffers, hooks) is copied as usual
    plain = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size)
    for module in model.modules():
        for name, value in vars(module).items():
            if name in own or id(value) in memo or isinstance(value, plain):
                continue
            if isinstance(value, torch.Tensor):
                memo[id(value)] = torch.empty_like(value, device="meta")
                continue
            try:
                copy.deepcopy(value, dict(memo))
            except Exception:
                memo[id(value)] = value
    return copy.deepcopy(model, memo)


def lazy_names(model: Any) -> tuple[str, ...]:
    """The modules whose parameters or buffers are not created yet (nn.LazyLinear and kin before a forward)."""
    from torch.nn.parameter import is_lazy

    return tuple(dict.fromkeys(name.rpartition(".")[0] or name for name, t in
                               [*model.named_parameters(), *model.named_buffers()] if is_lazy(t)))


def materialize_lazy(model: Any, inputs: tuple[Any, ...], spec: str) -> tuple[str, ...]:
    """Create the parameters of lazy modules as torch says to: one forward on the inputs (eval, no grad), where
    they take their shapes. Returns the modules so created; none when the model has no lazy module."""
    import torch

    names = lazy_names(model)
    if not names:
        return ()
    training = model.training
    try:
        with torch.no_grad():
            model.eval()(*inputs)
    except Exception as exc:  # the user's forward can raise anything
        message = one_line(str(exc).strip().splitlines()[0]) if str(exc).strip() else ""
        raise ModelSpecError(f"--model {spec!r}: its lazy modules ({', '.join(names[:3])}) take their shapes from a "
                             f"first forward, which failed on the inputs given: {type(exc).__name__}: {message} "
                             "(check --input-shape, or give the inputs with --input module:function)") from None
    finally:
        model.train(training)
    return names
