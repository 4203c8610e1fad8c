"""The package's import graph: no circles, and core at the bottom (docs/architecture.md, "Dependency direction").

Every import of a ``chunk_offload`` module by another is an edge, wherever it is written (inside
a function too: a lazy import does not break a circle, it hides it), except under
``if TYPE_CHECKING:``, which never runs. ``from pkg import name`` is an edge to ``pkg.name`` when
that is a module, else to ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "chunk_offload"
CORE_NEVER_IMPORTS = ("megatron", "transformer_engine", "chunk_offload.integrations")
FLOORS = {"core": 1, "schedule": 2, "module_names": 2, "bit_identity": 2, "devkit": 2, "option_flags": 3, "report": 4, "planner": 4, "integrations": 5, "replay": 6, "megatron_lm": 6}
"""docs/architecture.md's floors: a package imports only packages on lower floors (the package's
own ``__init__``, its public face, is on none)."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree`` outside ``if TYPE_CHECKING:`` blocks (their ``else`` included)."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))
    return found


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The absolute module names ``node`` (in module ``name``) imports."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([node.module] if node.module else []))
    submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
    return submodules if len(submodules) == len(node.names) else [base, *submodules]


def import_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports (of any package; ``type_checking``: those blocks included)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] if type_checking else _runtime_imports(tree)
        graph[name] = {target for node in nodes for target in _targets(name, path, node, modules) if target != name}
    return graph


def rings(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle of each strongly connected set of ``graph``'s nodes, as a path back to its start."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan; the package is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path_around(graph, component) for component in components]


def _path_around(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A path from the component's first module back to itself, inside the component."""
    start, members = component[0], set(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for target in sorted(graph[node] & members):
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if target not in previous:
                previous[target] = node
                frontier.append(target)
    raise AssertionError(f"no circle through {component}")


def test_no_import_circles() -> None:
    found = rings(import_graph())
    assert not found, "import circles (move the shared type or helper into a module both sides import): " + "; ".join(
        " -> ".join(ring) for ring in found
    )


def test_no_circles_even_for_type_checking() -> None:
    """A type a file only annotates with must not close a ring either (as farm-studio draws the
    house): the side that does not construct the other names a small Protocol of its own."""
    found = rings(import_graph(type_checking=True))
    assert not found, "circles through TYPE_CHECKING imports (use a Protocol on one side): " + "; ".join(
        " -> ".join(ring) for ring in found
    )


def test_a_circle_is_found_and_named() -> None:
    """The check can fail: a lazy import closing a ring is a circle, a TYPE_CHECKING one is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert rings(graph) == [["a", "b", "c", "a"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\ndef f():\n    import y\n")
    assert sorted(n.names[0].name for n in _runtime_imports(tree)) == ["TYPE_CHECKING", "y"]


def test_the_graph_resolves_relative_imports() -> None:
    graph = import_graph()
    assert "chunk_offload.integrations.session" in graph["chunk_offload.integrations.attached"]
    assert "chunk_offload.integrations.pipelining.order" in graph["chunk_offload.integrations.pipelining.attach"]
    assert "chunk_offload.integrations.pipelining" not in graph["chunk_offload.integrations.pipelining.attach"]


def test_packages_import_only_lower_floors() -> None:
    def floor(module: str) -> int | None:
        parts = module.split(".")
        return FLOORS[parts[1]] if len(parts) > 1 else None

    upward = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in targets
        if target.startswith("chunk_offload") and floor(module) is not None and floor(target) is not None
        if module.split(".")[1] != target.split(".")[1] and floor(target) >= floor(module)
    )
    assert set(FLOORS) == {m.split(".")[1] for m in _modules() if "." in m}, "a new package needs its floor here and in the docs"
    assert not upward, f"imports that do not point down a floor: {upward}"


@pytest.mark.parametrize("forbidden", CORE_NEVER_IMPORTS)
def test_core_never_imports(forbidden: str) -> None:
    """Not even for type checking: core is plain torch."""
    graph = import_graph(type_checking=True)
    wrong = {
        module: sorted(t for t in targets if t == forbidden or t.startswith(forbidden + "."))
        for module, targets in graph.items()
        if module.startswith("chunk_offload.core")
    }
    assert not {m: t for m, t in wrong.items() if t}
