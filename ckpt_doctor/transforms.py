"""Pure functions on key lists: the renames `fix` applies and `inspect --model` proposes. No I/O, no torch."""

from __future__ import annotations

import enum
import re
from collections import Counter
from ._record import record

from .errors import PlanError, Rerun, UsageError


class Op(str, enum.Enum):
    """Key transforms, in the order they are applied whatever the order on the command line."""

    DROP = "drop"
    STRIP_PREFIX = "strip-prefix"
    RENAME = "rename"
    ADD_PREFIX = "add-prefix"


APPLY_ORDER = (Op.DROP, Op.STRIP_PREFIX, Op.RENAME, Op.ADD_PREFIX)


@record
class Transform:
    op: Op
    arg: str
    repl: str = ""

    def apply(self, key: str) -> str | None:
        """The new key, or None when the key is dropped."""
        if self.op is Op.DROP:
            return None if re.search(self.arg, key) else key
        if self.op is Op.STRIP_PREFIX:
            return key[len(self.arg):] if key.startswith(self.arg) and len(key) > len(self.arg) else key
        if self.op is Op.ADD_PREFIX:
            return self.arg + key
        if self.op is Op.RENAME:
            try:
                return re.sub(self.arg, self.repl, key)
            except (re.error, IndexError) as exc:  # a group the pattern lacks, a bad escape in REPL
                raise UsageError(f"--rename {self.arg}={self.repl}: the replacement does not fit the pattern ({exc})"
                                 ) from None
        raise AssertionError(self.op)

    def flags(self) -> list[str]:
        if self.op is Op.STRIP_PREFIX:
            return ["--strip-module"] if self.arg == "module." else ["--strip-prefix", self.arg]
        if self.op is Op.ADD_PREFIX:
            return ["--add-module"] if self.arg == "module." else ["--add-prefix", self.arg]
        if self.op is Op.RENAME:
            return ["--rename", f"{self.arg}={self.repl}"]
        return ["--drop", self.arg]


def strip_prefix(prefix: str) -> Transform:
    """Take a leading `prefix` off the keys that have it. A prefix is whole key components: `module` means
    `module.` (a blind `k[len(p):]` would leave `.features.0.weight`); `--rename` cuts inside a component."""
    return Transform(Op.STRIP_PREFIX, _components(prefix, "--strip-prefix"))


def add_prefix(prefix: str) -> Transform:
    """Put `prefix` (whole components: `model` means `model.`) before every key."""
    return Transform(Op.ADD_PREFIX, _components(prefix, "--add-prefix"))


def _components(prefix: str, flag: str) -> str:
    parts = prefix[:-1].split(".") if prefix.endswith(".") else prefix.split(".")
    if not prefix or not all(parts):
        raise UsageError(f"{flag} {prefix!r}: a prefix is one or more whole key components, such as module or "
                         "model.encoder (an empty component is no name)")
    return prefix if prefix.endswith(".") else prefix + "."


def rename(spec: str) -> Transform:
    """`REGEX=REPL`: the first `=` splits (use `\\=` for a literal `=` in the pattern)."""
    parts = re.split(r"(?<!\\)=", spec, maxsplit=1)
    if len(parts) != 2:
        raise UsageError(f"--rename {spec!r}: expected REGEX=REPL, e.g. --rename '^backbone\\.=encoder.'")
    pattern = parts[0].replace("\\=", "=")
    compiled = compile_regex(pattern, "--rename")
    try:  # re checks a template when a key first matches; check it now, once, as re.sub will (CPython 3.11+)
        template = getattr(re, "_compile_template", None)
        if template is not None:
            template(compiled, parts[1])
    except (re.error, IndexError) as exc:
        raise UsageError(f"--rename {spec!r}: the replacement does not fit the pattern ({exc})") from None
    return Transform(Op.RENAME, pattern, parts[1])


def drop(pattern: str) -> Transform:
    compile_regex(pattern, "--drop")
    return Transform(Op.DROP, pattern)


def compile_regex(pattern: str, flag: str) -> re.Pattern[str]:
    """The compiled pattern a user gave with `flag`, or a UsageError that says what is wrong with it."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"{flag} {pattern!r} is not a valid regular expression ({exc})") from None


def ordered(transforms: list[Transform]) -> list[Transform]:
    """Transforms in APPLY_ORDER; within one kind, in the order given."""
    return sorted(transforms, key=lambda t: APPLY_ORDER.index(t.op))


@record
class KeyPlan:
    """What happens to every key: old -> new for kept keys (in output order), and the dropped ones."""

    mapping: dict[str, str]
    dropped: tuple[str, ...]
    idle: tuple[Transform, ...] = ()  # the transforms that changed no key (a prefix spelled otherwise than the keys)

    @property
    def renamed(self) -> dict[str, str]:
        return {old: new for old, new in self.mapping.items() if old != new}


def plan_keys(keys: list[str], transforms: list[Transform], order: list[str] | None = None) -> KeyPlan:
    """Apply transforms to every key; two keys landing on one name is a PlanError, never a silent overwrite, and so
    is a key no module could have (`key_problem`)."""
    return _plan_keys(keys, ordered(transforms), order, suggest=True)


def _plan_keys(keys: list[str], steps: list[Transform], order: list[str] | None, suggest: bool) -> KeyPlan:
    mapping: dict[str, str] = {}
    dropped: list[str] = []
    idle = list(steps)
    for key in keys:
        new: str | None = key
        for step in steps:
            before, new = new, step.apply(new)
            if new != before and idle and step in idle:
                idle.remove(step)
            if new is None:
                break
        if not well_formed(new) and well_formed(key):  # a name the file already has is kept as torch would
            raise _malformed(key, steps, keys, suggest)
        if new is None:
            dropped.append(key)
        else:
            mapping[key] = new
    counts = Counter(mapping.values())
    clashes = [name for name, n in counts.items() if n > 1]
    if clashes:
        sources = [old for old, new in mapping.items() if new == clashes[0]]
        raise PlanError(f"{len(clashes)} key(s) would end with the same name, e.g. {' and '.join(sources[:2])} "
                        f"→ {clashes[0]}; nothing written. Add --drop for one of them or narrow the rename")
    if order is not None:
        rank = {name: i for i, name in enumerate(order)}
        mapping = dict(sorted(mapping.items(), key=lambda kv: rank.get(kv[1], len(rank))))
    return KeyPlan(mapping, tuple(dropped), tuple(idle))


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def key_problem(key: str | None) -> str | None:
    """Why no module could have `key` as the name of a tensor (an empty component: a leading, trailing or doubled
    dot, or no name at all; a control character), or None when it is a name torch can use."""
    if key is None:
        return None
    if key == "":
        return "an empty key"
    if key.startswith(".") or key.endswith(".") or ".." in key:
        return "a key with an empty component"
    control = _CONTROL.search(key)
    if control:
        return f"a key with a control character ({control.group()!r})"
    return None


def well_formed(key: str | None) -> bool:
    """A key torch can name a tensor by: no empty component (no leading, trailing or doubled dot), no control
    character."""
    return key_problem(key) is None


def _malformed(key: str, steps: list[Transform], keys: list[str], suggest: bool = True) -> PlanError:
    """The refusal of transforms that make a key no module has: names the first step that does, with the rename that
    was meant when one is plain (the dot beside the match taken with it) and the whole set of transforms, so changed,
    plans cleanly on every key; else says why that rename would not do either."""
    import shlex

    new: str | None = key
    for step in steps:
        before, new = new, step.apply(new)  # type: ignore[arg-type]
        if not well_formed(new):
            break
    problem = key_problem(new)
    what = f"{' '.join(step.flags())} turns {before!r} into {new!r}: {problem}, which no module has; nothing written"
    if step.op is not Op.RENAME or not suggest or not problem or "empty" not in problem:
        return PlanError(what)
    why_not: list[str] = []
    for pattern in (step.arg + r"\.", r"\." + step.arg):
        meant = Transform(Op.RENAME, pattern, step.repl)
        try:
            re.compile(pattern)
            if not (all(well_formed(meant.apply(k)) for k in keys) and any(meant.apply(k) != k for k in keys)):
                continue
            _plan_keys(keys, [meant if s is step else s for s in steps], None, suggest=False)  # checked as a whole
        except re.error:
            continue
        except (PlanError, UsageError) as exc:
            why_not.append(f"{' '.join(shlex.quote(f) for f in meant.flags())} would not do either: "
                           f"{str(exc).split('; nothing written')[0]}")
            continue
        return PlanError(what + "; the rename with the dot beside it: {0}",
                         reruns=(Rerun(add=tuple(meant.flags()), remove=tuple(step.flags())),))
    return PlanError(what + (f" ({why_not[0]})" if why_not else ""))


def flags_for(transforms: list[Transform]) -> list[str]:
    return [flag for t in ordered(transforms) for flag in t.flags()]


def literal_regex(text: str) -> str:
    """A regex for exactly `text`, each character that is not printable written as its escape (\\x00, \\u202e):
    the command that holds it can be pasted whole, and a NUL, which no argument can carry, passes as four
    characters."""
    if text.isprintable():
        return re.escape(text)
    return "".join(re.escape(c) if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 0x100 else
                   f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}" for c in text)


def exact_keys_regex(keys: list[str] | tuple[str, ...]) -> str:
    """One anchored regex naming exactly these keys, as --drop and --allow-missing take them:
    `^(fc\\.weight|fc\\.bias)$`."""
    parts = [literal_regex(k) for k in keys]
    return f"^{parts[0]}$" if len(parts) == 1 else "^(" + "|".join(parts) + ")$"
