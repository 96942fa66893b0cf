"""The dependency picture: layers only point down, no circles, one transport seam (read from the source).

    cli      (command line, launcher, ctl)
    evaluator    (the sidecar evaluator: reuses the worker's client)
    ps  worker   (the two roles: never each other)
    rpcps    (shared: protocol, transport, settings, tasks)

``harness`` (test and fault-injection machinery) may use any of them; none of them may use it.
Inside ``ps/`` the folders have layers too (``PS_LAYERS``): ``sparse`` < ``core`` < ``config`` <
``api``, ``checkpoints``, ``lifecycle``, ``replication``, ``control`` < ``runner``.
docs/ARCHITECTURE.md draws the same picture.

Every import counts, ``if TYPE_CHECKING:`` ones too: a reader follows a type-only import like any
other, and a circle through one is a circle in the design.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNTIME = ("rpcps", "ps", "worker", "evaluator", "cli")
ALLOWED = {
    "rpcps": {"rpcps"},
    "ps": {"rpcps", "ps"},
    "worker": {"rpcps", "worker"},
    "evaluator": {"rpcps", "worker", "evaluator"},
    "cli": {"rpcps", "ps", "worker", "evaluator", "cli"},
    "harness": {"rpcps", "ps", "worker", "evaluator", "cli", "harness"},
}
PS_LAYERS = {
    "ps": 0,  # the package's own __init__: a docstring
    "ps.sparse": 0,
    "ps.core": 1,
    "ps.config": 2,
    "ps.api": 3,
    "ps.checkpoints": 3,
    "ps.lifecycle": 3,
    "ps.replication": 3,
    "ps.control": 3,
    "ps.runner": 4,
}
"""Rank of each unit of ``ps/``: an import may point to a unit of the same or a lower rank only."""
MAX_FILES_DIRECTLY_IN_PS = 11
TRANSPORT_ONLY = "torch.distributed.rpc"


def _modules() -> dict[str, Path]:
    found = {}
    for package in (*RUNTIME, "harness"):
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


@cache
def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) of every import, ``if TYPE_CHECKING:`` blocks included."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{path}:{child.lineno}: a relative import; spell the module out"
                assert child.module
                found.append((child.module, child.lineno, top))
                found.extend((f"{child.module}.{alias.name}", child.lineno, top) for alias in child.names)
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, top and not nested)

    visit(tree, True)
    return found


def _internal(name: str) -> str | None:
    """The module of ours that ``name`` refers to (a module, or a name imported from one), or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports. A package's ``__init__`` importing its own
    submodules (a public face) is not an arrow of meaning and is left out."""
    graph = {}
    for module, path in MODULES.items():
        targets = {t for name, _, _ in _imports(path) if (t := _internal(name)) is not None and t != module}
        if path.name == "__init__.py":
            targets = {t for t in targets if not t.startswith(module + ".")}
        graph[module] = targets
    return graph


GRAPH = _graph()


def _unit(module: str) -> str:
    """The package a module belongs to for the package-level picture: its subpackage (``ps.core``,
    ``rpcps.transport``), or the module itself when it lies directly in a top-level package
    (``ps.config``, ``rpcps.wire``), where each file is its own unit."""
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and MODULES[module].name != "__init__.py"):
        return module
    return ".".join(parts[:2])


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _package_graph(modules: set[str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in modules:
        for target in GRAPH[module] & modules:
            if _unit(module) != _unit(target):
                graph.setdefault(_unit(module), set()).add(_unit(target))
    return graph


def _arrows(graph: dict[str, set[str]]) -> int:
    return sum(len(targets) for targets in graph.values())


def _figures(modules: set[str]) -> str:
    """What a reader counts: arrows between modules, module circles, package circles."""
    inner = {m: GRAPH[m] & modules for m in modules}
    return (
        f"{len(modules)} modules, {_arrows(inner)} import arrows, {len(_circles(inner))} module circles, "
        f"{len(_circles(_package_graph(modules)))} package circles"
    )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_point_down(module: str) -> None:
    layer = module.split(".")[0]
    for name, line, _ in _imports(MODULES[module]):
        target = _internal(name)
        if target is None:
            continue
        assert target.split(".")[0] in ALLOWED[layer], f"{module}:{line} imports {target}: {layer} may not depend on it"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] in RUNTIME))
def test_only_the_transport_package_imports_torch_rpc(module: str) -> None:
    if module.startswith("rpcps.transport"):
        return
    for name, line, _ in _imports(MODULES[module]):
        assert not name.startswith(TRANSPORT_ONLY), f"{module}:{line} imports {name}; go through rpcps.transport"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] in RUNTIME))
def test_no_function_local_imports_of_our_own_modules(module: str) -> None:
    """An import hidden in a function is how a cycle or an upward arrow hides; roles are loaded
    lazily by name (cli.main's role table) instead."""
    for name, line, top in _imports(MODULES[module]):
        assert top or _internal(name) is None, f"{module}:{line} imports {name} inside a function"


@pytest.mark.parametrize("scope", ["ps", "the whole tree"])
def test_there_are_no_import_circles_between_modules(scope: str) -> None:
    modules = {m for m in MODULES if scope != "ps" or m.split(".")[0] == "ps"}
    circles = _circles({m: GRAPH[m] & modules for m in modules})
    assert not circles, f"{scope}: {_figures(modules)}; module circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize("scope", ["ps", "the whole tree"])
def test_there_are_no_import_circles_between_packages(scope: str) -> None:
    modules = {m for m in MODULES if scope != "ps" or m.split(".")[0] == "ps"}
    graph = _package_graph(modules)
    circles = _circles(graph)
    detail = [
        f"  {a} -> {b} ({', '.join(sorted(f'{m} -> {t}' for m in modules if _unit(m) == a for t in GRAPH[m] if _unit(t) == b))})"
        for circle in circles for a in circle for b in sorted(graph.get(a, set()) & set(circle))
    ]
    assert not circles, f"{scope}: {_figures(modules)}; package circles: {circles}\n" + "\n".join(detail)


def test_inside_ps_no_arrow_points_up() -> None:
    """The core is readable and importable without checkpoints, replication, control or the API."""
    modules = {m for m in MODULES if m.split(".")[0] == "ps"}
    unranked = sorted({_unit(m) for m in modules} - set(PS_LAYERS))
    assert not unranked, f"units of ps/ without a rank in PS_LAYERS: {unranked}"
    upward = sorted(
        f"{m} -> {t} (rank {PS_LAYERS[_unit(m)]} -> {PS_LAYERS[_unit(t)]})"
        for m in modules for t in GRAPH[m] & modules if PS_LAYERS[_unit(t)] > PS_LAYERS[_unit(m)]
    )
    assert not upward, f"ps: {_figures(modules)}, {len(upward)} upward arrows:\n" + "\n".join(upward)


def test_ps_keeps_few_files_at_its_top() -> None:
    files = sorted(p.name for p in (REPO / "ps").glob("*.py"))
    assert len(files) <= MAX_FILES_DIRECTLY_IN_PS, f"{len(files)} files directly in ps/ (at most {MAX_FILES_DIRECTLY_IN_PS}): {files}"


def test_the_layer_map_covers_every_package() -> None:
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages <= set(ALLOWED), f"packages without a layer: {packages - set(ALLOWED)}"
