"""What the server refuses over real RPC: a worker with another model, and malformed pushes."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from harness.procs import REPO, ProcessGroup, scrape_metrics

pytestmark = pytest.mark.integration

EXIT_REFUSED = 5  # worker/api.py


@pytest.mark.timeout(150)
def test_worker_with_a_different_model_is_refused_and_the_server_carries_on(procs: ProcessGroup, tmp_path: Path) -> None:
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    (plugin_dir / "wider_model.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def model():  # the built-in task's model with a narrower first layer
                return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
            """
        )
    )
    ps, port, ps_metrics = procs.ps()
    bad, _ = procs.worker("bad", port, 0, 1, "--model", "wider_model:model", extra_pythonpath=[plugin_dir])
    assert bad.wait(90) == EXIT_REFUSED, bad.tail()
    assert (
        "has a different model than the server: parameter '0.weight' has shape [64, 32] on the worker but [128, 32] "
        "on the server" in bad.stderr()
    )
    assert "Traceback" not in bad.stderr()
    assert ps.alive()
    # The refused worker left the RPC group on its way out, so the next join is not blocked by it.
    good, _ = procs.worker("good", port, 0, 1, "--steps", "10")
    assert good.wait(90) == 0, good.tail()
    metrics = scrape_metrics(ps_metrics)
    assert metrics["rpcps_server_updates_applied_total"] == 10
    assert metrics["rpcps_server_worker_registrations_total"] == 1
    assert ps.alive()


@pytest.mark.timeout(120)
def test_bad_pushes_over_rpc_raise_on_the_worker_and_leave_parameters_unchanged(procs: ProcessGroup) -> None:
    ps, port, ps_metrics = procs.ps("ps", "--optimizer", "sgd", "--lr", "1")
    client = procs.start("client", [f"127.0.0.1:{port}", "bad_pushes"], script=REPO / "tests/integration/ps/rpc_client.py")
    assert client.wait(90) == 0, client.tail()
    report = json.loads(client.stdout().strip().splitlines()[-1])
    outcomes = report["outcomes"]
    expected = {
        "wrong_shape": ("PushRejected", "push 1 from worker 0: chunk 0 has shape [5], expected [22026]"),
        "wrong_count": ("PushRejected", "push 2 from worker 0 has 2 gradient chunks, expected 1"),
        "wrong_dtype": ("PushRejected", "push 3 from worker 0: chunk 0 has dtype torch.float64, expected torch.float32"),
        "nan": ("PushRejected", "push 4 from worker 0 holds NaN/Inf in parameter '2.weight'; parameters unchanged"),
        "unknown_worker": ("UnknownWorker", "worker slot 7 is not registered with this server"),
        "stale_incarnation": ("UnknownWorker", "worker slot 0 was taken over by a newer registration"),
        "named_unknown": ("PushRejected", "push 7 from worker 0 names parameters the model does not have: ['x.y']"),
    }
    for case, (kind, message) in expected.items():
        assert outcomes[case]["raised"] == kind, (case, outcomes[case])
        assert message in outcomes[case]["message"], (case, outcomes[case])
        assert "Traceback" not in outcomes[case]["message"], "the worker must get the clean message, not a remote traceback"
    assert report["version_after_rejects"] == report["version_before"] == 0
    assert report["zero_push"] == "applied" and report["version_after_zero_push"] == 1
    assert report["unchanged"], "a rejected push changed the parameters"
    metrics = scrape_metrics(ps_metrics)
    assert metrics['rpcps_server_pushes_rejected_total{reason="shape"}'] == 2
    assert metrics['rpcps_server_pushes_rejected_total{reason="dtype"}'] == 1
    assert metrics['rpcps_server_pushes_rejected_total{reason="nonfinite"}'] == 1
    assert metrics['rpcps_server_pushes_rejected_total{reason="unknown_worker"}'] == 2
    assert metrics['rpcps_server_pushes_rejected_total{reason="names"}'] == 1
    assert ps.alive()
