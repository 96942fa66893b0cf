"""The deploy recipes' two variants through deploy/bare-metal/rpcps-node.sh, the launcher people run
on their nodes (and that systemd and Slurm run): a job with a hot standby (the coordinator, two
servers with ``--store`` and ``--replicas 2``, workers against the coordinator), and the CTR task
with sparse settings from an env file. Real processes on 127.0.0.1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from harness.procs import REPO, Proc, ProcessGroup, try_scrape, wait_until
from rpcps.ports import free_port, free_ports

pytestmark = pytest.mark.integration

NODE = REPO / "deploy" / "bare-metal" / "rpcps-node.sh"
STEPS = 100


def _launch(procs: ProcessGroup, name: str, role: str, *args: str) -> Proc:
    """``rpcps-node.sh ROLE ARGS`` as a named process; what it starts logs to logs/<name>/ (as on a node)."""
    launcher = ["bash", str(NODE), role, "--python", sys.executable, "--log-dir", str(procs.log_dir / name), "--backoff-s", "0"]
    return procs.start(name, args, program=launcher)


def _logs(procs: ProcessGroup) -> str:
    """The launchers' own output and the tail of every log the processes under them wrote."""
    tails = [f"--- {p.relative_to(procs.log_dir)}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
             for p in sorted(procs.log_dir.glob("*/*.log"))]
    return "\n".join([procs.tails(), *tails])


def _metric(port: int, key: str) -> float:
    return try_scrape(port).get(key, -1)


@pytest.mark.timeout(150)
def test_the_node_launcher_starts_a_coordinator_a_primary_and_its_standby(procs: ProcessGroup, tmp_path: Path) -> None:
    store_port, store_metrics = free_ports(2)
    store = f"127.0.0.1:{store_port}"
    coordinator = _launch(procs, "store", "store", "--listen", store, "--metrics-port", str(store_metrics), "--", "--lease-s", "3")

    def server(name: str) -> tuple[Proc, int]:
        listen, metrics, control = free_ports(3)
        proc = _launch(
            procs, name, "server", "--listen", f"127.0.0.1:{listen}", "--checkpoint-dir", str(tmp_path / "checkpoints"),
            "--metrics-port", str(metrics), "--control-port", str(control), "--store", store, "--replicas", "2",
        )
        return proc, metrics

    a, ma = server("ps_a")
    wait_until(lambda: _metric(ma, "rpcps_replica_role") == 2 or not a.alive(), 60, "ps_a to serve as primary")
    assert a.alive(), _logs(procs)
    b, mb = server("ps_b")
    wait_until(lambda: _metric(ma, "rpcps_replica_standby_in_sync") == 1 or not b.alive(), 60, "ps_b to attach in sync")
    assert b.alive(), _logs(procs)
    wait_until(lambda: _metric(mb, "rpcps_replica_role") == 1, 10, "ps_b to report itself an in-sync standby")
    # The coordinator's view of the shard is what the dashboard's "Shard views" panel and the docs show.
    assert _metric(store_metrics, 'rpcps_store_view_standby{shard="0"}') == 1

    workers = [
        _launch(procs, f"workers{i}", "workers", "--ps", store, "--first-index", str(i), "--num-workers", "2",
                "--metrics-port-base", str(free_port()), "--", "--steps", str(STEPS), "--data", "tests.integration.paced_data:paced_data")
        for i in range(2)
    ]
    assert [w.wait(100) for w in workers] == [0, 0], _logs(procs)
    # Every update reached the standby before its worker saw it acknowledged.
    assert _metric(ma, "rpcps_server_model_version") == 2 * STEPS
    wait_until(lambda: _metric(mb, "rpcps_server_model_version") == 2 * STEPS, 10, "the standby to hold every update")
    assert coordinator.alive() and a.alive() and b.alive(), _logs(procs)


@pytest.mark.timeout(240)
def test_the_node_launcher_trains_the_ctr_task_with_sparse_settings_from_an_env_file(procs: ProcessGroup, tmp_path: Path) -> None:
    """What docs/DEPLOY.md says to put in the env file reaches the server: the admission filter counts
    refused ids, so rows exist only for ids pulled twice."""
    env_file = tmp_path / "rpcps.env"
    env_file.write_text(
        "RPCPS_MODEL=rpcps.examples.ctr:dlrm_model\nRPCPS_DATA=rpcps.examples.ctr:ctr_data_small\nRPCPS_LOSS=rpcps.examples.ctr:bce_loss\n"
        "RPCPS_SPARSE_ADMIT_COUNT=2\nRPCPS_SPARSE_TTL=1000\n"
    )
    listen, metrics, control = free_ports(3)
    server = _launch(
        procs, "ps", "server", "--env-file", str(env_file), "--listen", f"127.0.0.1:{listen}",
        "--checkpoint-dir", str(tmp_path / "checkpoints"), "--metrics-port", str(metrics), "--control-port", str(control),
    )
    steps = 20
    workers = [
        _launch(procs, f"workers{i}", "workers", "--env-file", str(env_file), "--ps", f"127.0.0.1:{listen}", "--first-index", str(i),
                "--num-workers", "2", "--metrics-port-base", str(free_port()), "--", "--steps", str(steps))
        for i in range(2)
    ]
    assert [w.wait(200) for w in workers] == [0, 0], _logs(procs)
    scraped = try_scrape(metrics)
    assert scraped.get("rpcps_server_model_version") == 2 * steps, _logs(procs)
    assert scraped.get('rpcps_sparse_rows{table="cat0"}', 0) > 0, sorted(k for k in scraped if "sparse" in k)
    assert scraped.get('rpcps_sparse_filtered_ids_total{table="cat0"}', 0) > 0, "the env file's --sparse-admit-count is not in effect"
    assert server.alive(), _logs(procs)
