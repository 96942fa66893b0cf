"""tests/ is in folders, as the code is: no test file sits loose at the top of a tier, and every
integration folder says in its ``__init__.py`` what it holds.

tests/integration/ once held 38 test files side by side with their support modules; a newcomer could
not tell where a server's recovery was tested, or where a new test belonged. A test added at the top
again fails here: put it in the folder of what it exercises (or make one, with a docstring).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TIERS = (REPO / "tests" / "unit", REPO / "tests" / "integration")
INTEGRATION = REPO / "tests" / "integration"


def _folders(tier: Path) -> list[Path]:
    return sorted(p for p in tier.iterdir() if p.is_dir() and p.name != "__pycache__")


def test_no_test_file_sits_at_the_top_of_a_tier() -> None:
    for tier in TIERS:
        loose = sorted(p.name for p in tier.glob("test_*.py"))
        folders = ", ".join(p.name for p in _folders(tier))
        assert not loose, f"move {loose} from {tier.relative_to(REPO)}/ into the folder of what they exercise ({folders})"


def test_every_integration_folder_says_what_it_holds() -> None:
    folders = _folders(INTEGRATION)
    assert len(folders) >= 5, f"tests/integration/ has too few folders to be the layout this test expects: {folders}"
    silent = [
        folder.name for folder in folders
        if not (folder / "__init__.py").is_file() or not ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
    ]
    assert not silent, f"give each of {silent} in tests/integration/ an __init__.py whose docstring says what it holds"
