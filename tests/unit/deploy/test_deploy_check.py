"""deploy/check.sh: the monitoring bundle's static checks pass, and the script itself is sound."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CHECK = REPO / "deploy" / "check.sh"


def run(*argv: str, cwd: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # The script's Python steps run with the interpreter running these tests (never python3 from PATH).
    env = {**(os.environ if env is None else env), "PYTHON": sys.executable}
    return subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian: apt-get install prometheus)")
def test_check_sh_passes_on_the_shipped_bundle() -> None:
    result = run("bash", str(CHECK), cwd="/")  # from anywhere: the script finds its own files
    assert result.returncode == 0, result.stdout + result.stderr
    for step in ("promtool check config", "promtool check rules", "promtool test rules", "all monitoring checks passed"):
        assert step in result.stdout


def test_check_sh_without_promtool_says_what_to_install() -> None:
    result = run("bash", str(CHECK), env={"PATH": "/usr/bin:/bin", "PROMTOOL": "/nonexistent/promtool"})
    assert result.returncode == 2
    assert "promtool not found" in result.stderr and "apt-get install prometheus" in result.stderr


def test_check_sh_is_valid_bash() -> None:
    result = run("bash", "-n", str(CHECK))
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="needs shellcheck (Debian: apt-get install shellcheck)")
def test_check_sh_passes_shellcheck() -> None:
    result = run("shellcheck", str(CHECK))
    assert result.returncode == 0, result.stdout
