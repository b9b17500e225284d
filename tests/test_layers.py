"""The layers hold: each imports only downward, no module graph has a circle, no SQL above the store.

Read from the source with `ast`, every import counted: module level, inside functions, and under
`if TYPE_CHECKING:` (a back-reference hidden there is still a circle a reader has to untangle).
docs/architecture.md describes the layers these tests keep.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"kvwake": ROOT / "common", "kvwake.daemon": ROOT / "daemon", "kvwake.store": ROOT / "store",
           "kvwake.client": ROOT / "client"}
# Inside daemon/: a layer imports only those below it. The daemon's root modules: session.py
# (the shared vocabulary) and config.py, activation.py sit under every layer; serve.py is on top.
DAEMON_RANKS = {"session_state": 0, "timing": 0, "imports": 0, "config": 0, "activation": 0, "jobs": 0, "gcwatch": 1,
                "gilwatch": 1,
                "kv": 1, "model": 2, "sessions": 3, "fronts": 4, "serve": 5}
# (PRAGMA not after "#": a CUDA kernel's source says "#pragma unroll")
SQL = re.compile(r"\b(SELECT\b.+\bFROM|INSERT\b.+\bINTO|REPLACE\s+INTO|UPDATE\b.+\bSET|DELETE\s+FROM|CREATE\s+"
                 r"(TABLE|INDEX|VIEW|TRIGGER)|DROP\s+(TABLE|INDEX|VIEW|TRIGGER)|(?<!#)PRAGMA\s+\w+)\b", re.IGNORECASE | re.DOTALL)
# The store's own handles on its tables: code above it asks by method instead.
STORE_INTERNALS = {"index", "rows", "transaction", "locked", "db", "conn", "execute", "executemany", "executescript",
                   "query"}


def modules() -> dict[str, Path]:
    """Every module of the three folders, by import name."""
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The kvwake modules a file imports, anywhere in it (`from package import module` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: anchored at this module's package
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m == "kvwake" or m.startswith("kvwake.") or m.split(".")[0] in ("mlx", "mlx_lm")}


def graph() -> dict[str, set[str]]:
    """The import graph among kvwake's modules. Inside the store, importing the package (`from
    kvwake.store import Store`) is importing its facade: the package's `__init__` is the facade's."""
    known, edges = modules(), {}
    for name, path in known.items():
        targets = imports(name, path, known) & set(known) - {name}
        if name.startswith("kvwake.store.") and "kvwake.store" in targets:
            targets = targets - {"kvwake.store"} | {"kvwake.store.store"}
        edges[name] = targets - {name}
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[str]:
    """Every circle a depth-first walk meets, each as a path that ends where it starts."""
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    return cycles


def daemon_rank(module: str) -> int | None:
    parts = module.split(".")
    return DAEMON_RANKS.get(parts[2]) if len(parts) > 2 and parts[1] == "daemon" else None


def test_no_import_circles():
    edges = graph()
    assert "kvwake.store.maintenance" in edges["kvwake.store.store"]  # `from kvwake.store import maintenance`
    assert {"kvwake.daemon.kv.pipeline", "kvwake.store.remote.gc"} <= set(edges)  # the walk saw subpackages
    cycles = find_cycles(edges)
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_the_cycle_check_sees_a_circle():
    # The checks pass on an empty graph too; this proves find_cycles finds what it should.
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_daemon_layers_import_only_downward():
    wrong = []
    for module, targets in graph().items():
        rank = daemon_rank(module)
        if rank is None:
            continue
        for target in targets:
            below = daemon_rank(target)
            same_layer = target.split(".")[:3] == module.split(".")[:3]
            if below is not None and below >= rank and not same_layer:
                wrong.append(f"{module} (rank {rank}) imports {target} (rank {below})")
    assert not wrong, "imports that go up or sideways:\n" + "\n".join(sorted(wrong))


def test_every_daemon_module_has_a_layer():
    homeless = [m for m in modules() if m.startswith("kvwake.daemon.") and daemon_rank(m) is None]
    assert not homeless, f"modules outside the layers of docs/architecture.md: {homeless}"


def test_the_store_never_imports_mlx_or_the_daemon():
    known = modules()
    wrong = {name: sorted(m for m in imports(name, path, known) if m.startswith(("kvwake.daemon", "mlx")))
             for name, path in known.items() if name.startswith("kvwake.store")}
    assert not {k: v for k, v in wrong.items() if v}


def test_store_helpers_take_the_core_and_formats_stand_below_everything():
    # A helper typed against the Store facade would be a circle through it: they take a StoreCore.
    edges = graph()
    assert {name for name, targets in edges.items() if "kvwake.store.store" in targets} == {"kvwake.store"}
    for name, targets in edges.items():
        if name.startswith("kvwake.store.format"):
            assert all(t.startswith(("kvwake.store.format", "kvwake.errors")) for t in targets), (name, targets)


def test_the_client_imports_no_daemon_store_or_mlx_at_import_time():
    wrong = []
    for name, path in modules().items():
        top = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [f"{n.module}.{a.name}" for n in top if isinstance(n, ast.ImportFrom) for a in n.names]
        if name.startswith("kvwake.client") and any(x.startswith(("kvwake.daemon", "kvwake.store", "mlx"))
                                                    for x in names):
            wrong.append(name)
    assert not wrong, f"client modules that import the daemon, the store or mlx at import time: {wrong}"


def strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string a module spells: constants, f-strings with their holes as "?", and `+` of those."""
    def text(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(text(v) or "?" for v in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = text(node.left), text(node.right)
            return None if left is None and right is None else (left or "?") + (right or "?")
        return None

    return [(n.lineno, s) for n in ast.walk(tree) if isinstance(n, (ast.Constant, ast.JoinedStr, ast.BinOp))
            and (s := text(n)) is not None]


def test_the_sql_check_sees_sql():
    # The check below passes on code with no strings at all; this proves it finds what it should.
    code = 'q = f"SELECT {c} FROM t"\nr = "INSERT OR REPLACE " + "INTO t"\ns = self.store.index.rows("x")'
    tree = ast.parse(code)
    assert sum(bool(SQL.search(s)) for _, s in strings(tree)) == 2
    assert SQL.search("PRAGMA journal_mode=WAL") and not SQL.search("#pragma unroll\nfor (int i = 0; i < 4; ++i)")
    assert [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and reaches_store(n)] == ["index"]


def reaches_store(node: ast.Attribute) -> bool:
    """`<...>store.<internal>`: the store's index, raw queries or locks, reached from outside it."""
    base = node.value
    name = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else ""
    return node.attr in STORE_INTERNALS and name.endswith("store")


@pytest.mark.parametrize("folder", ["daemon", "client"])
def test_no_sql_outside_the_store(folder):
    """The daemon and the client ask the store by method; its tables are its own."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text())
        found += [f"{path.relative_to(ROOT)}:{line}: {s[:60]!r}" for line, s in strings(tree) if SQL.search(s)]
        found += [f"{path.relative_to(ROOT)}:{n.lineno}: .{n.attr}" for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and (reaches_store(n) or n.attr in ("execute", "executemany"))]
    assert not found, "SQL outside store/:\n" + "\n".join(found)


# What lies behind the session manager: the fronts ask it by method (status, a page of sessions, generate, ...).
BEHIND_MANAGER = {"engine", "store", "thread", "decoder", "entries", "models", "model", "remote", "planner",
                  "persister", "counters", "collector"}
# Never reached from a front, through whatever name.
MODEL_PARTS = {"engine", "thread", "decoder", "planner", "persister"}


def reaches_behind_manager(node: ast.Attribute) -> bool:
    """`manager.<part>`, `m.<part>`, `<...>.manager.<part>` for a part behind the manager, or any `.engine`,
    `.thread`, `.decoder` and the like."""
    base = node.value
    name = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else ""
    return node.attr in MODEL_PARTS or (node.attr in BEHIND_MANAGER and name in ("manager", "m"))


def test_the_reach_check_sees_a_reach():
    code = "a = self.manager.engine.model_name\nb = m.store.fsck\nc = req.store\nd = ctx.manager.status()"
    found = [n.attr for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Attribute) and reaches_behind_manager(n)]
    assert sorted(found) == ["engine", "store"]


def test_the_fronts_ask_the_manager_and_never_reach_behind_it():
    """A front reads no engine, store, thread or decoder: it asks the session manager (docs/architecture.md)."""
    found = []
    for path in sorted((ROOT / "daemon" / "fronts").rglob("*.py")):
        found += [f"{path.relative_to(ROOT)}:{n.lineno}: .{n.attr}" for n in ast.walk(ast.parse(path.read_text()))
                  if isinstance(n, ast.Attribute) and reaches_behind_manager(n)]
    assert not found, "fronts reaching behind the session manager:\n" + "\n".join(found)
