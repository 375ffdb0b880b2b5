"""The packages' boundaries, read from the source (every ``import`` statement, wherever it stands).

* ``shared`` (the wire contract and the shared-memory primitives) imports neither
  ``supervisor`` nor ``worker``; ``worker`` never imports ``supervisor``, nor ``supervisor``
  ``worker`` (it names the worker's entry point as a string);
* ``supervisor.client`` imports only ``shared`` and itself, so it ships alone;
* no module imports itself back through others within a top package (an import circle), and the
  supervisor's sub-packages import each other in one direction only (no circle between them).

The graph is read with :mod:`ast`, so an import inside a function or under ``TYPE_CHECKING``
counts as much as one at the top: each is a dependency of the code. Imports by name at run time
(``importlib.import_module``: the lazy package faces, the CLI's command table) are not edges.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from tests.helpers.other_user import REPO

PACKAGES = ("shared", "supervisor", "worker")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str, root: Path) -> bool:
    """Whether ``name`` is a module or package of the tree (a ``.py``, a package, a C extension)."""
    base = root.joinpath(*name.split("."))
    return (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()
            or base.with_suffix(".pyi").is_file() or any(base.parent.glob(base.name + ".*.so")))


def _imported(tree: ast.AST, module: str, is_package: bool, root: Path) -> set[str]:
    """The modules of the tree a module imports: ``from pkg import sub`` is an edge to ``pkg.sub``
    when ``sub`` is a module, else to ``pkg``; a name that is no module of the tree (the standard
    library, a dependency) is left out by the caller."""
    out: set[str] = set()
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here[:len(here) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if _is_module(sub, root) else base)
    return out


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """Each module of ``packages`` under ``root`` -> the modules of those packages it imports."""
    sources = {_module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))
               if "__pycache__" not in p.parts}
    graph: dict[str, set[str]] = {}
    for module, path in sources.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = set()
        for name in _imported(tree, module, path.name == "__init__.py", root):
            if name not in sources and _is_module(name, root):
                continue  # a C extension (shared._atomics): it imports nothing of the tree
            while name and name not in sources:  # ``import a.b.c`` of a name inside a module
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(name)
        graph[module] = edges
    return graph


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
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
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        found.append(sorted(part))
    return found


def crossings(graph: Mapping[str, Iterable[str]], source: str, forbidden: Iterable[str]) -> list[str]:
    """``module -> imported`` for each import from the package ``source`` into a ``forbidden`` one."""
    def inside(name: str, pkg: str) -> bool:
        return name == pkg or name.startswith(pkg + ".")

    return sorted(f"{m} -> {t}" for m, targets in graph.items() if inside(m, source)
                  for t in targets if any(inside(t, f) for f in forbidden))


def sub_package_graph(graph: Mapping[str, Iterable[str]], package: str) -> dict[str, set[str]]:
    """The graph between the sub-packages (and top modules) of ``package``: ``supervisor.admission``
    -> ``supervisor.routing`` when a module of the first imports one of the second."""
    depth = package.count(".") + 2

    def room(name: str) -> str:
        return ".".join(name.split(".")[:depth])

    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if not module.startswith(package + "."):
            continue
        rooms.setdefault(room(module), set()).update(
            room(t) for t in targets if t.startswith(package + ".") and room(t) != room(module))
    return rooms


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(Path(REPO))


def test_the_graph_is_read(graph: dict[str, set[str]]) -> None:
    """The reader sees the imports it must judge (a reader that saw none would pass every rule)."""
    assert "shared.quota" in graph["worker.allocator"]
    # ``from shared import _atomics, _shm``: the modules, not the package face
    assert "shared._shm" in graph["shared.quota"] and "shared" not in graph["shared.quota"]
    assert "supervisor.client.api" in graph["supervisor.client.launch"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_shared_imports_neither_the_supervisor_nor_the_worker(graph: dict[str, set[str]]) -> None:
    assert crossings(graph, "shared", ("supervisor", "worker")) == []


def test_worker_and_supervisor_never_import_each_other(graph: dict[str, set[str]]) -> None:
    assert crossings(graph, "worker", ("supervisor",)) == []
    assert crossings(graph, "supervisor", ("worker",)) == []


def test_the_client_imports_only_shared(graph: dict[str, set[str]]) -> None:
    """``supervisor.client`` ships alone: nothing of the supervisor's server packages, nor the
    ``supervisor`` package face (which names the daemon's classes)."""
    foreign = [edge for edge in crossings(graph, "supervisor.client", ("supervisor",))
               if not edge.split(" -> ")[1].startswith("supervisor.client")]
    assert foreign == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle_inside_a_package(graph: dict[str, set[str]], package: str) -> None:
    inside = {m: {t for t in targets if t.split(".")[0] == package}
              for m, targets in graph.items() if m.split(".")[0] == package}
    assert circles(inside) == []


def test_the_supervisor_parts_import_in_one_direction(graph: dict[str, set[str]]) -> None:
    """Between the supervisor's sub-packages (admission, routing, store, ...) the arrows run one
    way: each part stands on the ones below it, none reaches back up."""
    rooms = sub_package_graph(graph, "supervisor")
    found = circles(rooms)
    detail = {f"{a} -> {b}": sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith(a + ".") or m == a
                                    for t in ts if t.startswith(b + ".") or t == b)
              for part in found for a in part for b in part if b in rooms.get(a, ())}
    assert found == [], detail


#: what the daemon loads: its process and every op class it serves (found by listing the package;
#: its ``__main__``, the doc writer, is a program of its own)
_DAEMON_ROOTS = ("supervisor.supervisor", "supervisor.wiring", "supervisor.control.ops")


def _daemon_closure(graph: Mapping[str, Iterable[str]]) -> set[str]:
    roots = [m for m in graph if (m in _DAEMON_ROOTS or m.startswith("supervisor.control.ops."))
             and not m.endswith(".__main__")]  # ``python -m supervisor.control.ops``: the doc writer
    seen: set[str] = set()
    while roots:
        module = roots.pop()
        if module not in seen:
            seen.add(module)
            roots.extend(graph.get(module, ()))
    return seen


def test_the_daemon_loads_neither_the_client_nor_the_command_line(graph: dict[str, set[str]]) -> None:
    """The supervisor process's modules (its op classes included) import nothing of
    ``supervisor.client`` or ``supervisor.cli`` and no ``argparse``: an op's command half is
    its class under ``supervisor.cli.commands``."""
    closure = _daemon_closure(graph)
    assert "supervisor.control.ops.alloc" in closure and "supervisor.admission.frontend" in closure
    loaded = sorted(m for m in closure if m.startswith(("supervisor.client", "supervisor.cli")))
    assert loaded == []
    argparse_users = sorted(m for m in closure if "argparse" in _stdlib_imports(m))
    assert argparse_users == []


def _stdlib_imports(module: str) -> set[str]:
    """The top names a module of the tree imports (wherever the import stands)."""
    root = Path(REPO)
    base = root.joinpath(*module.split("."))
    path = base / "__init__.py" if (base / "__init__.py").is_file() else base.with_suffix(".py")
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names
