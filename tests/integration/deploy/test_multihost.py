"""A server and two workers on three "hosts" (network namespaces on a private bridge), or a job with
a hot standby on five (the coordinator, two replicas, two workers), started with the per-node
launcher people use (deploy/bare-metal/rpcps-node.sh), then links cut and restored; or the same
standby job with its store in etcd, an etcd member on each of its three hosts.

What it holds the system to (docs/FAULT_TOLERANCE.md, docs/DEPLOY.md):
- training works across hosts when TensorPipe is told which interface to advertise (--ifname), and
  does not without it when the hostname resolves to an address peers cannot reach;
- a worker whose link is cut is dropped by the server after its lease while the other keeps
  training, and rejoins by itself when the link comes back;
- a server cut off for longer than the workers' timeouts is waited for: the workers restart
  themselves, rejoin when it is back, and nothing is applied twice or lost;
- a server that crashes is restarted by the node launcher and resumes from its snapshot, losing at
  most one checkpoint interval;
- in the end the model has exactly one update per worker step (the audit ledger proves it);
- with a hot standby (the coordinator, a primary and its standby each on a host of its own), the
  primary's host cut off: the standby promotes itself after its lease, training goes on there, and
  the old primary, back on the network, applies nothing more, steps down and returns as standby;
- the same with the group's store in etcd (a member per host, no coordinator): the cut-off primary's
  etcd member is in the minority, the standby promotes through the majority's transaction.

Needs root and `ip netns` (iproute2); skipped with the reason otherwise. Everything lives in
namespaces the test makes (10.213.7.0/24 on a bridge in its own namespace) and is deleted after.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.etcd import EtcdCluster, available
from harness.ledger import LedgerReport, check_ledger, first_apply_after
from harness.procs import REPO, ProcessGroup, child_env, descendants, try_scrape, wait_until
from rpcps.secret_files import create_secret_file
from tests.netns import TestNetwork, unavailable_reason

pytestmark = pytest.mark.integration

NODE = REPO / "deploy" / "bare-metal" / "rpcps-node.sh"
RPC_PORT, SERVER_METRICS, WORKER_METRICS, STORE_METRICS = 29500, 9400, 9410, 9390
CONTROL_PORT = 9500
"""The server's control plane (the node launcher's default), on its host's loopback."""
STEPS = 2500  # per worker, paced to <= 100 steps/s; held with the server's pause where a worker would train alone
CHECKPOINT_EVERY = 100
RPC_TIMEOUT_S, LEASE_S, MAX_RETRIES = 2, 3, 3
PACED_DATA = "tests.integration.paced_data:paced_data"


SINGLE_SERVER = ("ps", "w0", "w1")
STANDBY_PAIR = ("store", "psa", "psb", "w0", "w1")
"""Hosts of a job with a hot standby: the coordinator, the shard's two replicas, two workers."""
STANDBY_PAIR_ETCD = ("psa", "psb", "w0")
"""Hosts of a job with a hot standby and its store in etcd: an etcd member on each, the shard's two
replicas, both workers on w0."""


@pytest.fixture
def net(request: pytest.FixtureRequest) -> Iterator[TestNetwork]:
    """The test network; its hosts are SINGLE_SERVER unless a test parametrizes ``net`` indirectly."""
    hosts: tuple[str, ...] = getattr(request, "param", SINGLE_SERVER)
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host test: {reason}")
    try:
        network = TestNetwork(tag=str(os.getpid()))
    except RuntimeError as e:
        pytest.skip(f"multi-host test: cannot build the test network here: {e}")
    try:
        try:
            for host in hosts:
                network.add_host(host)
        except RuntimeError as e:  # e.g. a kernel without veth: the machine's limit, not rpcps's
            pytest.skip(f"multi-host test: cannot build the test network here: {e}")
        yield network
    finally:
        errors = network.close()
        if errors:
            print(f"network clean-up: {errors}", file=sys.stderr)


class Cluster:
    """The test's view of the hosts: start node launchers, read metrics inside namespaces."""

    def __init__(self, net: TestNetwork, procs: ProcessGroup, run_dir: Path) -> None:
        self.net = net
        self.procs = procs
        self.run_dir = run_dir
        self.ledger = run_dir / "audit.log"
        # Workers dial the coordinator when the job has one (it knows which replica serves); a job
        # whose store is in etcd sets its etcd:// URL here.
        self.ps_address = self.address("store" if "store" in net.hosts else "ps") if {"store", "ps"} & set(net.hosts) else ""
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

    def address(self, host: str) -> str:
        return f"{self.net.hosts[host].address}:{RPC_PORT}"

    def server(self, *args: str, ifname: bool = True) -> None:
        self._server("ps", (), args, ifname=ifname)

    def coordinator(self) -> None:
        self.node("store", "store", "--listen", self.address("store"), "--", "--lease-s", str(LEASE_S))

    def replica(self, host: str, store: str | None = None) -> None:
        """One of shard 0's two replicas, on ``host`` with a disk of its own; both write one ledger.
        ``store``: the group's store (default: the coordinator on host "store")."""
        self._server(host, ("--store", store or self.address("store"), "--replicas", "2"), ("--digest-every", "25"))

    def _server(self, host: str, launcher_args: tuple[str, ...], args: tuple[str, ...], ifname: bool = True) -> None:
        self.node(
            host, "server", "--listen", self.address(host), "--checkpoint-dir", str(self.run_dir / f"ckpt-{host}"),
            *launcher_args, "--",
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
        port = STORE_METRICS if host == "store" else SERVER_METRICS if host.startswith("ps") else WORKER_METRICS
        return self.net.call_in(host, lambda: try_scrape(port))

    def server_value(self, name: str, host: str = "ps") -> float:
        return self.metrics(host).get(name, -1.0)

    def control(self, host: str, action: str) -> int:
        """``rpcps ctl pause|resume`` on ``host``'s server, tried until it answers (both are idempotent;
        its control plane listens on the host's loopback, which a cut cable leaves up). Returns the
        model version it answered with."""
        command = self.net.argv(host, [sys.executable, str(REPO / "trainer_entry.py"), "ctl", action,
                                       "--addr", f"127.0.0.1:{CONTROL_PORT}", "--json"])

        def call() -> subprocess.CompletedProcess[str] | None:
            done = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60, check=False)
            return done if done.returncode == 0 else None

        done = wait_until(call, 60, f"{host}'s control plane to answer {action}")
        return int(json.loads(done.stdout)["model_version"])

    def serving_pid(self, host: str) -> int:
        """The server process on ``host`` (under the launcher, which alone restarts it)."""
        entry = str(REPO / "trainer_entry.py")
        pids = [pid for pid in descendants(self.procs[host].pid) if _cmdline(pid).split()[1:2] == [entry]]
        assert len(pids) == 1, pids
        return pids[0]

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
    #    and worker 0 trains on undisturbed meanwhile. Then training is held (the server's pause)
    #    until worker 1 is back: its restart and rejoin take seconds, more on a loaded machine, and
    #    worker 0 training alone all that time could finish before the faults below.
    reaped, at_cut = c.server_value(REAPED), c.server_value(VERSION)
    c.net.cut("w1")
    try:
        wait_until(lambda: c.server_value(REAPED) > reaped, 30, "the server to remove the unreachable worker 1")
        assert c.server_value(LIVE) == 1
        wait_until(lambda: c.server_value(VERSION) >= at_cut + 100, 30, "worker 0 to keep training while worker 1 is cut off")
        c.control("ps", "pause")
    finally:
        c.net.restore("w1")
    # Back on the network, worker 1 finds its calls refused, restarts itself and rejoins.
    wait_until(lambda: c.metrics("w1").get("rpcps_worker_reconnects", 0) >= 1, 60, "worker 1 to restart itself")
    wait_until(lambda: c.server_value(LIVE) == 2, 60, "worker 1 to rejoin")
    c.control("ps", "resume")
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
        c.control("ps", "pause")  # the first worker back must not train alone while the other rejoins
    finally:
        c.net.restore("ps")
    wait_until(lambda: c.server_value(LIVE) == 2, 60, "both workers to rejoin the server")
    at_restore = c.control("ps", "resume")
    wait_until(lambda: c.server_value(VERSION) >= at_restore + 100, 60, "training to resume after the server's link healed")

    # 4. The server crashes. The node launcher, the one layer that restarts it (rpcps ps runs with
    #    --supervise off under it), starts it again; it resumes from its newest snapshot, and the
    #    workers find it again.
    #    Held from its first answer until both workers are back (neither trains alone meanwhile).
    os.kill(c.serving_pid("ps"), signal.SIGKILL)
    wait_until(lambda: c.metrics("ps").get("rpcps_server_resumes_total", 0) >= 1, 60, "the restarted server to resume")
    c.control("ps", "pause")
    assert c.metrics("ps").get("rpcps_server_crash_restarts") == 1, "the launcher hands its restart count to the server"
    wait_until(lambda: c.server_value(LIVE) == 2, 60, "both workers to rejoin the restarted server")
    c.control("ps", "resume")

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
    assert "ps: exited with 137 (killed by signal 9); restart 1/10 in 1s" in ps_log
    assert "resumed from" in ps_log


ROLE, IN_SYNC, EPOCH = "rpcps_replica_role", "rpcps_replica_standby_in_sync", "rpcps_replica_epoch"
PRIMARY, STANDBY = 2, 1  # rpcps_replica_role's values (docs/METRICS.md)
FAILOVER_BOUND_S = 5.0
"""Cut -> the standby serving: its lease (1.5 s of silence) plus the promotion and the workers' resend."""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("net", [STANDBY_PAIR], indirect=True, ids=["standby"])
def test_a_standby_on_another_host_takes_over_when_the_primarys_host_is_cut_off(cluster: Cluster) -> None:
    """docs/FAULT_TOLERANCE.md "Hot standby": the coordinator, primary psa and standby psb on hosts of
    their own, started by the node launcher with --store and --replicas 2; the workers join through
    the coordinator. psa's cable is pulled: psb hears nothing for --replica-lease-s, promotes itself
    and serves, psa (alive, cut off) applies nothing. Back on the network, psa learns of the newer
    epoch, steps down, restarts itself and follows psb. The ledger shows one history."""
    c = cluster
    c.coordinator()
    c.replica("psa")
    wait_until(lambda: c.server_value(ROLE, "psa") == PRIMARY, 90, "psa to serve as primary")
    c.replica("psb")
    wait_until(lambda: c.server_value(IN_SYNC, "psa") == 1 and c.server_value(ROLE, "psb") == STANDBY, 90, "psb to be psa's in-sync standby")
    c.worker(0)
    c.worker(1)
    wait_until(lambda: c.server_value(LIVE, "psa") == 2 and c.server_value(VERSION, "psa") >= 100, 90, "2 live workers and 100 updates")

    # psa's cable is pulled. psb promotes itself once psa has been silent for its lease; psa, cut off
    # from its standby and the coordinator, has no lease and applies nothing.
    cut_at, promoted_in, epoch = _cut_off_the_primary(c, "psb to promote itself")
    assert epoch == 2

    # Back on the network: psa steps down, restarts itself in place, and follows psb.
    wait_until(lambda: c.server_value(ROLE, "psa") == STANDBY and c.server_value(IN_SYNC, "psb") == 1, 120,
               "psa to come back as psb's in-sync standby")
    for w in ("w0", "w1"):
        assert c.procs[w].wait(150) == 0, c.log(f"{w}/worker{w[1]}.log")[-3000:]
    assert c.server_value(VERSION, "psb") == 2 * STEPS
    for host in ("psa", "psb", "store"):  # the standby first: stopping the primary first would hand over
        c.procs[host].send(signal.SIGTERM)
        assert c.procs[host].wait(60) == 0, c.log(f"{host}/{'store' if host == 'store' else 'ps'}.log")[-3000:]

    report = _check_one_history(c, cut_at, promoted_in, "")
    assert report.restarts == 3, "psa and psb started, and psa restarted itself (in place) once after stepping down"
    assert "stepping down as shard 0's primary (epoch 1)" in c.log("psa/ps.log")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("net", [STANDBY_PAIR_ETCD], indirect=True, ids=["standby-etcd"])
def test_with_the_store_in_etcd_a_member_per_host_the_standby_takes_over_from_a_cut_off_primary(
    cluster: Cluster, tmp_path: Path
) -> None:
    """docs/FAULT_TOLERANCE.md "Coordination in etcd", across hosts: an etcd member on each of three
    hosts, primary psa and standby psb started by the node launcher with --store etcd://..., both
    workers on w0 joining through etcd. psa's cable is pulled: its etcd member is cut off with it (a
    minority), psb promotes itself in a transaction of the two others, psa applies nothing; back on the
    network, psa steps down and follows psb. One history, exact final version."""
    reason = available()
    if reason is not None:
        pytest.skip(f"etcd: {reason}")  # tools/setup.sh --test installs it: CI never skips here
    c = cluster
    etcd = EtcdCluster(c.procs, tmp_path / "etcd", hosts=[(c.net.hosts[h].address, c.net.argv(h, [])) for h in STANDBY_PAIR_ETCD])
    c.ps_address = etcd.url("multihost")
    c.replica("psa", c.ps_address)
    wait_until(lambda: c.server_value(ROLE, "psa") == PRIMARY, 90, "psa to serve as primary")
    c.replica("psb", c.ps_address)
    wait_until(lambda: c.server_value(IN_SYNC, "psa") == 1 and c.server_value(ROLE, "psb") == STANDBY, 90, "psb to be psa's in-sync standby")
    c.worker(0, launcher_args=("--count", "2"))
    wait_until(lambda: c.server_value(LIVE, "psa") == 2 and c.server_value(VERSION, "psa") >= 100, 90, "2 live workers and 100 updates")

    cut_at, promoted_in, _ = _cut_off_the_primary(c, "psb to promote itself through etcd")

    wait_until(lambda: c.server_value(ROLE, "psa") == STANDBY and c.server_value(IN_SYNC, "psb") == 1, 120,
               "psa to come back as psb's in-sync standby")
    assert c.procs["w0"].wait(150) == 0, c.log("w0/worker0.log")[-3000:] + c.log("w0/worker1.log")[-3000:]
    assert c.server_value(VERSION, "psb") == 2 * STEPS
    for host in ("psa", "psb"):  # the standby first: stopping the primary first would hand over
        c.procs[host].send(signal.SIGTERM)
        assert c.procs[host].wait(60) == 0, c.log(f"{host}/ps.log")[-3000:]

    _check_one_history(c, cut_at, promoted_in, "etcd across hosts: ")


def _cut_off_the_primary(c: Cluster, promotion: str) -> tuple[float, float, float]:
    """Pulls psa's cable until psb has promoted itself (``promotion``: what the wait says) and applied
    400 updates while psa applied none; then plugs it back. Returns (wall time of the cut, seconds to
    the promotion seen, psb's epoch when it was seen)."""
    cut_at, cut_clock = time.time(), time.monotonic()
    c.net.cut("psa")
    try:
        wait_until(lambda: c.server_value(ROLE, "psb") == PRIMARY, 30, promotion)
        promoted_in = time.monotonic() - cut_clock
        epoch = c.server_value(EPOCH, "psb")
        at_promotion = c.server_value(VERSION, "psb")
        wait_until(lambda: c.server_value(VERSION, "psb") >= at_promotion + 200, 30, "training to go on at psb")
        stuck_at = c.server_value(VERSION, "psa")
        wait_until(lambda: c.server_value(VERSION, "psb") >= at_promotion + 400, 30, "more training at psb")
        assert c.server_value(VERSION, "psa") == stuck_at, "the cut-off primary applied an update"
    finally:
        c.net.restore("psa")
    return cut_at, promoted_in, epoch


def _check_one_history(c: Cluster, cut_at: float, promoted_in: float, label: str) -> LedgerReport:
    """The ledger after a cut of psa: one history, every step applied once, psb promoted to epoch 2
    and psa stepped down from 1, digests compared, psa's last applies in flight within its lease,
    and the failover within ``FAILOVER_BOUND_S`` (printed, ``label`` first)."""
    report = check_ledger(c.ledger)
    assert report.problems == [], report.problems[:10]
    assert report.final_version == 2 * STEPS, "one update per worker step: nothing lost, nothing applied twice"
    assert [epoch for _, epoch, _, _ in report.promotions][:1] == [2], report.promotions
    assert [epoch for _, epoch, _ in report.stepdowns] == [1], report.stepdowns
    assert report.digests_compared > 0
    # psa restarted in place (same pid, a fresh RPC name): its name at the cut wrote the last apply before it.
    old_name = [w for (t, _), w in zip(report.applies, report.apply_writers) if t <= cut_at][-1]
    late = [t - cut_at for (t, _), w in zip(report.applies, report.apply_writers) if w == old_name and t > cut_at]
    assert all(t < 1.5 for t in late), f"the cut-off primary applied updates {late} s after the cut, past its lease"
    resumed = first_apply_after(report, cut_at, other_than=old_name)
    assert resumed is not None
    print(f"{label}cut of the primary's host -> psb promoted (seen) {promoted_in:.2f}s, first update applied by psb "
          f"{resumed - cut_at:.2f}s; psa applied {len(late)} in flight after the cut, the last {max(late, default=0):.3f}s after")
    assert promoted_in <= FAILOVER_BOUND_S and resumed - cut_at <= FAILOVER_BOUND_S
    return report


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
    steps = 400
    c.server()
    # Held until both ranks are live: torchrun starts them together, but one interpreter may be up
    # seconds before the other on a loaded machine, long enough for a rank to train all its steps.
    c.control("ps", "pause")
    c.node("w0", "workers", "--ps", c.ps_address, "--torchrun", "--count", "2", "--", "--steps", str(steps),
           "--data", PACED_DATA, "--rpc-timeout-s", str(RPC_TIMEOUT_S), "--connect-timeout-s", "60")
    wait_until(lambda: c.server_value(LIVE) == 2, 90, "both torchrun ranks to join")
    second = c.net.call_in("w0", lambda: try_scrape(WORKER_METRICS + 1))
    assert second.get("rpcps_worker_steps_total", -1) >= 0, "rank 1 serves /metrics on 9410 + LOCAL_RANK"
    c.control("ps", "resume")
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
