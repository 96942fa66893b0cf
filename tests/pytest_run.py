"""Runs pytest in a subprocess on a small test file, under this repository's pytest settings.

For tests of the test machinery itself (timeouts, the must-run list): they need a real pytest whose
run can time out, ``os._exit`` or fail, which an in-process pytester run would take down with it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.procs import REPO, child_env


def run_pytest(
    directory: Path, source: str, *options: str, timeout_s: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """Writes ``source`` to ``directory/test_tiny.py`` and runs pytest on it; returns the finished run.

    The run uses pyproject.toml's settings (timeouts, markers, addopts) with ``directory`` as its
    rootdir, so node ids are ``test_tiny.py::NAME``; ``tests/conftest.py`` is loaded as a plugin
    (the ``procs`` fixture, the must-run hook). One process (``-n 0``): these runs check what happens
    inside a pytest process, not across xdist workers. ``env`` is added to the child's environment.
    """
    test_file = directory / "test_tiny.py"
    test_file.write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(directory),
         "-p", "tests.conftest", "-p", "no:cacheprovider", "-n", "0", *options, str(test_file)],
        cwd=directory, env=child_env(**env), capture_output=True, text=True, timeout=timeout_s, check=False,
    )
