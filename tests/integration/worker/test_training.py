"""Asynchronous training end to end: the server and workers as real processes over torch RPC."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from harness import control as control_plane
from harness.procs import ENTRY, ProcessGroup, free_port, scrape_metrics, wait_until
from tests.integration.conftest import assert_learned, imported_modules, read_json, wait_for_updates

pytestmark = pytest.mark.integration

STEPS = 200


@pytest.mark.timeout(180)
def test_local_with_two_workers_learns(procs: ProcessGroup, tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    local = procs.start(
        "local",
        ["local", "--workers", "2", "--steps", str(STEPS), "--run-dir", tmp_path / "run", "--summary-json", summary_path,
         "--progress-s", "2"],
    )
    assert local.wait(150) == 0
    summary = read_json(summary_path)
    assert_learned(summary)
    assert summary["updates_applied"] == summary["steps"] == 2 * STEPS
    assert summary["restarts"] == {"ps": 0, "worker0": 0, "worker1": 0}
    assert "rpcps local: done in" in local.stdout()


@pytest.mark.timeout(180)
def test_separate_server_and_two_workers_learn(procs: ProcessGroup, tmp_path: Path) -> None:
    ps, port, ps_metrics = procs.ps("ps", "--summary-json", str(tmp_path / "ps.json"), "--progress-s", "1")
    workers = [
        procs.worker(f"worker{i}", port, i, 2, "--steps", str(STEPS), "--summary-json", str(tmp_path / f"w{i}.json"))[0]
        for i in range(2)
    ]
    for w in workers:
        assert w.wait(150) == 0, w.tail()
    assert scrape_metrics(ps_metrics)["rpcps_server_updates_applied_total"] == 2 * STEPS
    for i in range(2):
        worker_summary = read_json(tmp_path / f"w{i}.json")
        assert worker_summary["steps"] == worker_summary["updates_applied"] == STEPS
        assert_learned(worker_summary)
    ps.send(15)
    assert ps.wait(30) == 0
    server = read_json(tmp_path / "ps.json")
    assert server["updates_applied"] == server["model_version"] == 2 * STEPS
    assert server["pushes_rejected"] == server["pushes_duplicate"] == 0
    assert_learned(server)


@pytest.mark.timeout(180)
def test_four_concurrent_workers_lose_no_update(procs: ProcessGroup, tmp_path: Path) -> None:
    steps = [60, 70, 80, 90]
    ps, port, ps_metrics = procs.ps("ps", "--summary-json", str(tmp_path / "ps.json"), "--optimizer", "sgd", "--lr", "0.01")
    workers = [
        procs.worker(f"worker{i}", port, i, 4, "--steps", str(n), "--max-in-flight", "4", "--summary-json",
                     str(tmp_path / f"w{i}.json"))[0]
        for i, n in enumerate(steps)
    ]
    for w in workers:
        assert w.wait(150) == 0, w.tail()
    wait_for_updates(ps_metrics, sum(steps), timeout=5, proc=ps)
    ps.send(15)
    assert ps.wait(30) == 0
    server = read_json(tmp_path / "ps.json")
    assert server["updates_applied"] == server["model_version"] == sum(steps)
    assert server["pushes_duplicate"] == server["pushes_rejected"] == server["pushes_skipped"] == 0
    assert sum(read_json(tmp_path / f"w{i}.json")["updates_applied"] for i in range(4)) == sum(steps)


@pytest.mark.timeout(120)
def test_worker_started_before_its_server_waits_and_trains(procs: ProcessGroup, tmp_path: Path) -> None:
    port = free_port()
    worker, _ = procs.worker("worker0", port, 0, 1, "--steps", "20", "--connect-timeout-s", "60")
    # Its metrics endpoint comes up just before it starts looking for the server; from then on it
    # polls the store port with plain connects, which the server must not mind once it is up.
    wait_until(lambda: "metrics on http" in worker.stderr(), timeout=60, what="the worker to start")
    ps, _, ps_metrics = procs.ps("ps", port=port)
    assert worker.wait(90) == 0, worker.tail()
    assert scrape_metrics(ps_metrics)["rpcps_server_updates_applied_total"] == 20
    assert ps.alive()


@pytest.mark.timeout(180)
def test_hand_started_workers_share_a_host_and_load_no_server_module(procs: ProcessGroup) -> None:
    """Two workers started by hand on one host without --metrics-port or LOCAL_RANK both run (the
    second serves /metrics on a free port and says where), and a worker process never imports ``ps``."""
    control = f"127.0.0.1:{free_port()}"
    _, port, ps_metrics = procs.ps("ps", "--control-port", control.rsplit(":", 1)[1])
    # Training held until both serve /metrics: the first must still hold its port when the second binds.
    control_plane.pause(control, wait_for_ready=True)
    workers = [
        procs.start(
            f"worker{i}",
            ["worker", "--ps", f"127.0.0.1:{port}", "--worker-index", str(i), "--num-workers", "2", "--steps", "30",
             "--metrics-addr", "127.0.0.1"],
            program=[sys.executable, "-X", "importtime", str(ENTRY)],
        )
        for i in range(2)
    ]
    wait_until(lambda: all("metrics on http" in w.stderr() or not w.alive() for w in workers), 120, "both workers to serve /metrics")
    control_plane.resume(control)
    for w in workers:
        assert w.wait(120) == 0, w.tail()
    assert scrape_metrics(ps_metrics)["rpcps_server_updates_applied_total"] == 60
    ports = [re.findall(r"metrics on http://127.0.0.1:(\d+)/metrics", w.stderr()) for w in workers]
    assert all(len(p) == 1 for p in ports) and ports[0] != ports[1], ports
    for w in workers:
        modules = imported_modules(w.stderr())
        assert "worker.trainer" in modules  # the importtime lines were read at all
        server_side = sorted(m for m in modules if m == "ps" or m.startswith("ps."))
        assert not server_side, f"{w.name} imported server modules: {server_side}"
