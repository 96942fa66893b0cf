"""A server and two workers on three "hosts" (network namespaces on a private bridge), started with
the per-node launcher people use (deploy/bare-metal/rpcps-node.sh), then links cut and restored.

What it holds the system to (docs/FAULT_TOLERANCE.md, docs/DEPLOY.md):
- training works across hosts when TensorPipe is told which interface to advertise (--ifname), and
  does not without it when the hostname resolves to an address peers cannot reach;
- a worker whose link is cut is dropped by the server after its lease while the other keeps
  training, and rejoins by itself when the link comes back;
- a server cut off for longer than the workers' timeouts is waited for: the workers restart
  themselves, rejoin when it is back, and nothing is applied twice or lost;
- a server that crashes is restarted by the node launcher and resumes from its snapshot, losing at
  most one checkpoint interval;
- in the end the model has exactly one update per worker step (the audit ledger proves it).

Needs root and `ip netns` (iproute2); skipped with the reason otherwise. Everything lives in
namespaces the test makes (10.213.7.0/24 on a bridge in its own namespace) and is deleted after.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.ledger import check_ledger
from harness.procs import REPO, ProcessGroup, child_env, descendants, try_scrape, wait_until
from rpcps.secret_files import create_secret_file
from tests.netns import TestNetwork, unavailable_reason

pytestmark = pytest.mark.integration

NODE = REPO / "deploy" / "bare-metal" / "rpcps-node.sh"
RPC_PORT, SERVER_METRICS, WORKER_METRICS = 29500, 9400, 9410
STEPS = 2500  # per worker; paced to <= 100 steps/s, so training outlasts every fault below
CHECKPOINT_EVERY = 100
RPC_TIMEOUT_S, LEASE_S, MAX_RETRIES = 2, 3, 3
PACED_DATA = "tests.integration.paced_data:paced_data"


@pytest.fixture
def net() -> Iterator[TestNetwork]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host test: {reason}")
    try:
        network = TestNetwork(tag=str(os.getpid()))
    except RuntimeError as e:
        pytest.skip(f"multi-host test: cannot build the test network here: {e}")
    try:
        try:
            for host in ("ps", "w0", "w1"):
                network.add_host(host)
        except RuntimeError as e:  # e.g. a kernel without veth: the machine's limit, not rpcps's
            pytest.skip(f"multi-host test: cannot build the test network here: {e}")
        yield network
    finally:
        errors = network.close()
        if errors:
            print(f"network clean-up: {errors}", file=sys.stderr)


class Cluster:
    """The test's view of the three hosts: start node launchers, read metrics inside namespaces."""

    def __init__(self, net: TestNetwork, procs: ProcessGroup, run_dir: Path) -> None:
        self.net = net
        self.procs = procs
        self.run_dir = run_dir
        self.ledger = run_dir / "audit.log"
        self.ps_address = f"{net.hosts['ps'].address}:{RPC_PORT}"
        # The RPC ports leave loopback here, so the job needs its secret and the acknowledgement that
        # this network admits only the job (docs/SECURITY.md); both through the environment, as
        # deploy/bare-metal/rpcps.env.example sets them.
        self.secret = run_dir / "job-secret"
        create_secret_file(self.secret)

    def node(self, host: str, role: str, *args: str, ifname: bool = True, launcher_args: tuple[str, ...] = ()) -> None:
        launcher = [
            str(NODE), role, "--log-dir", str(self.run_dir / "logs" / host), "--python", sys.executable,
            "--backoff-s", "1", *(["--ifname", "eth0"] if ifname else []), *launcher_args, *args,
        ]
        env = child_env(RPCPS_JOB_SECRET_FILE=str(self.secret), RPCPS_TRUST_NETWORK="on")
        self.procs.start(host, [], program=self.net.argv(host, launcher), env=env)

    def server(self, *args: str, ifname: bool = True) -> None:
        self.node(
            "ps", "server", "--listen", self.ps_address, "--checkpoint-dir", str(self.run_dir / "ckpt"), "--",
            "--audit-log", str(self.ledger), "--rpc-timeout-s", str(RPC_TIMEOUT_S), "--lease-s", str(LEASE_S),
            "--checkpoint-every-updates", str(CHECKPOINT_EVERY), "--progress-s", "2", *args, ifname=ifname,
        )

    def worker(self, index: int, *args: str, ifname: bool = True, launcher_args: tuple[str, ...] = ()) -> None:
        self.node(
            f"w{index}", "workers", "--ps", self.ps_address, "--first-index", str(index), "--num-workers", "2", "--",
            "--steps", str(STEPS), "--data", PACED_DATA, "--rpc-timeout-s", str(RPC_TIMEOUT_S),
            "--max-retries", str(MAX_RETRIES), "--connect-timeout-s", "60", "--heartbeat-s", "1", *args,
            ifname=ifname, launcher_args=launcher_args,
        )

    def metrics(self, host: str) -> dict[str, float]:
        port = SERVER_METRICS if host == "ps" else WORKER_METRICS
        return self.net.call_in(host, lambda: try_scrape(port))

    def server_value(self, name: str) -> float:
        return self.metrics("ps").get(name, -1.0)

    def log(self, name: str) -> str:
        path = self.run_dir / "logs" / name
        return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture
def cluster(net: TestNetwork, procs: ProcessGroup, tmp_path: Path) -> Iterator[Cluster]:
    run = Cluster(net, procs, tmp_path)
    try:
        yield run
    finally:
        procs.reap()  # before the network goes: processes in a namespace keep it (and its veth) alive


VERSION, LIVE, REAPED = "rpcps_server_model_version", "rpcps_server_live_workers", "rpcps_server_workers_reaped_total"


@pytest.mark.slow  # over 40 s on 2 cores: CI runs it in its slow pass
@pytest.mark.timeout(240)
def test_training_across_hosts_survives_cut_links_and_a_server_crash(cluster: Cluster) -> None:
    c = cluster
    c.server()
    c.worker(0)
    c.worker(1)

    # 1. Training across hosts: both workers live, updates flowing.
    wait_until(lambda: c.server_value(LIVE) == 2 and c.server_value(VERSION) >= 100, 90, "2 live workers and 100 updates")

    # 2. Worker 1's cable is pulled. The server stops hearing from it, removes it after its lease,
    #    and worker 0 trains on undisturbed meanwhile.
    reaped, at_cut = c.server_value(REAPED), c.server_value(VERSION)
    c.net.cut("w1")
    try:
        wait_until(lambda: c.server_value(REAPED) > reaped, 30, "the server to remove the unreachable worker 1")
        assert c.server_value(LIVE) == 1
        wait_until(lambda: c.server_value(VERSION) >= at_cut + 100, 30, "worker 0 to keep training while worker 1 is cut off")
    finally:
        c.net.restore("w1")
    # Back on the network, worker 1 finds its calls refused, restarts itself and rejoins.
    wait_until(lambda: c.metrics("w1").get("rpcps_worker_reconnects", 0) >= 1, 60, "worker 1 to restart itself")
    wait_until(lambda: c.server_value(LIVE) == 2, 60, "worker 1 to rejoin")
    wait_until(lambda: c.metrics("w1").get("rpcps_worker_steps_total", 0) >= 20, 60, "worker 1 to train again")

    # 3. The server's cable is pulled for longer than the workers' timeouts (rpc timeout x retries
    #    and back-off). Both workers give up on their calls and restart themselves; nothing is applied.
    before = {w: c.metrics(w).get("rpcps_worker_reconnects", 0) for w in ("w0", "w1")}
    c.net.cut("ps")
    try:
        version_at_cut = c.server_value(VERSION)
        for w in ("w0", "w1"):
            wait_until(lambda w=w: c.metrics(w).get("rpcps_worker_reconnects", 0) > before[w], 60,
                       f"{w} to give up on the unreachable server and restart itself")
        # pushes already on the wire when the cable went may still land; no more than that
        assert c.server_value(VERSION) <= version_at_cut + 2 * 2
    finally:
        c.net.restore("ps")
    wait_until(lambda: c.server_value(LIVE) == 2, 60, "both workers to rejoin the server")
    at_restore = c.server_value(VERSION)
    wait_until(lambda: c.server_value(VERSION) >= at_restore + 100, 60, "training to resume after the server's link healed")

    # 4. The serving process crashes. Its supervisor (rpcps ps supervises itself, inside the node
    #    launcher) restarts it, it resumes from its newest snapshot, and the workers find it again.
    entry = str(REPO / "trainer_entry.py")
    server_pids = [pid for pid in descendants(c.procs["ps"].pid) if _cmdline(pid).split()[1:2] == [entry]]
    assert len(server_pids) == 1, server_pids
    os.kill(server_pids[0], signal.SIGKILL)
    wait_until(lambda: c.metrics("ps").get("rpcps_server_resumes_total", 0) >= 1, 60, "the restarted server to resume")
    wait_until(lambda: c.server_value(LIVE) == 2, 60, "both workers to rejoin the restarted server")

    # 5. Both workers finish; then the server is stopped the way systemd or Slurm would stop it.
    for w in ("w0", "w1"):
        assert c.procs[w].wait(150) == 0, c.log(f"{w}/worker{w[1]}.log")[-3000:]
    c.procs["ps"].send(signal.SIGTERM)
    assert c.procs["ps"].wait(60) == 0, c.log("ps/ps.log")[-3000:]

    report = check_ledger(c.ledger)
    assert report.problems == [], report.problems[:10]
    assert report.final_version == 2 * STEPS, "one update per worker step: nothing lost, nothing applied twice"
    assert report.restarts == 2, "started once, restarted once after the crash (never for a cut link)"
    assert len(report.updates_lost) == 1 and report.updates_lost[0] <= CHECKPOINT_EVERY + 2 * 2 * 4, report.updates_lost
    ps_log = c.log("ps/ps.log")
    assert "the serving process killed by SIGKILL (after serving); restarting it from its newest snapshot" in ps_log
    assert "resumed from" in ps_log


@pytest.mark.timeout(120)
def test_without_the_interface_name_peers_get_an_unreachable_address(cluster: Cluster) -> None:
    """The server advertises what its hostname resolves to (loopback here, or an address of another
    namespace): a worker on another host reaches the store but cannot join. --ifname fixes that."""
    c = cluster
    c.server(ifname=False)
    c.worker(0, "--max-reconnects", "0", "--connect-timeout-s", "20", launcher_args=("--max-restarts", "0"))
    code = c.procs["w0"].wait(90)
    assert code == 3, f"worker exited with {code}, expected 3 (could not join)\n" + c.log("w0/worker0.log")[-3000:]
    assert c.server_value(LIVE) == 0 and c.server_value(VERSION) == 0


@pytest.mark.timeout(150)
def test_torchrun_workers_take_their_slots_from_rank_and_world_size(cluster: Cluster) -> None:
    """rpcps-node.sh workers --torchrun: torchrun starts two ranks on one host; RANK and WORLD_SIZE
    become slot and slot count, LOCAL_RANK the metrics port (9410 + LOCAL_RANK)."""
    c = cluster
    steps = 400  # paced: at least 4 s of training, time to see both ranks live
    c.server()
    c.node("w0", "workers", "--ps", c.ps_address, "--torchrun", "--count", "2", "--", "--steps", str(steps),
           "--data", PACED_DATA, "--rpc-timeout-s", str(RPC_TIMEOUT_S), "--connect-timeout-s", "60")
    wait_until(lambda: c.server_value(LIVE) == 2, 90, "both torchrun ranks to join")
    second = c.net.call_in("w0", lambda: try_scrape(WORKER_METRICS + 1))
    assert second.get("rpcps_worker_steps_total", -1) >= 0, "rank 1 serves /metrics on 9410 + LOCAL_RANK"
    assert c.procs["w0"].wait(120) == 0, c.log("w0/torchrun.log")[-3000:]
    c.procs["ps"].send(signal.SIGTERM)
    assert c.procs["ps"].wait(60) == 0
    report = check_ledger(c.ledger)
    assert report.problems == [] and report.final_version == 2 * steps
    ps_log = c.log("ps/ps.log")
    assert "worker slot 0 registered" in ps_log and "worker slot 1 registered" in ps_log


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
