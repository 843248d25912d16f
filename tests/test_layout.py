"""The package's shape (docs/DESIGN.md §5): its groups in layers, each importing only from its
own group and the layers below it, and no module reaching itself through imports. Every
import counts, at the top or inside a function, under TYPE_CHECKING or not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "runner"

# Lowest first. A module of a group may import from its own group and from the groups of
# earlier layers; groups in one layer are peers and do not import each other. A group is a
# subpackage of runner/, or a module of its root.
LAYERS: list[tuple[str, ...]] = [
    ("protocol",),  # the Go wire: structs, Go's JSON rules, Go's error texts
    ("engine",),  # the one thread that owns MLX
    ("text",),  # tokenization
    ("sources",),  # a model's files, wherever they come from
    ("native",),  # the native library: its ABI, build and preload
    ("media",),  # images in prompts
    ("cache",),  # cache kinds, the trie, the prefix cache, sessions
    ("backend",),  # the backend policy and kernels
    ("models",),  # the model contract, the registry, the families
    ("score", "generate"),  # the two pipelines
    ("service",),  # the composition root: a loaded model and what serves with it
    ("distributed",),  # one model over a process group: shards, rank 0's commands, the others
    ("server",),  # HTTP
    ("process",),  # the process: runner/__main__.py, flags.py, environment.py
]
PROCESS = {"flags", "environment", "__main__", "__init__"}
RANK = {group: rank for rank, groups in enumerate(LAYERS) for group in groups}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def group(module: str) -> str:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    return "process" if name in PROCESS else name


def imports(path: Path, text: str | None = None) -> set[str]:
    """The runner modules `path` (or `text`, read as though it were `path`) imports
    (`from runner.x import y` counts runner.x.y when that is a module, else runner.x)."""
    tree = ast.parse(path.read_text() if text is None else text, str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            if name.split(".")[0] != "runner":
                continue
            while name not in MODULES and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in MODULES:
                found.add(name)
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def graph() -> dict[str, set[str]]:
    out = {}
    for name, path in MODULES.items():
        # a package's own __init__ and its parents are not what a module depends on
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        out[name] = imports(path) - {name} - parents
    return out


def test_every_group_has_a_layer() -> None:
    assert {group(m) for m in MODULES} - set(RANK) == set()


def test_no_group_imports_upward_or_sideways() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, targets in graph().items()
        for target in targets
        if group(target) != group(module) and RANK[group(target)] >= RANK[group(module)]
    ]
    assert wrong == []


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others() -> None:
    assert cycles(graph()) == []


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(edges: dict[str, set[str]], expected: list) -> None:
    assert cycles(edges) == expected


def test_the_checks_see_what_they_guard() -> None:
    """An upward import inside a function (the kind that hid a circle before) is found."""
    source = PACKAGE / "cache" / "trie.py"
    text = source.read_text() + "\n\ndef f():\n    from runner.models import base\n"
    assert imports(source, text) - imports(source) == {"runner.models", "runner.models.base"}
