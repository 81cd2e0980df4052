"""`fix --plain-data`: objects torch.load(weights_only=True) refuses that only hold data, written as that data — an
argparse.Namespace of hyper-parameters as a dict of them, a NumPy scalar as a Python number, a pathlib path as its
text — so a training script's `{"args": args, "best_acc": np.float64(…)}` keeps its values instead of losing the
entries to --drop. Each is read from what the pickle records (a Namespace's attributes, a scalar's dtype code and
bytes, a path's parts); nothing is imported or called. Anything else stays as it is, for the planner to refuse."""

from __future__ import annotations

from .._record import replace
from ..records import Checkpoint
from ..safepickle.plain import NOT_PLAIN, plain_kind, plain_value
from ..tree import join, run_nested

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Any, Generator

def with_plain_data(ckpt: Checkpoint) -> tuple[Checkpoint, list[tuple[str, str, str]]]:
    """`ckpt` with every object plain_value reads written as its value (the containers above it copied, nothing
    else), and what was converted: (path, what it was, what it is now: `argparse.Namespace`, `dict`). Tensors keep
    their paths: a Namespace's attribute is under the same path as the dict's key that replaces it."""
    converted: list[tuple[str, str, str]] = []
    inside: set[int] = set()  # the containers being walked: one met within itself is left for the planner to refuse

    def walk(obj: Any, path: str) -> Generator:  # yields the walk of each child, sent its result
        if id(obj) in inside:  # met within itself: as it is (the planner refuses the cycle)
            return obj
        value = plain_value(obj)
        walking = [id(obj)]  # a Namespace that holds itself: its new dict is made once, not once a level
        if value is not NOT_PLAIN:
            converted.append((path or "the root", plain_kind(obj), type(value).__name__))
            obj = value
            walking.append(id(obj))
        if not (isinstance(obj, dict) or type(obj) in (list, tuple)):
            return obj
        inside.update(walking)
        if isinstance(obj, dict):
            pairs = []
            for k, v in obj.items():
                pairs.append((k, (yield walk(v, join(path, k)))))
            items = [v for _, v in pairs]
        else:
            items = []
            for i, v in enumerate(obj):
                items.append((yield walk(v, join(path, i))))
        inside.difference_update(walking)
        if all(new is old for new, old in zip(items, obj.values() if isinstance(obj, dict) else obj)):
            return obj
        if not isinstance(obj, dict):
            return items if type(obj) is list else tuple(items)
        out = type(obj)(pairs)
        if getattr(obj, "_metadata", None) is not None:
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out

    root = run_nested(walk(ckpt.root, ""))
    return (ckpt, converted) if root is ckpt.root else (replace(ckpt, root=root), converted)
