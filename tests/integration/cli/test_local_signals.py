"""``rpcps local`` on Ctrl-C: stops its workers and server, reaps them all, exits with 130."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from harness.procs import ProcessGroup, descendants, pid_alive, try_scrape, wait_until
from tests.integration.conftest import wait_for_updates

pytestmark = pytest.mark.integration


@pytest.mark.timeout(150)
def test_local_stops_cleanly_on_sigint(procs: ProcessGroup, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = procs.start("local", ["local", "--workers", "2", "--steps", "1000000", "--run-dir", run_dir, "--progress-s", "1"])
    targets = wait_until(lambda: _targets(run_dir), timeout=30, what="local's Prometheus targets file")
    ps_port = next(t["targets"][0] for t in targets if t["labels"]["role"] == "ps").rsplit(":", 1)[1]
    wait_for_updates(int(ps_port), 20, timeout=90, proc=local)
    wait_until(lambda: try_scrape(int(ps_port)).get("rpcps_server_live_workers") == 2, timeout=60,
               what="both workers to be live on the server")
    children = descendants(local.pid)
    assert len(children) == 3, f"expected a server and two workers below local, found {children}"
    recorded = json.loads((run_dir / "children.json").read_text())
    assert {c["pid"] for c in recorded.values()} == set(children), "local's children.json must name its live children"

    local.send(signal.SIGINT)
    assert local.wait(60) == 130
    assert "interrupted; all children stopped" in local.stdout()
    assert [pid for pid in children if pid_alive(pid)] == []
    # The children were stopped, not killed: each logged its own orderly end.
    assert "ps.runner: stopping" in (run_dir / "ps.log").read_text()
    for i in range(2):
        assert "worker.api: done:" in (run_dir / f"worker{i}.log").read_text()


def _targets(run_dir: Path) -> list[dict] | None:
    try:
        return json.loads((run_dir / "prometheus_targets.json").read_text())
    except (OSError, ValueError):
        return None
