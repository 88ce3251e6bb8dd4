"""kvtier's modules import one way down: no two of them import each other,
directly or through others.

Two files that import each other are one concept split wrongly, or miss a third
file below both (page identity is that file for storage's keys and sealed
pages). The graph is read from the source with `ast`, every import counted:
at module level, inside functions (imported on first use) and under
``TYPE_CHECKING``, since each is a place where one file leans on another.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvtier"

# Cycles allowed on purpose, each as the sorted tuple of its modules, with the
# reason. Any other cycle that returns is a bug in the structure.
ALLOWED: dict[tuple[str, ...], str] = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the kvtier modules it imports. ``from a.b import c`` names
    ``a.b.c`` where that is a module, else ``a.b``."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                ]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_kvtier_modules_import_each_other() -> None:
    found = cycles(import_graph())
    unexpected = [c for c in found if c not in ALLOWED]
    assert unexpected == [], f"import cycles among kvtier modules: {unexpected}"
    stale = [c for c in ALLOWED if c not in found]
    assert stale == [], f"allowed cycles that are gone (remove them from ALLOWED): {stale}"


def test_the_reading_sees_imports_made_on_first_use_and_the_finder_a_cycle() -> None:
    # the test above is only as good as this reading of the code
    graph = import_graph()
    assert "kvtier.bench.report" in graph["kvtier.bench.core"]  # imported inside a function
    assert "kvtier.storage.identity" in graph["kvtier.storage.keys"]
    assert "kvtier.storage.identity" in graph["kvtier.storage.sealed"]
    graph["kvtier.storage.identity"].add("kvtier.storage.sealed")
    assert ("kvtier.storage.identity", "kvtier.storage.sealed") in cycles(graph)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
