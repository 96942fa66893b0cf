"""The dependency picture: layers only point down, no cycles, one transport seam (read from the source).

    cli      (command line, launcher, ctl)
    evaluator    (the sidecar evaluator: reuses the worker's client)
    ps  worker   (the two roles: never each other)
    rpcps    (shared: protocol, transport, settings, tasks)

``harness`` (test and fault-injection machinery) may use any of them; none of them may use it.
docs/ARCHITECTURE.md draws the same picture.
"""

from __future__ import annotations

import ast
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


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) of every import, leaving out ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
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


def test_there_are_no_import_cycles() -> None:
    graph = {m: {t for name, _, _ in _imports(p) if (t := _internal(name)) is not None and t != m} for m, p in MODULES.items()}
    # A package's __init__ re-exporting its own submodules is not a cycle of meaning; drop those edges.
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not (module == t.rpartition(".")[0] and MODULES[module].name == "__init__.py")}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_layer_map_covers_every_package() -> None:
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages <= set(ALLOWED), f"packages without a layer: {packages - set(ALLOWED)}"
