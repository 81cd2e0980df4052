"""Walks an unpickled tree into key paths: tensors, metadata leaves, module trees, and the state_dict root."""

from __future__ import annotations

from bisect import bisect_left
from operator import itemgetter
from collections import OrderedDict
from ._record import field, record

from .errors import ReadError
from .safepickle import limits
from .safepickle.plain import plain_text
from .safepickle.unpickler import Opaque, RawTensor, Token

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any, Generator

# Names under which training checkpoints keep the model's weights, most telling first.
STATE_DICT_NAMES = ("state_dict", "model_state_dict", "model_state", "model", "module", "net", "network",
                    "model_ema", "ema", "state_dict_ema", "ema_state_dict", "weights", "params", "params_ema",
                    "generator", "student", "teacher", "encoder")

# TorchScript: which attributes of a class are parameters/buffers, and whether it is a module.
TorchScriptMembers = "Callable[[str], tuple[tuple[str, ...], tuple[str, ...], bool] | None]"  # for annotations


@record(frozen=False)
class Flat:
    tensors: list[tuple[str, RawTensor]] = field(default_factory=list)
    metadata: "OrderedDict[str, Any]" = field(default_factory=OrderedDict)
    containers: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (direct tensors, direct items)
    modules: list[str] = field(default_factory=list)
    module_classes: dict[str, str] = field(default_factory=dict)
    non_persistent: list[str] = field(default_factory=list)
    metadata_truncated: int = 0
    optimizers: list[str] = field(default_factory=list)  # optimizer state_dicts ({"state", "param_groups"})


def join(prefix: str, name: Any) -> str:
    name = name if isinstance(name, str) else _key_text(name)
    key = f"{prefix}.{name}" if prefix else name
    if len(key) > limits.MAX_KEY_LENGTH:
        raise ReadError(f"a key path is longer than {limits.MAX_KEY_LENGTH:,} characters ({key[:60]}…); refusing "
                        "to list it (containers nested thousands deep, or one long key reused at every level?)")
    return key


def _key_text(name: Any) -> str:
    if isinstance(name, int) and not isinstance(name, bool) and name.bit_length() > 64:
        return f"<int of {name.bit_length()} bits>"
    if isinstance(name, (str, int, float, bool)) or name is None:
        return str(name)
    if isinstance(name, (bytes, bytearray)):
        return repr(bytes(name[:64]))
    return f"<{type(name).__name__}>"


def _is_module(obj: Opaque) -> bool:
    state = obj.ckd.state
    return isinstance(state, dict) and "_parameters" in state and "_modules" in state


def _leaf_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        if isinstance(value, str) and len(value) > 200:
            return value[:200] + "…"
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**63:
            return str(value) if value.bit_length() < 1000 else f"<int of {value.bit_length()} bits>"
        return value
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        items = [_leaf_value(v) for v in value[:16]]
        return items + [f"… {len(value) - 16} more"] if len(value) > 16 else items
    if isinstance(value, Opaque):  # a NumPy scalar, a path: its value shown, `<numpy.float64 0.81>`
        text = plain_text(value)
        return repr(value) if text is None else text if len(text) <= 200 else text[:199] + "…>"
    if isinstance(value, Token):
        return repr(value)
    return f"<{type(value).__name__}>"


# Markers on the walk's stack: where a container's walk ends, and where a container's counts are recorded.
_LEAVE = object()
_CONTAINER = object()


class Walker:
    def __init__(self, ts_members: TorchScriptMembers | None = None, max_nodes: int | None = None) -> None:
        self.flat = Flat()
        self.nodes = 0
        self.key_bytes = 0
        self.max_nodes = max_nodes if max_nodes is not None else limits.max_tree_nodes(0)
        self.ts_members = ts_members
        self._ancestors: set[int] = set()
        self._seen: dict[int, str] = {}  # containers walked, by id: a shared sub-tree is walked again only for tensors
        self._has_tensor: dict[int, bool] = {}
        self._sizes: dict[int, int] = {}

    def walk(self, obj: Any, path: str) -> None:
        """Walk `obj` as the tree at `path`: depth first, in the file's order. The walk keeps its own stack, as the
        unpickler does: torch.save writes containers nested up to Python's recursion limit (1,000) and torch.load
        reads them back, so the walk must not stop short of that (a call per level would)."""
        tasks: list[tuple] = [(obj, path, None)]
        while tasks:
            value, where, name = tasks.pop()
            if value is _LEAVE:  # a container's walk ends here
                self._ancestors.discard(where)
            elif value is _CONTAINER:  # (direct tensors, direct items), recorded after what came before it
                self.flat.containers[where] = name
            else:
                later = self._visit(value, where if name is None else join(where, name))
                if later:
                    tasks.extend(reversed(later))

    def _visit(self, obj: Any, path: str) -> list[tuple] | None:
        """One object of the tree; for a container, what is under it, in order, as (value, parent path, name)."""
        self._count(1)
        if isinstance(obj, RawTensor):
            self._list([path], [obj])
            return None
        if isinstance(obj, (dict, list, tuple, Opaque)):
            key = id(obj)
            if key in self._ancestors:
                self._meta(path, "<cycle>")
                return None
            first = self._seen.get(key)
            if first is not None and not has_tensor(obj, self._has_tensor):
                # Listed once; still counted whole, so a few KB of shared lists cannot pass for a small tree.
                self.nodes += tree_size(obj, self._sizes) - 1
                if self.nodes > self.max_nodes:
                    raise ReadError(f"the pickle holds more than {self.max_nodes:,} objects, counting a shared "
                                    f"one (under {first.split('.')[0] or 'the root'}) each place it appears; "
                                    "ckpt-doctor lists a shared object once but counts it whole, and does not walk "
                                    "that many")
                self._meta(path, f"<the same object as {first or 'the root'}>")
                return None
            if first is None and (not isinstance(obj, (list, tuple, dict)) or obj):
                self._seen[key] = path
            self._ancestors.add(key)
            later: list[tuple] = []
            self._container(obj, path, later)
            later.append((_LEAVE, key, None))
            return later
        self._meta(path, obj)
        return None

    def _meta(self, path: str, value: Any) -> None:
        if len(self.flat.metadata) >= limits.MAX_METADATA:
            self.flat.metadata_truncated += 1
        else:
            self.flat.metadata[path] = _leaf_value(value)

    def _container(self, obj: Any, path: str, later: list[tuple]) -> None:
        if isinstance(obj, dict):
            items = list(obj.items())
            if "state" in obj and "param_groups" in obj:
                self.flat.optimizers.append(path)
        elif isinstance(obj, (list, tuple)):
            if obj and all(o is None or isinstance(o, (bool, int, float, str)) for o in obj):
                self._meta(path, obj)
                return
            items = list(enumerate(obj))
        else:
            self._object(obj, path, later)
            return
        direct = sum(isinstance(v, RawTensor) for _, v in items)
        self.flat.containers[path] = (direct, len(items))
        if not items and path:
            self._meta(path, obj if isinstance(obj, (list, tuple)) else {})
        if direct == len(items):  # a state_dict: tensors only, listed now, as they would be next
            self._tensors(items, path)
        else:
            later.extend((value, path, key) for key, value in items)

    def _tensors(self, items: list[tuple[Any, RawTensor]], path: str) -> None:
        """A container's tensors, listed as _visit lists each (its limits checked for them all at once)."""
        self._count(len(items))
        names = [key for key, _ in items]
        if set(map(type, names)) <= {str}:  # join() of each, at once
            paths = list(map(f"{path}.".__add__, names)) if path else names
            if max(map(len, paths), default=0) <= limits.MAX_KEY_LENGTH:
                self._list(paths, [value for _, value in items])
                return
        self._list([join(path, key) for key, _ in items], [value for _, value in items])

    def _count(self, nodes: int) -> None:
        """`nodes` more objects walked, within the bound of the pickle's length."""
        self.nodes += nodes
        if self.nodes > self.max_nodes:
            raise ReadError(f"the pickle holds more than {self.max_nodes:,} objects, counting a shared one each "
                            "place it appears; ckpt-doctor does not walk that many")

    def _list(self, paths: list[str], tensors: list[RawTensor]) -> None:
        """Tensors at these key paths, listed within the bounds on their number and their paths' bytes."""
        if len(self.flat.tensors) + len(tensors) > limits.MAX_TENSORS:
            raise ReadError(f"more than {limits.MAX_TENSORS:,} tensors; refusing to list them")
        self.key_bytes += sum(map(len, paths))
        if self.key_bytes > limits.MAX_KEY_BYTES:
            raise ReadError(f"the tensors' key paths add up to more than {limits.MAX_KEY_BYTES >> 20} MB "
                            "(keys nested hundreds of levels deep?); refusing to list them")
        self.flat.tensors += zip(paths, tensors)

    def _object(self, obj: Opaque, path: str, later: list[tuple]) -> None:
        data = obj.ckd
        ref = data.ref
        if _is_module(obj):
            self._module(obj, path, later)
            return
        if ref is not None and ref.module.startswith("__torch__") and self.ts_members is not None:
            members = self.ts_members(ref.qualname)
            if members is not None and members[2]:
                self._script_module(obj, path, members, later)
                return
        walked = False
        for part in (data.args, data.kwargs, data.state, data.items, data.dictitems):
            if part in ((), {}, None, []):
                continue
            if isinstance(part, dict) and isinstance(data.state, dict) and part is data.state:
                later.append((_CONTAINER, path, (sum(isinstance(v, RawTensor) for v in part.values()), len(part))))
                later.extend((value, path, key) for key, value in part.items())
            elif isinstance(part, tuple) and part is data.state and len(part) == 2 and isinstance(part[0], dict):
                later.extend((value, path, key) for key, value in part[0].items())  # (dict state, slots state)
            elif has_tensor(part, self._has_tensor):
                later.append((part, path, None))
            else:
                continue
            walked = True
        if not walked:
            self._meta(path, obj)

    def _module(self, obj: Opaque, path: str, later: list[tuple]) -> None:
        state = obj.ckd.state
        self.flat.modules.append(path)
        if obj.ckd.ref is not None:
            self.flat.module_classes[path] = obj.ckd.ref.qualname
        non_persistent = state.get("_non_persistent_buffers_set") or ()
        direct = 0
        for group in ("_parameters", "_buffers"):
            tensors = state.get(group)
            if not isinstance(tensors, dict):
                continue
            for name, tensor in tensors.items():
                if tensor is None:
                    continue
                key = join(path, name)
                if group == "_buffers" and name in non_persistent:
                    self.flat.non_persistent.append(key)
                    continue
                direct += 1
                later.append((tensor, key, None))
        children = state.get("_modules")
        later.append((_CONTAINER, path, (direct, direct + (len(children) if isinstance(children, dict) else 0))))
        if isinstance(children, dict):
            later.extend((child, path, name) for name, child in children.items() if child is not None)

    def _script_module(self, obj: Opaque, path: str, members: tuple, later: list[tuple]) -> None:
        params, buffers, _ = members
        state = obj.ckd.state if isinstance(obj.ckd.state, dict) else {}
        self.flat.modules.append(path)
        self.flat.module_classes[path] = obj.ckd.ref.qualname if obj.ckd.ref else ""
        direct = 0
        for name in (*params, *buffers):
            value = state.get(name)
            if isinstance(value, RawTensor):
                direct += 1
                later.append((value, path, name))
        later.append((_CONTAINER, path, (direct, len(state))))
        for name, value in state.items():
            if isinstance(value, Opaque) and value.ckd.ref is not None and self.ts_members is not None:
                sub = self.ts_members(value.ckd.ref.qualname)
                if sub is not None and sub[2]:
                    later.append((value, path, name))


def run_nested(top: Generator) -> Any:
    """The result of a recursive computation over a tree from a file, written as generators: each yields the
    generator of a sub-call where it would call itself, and is sent that call's result. They run on a list, not on
    Python's stack, because torch.save writes containers nested as deep as the recursion limit itself."""
    stack = [top]
    value = None
    while stack:
        try:
            child = stack[-1].send(value)
        except StopIteration as done:
            stack.pop()
            value = done.value
        else:
            stack.append(child)
            value = None
    return value


def has_tensor(obj: Any, memo: dict[int, bool] | None = None) -> bool:
    """Whether a tensor is anywhere under `obj`. With a `memo` shared across calls, each sub-tree is looked at
    once however often it is shared; no recursion, as a pickle can nest containers 100,000 deep."""
    memo = {} if memo is None else memo
    known = memo.get(id(obj))
    if known is not None:
        return known
    stack = [obj]
    visited: list[int] = []
    while stack:
        item = stack.pop()
        if isinstance(item, RawTensor):
            for key in visited:  # marked tensor-free on the way down: not known after all
                memo.pop(key, None)
            memo[id(obj)] = True
            return True
        if not isinstance(item, (dict, list, tuple, Opaque)) or memo.get(id(item)) is not None:
            if memo.get(id(item)):
                memo[id(obj)] = True
                return True
            continue
        memo[id(item)] = False
        visited.append(id(item))
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            d = item.ckd
            stack.extend((d.args, d.state, d.items, d.kwargs, d.dictitems))
    return False


def _children(item: Any) -> list:
    if isinstance(item, dict):
        return list(item.values())
    if isinstance(item, (list, tuple)):
        return list(item)
    if isinstance(item, Opaque):
        d = item.ckd
        return [d.args, d.state, d.items, d.kwargs, d.dictitems]
    return []


def tree_size(obj: Any, memo: dict[int, int]) -> int:
    """How many objects `obj` would count as a tree (shared sub-trees counted each time they appear), computed once
    per distinct object: a billion-laughs pickle gets its true, astronomical size in a few steps."""
    if id(obj) in memo:
        return memo[id(obj)]
    stack: list[tuple[Any, bool]] = [(obj, False)]
    while stack:
        item, done = stack.pop()
        if not isinstance(item, (dict, list, tuple, Opaque)):
            continue
        if done:
            memo[id(item)] = 1 + sum(memo.get(id(c), 1) for c in _children(item))
        elif id(item) not in memo:
            memo[id(item)] = 1  # in progress: a cycle counts once
            stack.append((item, True))
            stack.extend((c, False) for c in _children(item) if id(c) not in memo)
    return memo[id(obj)]


def flatten(root: Any, ts_members: TorchScriptMembers | None = None, max_nodes: int | None = None) -> Flat:
    walker = Walker(ts_members, max_nodes)
    walker.walk(root, "")
    return walker.flat


def find_state_dict_root(flat: Flat) -> tuple[str | None, tuple[str, ...]]:
    """The container holding the model's weights, and other containers that look like state_dicts (EMA…)."""
    if not flat.tensors:
        return None, ()
    candidates: dict[str, int] = {}
    modules = set(flat.modules)
    optimizers = set(flat.optimizers)
    keys: list[str] = []  # sorted when a container other than the root is a candidate
    for path, (direct, total) in flat.containers.items():
        if path in modules:
            if path and _under_any(path, modules):
                continue  # a module is a candidate only at the top of a module tree
        elif direct == 0 or direct * 2 < total:
            continue
        if any("optim" in part or "scheduler" in part for part in path.split(".")):
            continue
        if path in optimizers or _under_any(path, optimizers):
            continue  # an optimizer's per-parameter state (state.0.exp_avg …) is no model's state_dict
        # Keys under `path.` sort between `path.` and `path/` ("/" follows "."): counted by bisection, not by a
        # scan of every key for every container (40,000 one-tensor dicts would take minutes).
        if path == "":
            candidates[path] = len(flat.tensors)
            continue
        if not keys:
            keys = sorted(map(itemgetter(0), flat.tensors))
        candidates[path] = bisect_left(keys, path + "/") - bisect_left(keys, path + ".")
    if not candidates:
        return None, ()
    if "" in candidates:
        return "", tuple(sorted(p for p in candidates if p))
    # Drop candidates nested in another candidate (a module inside a state_dict holder).
    top = {p: n for p, n in candidates.items() if not _under_any(p, candidates)}
    # The model's own weights before a copy of them (EMA, teacher): by the name of the container's last part
    # (`state_dict.model` as `model`), else the biggest.
    rank = {name: i for i, name in enumerate(STATE_DICT_NAMES)}
    named = [p for p in top if p.rsplit(".", 1)[-1] in rank]
    if named:
        root = min(named, key=lambda p: (rank[p.rsplit(".", 1)[-1]], p.count("."), p))
    else:
        root = max(top, key=lambda p: (top[p], -len(p)))
    return root, tuple(p for p in top if p != root)


def _under_any(path: str, paths: "set[str] | dict[str, int]") -> bool:
    """Whether `path` lies under one of `paths` (the root "" holds everything else): its own prefixes are looked
    up, so the cost is the path's length, not the number of paths."""
    if "" in paths:
        return True
    at = path.find(".")
    while at >= 0:
        if path[:at] in paths:
            return True
        at = path.find(".", at + 1)
    return False


def node_at(tree: Any, path: str) -> Any:
    """The container at a dotted path of the unpickled tree (None when the path is only part of flat keys)."""
    node = tree
    for part in path.split(".") if path else []:
        if isinstance(node, Opaque):
            state = node.ckd.state
            node = state.get("_modules", state) if isinstance(state, dict) else None
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, (dict, list, tuple, Opaque)) else None


def state_dict_metadata(tree: Any, root: str | None) -> Any:
    """The `_metadata` torch.save stored on the state_dict at `root` of the tree (module versions), or None."""
    node = node_at(tree, root) if root is not None else None
    metadata = getattr(node, "_metadata", None) if isinstance(node, dict) else None
    return metadata if isinstance(metadata, dict) else None
