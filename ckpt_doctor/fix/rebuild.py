"""The output's tree: the source tree rebuilt around the written part, dropped entries cut and listed, and every
object the output could not hold (a global off the allow-list, a cycle, a value torch.load refuses) refused."""

from __future__ import annotations

import re
from collections import OrderedDict

from ..errors import PlanError, Rerun, UsageError
from ..records import Checkpoint, GlobalRef, OutTensor, TensorRecord, Verdict, ancestors
from ..safepickle.policy import Policy, check_user_allowance, resolve
from ..safepickle.unpickler import Device, DType, Opaque, RawTensor, SizeValue
from ..transforms import Transform, exact_keys_regex
from ..tree import has_tensor, join, run_nested

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Any, Callable, Generator


def is_module_root(ckpt: Checkpoint, root: str) -> bool:
    return ckpt.model_class is not None and root == (ckpt.state_dict_root or "")


MISSING = object()


def subtree(obj: Any, path: str) -> Any:
    """The value at a dotted key path (keys that hold dots themselves are tried first), or MISSING."""
    if path == "":
        return obj
    for name, value in _longest_first(obj):
        if path == name:
            return value
        if path.startswith(name + "."):
            found = subtree(value, path[len(name) + 1:])
            if found is not MISSING:
                return found
    return MISSING


def beside(obj: Any, path: str, above: str = "") -> list[str]:
    """The dotted paths of what `obj` holds besides the value at `path` (found as subtree finds it): its siblings at
    every level above it, in the container's order."""
    for name, value in _longest_first(obj):
        rest = path[len(name) + 1:]
        if path == name or path.startswith(name + ".") and subtree(value, rest) is not MISSING:
            keys = obj if isinstance(obj, dict) else range(len(obj))
            others = [join(above, key) for key in keys if str(key) != name]
            return others if path == name else others + beside(value, rest, join(above, name))
    return []


def unlisted_tensors(tensors: tuple[TensorRecord, ...], written: set[str], dropped: list[str],
                      prefix: str) -> list[str]:
    """Every source tensor the output does not hold and `dropped` does not name yet (itself or a container above
    it): none leaves unlisted, whatever part was selected (a whole pickled model's other modules included). A key
    of the state_dict is named as the state_dict names it, any other by its full path."""
    listed = set(dropped)
    out = []
    for t in tensors:
        if t.key in written:
            continue
        relative = t.key[len(prefix):] if prefix and t.key.startswith(prefix) else None
        if any(path in listed for path in ancestors(t.key)) or \
                relative is not None and any(path in listed for path in ancestors(relative)):
            continue
        out.append(relative if relative is not None else t.key)
    return out


def left_out(tree: Any, part: str, *, beside: bool, inside: bool) -> list[str]:
    """Paths of the source tree an output at `part` does not hold: with `beside`, every entry beside the part at
    each level above it (a training checkpoint's `optimizer`, `epoch` when its `model` is written alone); with
    `inside`, the entries within the part that hold no tensor (a state_dict's `version`, an `_extra_state` object),
    which a state_dict of tensors cannot hold. A container left out whole is one path."""
    out: list[str] = []
    node, at = tree, ""
    rest = part
    while rest:  # down the part's path; keys may hold dots themselves, so the longest matching name is taken
        items = _items(node)
        step = next(((name, value) for name, value in _longest_first(node)
                     if rest == name or rest.startswith(name + ".")), None)
        if step is None:
            return out
        if beside:
            out += [join(at, name) for name, _ in items if name != step[0]]
        node, at = step[1], join(at, step[0])
        rest = rest[len(step[0]) + 1:]
    if inside:
        todo = [(at, node)]
        while todo:
            path, value = todo.pop()
            for name, child in _items(value):
                if isinstance(child, RawTensor):
                    continue
                if isinstance(child, (dict, list, tuple)) and has_tensor(child):
                    todo.append((join(path, name), child))
                elif not (isinstance(child, Opaque) and has_tensor(child)):  # a module's own tensors are written
                    out.append(join(path, name))
    return out


def _items(node: Any) -> list[tuple[str, Any]]:
    """A container's entries by the names a dotted path gives them, in its order; none for anything else."""
    if isinstance(node, dict):
        return [(k if isinstance(k, str) else str(k), v) for k, v in node.items()]
    if isinstance(node, (list, tuple)) and type(node) is not SizeValue:
        return [(str(i), v) for i, v in enumerate(node)]
    return []


def _longest_first(node: Any) -> list[tuple[str, Any]]:
    """_items, the longest names first: a key that holds dots is tried before its shorter prefixes."""
    return sorted(_items(node), key=lambda kv: -len(kv[0]))


def rebuild(obj: Any, path: str, root: str, state: "OrderedDict[str, OutTensor]",
             records: dict[str, TensorRecord], drops: list[Transform], outs: list[OutTensor],
             out_tensor: Callable[[str, TensorRecord], OutTensor], cut: set[str], problems: list,
             policy: Policy) -> Any:
    """The original tree with the state_dict at `root` replaced by `state`; dropped entries left out, and their
    paths added to `cut`; objects that cannot be written added to `problems` as (path, global)."""

    inside: set[int] = set()  # the containers being rebuilt: one met again within itself is a cycle

    def rebuilt(obj: Any, path: str) -> Generator:  # yields the rebuilding of each child, sent its result
        if path == root:
            return state
        if isinstance(obj, (dict, list, tuple)) and id(obj) in inside:
            raise PlanError(f"{path}: the {type(obj).__name__} holds itself (a cycle): torch.save writes that, fix "
                            f"writes trees; leave the repeat out with --drop '{re.escape(path)}$'")
        if isinstance(obj, RawTensor):
            record = records.get(path)
            if record is None:
                raise PlanError(f"internal: tensor at {path} not listed")
            out = out_tensor(path, record)
            outs.append(out)
            return out
        if isinstance(obj, dict):
            items = [(k, v) for k, v in obj.items() if is_kept(join(path, k), drops, cut)]
            for k, _ in items:
                if isinstance(k, Opaque) or isinstance(k, type) and issubclass(k, Opaque):
                    check_writable(k, join(path, k), problems, policy)
            pairs = []
            inside.add(id(obj))
            for k, v in items:
                pairs.append((k, (yield rebuilt(v, join(path, k)))))
            inside.discard(id(obj))
            return OrderedDict(pairs) if isinstance(obj, OrderedDict) else dict(pairs)
        if isinstance(obj, frozenset):  # written as builtins.frozenset, which torch.load(weights_only=True) refuses
            if not policy.writable("builtins", "frozenset"):
                problems.append((path, GlobalRef("builtins", "frozenset", Verdict.SAFE, "a frozenset value")))
            return obj
        if isinstance(obj, (list, tuple)):
            if type(obj) is SizeValue or obj and all(o is None or isinstance(o, (bool, int, float, str)) for o in obj) \
                    and all(is_kept(join(path, i), drops, cut) for i in range(len(obj))):
                return obj  # plain values, none dropped: as they are
            kept = [i for i in range(len(obj)) if is_kept(join(path, i), drops, cut)]
            refuse_shift(obj, path, kept)
            values = []
            inside.add(id(obj))
            first = len(problems)
            for i in kept:
                values.append((yield rebuilt(obj[i], join(path, i))))
            inside.discard(id(obj))
            if path:  # an item's place is its meaning: leaving one out would shift the rest, so the advice is the whole
                items = {join(path, i) for i in range(len(obj))}
                problems[first:] = [(path, *p[1:]) if p[0] in items else p for p in problems[first:]]
            return values if isinstance(obj, list) else tuple(values)
        if isinstance(obj, Opaque):
            if has_tensor(obj):
                raise PlanError(f"{path or 'the file'} is a pickled "
                                f"{obj.ckd.ref.qualname if obj.ckd.ref else 'object'} holding tensors; write its "
                                f"weights alone with --select {path or '…'}")
            check_writable(obj, path, problems, policy)
        elif isinstance(obj, type) and issubclass(obj, Opaque):
            check_writable(obj, path, problems, policy)
        else:
            check_leaf(obj, path, problems)
        return obj

    return run_nested(rebuilt(obj, path))


def refuse_shift(items: list | tuple, path: str, kept: list[int]) -> None:
    """A --drop of a list's or tuple's item before others holding tensors would move them into its place: tensors
    under other names (which the check of the written file refuses). Refused while planning, dry run included."""
    moved = next((i for n, i in enumerate(kept) if n != i and has_tensor(items[i])), None)
    if moved is None:
        return
    gone = next(i for i in range(moved) if i not in kept)
    kind = type(items).__name__
    what = f"--drop leaves out {join(path, gone)}, an item of the {kind} {path or 'at the root'}: " \
           f"{join(path, moved)} would be written as {join(path, kept.index(moved))} (an item is known by its place)"
    if not path:
        raise PlanError(f"{what}; write the part you want with --select N")
    raise PlanError(what + "; leave out the whole " + kind + " with {0}",
                    reruns=(Rerun(add=("--drop", exact_keys_regex([path]))),))


# What the output's pickle can hold as a plain value: what torch.load(weights_only=True) reads back.
_LEAVES = (type(None), bool, int, float, str, bytes, bytearray, complex, set, DType, Device)


_LONG1_BITS = 255 * 8 - 1  # ints past LONG1's 255 bytes need LONG4, which torch's weights_only unpickler refuses


def check_leaf(obj: Any, path: str, problems: list) -> None:
    """Note a plain value the output cannot hold as torch.load(weights_only=True) reads it (a slice, an int too
    big for LONG1): found while planning, so that a dry run, a rescue and the write agree."""
    if isinstance(obj, int) and not isinstance(obj, bool) and obj.bit_length() > _LONG1_BITS:
        problems.append((path, GlobalRef("builtins", "int", Verdict.SAFE, "an int of more than 255 bytes"), False))
    elif not isinstance(obj, _LEAVES):
        name = type(obj).__name__
        problems.append((path, GlobalRef(type(obj).__module__ or "builtins", name, Verdict.SAFE, f"a {name} value"),
                         False))


def check_writable(obj: Any, path: str, problems: list, policy: Policy) -> None:
    """Note (in `problems`) an object the output would have to name a global for, unless torch.load(weights_only=
    True) accepts that global or the user allowed it: fix never writes what the allow-list does not hold."""
    refs = [ref for ref in _refs_in(obj) if not policy.writable(ref.module, ref.name)]
    if refs and _holds_cycle(obj):  # --allow-global cannot keep it: the writer cannot write a cycle back
        article = "an" if refs[0].qualname[:1].lower() in "aeiou" else "a"
        problems.append((path, refs[0], False, f"{article} {refs[0].qualname} that holds itself (a cycle)"))
    else:
        problems.extend((path, ref) for ref in refs)


def _allowable(name: str) -> bool:
    """Whether --allow-global takes `name` (advice never offers one it would refuse)."""
    try:
        check_user_allowance(name)
    except UsageError:
        return False
    return True


def refuse_unwritable(problems: list, plain_data: tuple[str, ...] | None = None) -> None:
    """Exit 2 naming every object fix would have to leave out, with the one --drop that leaves them all out (as a
    command to paste; `.drop` holds its pattern for callers that plan a rescue), and `plain_data`'s flags where
    given (--plain-data, and a --drop of what it leaves: the same fix with them plans, plan.plain_data_plans)."""
    if not problems:
        return
    keepable = all(len(p) < 3 or p[2] for p in problems)  # a value the writer cannot hold is not kept by a flag
    pairs = list(dict.fromkeys((p[0], ".".join(resolve(p[1].module, p[1].name)), p[1].verdict) for p in problems))
    paths = list(dict.fromkeys(path for path, _, _ in pairs))
    names = list(dict.fromkeys(name for _, name, _ in pairs))
    dangerous = any(v is Verdict.DANGEROUS for _, _, v in pairs)
    reruns: list[Rerun] = []
    pattern = None
    if not all(paths):
        drop = "--select with the part that holds the tensors (the file's root itself is such an object)"
    else:
        pattern = exact_keys_regex(paths)
        reruns.append(Rerun(add=("--drop", pattern)))
        drop = "{0}"
        tops = list(dict.fromkeys(p.split(".")[0] for p in paths))
        if len(paths) > 1 and len(tops) == 1:
            reruns.append(Rerun(add=("--drop", exact_keys_regex(tops[:1]))))
            drop += " (or the whole entry: {1})"
    keep = ""
    if plain_data:
        what = "it" if len(paths) == 1 else "them" if len(plain_data) == 1 else "what is data"
        keep = (f", or write {what} as plain data (a Namespace as a dict, a NumPy scalar as a number, a path as a "
                f"str){' and leave out the rest' if len(plain_data) > 1 else ''} with {{{len(reruns)}}}")
        reruns.append(Rerun(add=plain_data))
    if not dangerous and keepable and all(_allowable(n) for n in names):
        at = len(reruns)
        reruns.append(Rerun(add=tuple(a for n in names for a in ("--allow-global", n))))
        classes = ", and for the classes of the NumPy dtypes it builds, which fix's note names" \
            if "numpy.dtype" in names else ""
        keep += (f", or keep {'it' if len(paths) == 1 else 'them'} with {{{at}}} (then torch.load needs "
                f"torch.serialization.add_safe_globals for {'it' if len(names) == 1 else 'them'}{classes})")
    refused = "which torch.load(weights_only=True) refuses and ckpt-doctor does not write"
    if len(pairs) == 1:
        path, name, verdict = pairs[0]
        plain = [p[3] if len(p) > 3 else p[1].reason for p in problems if len(p) > 2 and not p[2]]  # say what
        what = f"{path or 'the root'} holds " + (f"{plain[0]}, " if plain else
                                                 f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name} "
                                                 f"({verdict.value}), ")
        message = f"{what}{refused}. Leave it out with {drop}{keep}"
    else:
        by_path: dict[str, list[str]] = {}
        for path, name, _ in pairs:
            by_path.setdefault(path, []).append(name)
        shown = "; ".join(f"{p or 'the root'} ({', '.join(ns[:2])}{', …' if len(ns) > 2 else ''})"
                          for p, ns in list(by_path.items())[:6])
        more = f"; … {len(paths) - 6} more" if len(paths) > 6 else ""
        one = len(paths) == 1  # (one entry holding several objects)
        message = (f"{len(paths)} {'entry holds' if one else 'entries hold'} objects {refused}: {shown}{more}. "
                   f"Leave {'it' if one else 'them'} out with {drop}{keep}")
    error = PlanError(message, reruns=tuple(reruns))
    error.drop = pattern  # type: ignore[attr-defined]
    raise error


def _parts(item: Any) -> list | None:
    """What an object of the unpickled tree holds (what writing it writes too); None for a leaf."""
    if isinstance(item, Opaque):
        data = item.ckd
        return [data.args, data.kwargs, data.state, data.items, data.dictitems]
    if isinstance(item, dict):
        return [*item.keys(), *item.values()]
    if isinstance(item, (list, tuple, set, frozenset)):
        return list(item)
    return None


def _refs_in(obj: Any) -> list:
    """The globals an object of the unpickled tree would be written with (its class, and those of its parts)."""
    refs, stack, seen = [], [obj], set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, type) and issubclass(item, Opaque):
            if item.__ref__ is not None:
                refs.append(item.__ref__)
            continue
        if isinstance(item, Opaque) and item.ckd.ref is not None:
            refs.append(item.ckd.ref)
        stack.extend(_parts(item) or ())
    return refs


def _holds_cycle(obj: Any) -> bool:
    """Whether an object of the unpickled tree holds itself somewhere inside (omegaconf's nodes point back to their
    parents), which no pickle fix writes can hold: its _parts walked depth first, the open ones kept."""
    stack: list[tuple[Any, bool]] = [(obj, False)]
    open_: set[int] = set()
    done: set[int] = set()
    while stack:
        item, leaving = stack.pop()
        if leaving:
            open_.discard(id(item))
            done.add(id(item))
            continue
        if id(item) in open_:
            return True
        parts = None if id(item) in done else _parts(item)
        if parts is None:
            continue
        open_.add(id(item))
        stack.append((item, True))
        stack.extend((part, False) for part in parts)
    return False


class PlainState(OrderedDict):
    """A state_dict the source holds as a plain dict (torch.save of `{name: tensor}`): written back as a dict, where
    one from a module's state_dict() (an OrderedDict, whose `_metadata` its loading reads) is written as one."""


def in_source_order(tree: "OrderedDict[Any, Any]", source: dict, mapping: dict[str, str]) -> "OrderedDict[Any, Any]":
    """`tree`'s entries in the order their sources have in `source` (a tensor's under its new name); any other
    entry after them."""
    ordered: OrderedDict[Any, Any] = type(tree)()
    for key in source:
        name = mapping.get(key if isinstance(key, str) else str(key), key)
        if name in tree and name not in ordered:
            ordered[name] = tree[name]
    for name, value in tree.items():
        ordered.setdefault(name, value)
    return ordered


def out_tensors(obj: Any) -> list[OutTensor]:
    """The OutTensors inside a rebuilt entry, in order."""
    found: list[OutTensor] = []
    todo = [obj]  # depth first, on a list: an entry can nest as deep as torch.save writes
    while todo:
        item = todo.pop()
        if isinstance(item, OutTensor):
            found.append(item)
        elif isinstance(item, dict):
            todo.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            todo.extend(reversed(item))
    return found


def is_dropped(path: str, drops: list[Transform]) -> bool:
    return any(re.search(d.arg, path) for d in drops)


def is_kept(path: str, drops: list[Transform], cut: set[str]) -> bool:
    if is_dropped(path, drops):
        cut.add(path)
        return False
    return True


def tensors_under(cut: set[str], records: dict[str, TensorRecord], state_prefix: str) -> list[str]:
    """The tensors (full paths) inside the entries --drop cut from the tree, those of the state_dict excepted
    (already listed by their keys)."""
    if not cut:
        return []
    found = []
    for key in records:
        if state_prefix and key.startswith(state_prefix):
            continue
        if any(path in cut for path in ancestors(key)):
            found.append(key)
    return found

