"""Fail points: the N-th time a point is reached over a run (restarts included) kills the process, once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rpcps import failpoints

REPO = Path(__file__).resolve().parents[2]


def _reach(point: str, spec: str) -> int:
    """Runs a process that reaches ``point`` once under RPCPS_FAILPOINTS=spec; returns its exit code."""
    code = f"from rpcps import failpoints; failpoints.hit({point!r})"
    env = {**os.environ, "PYTHONPATH": str(REPO), failpoints.ENV: spec}
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=60, check=False).returncode


@pytest.mark.timeout(120)
def test_the_nth_hit_across_processes_kills_once(tmp_path: Path) -> None:
    marker = tmp_path / "fp.fired"
    spec = f"snapshot.after_commit=kill@2:{marker}"
    assert _reach("snapshot.after_commit", spec) == 0  # hit 1
    assert _reach("snapshot.after_commit", spec) == -signal.SIGKILL  # hit 2, counted across processes
    assert marker.exists()
    assert _reach("snapshot.after_commit", spec) == 0  # fired already: inert from now on
    assert _reach("finish.after_snapshot", spec) == 0  # other points are not armed


def test_a_bad_spec_names_the_points() -> None:
    with pytest.raises(ValueError, match="expected NAME=kill@N:MARKER with NAME in"):
        failpoints._parse("snapshot.whenever=kill@1:/x")
    with pytest.raises(ValueError, match="bad entry"):
        failpoints._parse("snapshot.after_commit=explode@1:/x")
