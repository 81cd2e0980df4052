"""The values the command line takes as text (`5GB`, `cuda:3=cpu`, `bf16`, `ALIAS=KEY`) made typed, and the flags
of `fix` made one FixOptions: the one place a command's arguments become the library's options."""

from __future__ import annotations

import re

from .dtypes import user_dtype_name
from .errors import UsageError
from .safepickle.policy import DEFAULT_POLICY, Policy

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from .fix import FixOptions


def parse_size(text: str) -> int:
    """`5GB`, `500MB`, `2GiB`, `1000000` -> bytes (decimal units as Hugging Face uses them, binary with `i`)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise UsageError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    number, unit, binary = float(match.group(1)), match.group(2).upper(), match.group(3)
    scale = (1024 if binary else 1000) ** "_KMGT".index(unit or "_")
    size = int(number * scale)
    if size <= 0:
        raise UsageError(f"--max-shard-size {text!r} must be positive")
    return size


def parse_map_location(values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`cpu` (every device) or `cuda:3=cuda:0` (one device), repeatable."""
    table = []
    for value in values:
        old, sep, new = value.partition("=")
        pair = (old, new) if sep else ("*", old)
        for device in pair:
            if device != "*" and not re.fullmatch(r"(cpu|meta|mps|xpu|hpu|cuda)(:\d+)?", device):
                raise UsageError(f"--map-location {value!r}: {device!r} is not a device (cpu, cuda:0, mps, …)")
        # the tag written must be one torch.load restores: `cpu:0` it refuses everywhere; `meta` loads no data
        if re.fullmatch(r"cpu:\d+", pair[1]):
            raise UsageError(f"--map-location {value!r}: torch.load restores `cpu`, not {pair[1]!r}; write cpu")
        if pair[1] == "meta":
            raise UsageError(f"--map-location {value!r}: a meta tag makes torch.load return tensors without their "
                             "data; keep the data with cpu")
        table.append(pair)
    return tuple(table)


def parse_dtype(value: str | None) -> str | None:
    if value is None:
        return None
    name = user_dtype_name(value)
    if name not in ("float16", "bfloat16", "float32", "float64"):
        raise UsageError(f"--dtype {value!r}: choose float16 (half, fp16), bfloat16 (bf16), float32 (float, fp32) "
                         "or float64 (double, fp64)")
    return name



def parse_tie(spec: str) -> tuple[str, str]:
    """`lm_head.weight=transformer.wte.weight` -> (alias, key)."""
    alias, sep, key = spec.partition("=")
    if not sep or not alias or not key:
        raise UsageError(f"--tie {spec!r}: expected ALIAS=KEY, e.g. --tie lm_head.weight=transformer.wte.weight")
    if alias == key:
        raise UsageError(f"--tie {spec!r} ties a key to itself, which changes nothing: name the key that is missing "
                         "(ALIAS) and the one it shares its tensor with (KEY)")
    return alias, key


def fix_options(*, strip_module: bool = False, add_module: bool = False, strip_prefix: tuple[str, ...] = (),
                add_prefix: tuple[str, ...] = (), rename: tuple[str, ...] = (), drop: tuple[str, ...] = (),
                select: str | None = None, map_location: tuple[str, ...] = (), dtype: str | None = None,
                model_spec: str | None = None, model_args: tuple[str, ...] = (), auto: bool = False,
                reorder: bool = False, map_by_order: bool = False, allow_missing: str | None = None,
                allow_unexpected: str | None = None, ties: tuple[str, ...] = (), format_: str | None = None,
                max_shard_size: str | None = None, dry_run: bool = False, force: bool = False,
                no_verify: bool = False, allow_unsafe: bool = False, plain_data: bool = False,
                policy: Policy = DEFAULT_POLICY, checkpoint: str | None = None) -> FixOptions:
    """The flags of `ckpt-doctor fix` (as the parser names them) -> FixOptions. Transforms are listed in the order
    they apply, whatever their order on the command line; the model is built (on meta) here. `checkpoint`: the
    file fixed, beside which `--model hf:` alone finds its config.json. `policy`: the allow-list the command built
    from --allow-global (a reference checkpoint given as --model is read under it too)."""
    # only when fix runs: the fix package (its plan, options and writers) is not imported for the other commands
    from . import transforms as T
    from .fix import FixOptions, OutputFormat  # (only for fix)

    if model_args and not model_spec:
        raise UsageError("--model-arg needs --model")
    if (auto or reorder or map_by_order) and not model_spec:
        raise UsageError("--auto, --reorder and --map-by-order need --model SPEC")
    steps: list[T.Transform] = []
    if strip_module:
        steps.append(T.strip_prefix("module."))
    steps += [T.strip_prefix(p) for p in strip_prefix]
    if add_module:
        steps.append(T.add_prefix("module."))
    steps += [T.add_prefix(p) for p in add_prefix]
    steps += [T.rename(r) for r in rename]
    steps += [T.drop(d) for d in drop]
    for flag, pattern in (("--allow-missing", allow_missing), ("--allow-unexpected", allow_unexpected)):
        if pattern:
            T.compile_regex(pattern, flag)
    model = None
    if model_spec:
        from .modelspec import keys_from_spec, parse_model_args  # ast, and torch to build the model: only with --model

        model = keys_from_spec(model_spec, parse_model_args(model_args), checkpoint=checkpoint, policy=policy)
    return FixOptions(transforms=tuple(steps), select=select, map_location=parse_map_location(map_location),
                      dtype=parse_dtype(dtype), model=model, reorder=reorder, auto=auto, map_by_order=map_by_order,
                      force=force, format=OutputFormat(format_) if format_ else None, allow_missing=allow_missing,
                      allow_unexpected=allow_unexpected, ties=tuple(parse_tie(t) for t in ties), dry_run=dry_run,
                      max_shard_size=parse_size(max_shard_size) if max_shard_size else None,
                      verify=not no_verify, allow_unsafe=allow_unsafe, plain_data=plain_data, policy=policy)
