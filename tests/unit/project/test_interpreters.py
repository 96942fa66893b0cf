"""Every process a test, bench or tool starts runs the interpreter that runs it (``sys.executable``).

``python``/``python3`` from PATH may be another interpreter without rpcps or torch (a system Python
next to the project's .venv): a test would then check the wrong environment, or fail for a reason
that has nothing to do with rpcps. This reads the sources and names each place that hands a bare
interpreter name to a child: as the program of an argv (``["python3", ...]``) or as the value of a
``*PYTHON*`` setting (``RPCPS_PYTHON="python3"``, ``{"PYTHON": "python"}``).
"""

from __future__ import annotations

import ast

from harness.procs import REPO

TREES = ("tests", "bench", "tools", "harness")
BARE = {"python", "python3"}


def _is_bare(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value in BARE


def bare_interpreters(source: str, filename: str) -> list[str]:
    """``file:line`` of every bare interpreter name handed to a child process in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.List, ast.Tuple)) and node.elts and _is_bare(node.elts[0]):
            found.append(node.lineno)
        elif isinstance(node, ast.keyword) and node.arg and "PYTHON" in node.arg.upper() and _is_bare(node.value):
            found.append(node.value.lineno)
        elif isinstance(node, ast.Dict):
            found += [
                v.lineno for k, v in zip(node.keys, node.values)
                if isinstance(k, ast.Constant) and "PYTHON" in str(k.value).upper() and _is_bare(v)
            ]
    return [f"{filename}:{line}" for line in sorted(found)]


def test_the_check_finds_each_way_of_naming_a_bare_interpreter() -> None:
    """It can fail: the forms it looks for are found, and sys.executable or a file named python is not."""
    bad = 'run(["python3", "x.py"])\nenv.update(RPCPS_PYTHON="python3")\nenv = {"PYTHON": "python"}\n'
    assert bare_interpreters(bad, "bad.py") == ["bad.py:1", "bad.py:2", "bad.py:3"]
    good = 'run([sys.executable, "x.py"])\nenv.update(RPCPS_PYTHON=sys.executable)\nstub = root / "python"\n'
    assert bare_interpreters(good, "good.py") == []


def test_no_test_bench_or_tool_starts_python_from_path() -> None:
    found = [
        hit
        for tree in TREES
        for path in sorted((REPO / tree).rglob("*.py"))
        for hit in bare_interpreters(path.read_text(), str(path.relative_to(REPO)))
    ]
    assert found == [], f"use sys.executable (or $PYTHON in scripts), not python from PATH: {found}"
