"""--mode local-steps with real processes: exact round counts, and a kill -9 of a replicated primary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.ledger import check_ledger
from harness.procs import ENTRY, REPO, ProcessGroup, child_env, try_scrape, wait_until
from tests.integration.ps.test_standby import PACED, _start_pair

pytestmark = pytest.mark.integration

LOCAL_STEPS = ("--mode", "local-steps")


@pytest.mark.timeout(240)
def test_local_steps_training_applies_exactly_one_outer_step_per_round(tmp_path: Path) -> None:
    """``local --mode local-steps``: 2 workers x 100 rounds of 4 inner steps: 200 outer steps, each
    counted as a round, and the model learns (each worker's last 10 losses average below its first 10;
    at 30 rounds the margin was as small as 0.001 and a run failed, at 100 it is about 0.7)."""
    summary = tmp_path / "summary.json"
    done = subprocess.run(
        [sys.executable, str(ENTRY), "local", *LOCAL_STEPS, "--local-steps", "4", "--workers", "2", "--steps", "100",
         "--run-dir", str(tmp_path / "run"), "--summary-json", str(summary)],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=200, check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(summary.read_text())
    assert result["updates_applied"] == 200
    server = result["server"]
    assert server["rounds"] == 200 and server["mode"] == "local-steps"
    for worker in result["workers"]:
        assert worker["steps"] == 100 and worker["final_loss"] < worker["initial_loss"], worker


@pytest.mark.timeout(240)
def test_kill_9_of_a_local_steps_primary_loses_no_round_and_applies_none_twice(procs: ProcessGroup, tmp_path: Path) -> None:
    """The standby applies every delta with the same outer optimizer (digests equal along the way),
    promotes on the kill, and the history ends at exactly workers x rounds, each (slot, round) once."""
    port, [(a, ma), (b, mb)] = _start_pair(procs, tmp_path, *LOCAL_STEPS)
    workers = [procs.worker(f"w{i}", port, i, 2, "--steps", "120", "--local-steps", "2", *PACED)[0] for i in range(2)]
    wait_until(lambda: try_scrape(ma).get("rpcps_server_model_version", -1) >= 60, 90, "60 outer steps")
    a.kill()
    assert [w.wait(180) for w in workers] == [0, 0], procs.tails()
    assert try_scrape(mb).get("rpcps_server_model_version") == 240
    assert try_scrape(mb).get("rpcps_replica_failovers_total") == 1
    b.send(15)
    b.wait(60)
    report = check_ledger(tmp_path / "audit.log")
    assert report.problems == [], report.problems[:5]
    assert report.final_version == 240
    assert report.digests_compared >= 5, f"compared {report.digests_compared} digests"
