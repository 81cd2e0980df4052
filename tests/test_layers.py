"""The house's plan, drawn from its imports: no import circle (imports inside functions counted too), every import
points down the layers, none takes another module's private name, and each import left inside a function says what
cost it defers. Run as a script, it prints the graph's circles and layer breaches."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckpt_doctor"

# From the bottom. A module may import from its own layer or any below it, never from one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("safety core", ("_record", "_version", "errors", "dtypes", "units", "advice", "safepickle")),
    ("formats", ("sniff", "records", "tree", "readers", "writers", "tensordata", "assemble", "devices", "pool")),
    ("analysis", ("analyze", "transforms", "compare", "hfspec", "modelspec", "diff", "stats", "default_load", "outputs")),
    ("actions", ("fix", "verify", "loader", "_ddp_worker")),
    # inspect's report, scan and the folder listing: analysis plus the rescue line each prints, which is planned by
    # fix so that the command shown is one that runs
    ("reports", ("report", "scan", "listing")),
    ("presentation", ("render", "cliparse", "cli", "__main__", "")),  # "": ckpt_doctor/__init__.py, the API
]

# A function-level import must say why it waits (a cost deferred: torch, a big module, a platform-only one).
WHY_WORDS = ("torch", "ms", "only", "platform", "posix", "not imported", "first use", "deferred", "import time",
             "startup", "start-up", "cost", "when", "lazily", "lazy")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or
                                         isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(name: str) -> list[tuple[str, list[str], int, bool]]:
    """(module imported, names taken, line, inside a function) for each import of a ckpt_doctor module; imports under
    `if TYPE_CHECKING:` are for annotations only and never run."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, list[str], int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                for other in child.orelse:  # type: ignore[attr-defined]
                    visit(other, in_function)
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[:len(package.split(".")) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                for alias in child.names:
                    sub = f"{target}.{alias.name}"
                    if sub in MODULES:
                        found.append((sub, [], child.lineno, inner))
                    elif target in MODULES:
                        found.append((target, [alias.name], child.lineno, inner))
            elif isinstance(child, ast.Import):
                found.extend((a.name, [], child.lineno, inner) for a in child.names if a.name in MODULES)
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


def graph() -> dict[str, dict[str, tuple[int, bool]]]:
    edges: dict[str, dict[str, tuple[int, bool]]] = {}
    for name in MODULES:
        edges[name] = {}
        for target, _, line, inner in imports(name):
            if target != name:
                edges[name].setdefault(target, (line, inner))
    return edges


def cycles(edges: dict[str, dict[str, tuple[int, bool]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, on a stack: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def layer_of(name: str) -> int:
    inner = name.removeprefix("ckpt_doctor").removeprefix(".")
    top = inner.split(".")[0]
    for level, (_, members) in enumerate(LAYERS):
        if top in members:
            return level
    raise AssertionError(f"{name} is in no layer: add it to LAYERS in tests/test_layers.py")


def breaches(edges: dict[str, dict[str, tuple[int, bool]]]) -> list[str]:
    out = []
    for name, targets in edges.items():
        for target, (line, _) in targets.items():
            if layer_of(target) > layer_of(name):
                out.append(f"{name}:{line} imports {target} ({LAYERS[layer_of(name)][0]} → "
                           f"{LAYERS[layer_of(target)][0]})")
    return out


def test_the_import_graph_has_no_circles():
    found = cycles(graph())
    assert found == [], f"{len(found)} import circle(s): {found}"


def test_every_module_is_in_a_layer_and_imports_only_downwards():
    assert breaches(graph()) == []


def test_no_module_imports_another_modules_private_names():
    taken = [(name, n, line) for name in MODULES for target, names, line, _ in imports(name) for n in names
             if n.startswith("_") and not n.startswith("__")]
    assert taken == []


def test_an_import_inside_a_function_says_what_it_defers():
    """Each names its cost or its condition in a comment on its line or the lines above (`# torch: ~1 s, only when
    tensors are needed`); a plain one is a circle hidden or a cost nobody measured."""
    silent = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        for target, _, line, inner in imports(name):
            near = set(re.findall(r"[a-z][a-z-]*", " ".join(lines[max(0, line - 3):line]).lower()))
            if inner and not near & set(WHY_WORDS) and "not imported" not in " ".join(lines[max(0, line - 3):line]):
                silent.append(f"{name}:{line} ({target})")
    assert silent == []


if __name__ == "__main__":
    edges = graph()
    print(f"{len(MODULES)} modules, {sum(len(t) for t in edges.values())} import edges, "
          f"{sum(1 for t in edges.values() for _, inner in t.values() if inner)} of them inside functions")
    for component in cycles(edges):
        print("circle:", " ".join(component))
    for line in breaches(edges):
        print("breach:", line)
    sys.exit(1 if cycles(edges) or breaches(edges) else 0)
