"""Walks an unpickled tree into key paths: tensors, metadata leaves, module trees, and the state_dict root."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import ReadError
from .unpickler import Opaque, RawTensor, _Token

MAX_NODES = 1_000_000  # a pickle that expands past this is a bomb, not a checkpoint
MAX_METADATA = 2_000

# Names under which training checkpoints keep the model's weights, most telling first.
STATE_DICT_NAMES = ("state_dict", "model_state_dict", "model_state", "model", "module", "net", "network",
                    "model_ema", "ema", "state_dict_ema", "ema_state_dict", "weights", "params", "params_ema",
                    "generator", "student", "teacher", "encoder")

# TorchScript: which attributes of a class are parameters/buffers, and whether it is a module.
TorchScriptMembers = Callable[[str], "tuple[tuple[str, ...], tuple[str, ...], bool] | None"]


@dataclass
class Flat:
    tensors: list[tuple[str, RawTensor]] = field(default_factory=list)
    metadata: "OrderedDict[str, Any]" = field(default_factory=OrderedDict)
    containers: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (direct tensors, direct items)
    modules: list[str] = field(default_factory=list)
    module_classes: dict[str, str] = field(default_factory=dict)
    non_persistent: list[str] = field(default_factory=list)
    metadata_truncated: int = 0


def join(prefix: str, name: Any) -> str:
    name = name if isinstance(name, str) else str(name)
    return f"{prefix}.{name}" if prefix else name


def _is_module(obj: Opaque) -> bool:
    state = obj.ckd.state
    return isinstance(state, dict) and "_parameters" in state and "_modules" in state


def _leaf_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        if isinstance(value, str) and len(value) > 200:
            return value[:200] + "…"
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**63:
            return str(value)
        return value
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        items = [_leaf_value(v) for v in value[:16]]
        return items + [f"… {len(value) - 16} more"] if len(value) > 16 else items
    if isinstance(value, (Opaque, _Token)):
        return repr(value)
    return f"<{type(value).__name__}>"


class Walker:
    def __init__(self, ts_members: TorchScriptMembers | None = None) -> None:
        self.flat = Flat()
        self.nodes = 0
        self.ts_members = ts_members
        self._ancestors: set[int] = set()

    def walk(self, obj: Any, path: str) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise ReadError(f"the pickle expands to more than {MAX_NODES:,} objects; refusing to walk it "
                            "(a pickle bomb, or not a checkpoint)")
        if isinstance(obj, RawTensor):
            self.flat.tensors.append((path, obj))
            return
        if isinstance(obj, (dict, list, tuple, Opaque)):
            if id(obj) in self._ancestors:
                self._meta(path, "<cycle>")
                return
            self._ancestors.add(id(obj))
            try:
                self._container(obj, path)
            finally:
                self._ancestors.discard(id(obj))
            return
        self._meta(path, obj)

    def _meta(self, path: str, value: Any) -> None:
        if len(self.flat.metadata) >= MAX_METADATA:
            self.flat.metadata_truncated += 1
        else:
            self.flat.metadata[path] = _leaf_value(value)

    def _container(self, obj: Any, path: str) -> None:
        if isinstance(obj, dict):
            items = list(obj.items())
        elif isinstance(obj, (list, tuple)):
            if obj and all(o is None or isinstance(o, (bool, int, float, str)) for o in obj):
                self._meta(path, obj)
                return
            items = list(enumerate(obj))
        else:
            self._object(obj, path)
            return
        direct = sum(isinstance(v, RawTensor) for _, v in items)
        self.flat.containers[path] = (direct, len(items))
        if not items and path:
            self._meta(path, obj if isinstance(obj, (list, tuple)) else {})
        for key, value in items:
            self.walk(value, join(path, key))

    def _object(self, obj: Opaque, path: str) -> None:
        data = obj.ckd
        ref = data.ref
        if _is_module(obj):
            self._module(obj, path)
            return
        if ref is not None and ref.module.startswith("__torch__") and self.ts_members is not None:
            members = self.ts_members(ref.qualname)
            if members is not None and members[2]:
                self._script_module(obj, path, members)
                return
        walked = False
        for part in (data.args, data.kwargs, data.state, data.items, data.dictitems):
            if part in ((), {}, None, []):
                continue
            if isinstance(part, dict) and isinstance(data.state, dict) and part is data.state:
                self.flat.containers[path] = (sum(isinstance(v, RawTensor) for v in part.values()), len(part))
                for key, value in part.items():
                    self.walk(value, join(path, key))
            elif isinstance(part, tuple) and part is data.state and len(part) == 2 and isinstance(part[0], dict):
                for key, value in part[0].items():  # (dict state, slots state)
                    self.walk(value, join(path, key))
            elif has_tensor(part):
                self.walk(part, path)
            else:
                continue
            walked = True
        if not walked:
            self._meta(path, obj)

    def _module(self, obj: Opaque, path: str) -> None:
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
                self.walk(tensor, key)
        children = state.get("_modules")
        self.flat.containers[path] = (direct, direct + (len(children) if isinstance(children, dict) else 0))
        if isinstance(children, dict):
            for name, child in children.items():
                if child is not None:
                    self.walk(child, join(path, name))

    def _script_module(self, obj: Opaque, path: str, members: tuple) -> None:
        params, buffers, _ = members
        state = obj.ckd.state if isinstance(obj.ckd.state, dict) else {}
        self.flat.modules.append(path)
        self.flat.module_classes[path] = obj.ckd.ref.qualname if obj.ckd.ref else ""
        direct = 0
        for name in (*params, *buffers):
            value = state.get(name)
            if isinstance(value, RawTensor):
                direct += 1
                self.walk(value, join(path, name))
        self.flat.containers[path] = (direct, len(state))
        for name, value in state.items():
            if isinstance(value, Opaque) and value.ckd.ref is not None and self.ts_members is not None:
                sub = self.ts_members(value.ckd.ref.qualname)
                if sub is not None and sub[2]:
                    self.walk(value, join(path, name))


def has_tensor(obj: Any, depth: int = 0) -> bool:
    if isinstance(obj, RawTensor):
        return True
    if depth > 6:
        return False
    if isinstance(obj, dict):
        return any(has_tensor(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_tensor(v, depth + 1) for v in obj)
    if isinstance(obj, Opaque):
        d = obj.ckd
        return any(has_tensor(p, depth + 1) for p in (d.args, d.state, d.items))
    return False


def flatten(root: Any, ts_members: TorchScriptMembers | None = None) -> Flat:
    walker = Walker(ts_members)
    walker.walk(root, "")
    return walker.flat


def find_state_dict_root(flat: Flat) -> tuple[str | None, tuple[str, ...]]:
    """The container holding the model's weights, and other containers that look like state_dicts (EMA…)."""
    if not flat.tensors:
        return None, ()
    candidates: dict[str, int] = {}
    modules = set(flat.modules)
    for path, (direct, total) in flat.containers.items():
        if path in modules:
            # A module is a candidate only at the top of a module tree.
            if any(path.startswith(m + ".") or (m == "" and path) for m in modules if m != path):
                continue
        elif direct == 0 or direct * 2 < total:
            continue
        if any("optim" in part or "scheduler" in part for part in path.split(".")):
            continue
        under = sum(1 for key, _ in flat.tensors if path == "" or key.startswith(path + "."))
        candidates[path] = under
    if not candidates:
        return None, ()
    if "" in candidates:
        return "", tuple(sorted(p for p in candidates if p))
    # Drop candidates nested in another candidate (a module inside a state_dict holder).
    top = {p: n for p, n in candidates.items() if not any(p.startswith(q + ".") for q in candidates if q != p)}
    for name in STATE_DICT_NAMES:
        if name in top:
            root = name
            break
    else:
        root = max(top, key=lambda p: (top[p], -len(p)))
    return root, tuple(p for p in top if p != root)
