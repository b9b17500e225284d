"""store/ is layered: its import graph has no circle, and it never reaches mlx or the daemon.

Every import statement counts, wherever it stands: at the top, inside a function, under
`if TYPE_CHECKING:` (a type-only back-reference is still a circle a reader has to hold in their
head). A module's implicit import of its own parent package does not count; an explicit one does.
"""

from __future__ import annotations

import ast
from pathlib import Path

STORE = Path(__file__).resolve().parent.parent / "store"
PACKAGE = "kvwake.store"


def forbidden(module: str) -> bool:
    """mlx, mlx-lm or the daemon: what the store must never import (it runs without a model)."""
    return module.split(".")[0] in ("mlx", "mlx_lm") or module == "kvwake.daemon" or module.startswith("kvwake.daemon.")


def module_name(path: Path) -> str:
    parts = path.relative_to(STORE).with_suffix("").parts
    return ".".join((PACKAGE, *parts[:-1])) if parts[-1] == "__init__" else ".".join((PACKAGE, *parts))


def store_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(STORE.rglob("*.py"))}


def imported(name: str, path: Path) -> set[str]:
    """Every module `name` (at `path`) imports, fully qualified; `from X import n` counts as X.n
    where that is a module of the store, else as X."""
    modules = store_modules()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules or forbidden(full) else base)
    return found


def graph() -> dict[str, set[str]]:
    """The import graph among store modules."""
    modules = store_modules()
    return {name: {m for m in imported(name, path) if m in modules and m != name} for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle in the graph as a path that ends where it starts, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_store_import_graph_has_no_circle():
    edges = graph()
    assert f"{PACKAGE}.core" in edges and f"{PACKAGE}.remote.gc" in edges  # the walk saw the subpackages
    assert f"{PACKAGE}.maintenance" in edges[f"{PACKAGE}.store"]  # `from kvwake.store import maintenance`
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_only_the_package_imports_the_facade():
    # Helpers take a StoreCore: a helper typed against Store would be a circle through the facade.
    importers = {name for name, targets in graph().items() if f"{PACKAGE}.store" in targets}
    assert importers == {PACKAGE}


def test_formats_import_nothing_above_them():
    fmt = f"{PACKAGE}.format"
    for name, targets in graph().items():
        if name.startswith(fmt):
            assert all(t.startswith(fmt) for t in targets), (name, targets)


def test_the_store_never_imports_mlx_or_the_daemon():
    for name, path in store_modules().items():
        bad = {m for m in imported(name, path) if forbidden(m)}
        assert not bad, f"{path.relative_to(STORE.parent)} imports {sorted(bad)}"


def test_the_cycle_check_sees_a_circle():
    # The checks above pass on an empty graph too; this one proves find_cycle finds what it should.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
