"""``rpcps local`` on Ctrl-C: stops its workers and server, reaps them all, exits with 130; killed, its
children stop too."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from harness.procs import Proc, ProcessGroup, descendants, pid_alive, try_scrape, wait_until
from tests.integration.conftest import wait_for_updates

pytestmark = pytest.mark.integration


@pytest.mark.timeout(150)
def test_local_stops_cleanly_on_sigint(procs: ProcessGroup, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = _training_local(procs, run_dir, "--progress-s", "1")
    titles = {pid: _cmdline(pid) for pid in descendants(local.pid)}
    children = [pid for pid, title in titles.items() if "trainer_entry.py" in title]  # each shows its own command line
    assert len(children) == 3, f"expected a server and two workers below local, found {titles}"
    others = [title for pid, title in titles.items() if pid not in children]
    assert len(others) == 1 and " -m rpcps.prefork " in others[0], f"besides them only their fork server: {titles}"
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


@pytest.mark.timeout(150)
def test_a_killed_local_takes_its_children_with_it(procs: ProcessGroup, tmp_path: Path) -> None:
    """kill -9 of local: its fork server dies with it and each child gets SIGTERM and stops in order (all at
    once: a worker may find its server gone first)."""
    run_dir = tmp_path / "run"
    local = _training_local(procs, run_dir)
    children = [pid for pid in descendants(local.pid) if "trainer_entry.py" in _cmdline(pid)]
    assert len(children) == 3, children

    local.send(signal.SIGKILL)
    wait_until(lambda: not any(pid_alive(pid) for pid in children), 60, "local's children to stop")
    assert "ps.runner: stopping" in (run_dir / "ps.log").read_text()
    for i in range(2):  # each ended in order: its steps so far done, or stopped while its server went first
        log = (run_dir / f"worker{i}.log").read_text()
        assert "worker.api: done:" in log or "worker.api: stopped by signal while the server went away" in log, log[-2000:]


def _training_local(procs: ProcessGroup, run_dir: Path, *flags: str) -> Proc:
    """``local`` with a server and two workers, once the server applied 20 updates and both workers are
    live on it (one worker alone can make the 20 while the other still starts, and has logged nothing)."""
    local = procs.start("local", ["local", "--workers", "2", "--steps", "1000000", "--run-dir", run_dir, *flags])
    targets = wait_until(lambda: _targets(run_dir), timeout=30, what="local's Prometheus targets file")
    ps_port = int(next(t["targets"][0] for t in targets if t["labels"]["role"] == "ps").rsplit(":", 1)[1])
    wait_for_updates(ps_port, 20, timeout=90, proc=local)
    wait_until(lambda: try_scrape(ps_port).get("rpcps_server_live_workers") == 2, timeout=60,
               what="both workers to be live on the server")
    return local


def _targets(run_dir: Path) -> list[dict] | None:
    try:
        return json.loads((run_dir / "prometheus_targets.json").read_text())
    except (OSError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
