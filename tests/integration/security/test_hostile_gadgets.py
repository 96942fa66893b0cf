"""Pickle gadgets that change objects instead of naming forbidden ones, against a real job (issue 24).

The review's first way in: one crafted message of a few hundred bytes used pickle's BUILD to rebind
attributes of an allowed class (torch's tensor receiver, an enum member), so every later push's
gradients were the attacker's or training stopped for good. Here a peer sends each gadget to a
training server and to its worker while the job is paused (the product's own control holds it
there); each is refused, counted and logged once, and training then finishes exactly as a run
nobody attacked. The gadgets one by one, and a property test over opcode sequences:
tests/unit/rpcps/transport/test_unpickler_mutations.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from harness.procs import REPO, ProcessGroup, free_port, scrape_metrics, wait_until
from rpcps.secret_files import create_secret_file
from tests.integration.conftest import assert_learned, read_json, run_ctl

pytestmark = pytest.mark.integration

STEPS = 300
SERVER = "ps0_r0"
"""The server's RPC name: shard 0 hosting the group's store joins as rank 0."""


def _job(procs: ProcessGroup, tmp_path: Path, name: str, held: bool = False) -> tuple[Any, int, int, str, Any]:
    """A server and one worker of STEPS steps; ``held``: the server is paused before the worker starts."""
    secret = tmp_path / f"{name}-secret"
    create_secret_file(secret)
    control = f"127.0.0.1:{free_port()}"
    ps, port, ps_metrics = procs.ps(f"{name}-ps", "--job-secret-file", str(secret), "--control-port", control.rsplit(":", 1)[1])
    if held:
        wait_until(lambda: run_ctl(control, "pause").returncode == 0 or not ps.alive(), 60, "the server to pause")
        assert ps.alive(), ps.tail()
    worker, worker_metrics = procs.worker(
        f"{name}-worker", port, 0, 1, "--steps", str(STEPS), "--job-secret-file", str(secret),
        "--summary-json", str(tmp_path / f"{name}.json"),
    )
    return ps, port, ps_metrics, control, (worker, worker_metrics)


@pytest.mark.timeout(240)
def test_build_gadgets_are_refused_counted_and_training_ends_as_if_unattacked(procs: ProcessGroup, tmp_path: Path) -> None:
    ps, _, ps_metrics, _, (worker, _) = _job(procs, tmp_path, "plain")
    assert worker.wait(120) == 0, worker.tail()
    plain = read_json(tmp_path / "plain.json")

    # Training is held while the peer starts and attacks (300 unpaced steps take about a second: a
    # pause sent after some of them could come after the last); the worker is registered and mid-run.
    ps, port, ps_metrics, control, (worker, worker_metrics) = _job(procs, tmp_path, "attacked", held=True)
    worker_name = wait_until(lambda: re.findall(r"worker slot 0 registered as (worker0_r\d+)", ps.stderr()), 60, "a registration")[-1]
    peer = procs.start(
        "peer", [f"127.0.0.1:{port}", SERVER, worker_name],
        script=REPO / "tests/integration/security/gadget_peer.py",
    )
    assert peer.wait(120) == 0, peer.tail()
    results = json.loads(peer.stdout().strip().splitlines()[-1])
    resumed = run_ctl(control, "resume")
    assert resumed.returncode == 0, resumed.stderr

    for target in ("server", "worker"):
        for gadget, result in results[target].items():
            kind = "call" if gadget == "call an endpoint while loading" else "mutation"
            assert result["outcome"] == "raised" and f"rpc payload refused ({kind}" in result["error"], (target, gadget, result)
    assert results["after"] == {"outcome": "returned", "value": "1"}, results["after"]
    for metrics_port, proc in ((ps_metrics, ps), (worker_metrics, worker)):
        metrics = scrape_metrics(metrics_port)
        assert metrics['rpcps_transport_refused_total{kind="mutation"}'] == 3, proc.name
        assert metrics['rpcps_transport_refused_total{kind="call"}'] == 1, proc.name
        assert proc.stderr().count("refused an RPC payload from a peer: mutation") == 3, proc.tail()  # once each

    assert worker.wait(120) == 0, worker.tail()
    attacked = read_json(tmp_path / "attacked.json")
    assert attacked["steps"] == plain["steps"] == STEPS and attacked["pushes_rejected"] == 0
    assert_learned(attacked)
    # One async worker is not bit-reproducible (which parameters a step sees depends on timing), so
    # "no different" is within run-to-run noise: replaced gradients would leave it untrained.
    assert abs(attacked["final_loss"] - plain["final_loss"]) < 0.5 * max(plain["final_loss"], 0.1), (plain, attacked)
    wait_until(lambda: scrape_metrics(ps_metrics)["rpcps_server_model_version"] == STEPS, 30, "the final version")
