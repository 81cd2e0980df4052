"""Advice is data: a command ckpt-doctor suggests is an argv and the check it promises, rendered once wherever it
is shown (the table, stderr, JSON) and run by the test suite, so no printed command can drift from one that works."""

from __future__ import annotations

import enum
import os

from ._record import record, replace

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Sequence


class Promise(str, enum.Enum):
    """What running a suggested command promises, and so what the test suite checks after running it."""

    # Where a Suggestion's `safe_globals` names globals (the user's --allow-global), "torch.load(weights_only=True)"
    # below is within torch.serialization.safe_globals([...]) of them.
    LOADS = "loads"  # exits 0; its output loads with torch.load(weights_only=True) and strictly into its --model
    # exits 0 and writes its output, which torch.load(weights_only=True) loads (a .safetensors one: load_file)
    WRITES = "writes"
    SHOWS = "shows"  # exits 0 and shows what it says (a dry run, a listing); writes nothing


@record
class Suggestion:
    argv: tuple[str, ...]  # what follows `ckpt-doctor`
    promise: Promise
    why: str = ""  # the sentence around it, for a person
    model: tuple[str, ...] = ()  # for LOADS: the --model SPEC [--model-arg …] its output must load into
    # Globals the output may name that only --allow-global allows: torch.load(weights_only=True) loads it within
    # torch.serialization.safe_globals([...]) of them (their classes imported by the user's own code).
    safe_globals: tuple[str, ...] = ()

    @property
    def command(self) -> str:
        return command_line(self.argv)

    def json(self) -> dict[str, object]:
        return {"command": self.command, "argv": ["ckpt-doctor", *self.argv], "promise": self.promise.value,
                "why": self.why, **({"model": list(self.model)} if self.model else {}),
                **({"safe_globals": list(self.safe_globals)} if self.safe_globals else {})}


def user_allowed(globals_: Sequence[object]) -> tuple[str, ...]:
    """The globals of a file (its GlobalRefs, read under the user's policy) that only --allow-global allows: safe, yet
    neither on torch's weights_only list nor among the curated records. A command that reads the file again names
    each with --allow-global (allow_flags), so that it reads it as this one did."""
    from .safepickle.policy import ALLOWED, Verdict, resolve

    found: dict[str, None] = {}
    for g in globals_:
        full = ".".join(resolve(g.module, g.name))  # type: ignore[attr-defined]
        if g.verdict is Verdict.SAFE and full not in ALLOWED:  # type: ignore[attr-defined]
            found[full] = None
    return tuple(found)


def allow_flags(names: Sequence[str]) -> tuple[str, ...]:
    """`--allow-global NAME` for each name."""
    return tuple(a for n in names for a in ("--allow-global", n))


def under_safe_globals(names: Sequence[str]) -> str:
    """How torch.load loads a file that names `names` (allowed with --allow-global)."""
    return (f"within torch.serialization.safe_globals([{', '.join(names)}]) (allowed with --allow-global, which "
            "torch's defaults refuse)")


def command_line(argv: Sequence[str]) -> str:
    """`ckpt-doctor ARGV…`, quoted for a POSIX shell: a word with a control character or a backtick in it is
    written as bash's $'…', so that the line stays one printable line to copy (and a backtick cannot end the
    `…` a command is printed in)."""
    return " ".join(["ckpt-doctor", *(shell_word(str(a)) for a in argv)])


def shell_word(word: str) -> str:
    """One word quoted for a POSIX shell, as command_line quotes each."""
    import shlex

    if word.isprintable() and "`" not in word:
        return shlex.quote(word)
    escaped = []
    for ch in word:
        if ch == "\\":
            escaped.append("\\\\")
        elif ch == "'":
            escaped.append("\\'")
        elif ch == "`" or not ch.isprintable():
            escaped.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}" if ord(ch) < 0x10000
                           else f"\\U{ord(ch):08x}")
        else:
            escaped.append(ch)
    return "$'" + "".join(escaped) + "'"


_SHOWN_AS: dict[str, str] = {}  # a local path -> the reference the user named it by (hf://org/name)


def show_as(local: str, ref: str) -> None:
    """Print `local` (and what lies under it) as `ref` in every command: a Hugging Face cache reference resolved to
    its snapshot (readers/hfcache.py) is printed as the user wrote it, and runs as printed."""
    _SHOWN_AS[local.rstrip(os.sep) or os.sep] = ref.rstrip("/")


def _shown(text: str) -> str:
    for local, ref in _SHOWN_AS.items():
        if text == local:
            return ref
        if text.startswith(local + os.sep):
            return ref + "/" + text[len(local) + 1:].replace(os.sep, "/")
    return text


def shell_path(path: str | os.PathLike[str]) -> str:
    """A path as an argument: one that starts with `-` is written `./-x.pt`, which no parser takes for an option."""
    text = str(path) if type(path).__name__ == "RemotePath" else os.fspath(path)  # a URL as it may be printed
    text = _shown(text) if _SHOWN_AS else text
    return "./" + text if text.startswith("-") else text


# Suffixes of checkpoint files, taken off a name before a suggested output's suffix is put on (`model.pth.tar`).
CHECKPOINT_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".ckpt", ".tar", ".pkl", ".pickle", ".safetensors", ".zip",
                                 ".model", ".weights", ".pth.tar", ".distcp"})


# The files a DeepSpeed folder is named by over HTTP (readers/deepspeed.names_folder), tensor-parallel ranks aside.
_RANK0_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def output_beside(source: str | os.PathLike[str], tag: str = "fixed", suffix: str = ".pt",
                  taken: set[str] | None = None) -> str:
    """A suggested output: beside the input (a folder's sibling), its checkpoint suffixes replaced by `_TAG.pt`,
    and a name no file has yet (`_fixed2.pt` when `_fixed.pt` exists) nor another suggestion of this run
    (`taken`), so that the command runs as printed. Where the input's folder is not writable, in this one; for a URL
    (https://, s3://: ckpt-doctor writes local files only) and a Hugging Face cache reference (hf://) in this one
    too, named after the URL's last part."""
    text = str(source).rstrip("/") or "."
    text = _shown(text) if _SHOWN_AS else text
    if text.startswith(("https://", "http://", "s3://", "hf://")):  # hf://org/name@rev: `name`, never in the cache
        parts = text.split("://", 1)[1].split("?", 1)[0].rsplit("/", 2)
        if len(parts) == 3 and (parts[-1] in (".metadata", "latest") or parts[-1] in _RANK0_MODEL_STATES):
            parts.pop()  # a DCP folder by its metadata, a DeepSpeed folder by its latest or model states: the folder
        folder, name = "", parts[-1].split("@", 1)[0] or "checkpoint"
    else:
        text = os.fspath(source).rstrip("/") or "."
        folder, name = os.path.split(text)
        if name.endswith(".index.json") and folder.strip("./"):  # a model folder's shard index: beside the folder,
            folder, name = os.path.split(folder.rstrip("/"))  # where a file inside would be one more of its files
    if os.path.isdir(folder or ".") and not os.access(folder or ".", os.W_OK) and os.access(".", os.W_OK):
        folder = ""
    stem = name.removesuffix(".index.json")  # a shard index (a remote sharded checkpoint): named as its model
    while True:
        base, dot, ext = stem.rpartition(".")
        if not dot or not base or "." + ext.lower() not in CHECKPOINT_SUFFIXES:
            break
        stem = base
    for n in range(1, 1000):
        candidate = shell_path(os.path.join(folder, f"{stem}_{tag}{n if n > 1 else ''}{suffix}"))
        if not os.path.lexists(candidate) and candidate not in (taken or ()):
            if taken is not None:
                taken.add(candidate)
            return candidate
    return shell_path(os.path.join(folder, f"{stem}_{tag}{suffix}"))


def rerun_argv(argv: Sequence[str], add: Sequence[str] = (), remove: Sequence[str] = ()) -> list[str] | None:
    """The user's argv with `remove` taken out (a flag with its value, as `--rename X` or `--rename=X`) and `add`
    appended, before a `--` (a switch already there is not added twice); None when `remove` is not in it as
    written."""
    out = list(argv)
    if remove:
        flag, values = remove[0], list(remove[1:])
        found = False
        i = 0
        while i < len(out):
            if out[i] == flag and out[i + 1:i + 1 + len(values)] == values:
                del out[i:i + 1 + len(values)]
                found = True
                continue
            if len(values) == 1 and out[i] == f"{flag}={values[0]}":
                del out[i]
                found = True
                continue
            i += 1
        if not found:
            return None
    if len(add) == 1 and add[0] in out:
        return out  # a switch already given
    end = out.index("--") if "--" in out else len(out)  # after `--` every word is an argument, none an option
    return out[:end] + list(add) + out[end:]


def consolidate(folder: str | os.PathLike[str]) -> Suggestion:
    """The command that writes a distributed checkpoint's folder (DCP, DeepSpeed) as one file of whole tensors."""
    return Suggestion(("fix", shell_path(folder), "-o", output_beside(folder, "consolidated", ".safetensors")),
                      Promise.WRITES, "writes the folder's whole tensors as one file")


def fix_line(path: str, flags: Sequence[str], promise: Promise, why: str = "", tag: str = "fixed",
             model: Sequence[str] = ()) -> Suggestion:
    """`ckpt-doctor fix PATH -o PATH_TAG.pt FLAGS…`: the output beside the input under a name not taken yet."""
    return Suggestion(("fix", shell_path(path), "-o", output_beside(path, tag), *flags), promise, why, tuple(model))


def has_fix_line(comparison: object) -> bool:
    """Whether a comparison gets a fix line: something makes it load (or it loads as it is, and the line writes the
    part to load), so that the verdict can point at that line."""
    c = comparison
    return not (c.fix_kind == "none" and not c.strict_ok  # type: ignore[attr-defined]
                and not getattr(c, "only_beside", False))


_ACCEPTING = ("--model", "--model-arg", "--allow-missing", "--allow-unexpected")  # the model, with its arguments


def fix_suggestions(path: str, comparison: object, dangerous: bool = False,
                    plain: bool = False) -> list[tuple[str, Suggestion]]:
    """The fix line of a comparison — its inferred flags, the model (so that `fix` checks its output against it
    before writing), --map-location cpu where the file holds devices this machine lacks — and, for a mapping by
    order with ambiguous positions, its dry run first (the fix line then needs --force, which it holds).

    `plain`: the file loads with torch's defaults as it is and names nothing off the allow-list. Where all the fix
    would do is accept the model's own values for keys the file lacks (a new head), it would write the file again
    unchanged: the line is then the check that accepts them (`accept`), not a fix."""

    c = comparison
    kind = c.fix_kind  # type: ignore[attr-defined]
    if not has_fix_line(c):
        return []  # nothing found that makes it load: no line to promise it (leaving out the entries of no tensor does)
    flags = list(c.suggested_fix)  # type: ignore[attr-defined]
    accepting = list(flags)  # the accept line's flags: extra keys the --allow-unexpected given accepts are loaded
    dropped = set(c.dropped)  # type: ignore[attr-defined]  # by strict=False as they are (not a reshaped head)
    accepted = set(c.allowed_unexpected) - set(c.replaced)  # type: ignore[attr-defined]
    if dropped and dropped <= accepted and flags.count("--drop") == 1:
        accepting[flags.index("--drop")] = "--allow-unexpected"  # the same regex of exactly those keys
    if plain and kind == "allowed" and all(f in _ACCEPTING for f in accepting[::2]) \
            and not (c.missing_devices or c.tied or c.dropped_entries  # type: ignore[attr-defined]
                     or getattr(c, "allowed_globals", ()) or c.fix_root):  # type: ignore[attr-defined]
        if c.strict_ok:  # type: ignore[attr-defined]  # accepted already, by the --allow-missing given
            return []
        least = c.min_loaded  # type: ignore[attr-defined]  # the user's --min-loaded: kept, and met, or no line
        if least is not None:
            if c.loaded_fraction < least - 1e-9:  # type: ignore[attr-defined]  # as the check rounds
                return []
            accepting += ["--min-loaded", repr(least)]  # exactly as given: a rounded one could fail
        kept = list(c.left_missing)  # type: ignore[attr-defined]
        names = ", ".join(kept[:3]) + (", …" if len(kept) > 3 else "")
        return [("accept", Suggestion(("inspect", shell_path(path), *accepting), Promise.SHOWS,
                                      f"exits 0: the model keeps its own {len(kept)} there ({names}); there is "
                                      "nothing to rewrite: load_state_dict(strict=False) loads the file as it is"))]
    if dangerous:
        flags.insert(0, "--allow-unsafe")
    allowed = tuple(getattr(c, "allowed_globals", ()))  # the file read again as here: what it may keep of them
    if kind == "partial":  # the closest fix: written as asked, but a strict load still fails, so no --model check
        kept = () if getattr(c, "globals_left_out", False) else allowed
        return [("fix", replace(fix_line(path, [*flags, *allow_flags(allowed)], Promise.WRITES,
                                         "the closest fix found; a strict load still fails"), safe_globals=kept))]
    if "--model" not in flags:
        flags += c.model_flags  # type: ignore[attr-defined]
    if c.missing_devices and "--map-location" not in flags:  # type: ignore[attr-defined]
        flags += ["--map-location", "cpu"]
    flags += allow_flags(allowed)
    kept = () if getattr(c, "globals_left_out", False) else allowed  # the entries naming them --drop'ped
    line = replace(fix_line(path, flags, Promise.LOADS, model=c.model_flags),  # type: ignore[attr-defined]
                   safe_globals=kept)
    out: list[tuple[str, Suggestion]] = []
    if c.ambiguous and (c.fix_kind == "map-by-order" or c.paired):  # type: ignore[attr-defined]
        out.append(("dry run", Suggestion((*line.argv, "--dry-run"), Promise.SHOWS,
                                          "shows old → new for every key; writes nothing")))
        if c.fix_kind == "map-by-order":  # type: ignore[attr-defined]  # refused without it; renames are explicit
            line = replace(line, argv=(*line.argv, "--force"))
    out.append(("fix", line))
    return out
