"""Models named by a Hugging Face config: `--model hf:PATH` builds them with transformers from `config.json` alone.

Nothing is downloaded (the hub is switched offline before transformers is imported) and nothing from the model's
folder is run: the class is the one the config names in `architectures`, looked up by name in transformers' own
namespace only, else the AutoModel of its `model_type`. A config whose class lives in the model's repository
(`auto_map`, what `trust_remote_code=True` would import) is refused. transformers is imported only here, and only
when such a spec is used: its import costs seconds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from .errors import CkptDoctorError, ModelSpecError, ReadError, UsageError, one_line
from .readers.jsonfile import read_json  # a regular file, read up to its limit (never a link to /dev/zero)

PREFIX = "hf:"
CONFIG = "config.json"
MAX_CONFIG_BYTES = 16 << 20  # real configs are a few KB; a larger "config" is no config
BATCH = 4  # rows of the inputs verify makes: a multiple of the usual --gpus, so every rank gets its own rows
SEQUENCE = 16  # tokens per row, fewer where the config allows fewer positions


def is_hf_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def resolve(spec: str, checkpoint: str | os.PathLike | None) -> str:
    """`hf:` alone is the config.json in the checkpoint's own folder (the folder itself when the checkpoint is one):
    named here, so that every command printed later names it too and runs from anywhere the checkpoint's path
    does. Any other spec is returned as it is."""
    if spec != PREFIX:
        return spec
    if checkpoint is None:
        raise ModelSpecError("--model hf: with no path means the config.json beside the checkpoint, and there is no "
                             "checkpoint here: name it, --model hf:path/to/config.json")
    path = Path(checkpoint)
    folder = path if path.is_dir() else path.parent
    config = folder / CONFIG
    if not config.is_file():
        raise ModelSpecError(f"--model hf: reads the config.json beside {checkpoint}, and {folder} has none: name "
                             "the model's config with --model hf:path/to/config.json (or its folder)")
    return PREFIX + str(config)


def config_path(spec: str) -> Path:
    rest = spec[len(PREFIX):]
    if not rest:
        raise ModelSpecError("--model hf: with no path means the config.json beside the checkpoint: name the "
                             "config with --model hf:path/to/config.json")
    if rest.startswith("//"):  # hf://org/name[@revision]: the config.json of a model in the local cache
        from .readers.hfcache import resolve  # only for such a spec

        try:
            path = resolve("hf:" + rest)
        except CkptDoctorError as exc:
            raise ModelSpecError(f"--model {spec}: {exc}") from None
    else:
        path = Path(rest)
    if path.is_dir():
        path = path / CONFIG
    if not path.is_file():
        raise ModelSpecError(f"--model {spec}: {path} does not exist (give a config.json or the folder holding one)")
    return path


def transformers_module() -> Any:
    """transformers, imported offline; a clear way out where it is not installed."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is first imported ...
    import sys

    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:  # ... and already read where it was: nothing the model's constructor asks for is fetched
        hub.HF_HUB_OFFLINE = True
    try:
        import transformers
    except ImportError as exc:
        raise ModelSpecError(f"--model hf:… builds the model with transformers, which is not installed ({exc}): "
                             "pip install 'ckpt-doctor[hf]'") from None
    return transformers


def read_config(spec: str, overrides: dict[str, Any] | None = None) -> tuple[Any, type]:
    """The config (with `--model-arg` fields set, as from_pretrained's keyword arguments set them) and the model
    class it names."""
    path = config_path(spec)
    try:
        data = read_json(path, "model config", MAX_CONFIG_BYTES)
    except ReadError as exc:
        raise ModelSpecError(f"--model {spec}: {path} is no JSON config: "
                             f"{one_line(str(exc).removeprefix(f'{path}: '), 160)}") from None
    if not isinstance(data, dict):
        raise ModelSpecError(f"--model {spec}: {path} holds {type(data).__name__}, not a config object")
    transformers = transformers_module()
    architectures = data.get("architectures") or []
    name = architectures[0] if isinstance(architectures, list) and architectures else None
    remote = data.get("auto_map")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        if remote:
            raise _remote_code(spec, path, name or model_type, remote, transformers.__version__)
        raise ModelSpecError(f"--model {spec}: {path} has model_type {model_type!r}, which transformers "
                             f"{transformers.__version__} does not know (upgrade transformers, or give the model "
                             "as package.module:attr)")
    try:
        config = transformers.CONFIG_MAPPING[model_type].from_dict(data)
    except Exception as exc:  # the config class validates its fields: any error is the file's
        raise ModelSpecError(f"--model {spec}: transformers cannot read {path}: {type(exc).__name__}: "
                             f"{one_line(exc, 200)}") from None
    for key, value in (overrides or {}).items():
        if not hasattr(config, key):
            raise UsageError(f"--model-arg {key}={value!r}: {type(config).__name__} has no field {key!r} "
                             f"(the fields are those of {path})")
        try:
            setattr(config, key, value)
        except Exception as exc:  # a property setter (num_labels) may refuse the value
            raise UsageError(f"--model-arg {key}={value!r}: {type(exc).__name__}: {one_line(exc, 160)}") from None
    return config, _model_class(spec, path, name, config, remote, transformers)


def _model_class(spec: str, path: Path, name: str | None, config: Any, remote: Any, transformers: Any) -> type:
    """The class `architectures` names, from transformers' own namespace (a TF/Flax name taken as its torch
    class), else the AutoModel of the config's model_type."""
    base = transformers.PreTrainedModel
    if isinstance(name, str) and name.isidentifier() and not name.startswith("_"):
        for candidate in (name, name.removeprefix("TF"), name.removeprefix("Flax")):
            try:
                found = getattr(transformers, candidate, None)
            except Exception:  # a class whose optional dependency is missing: no class of this name to use
                found = None
            if isinstance(found, type) and issubclass(found, base):
                return found
        if remote:
            raise _remote_code(spec, path, name, remote, transformers.__version__)
    try:
        return transformers.MODEL_MAPPING[type(config)]
    except Exception:  # KeyError, or the mapping's lazy import failing
        raise ModelSpecError(f"--model {spec}: transformers {transformers.__version__} has no class "
                             f"{name or '(no architectures in the config)'} and no AutoModel for model_type "
                             f"{config.model_type!r}") from None


def _remote_code(spec: str, path: Path, name: Any, remote: Any, version: str) -> ModelSpecError:
    where = next(iter(remote.values()), "") if isinstance(remote, dict) and remote else ""
    return ModelSpecError(f"--model {spec}: {path} names {name}, whose code is not part of transformers {version} but "
                          f"of the model's own repository ({where or 'its auto_map'}); ckpt-doctor never runs code "
                          "from a model's folder (trust_remote_code): give the model as package.module:attr from code "
                          "you have read")


def factory(spec: str, overrides: dict[str, Any] | None = None) -> Callable[[], Any]:
    """A function that builds the model (under the caller's torch.device), in the dtype the config names as
    from_pretrained would, its tied weights tied by transformers."""
    config, cls = read_config(spec, overrides)

    def build() -> Any:
        from transformers.utils import logging

        level = logging.get_verbosity()
        logging.set_verbosity_error()  # its advice on sizes far from a real model's is no news in a tiny one
        try:
            return cls._from_config(config)
        finally:
            logging.set_verbosity(level)

    build.__name__ = cls.__name__
    return build


def load_name(model: Any) -> Callable[[str], str]:
    """The name from_pretrained gives a checkpoint key: transformers' own renamings for the model (its conversion
    mapping: older names of the same tensors, asked of transformers itself), then the base model's prefix (`bert.`)
    put before a key that has a place only under it, as from_pretrained does. Conversions that merge or split
    tensors are no renames and are left out."""
    renamed = _renamings(model)
    own = set(model.state_dict())
    base = getattr(model, "base_model_prefix", "") or ""

    def rename(key: str) -> str:
        name = renamed(key)
        if name not in own and base and f"{base}.{name}" in own:  # the base model's weights, in a model with a head
            name = f"{base}.{name}"
        return name

    return rename


def _renamings(model: Any) -> Callable[[str], str]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings

        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    except Exception:  # transformers before 5 has none; a changed private API: most keys keep their names
        return lambda key: key

    def rename(key: str) -> str:
        try:
            return apply_renamings(key, renamings)
        except Exception:  # a key its patterns cannot take: loaded under its own name
            return key

    return rename if renamings else (lambda key: key)


def example_inputs(spec: str, overrides: dict[str, Any] | None, seed: int) -> tuple[Any, ...]:
    """Inputs the model accepts, made from its config: `input_ids` below `vocab_size`, `pixel_values` of the
    configured image size and channels, `decoder_input_ids` for an encoder-decoder; given by position, in the
    order of the model's forward, with an all-ones attention mask (zero token types) where one stands between."""
    import inspect as pyinspect

    import torch

    config, cls = read_config(spec, overrides)
    params = [p for p in pyinspect.signature(cls.forward).parameters.values()
              if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in params]
    generator = torch.Generator().manual_seed(seed)
    vocab = getattr(config, "vocab_size", None)
    positions = [getattr(config, a, None) for a in ("max_position_embeddings", "n_positions", "max_positions")]
    length = min([SEQUENCE, *[p for p in positions if isinstance(p, int) and p > 0]])
    wanted: dict[str, Any] = {}

    def tokens() -> Any:
        return torch.randint(0, vocab, (BATCH, length), generator=generator)

    if "input_ids" in names and isinstance(vocab, int) and vocab > 0:
        wanted["input_ids"] = tokens()
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in names:
            wanted["decoder_input_ids"] = tokens()
    elif "pixel_values" in names and isinstance(getattr(config, "image_size", None), (int, list, tuple)):
        size = config.image_size
        height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
        channels = getattr(config, "num_channels", 3)
        wanted["pixel_values"] = torch.randn((BATCH, channels, height, width), generator=generator)
    if not wanted:
        raise UsageError(f"verify cannot make inputs for {cls.__name__} from {spec} (its forward takes "
                         f"{', '.join(names[:4]) or 'nothing by position'}): give them with --input-shape or "
                         "--input module:function")
    fillers = {"attention_mask": lambda: torch.ones((BATCH, length), dtype=torch.long),
               "decoder_attention_mask": lambda: torch.ones((BATCH, length), dtype=torch.long),
               "token_type_ids": lambda: torch.zeros((BATCH, length), dtype=torch.long)}
    last = max(names.index(n) for n in wanted)
    out = []
    for name in names[:last + 1]:
        if name in wanted:
            out.append(wanted[name])
        elif name in fillers:
            out.append(fillers[name]())
        else:
            raise UsageError(f"verify cannot give {cls.__name__} its {', '.join(wanted)} by position ({name} stands "
                             "before them in its forward): give the inputs with --input module:function")
    return tuple(out)
