"""Fail points: the N-th time a point is reached over a run (restarts included) kills the process, once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rpcps import failpoints

REPO = Path(__file__).resolve().parents[3]


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


@pytest.mark.timeout(120)
def test_processes_reaching_a_point_side_by_side_count_every_hit(tmp_path: Path) -> None:
    """Two shards' servers reach server.after_apply at once: each of their hits counts. Before, a read
    between another process's truncate and write took the count back to 1 (a 2-shard local run with
    the point armed at 54 ended with a count of 1 and no crash)."""
    marker = tmp_path / "fp.fired"
    code = "from rpcps import failpoints\nfor _ in range(300): failpoints.hit('server.after_apply')"
    env = {**os.environ, "PYTHONPATH": str(REPO), failpoints.ENV: f"server.after_apply=kill@100000:{marker}"}
    racers = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(3)]
    assert [r.wait(60) for r in racers] == [0, 0, 0]
    assert int(Path(f"{marker}.count").read_text()) == 900


def test_a_count_is_rewritten_in_place_at_a_fixed_width_and_goes_on_from_an_older_file(tmp_path: Path) -> None:
    """The count file is never truncated: a process killed mid-update leaves the old count or the new
    one, never an empty file that would start the run's count again (CI run 42: 557 of 1017 hits
    counted after a kill landed between the old code's truncate and write)."""
    marker = tmp_path / "fp.fired"
    Path(f"{marker}.count").write_text("41")  # the unpadded form older runs wrote
    point = failpoints._Point(1000, str(marker))
    assert [point.count() for _ in range(2)] == [42, 43]
    assert Path(f"{marker}.count").read_text() == "000000000043"


def test_a_bad_spec_names_the_points() -> None:
    with pytest.raises(ValueError, match="expected NAME=kill@N:MARKER or NAME=hold-SECONDS@N:MARKER with NAME in"):
        failpoints._parse("snapshot.whenever=kill@1:/x")
    with pytest.raises(ValueError, match="bad entry"):
        failpoints._parse("snapshot.after_commit=explode@1:/x")


def _timing_hits(point: str, hits: int, spec: str) -> dict[str, Any]:
    """subprocess arguments: a process that reaches ``point`` ``hits`` times under RPCPS_FAILPOINTS=spec
    and prints how long each hit took (a JSON list)."""
    code = (
        "import json, time; from rpcps import failpoints\n"
        f"def took():\n    t = time.monotonic(); failpoints.hit({point!r}); return time.monotonic() - t\n"
        f"print(json.dumps([took() for _ in range({hits})]))\n"
    )
    return {"args": [sys.executable, "-c", code], "env": {**os.environ, "PYTHONPATH": str(REPO), failpoints.ENV: spec}}


@pytest.mark.timeout(60)
def test_a_hold_waits_its_seconds_once_then_passes(tmp_path: Path) -> None:
    marker = tmp_path / "fp.fired"
    spec = f"replication.standby_before_ack=hold-0.4@2:{marker}"
    done = subprocess.run(**_timing_hits("replication.standby_before_ack", 3, spec), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    first, second, third = json.loads(done.stdout)
    assert first < 0.1 and second >= 0.4 and third < 0.1, done.stdout  # hit 2 holds; hits after its 0.4 s pass
    assert marker.exists()


@pytest.mark.timeout(60)
def test_a_hold_ends_early_once_its_release_file_exists(tmp_path: Path) -> None:
    marker = tmp_path / "fp.fired"
    spec = f"replication.standby_before_promote=hold-50@1:{marker}"
    with subprocess.Popen(**_timing_hits("replication.standby_before_promote", 1, spec), stdout=subprocess.PIPE, text=True) as held:
        try:
            deadline = time.monotonic() + 30
            while not marker.exists():  # the point fired: the process holds there
                assert time.monotonic() < deadline and held.poll() is None, "the point never fired"
                time.sleep(0.05)
            (tmp_path / "fp.fired.release").touch()
            out, _ = held.communicate(timeout=20)
        finally:
            held.kill()
    assert held.returncode == 0 and json.loads(out)[0] < 40, out  # released, not held its 50 s


def test_a_hold_needs_seconds_in_range() -> None:
    assert failpoints._parse("replication.standby_before_ack=hold-0.5@3:/x")["replication.standby_before_ack"].hold_s == 0.5
    for bad in ("hold-@1:/x", "hold-0@1:/x", "hold-61@1:/x", "hold-x@1:/x"):
        with pytest.raises(ValueError, match="NAME=hold-SECONDS@N:MARKER"):
            failpoints._parse(f"replication.standby_before_ack={bad}")
