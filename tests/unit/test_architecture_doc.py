"""docs/ARCHITECTURE.md names every module by its path, and names none that is gone.

A newcomer looks a module up there to learn where it lives and why; a module added without a line
(or a line left behind by a move) fails here. ``__init__.py`` files (their docstrings say their
folder's job) and the generated ``*_pb2*.py`` are left out.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "ARCHITECTURE.md"
PACKAGES = ("ps", "worker", "evaluator", "rpcps", "cli")


def _modules() -> set[str]:
    return {
        path.relative_to(REPO).as_posix()
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
        if path.name != "__init__.py" and "_pb2" not in path.name
    }


def _named() -> set[str]:
    """Every backquoted path of a Python file under one of PACKAGES that the page names."""
    alternatives = "|".join(PACKAGES)
    pattern = re.compile(rf"`((?:{alternatives})/[\w/]+\.py)`")
    return set(pattern.findall(DOC.read_text()))


def test_every_module_is_named_in_the_architecture_doc() -> None:
    missing = sorted(_modules() - _named())
    assert not missing, f"{len(missing)} modules missing from docs/ARCHITECTURE.md (add a line: where it lives, its job): {missing}"


def test_the_architecture_doc_names_no_module_that_is_gone() -> None:
    gone = sorted(path for path in _named() if not (REPO / path).is_file())
    assert not gone, f"docs/ARCHITECTURE.md names {len(gone)} modules that do not exist: {gone}"
