"""The group's store in etcd (``--store etcd://...``): a real 3-member etcd cluster on loopback
(``harness.etcd``), servers with ``--replicas 2`` and workers joining through it, no ``rpcps store``.
The audit ledger (both replicas write one file) is the proof, as in test_standby.py.
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from harness import control
from harness.etcd import EtcdCluster, available
from harness.ledger import check_ledger, recovery_after
from harness.procs import (
    Proc,
    ProcessGroup,
    child_env,
    free_port,
    freeze_past_promotion,
    start_replica_pair,
    try_scrape,
    wait_until,
)
from ps.config import ReplicationConfig
from ps.replication.metrics import ReplicationMetrics
from ps.replication.primary import Primary
from rpcps.address import parse_store_address
from rpcps.etcd.store import EtcdStore, open_store
from rpcps.messages import View
from rpcps.transport import group
from rpcps.transport.registry import Registry, ViewRecord
from tests.integration.certs import self_signed
from tests.integration.paced_data import INTERVAL_ENV
from tests.unit.ps.replication.fakes import FakeServer

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(available() is not None, reason=f"needs etcd: {available()}"),
]

PACED = ("--data", "tests.integration.paced_data:paced_data")
VIEW_KEY = "rpcps/view/0"


@pytest.fixture
def etcd(procs: ProcessGroup, tmp_path: Path) -> Iterator[EtcdCluster]:
    """Three etcd members on free loopback ports, data under tmp_path; reaped with the test's processes."""
    yield EtcdCluster(procs, tmp_path / "etcd")


@pytest.fixture
def etcd_tls(procs: ProcessGroup, tmp_path: Path) -> Iterator[EtcdCluster]:
    """The same over TLS, requiring a client certificate (a self-signed one for 127.0.0.1 is the CA)."""
    (tmp_path / "tls").mkdir()
    yield EtcdCluster(procs, tmp_path / "etcd", tls=self_signed(tmp_path / "tls"))


def _scrape(port: int, key: str) -> float:
    return try_scrape(port).get(key, -1)


def _version(port: int) -> float:
    return _scrape(port, "rpcps_server_model_version")


@pytest.mark.timeout(60)
def test_the_etcd_store_answers_as_tcpstore_does_and_through_a_dead_leader(etcd: EtcdCluster) -> None:
    """torch's agent and rpcps's registry were written against TCPStore's semantics; through torch's
    own C++ PrefixStore (as the agent uses it) the etcd store gives the same answers. A kill -9 of the
    etcd leader costs at most a retry: the next write lands through another member."""
    store = open_store(parse_store_address(etcd.url("semantics")), timeout_s=5.0)
    agent_view = dist.PrefixStore("rpc_prefix_0", store)
    assert agent_view.compare_set("token", "", "").decode() == ""  # a read that creates the key empty
    assert agent_view.check(["token"])
    assert agent_view.compare_set("token", "", "mine") == b"mine"
    assert agent_view.compare_set("token", "", "theirs") == b"mine", "held: the holder is answered"
    assert agent_view.compare_set("token", "mine", "") == b""
    assert agent_view.compare_set("missing", "x", "y") == b"x" and not agent_view.check(["missing"])
    assert [agent_view.add("rank", 1) for _ in range(3)] == [1, 2, 3]
    agent_view.set("bytes", b"\x00\xff")
    assert agent_view.get("bytes") == b"\x00\xff"
    agent_view.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError, match="never appeared"):
        agent_view.get("never")
    with pytest.raises(dist.DistStoreError, match="never appeared"):
        agent_view.wait(["never"])
    leader = etcd.leader()
    assert leader is not None and leader.proc is not None
    leader.proc.kill()
    started = time.monotonic()
    assert agent_view.add("rank", 1) == 4
    print(f"first write after the etcd leader's kill -9: {time.monotonic() - started:.3f}s")
    assert isinstance(store, EtcdStore) and store.num_keys() == 3  # token, rank, bytes


@pytest.mark.timeout(60)
def test_views_in_etcd_change_by_revision_so_a_view_changed_back_still_fences_a_stale_writer(etcd: EtcdCluster) -> None:
    """Two registries (two processes' clients) on one etcd: a view is changed by a transaction on its
    key's mod revision. A view changed and changed back to the same text (a standby added, then
    dropped) has a new revision, so a writer holding the first reading loses, where a compare of the
    text would have let it win; a read creates nothing, and a deleted view is put back only over
    the reading of its absence."""
    address = parse_store_address(etcd.url("views"))
    store = open_store(address, timeout_s=5.0)
    primary, other = Registry(store), Registry(open_store(address, timeout_s=5.0))
    nothing = primary.read_view(0)
    assert (nothing.raw, nothing.revision) == ("", 0) and not store.check([VIEW_KEY])
    first = primary.change_view(0, nothing, View(1, "ps0_r1"))
    assert first is not None and first.revision is not None and first.revision > 0
    assert other.change_view(0, nothing, View(1, "ps0_r2")) is None, "a second bootstrap must lose"
    assert other.change_view(0, None, View(1, "ps0_r2")) is None, "so must one that never read"
    stale = other.view(0)
    assert stale == first
    with_standby = primary.change_view(0, first, View(1, "ps0_r1", "ps0_r2"))
    assert with_standby is not None
    back = primary.change_view(0, with_standby, View(1, "ps0_r1"))
    assert back is not None and back.raw == first.raw and (back.revision or 0) > (with_standby.revision or 0)
    assert other.change_view(0, stale, View(2, "ps0_r2")) is None, "same text, older revision: the change must lose"
    assert other.change_view(0, stale.raw, View(2, "ps0_r2")) is not None, "known by its text only: compared at the revision it is at now"
    promoted = other.view(0)
    assert promoted is not None and promoted.view == View(2, "ps0_r2")
    assert store.delete_key(VIEW_KEY)
    gone = other.read_view(0)
    assert other.restore_view(0, gone, promoted) is not None
    assert other.restore_view(0, gone, promoted) is None, "the key exists again: a reading of its absence is stale"


@pytest.mark.timeout(60)
def test_a_lone_primary_applies_only_under_its_etcd_claim_and_is_taken_over_once_it_ends(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A primary without a standby (in this process, over a real etcd) applies only while it holds
    its claim's etcd lease; a takeover conditioned on that claim loses while it is held. When etcd
    ends the lease (what it does to a primary frozen or cut off past the TTL; revoked here), the
    primary stops applying and steps down, and the takeover wins. A primary whose view moved on
    before it took its claim never holds one."""
    address = parse_store_address(etcd.url("claim"))
    store = open_store(address, timeout_s=5.0)
    monkeypatch.setattr(group, "_etcd", store)  # what joining through etcd sets (shard_claim reads it)
    registry, claimer = Registry(store), Registry(open_store(address, timeout_s=5.0))
    record = registry.change_view(0, registry.read_view(0), View(1, "ps0_r1"))
    assert record is not None
    stepped: list[str] = []
    primary = _lone_primary(registry, record, stepped)
    claim = primary._claim
    assert claim is not None and claim.ttl_s == 3
    assert primary.lease() is None, "no apply before its claim is held"
    claim.start()
    wait_until(claim.held, 10, "the claim to be held")
    assert primary.lease() is not None and not claimer.claim_ended(0, "ps0_r1")
    assert claimer.change_view(0, claimer.read_view(0), View(2, "ps0_r2"), unclaimed_by="ps0_r1") is None
    store.client.revoke(claim._lease)
    wait_until(lambda: claim.ended, 10, "the primary to find its lease ended at its next renewal")
    assert primary.lease() is None
    primary._keep_once()
    assert primary.server.deposed and len(stepped) == 1 and "etcd lease ended" in stepped[0]
    assert claimer.claim_ended(0, "ps0_r1")
    assert claimer.change_view(0, claimer.read_view(0), View(2, "ps0_r2"), unclaimed_by="ps0_r1") is not None
    late = _lone_primary(registry, record, stepped)  # serving a view that is no longer the shard's
    assert late._claim is not None
    late._claim.start()
    wait_until(lambda: late._claim is not None and late._claim.ended, 10, "the stale primary's claim to be refused")
    assert late.lease() is None and claimer.claim_ended(0, "ps0_r1")


def _lone_primary(registry: Registry, record: ViewRecord, stepped: list[str]) -> Primary:
    return Primary(
        FakeServer(), registry, 0, record.view.primary, record, ReplicationConfig(replicas=2, store_lease_s=3.0),  # type: ignore[arg-type]
        ReplicationMetrics(CollectorRegistry(), 2), {}, None, on_step_down=stepped.append,
    )


def _control_flags() -> tuple[str, tuple[str, ...]]:
    """A control address on a free loopback port, and the server flags that bind it."""
    port = free_port()
    return f"127.0.0.1:{port}", ("--control-addr", "127.0.0.1", "--control-port", str(port))


def _start_pair(
    procs: ProcessGroup, tmp_path: Path, url: str, *extra: str
) -> tuple[tuple[str, ...], list[tuple[Proc, int]], dict[int, str]]:
    """Two replicas of shard 0 joined through etcd, the second in sync, both with flags ``extra`` too.
    Returns (their flags, [(process, metrics port)] primary first, {metrics port: control address})."""
    common = ("--store", url, "--replicas", "2", "--audit-log", str(tmp_path / "audit.log"), "--digest-every", "10",
              "--lease-s", "3", *extra)
    (control_a, flags_a), (control_b, flags_b) = _control_flags(), _control_flags()
    pair = start_replica_pair(procs, common, flags_a, flags_b)
    return common, pair, {pair[0][1]: control_a, pair[1][1]: control_b}


def _kill_primary_and_replace(
    procs: ProcessGroup, common: tuple[str, ...], pair: list[tuple[Proc, int]], controls: dict[int, str], name: str
) -> tuple[tuple[float, int], list[tuple[Proc, int]]]:
    """kill -9 of the primary 100 updates from now. Once the promoted standby has applied an update,
    training is held with the control plane's pause (called in this process) while a new replica
    starts in the dead one's place and catches up, then resumed: the workers cannot finish before the
    next kill, however slow the machine is at starting an interpreter. Returns ((when, pid) of the
    kill, the new pair, primary first)."""
    (primary, mp), (standby, ms) = pair
    target = _version(mp) + 100
    wait_until(lambda: _version(mp) >= target or not primary.alive(), 90, "100 more updates before the kill")
    assert primary.alive(), primary.tail()
    killed = (time.time(), primary.pid)
    primary.kill()
    wait_until(lambda: _scrape(ms, "rpcps_replica_role") == 2, 30, "the standby to promote itself")
    promoted_at = _version(ms)
    wait_until(lambda: _version(ms) > promoted_at, 30, "the promoted standby's first update")
    control.pause(controls[ms])
    address, flags = _control_flags()
    again, _, mr = procs.ps(name, *common, *flags)
    controls[mr] = address
    wait_until(lambda: _scrape(ms, "rpcps_replica_standby_in_sync") == 1 or not again.alive(), 90, "the new standby to be in sync")
    assert again.alive(), again.tail()
    control.resume(controls[ms])
    return killed, [(standby, ms), (again, mr)]


@pytest.mark.timeout(300)
def test_training_through_etcd_survives_kills_of_the_primary_exactly(procs: ProcessGroup, tmp_path: Path, etcd: EtcdCluster) -> None:
    """No coordinator process: servers and workers rendezvous, take ranks and find each shard's view
    in etcd. kill -9 of whichever replica is primary, three times, each once its restarted peer is
    back in sync: the standby promotes itself through an etcd transaction on the view; the ledger holds
    one history, equal digests, and the final version is workers x steps (training is held with
    the control plane's pause while each replacement joins and catches up, so three kills fit on any machine)."""
    url = etcd.url("train")
    common, pair, controls = _start_pair(procs, tmp_path, url)
    workers = [procs.worker(f"w{i}", url, i, 2, "--steps", "1500", *PACED)[0] for i in range(2)]
    kills: list[tuple[float, int]] = []
    for round_ in range(3):
        killed, pair = _kill_primary_and_replace(procs, common, pair, controls, f"ps_{round_}")
        kills.append(killed)
    assert [w.wait(180) for w in workers] == [0, 0], procs.tails()
    (_, mlast), _ = pair
    assert _version(mlast) == 3000
    for proc, _ in pair:
        proc.send(15)
        proc.wait(60)
    report = check_ledger(tmp_path / "audit.log")
    assert report.problems == [], report.problems[:5]
    assert report.final_version == 3000
    assert [epoch for _, epoch, _, _ in report.promotions][:3] == [2, 3, 4]
    assert report.digests_compared > 0
    recovery = [recovery_after(report, at, pid) for at, pid in kills]
    assert None not in recovery, recovery
    median = statistics.median(r for r in recovery if r is not None)
    print(f"etcd store, kill -9 of the primary -> next applied update: median {median:.3f}s over {recovery}")
    assert median <= 1.0


@pytest.mark.timeout(300)
def test_a_kill_of_the_etcd_leader_during_training_pauses_nothing_and_loses_no_failover(
    procs: ProcessGroup, tmp_path: Path, etcd: EtcdCluster
) -> None:
    """kill -9 of the etcd leader while a replicated job trains, then kill -9 of the primary while
    the cluster runs on two members: updates never stop for more than 2 s, the failover happens
    (epoch 2), and the ledger is exact."""
    url = etcd.url("leader")
    _, [(a, ma), (b, mb)], _ = _start_pair(procs, tmp_path, url)
    workers = [procs.worker(f"w{i}", url, i, 2, "--steps", "400", *PACED)[0] for i in range(2)]
    wait_until(lambda: _version(ma) >= 100, 90, "100 updates")
    leader = etcd.leader()
    assert leader is not None and leader.proc is not None
    leader_killed_at = time.time()
    leader.proc.kill()
    wait_until(lambda: _version(ma) >= 300 or not a.alive(), 90, "300 updates with two etcd members")
    killed_at = time.time()
    a.kill()
    assert [w.wait(180) for w in workers] == [0, 0], procs.tails()
    assert _version(mb) == 800 and _scrape(mb, "rpcps_replica_epoch") == 2
    b.send(15)
    b.wait(60)
    report = check_ledger(tmp_path / "audit.log")
    assert report.problems == [] and report.final_version == 800, report.problems[:5]
    applies = sorted(t for t, _ in report.applies if t > leader_killed_at - 1)
    longest = max(later - earlier for earlier, later in itertools.pairwise(applies))
    recovery = recovery_after(report, killed_at, a.pid)
    print(f"etcd leader killed: longest pause between two applied updates {longest:.3f}s; primary failover {recovery}")
    assert longest <= 2.0


@pytest.mark.timeout(240)
def test_local_with_an_etcd_store_starts_no_coordinator(procs: ProcessGroup, tmp_path: Path, etcd: EtcdCluster) -> None:
    """``rpcps local --store etcd://... --replicas 2``: two server processes and the workers, all
    joined through etcd, no ``rpcps store``; every step applied once, nothing restarted, and the
    job's keys are under its prefix in etcd."""
    url = etcd.url("local")
    summary = tmp_path / "summary.json"
    local = procs.start("local", ["local", "--store", url, "--replicas", "2", "--workers", "2", "--steps", "100",
                                  "--run-dir", tmp_path / "run", "--summary-json", summary, "--audit-log", tmp_path / "audit.log"])
    assert local.wait(200) == 0, local.tail()
    assert f"store in {url}" in local.stdout() + local.stderr()
    result = json.loads(summary.read_text())
    assert result["updates_applied"] == 200
    assert result["restarts"] == {"ps": 0, "ps_b": 0, "worker0": 0, "worker1": 0}
    assert result.get("store") is None and not (tmp_path / "run" / "store.summary.json").exists()
    report = check_ledger(tmp_path / "audit.log")
    assert report.problems == [] and report.final_version == 200, report.problems[:5]
    store = open_store(parse_store_address(url), timeout_s=5.0)
    assert Registry(store).shard_count() == 1 and store.num_keys() > 0


@pytest.mark.slow  # a 5 s freeze inside a 20-30 s run on 2 cores: CI's slow pass
@pytest.mark.timeout(300)
def test_a_frozen_primary_is_fenced_through_etcd(procs: ProcessGroup, tmp_path: Path, etcd: EtcdCluster) -> None:
    """SIGSTOP of the primary for 5 s: the standby promotes itself through an etcd transaction after
    its lease; the thawed primary's lease has run out, so it applies nothing more, finds the newer
    view in etcd, steps down and comes back as the new primary's standby. One primary at a time (the
    ledger), exact final version."""
    url = etcd.url("frozen")
    _, [(a, ma), (b, mb)], _ = _start_pair(procs, tmp_path, url)
    workers = [procs.worker(f"w{i}", url, i, 2, "--steps", "500", *PACED)[0] for i in range(2)]
    wait_until(lambda: _version(ma) >= 150, 90, "150 updates")
    freeze_past_promotion(a, mb)
    assert [w.wait(180) for w in workers] == [0, 0], procs.tails()
    assert _version(mb) == 1000
    wait_until(lambda: _scrape(ma, "rpcps_replica_role") == 1, 60, "the old primary to return as an in-sync standby")
    for proc in (a, b):
        proc.send(15)
        proc.wait(60)
    report = check_ledger(tmp_path / "audit.log")
    assert report.problems == [] and report.final_version == 1000, report.problems[:5]
    assert [epoch for _, epoch, _, _ in report.promotions][:1] == [2]
    assert [epoch for _, epoch, _ in report.stepdowns] == [1], report.stepdowns


@pytest.mark.timeout(240)
def test_over_tls_with_client_certificates_a_job_trains_and_a_client_without_them_is_refused(
    procs: ProcessGroup, tmp_path: Path, etcd_tls: EtcdCluster
) -> None:
    """``--store etcd://...?cacert=FILE&cert=FILE&key=FILE``: every child of ``local`` (the server, the
    workers, torch's rendezvous) reaches etcd over TLS with its client certificate; a client in
    plaintext, or over TLS without a certificate, gets nothing from the cluster."""
    url = etcd_tls.url("tls")
    summary = tmp_path / "summary.json"
    local = procs.start("local", ["local", "--store", url, "--workers", "2", "--steps", "50", "--run-dir", tmp_path / "run",
                                  "--summary-json", summary])
    assert local.wait(200) == 0, local.tail()
    assert json.loads(summary.read_text())["updates_applied"] == 100
    assert open_store(parse_store_address(url), timeout_s=5.0).num_keys() > 0
    plaintext, without_certificate = url.partition("?")[0], etcd_tls.url("tls", client_certificate=False)
    with pytest.raises(dist.DistStoreError, match=r"did not answer .*if etcd serves TLS on that port, give the URL its CA"):
        open_store(parse_store_address(plaintext), timeout_s=1.0).num_keys()
    with pytest.raises(dist.DistStoreError, match=r"did not answer .*the TLS handshake failed: .* cert= and key="):
        open_store(parse_store_address(without_certificate), timeout_s=1.0).num_keys()


@pytest.mark.timeout(240)
def test_after_a_kill_of_every_process_the_job_restarts_from_its_checkpoint_through_the_same_etcd_keys(
    procs: ProcessGroup, tmp_path: Path, etcd: EtcdCluster
) -> None:
    """kill -9 of the server and both workers at once leaves them all listed in the group's member list
    in etcd, and no process is left to remove them. Started again on the same prefix, the server and
    the workers join (each join prunes the members whose etcd liveness key ended) and the job finishes
    from the server's checkpoint."""
    url = etcd.url("restart")
    server_args = ("--store", url, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every-updates", "20")
    server, _, metrics = procs.ps("ps", *server_args)
    workers = [procs.worker(f"w{i}", url, i, 2, "--steps", "150", *PACED)[0] for i in range(2)]
    wait_until(lambda: _version(metrics) >= 60 or not server.alive(), 90, "60 updates")
    for proc in (server, *workers):
        proc.kill()
    restarted_at = time.monotonic()
    again, _, metrics = procs.ps("ps_again", *server_args)
    workers = [procs.worker(f"w{i}_again", url, i, 2, "--steps", "150", *PACED)[0] for i in range(2)]
    assert [w.wait(150) for w in workers] == [0, 0], procs.tails()
    print(f"a job started again on its etcd prefix after kill -9 of every process finished in {time.monotonic() - restarted_at:.1f}s")
    assert _version(metrics) == 300, again.tail()
    # Each join drops the dead it finds (one join may find them all, or several a few each, as their
    # keys end): together the joins dropped the killed server and both killed workers.
    logs = "".join(p.stderr() for p in (again, *workers))
    dropped = {n for names in re.findall(r"dropped \d+ members whose processes are gone from the group's member list: \[(.*)\]", logs)
               for n in re.findall(r"'(\w+)_r\d+'", names)}
    assert dropped == {"ps0", "worker0", "worker1"}, procs.tails()
    again.send(15)
    assert again.wait(60) == 0, again.tail()


@pytest.mark.slow  # a 6-7 s freeze inside a 30-40 s run: CI's slow pass
@pytest.mark.timeout(300)
def test_a_lone_primary_fenced_by_its_etcd_claim_restarts_and_its_workers_rejoin_and_finish_exactly(
    procs: ProcessGroup, tmp_path: Path, etcd: EtcdCluster
) -> None:
    """kill -9 of the standby, then SIGSTOP of the primary, now alone, past its claim's lease: thawed,
    it applies nothing more, steps down, writes its exact state and restarts from it, while its workers,
    having lost it, rejoin. No other server is joined to clean up after the joins that fail meanwhile
    (a listed member that just died, a token held by a failed join): each join does it. The job
    finishes at workers x steps with one history."""
    url = etcd.url("lone")
    _, [(a, ma), (b, _)], _ = _start_pair(procs, tmp_path, url, "--store-lease-s", "3")  # its claim's etcd lease
    workers = [procs.worker(f"w{i}", url, i, 2, "--steps", "400", *PACED)[0] for i in range(2)]
    wait_until(lambda: _version(ma) >= 100, 90, "100 updates")
    b.kill()
    wait_until(lambda: _scrape(ma, "rpcps_replica_standby_in_sync") == 0, 30, "the primary to drop its dead standby")
    alone_at = _version(ma)
    wait_until(lambda: _version(ma) >= alone_at + 20, 30, "20 updates alone (under its etcd claim)")
    a.freeze()
    thaw_at = time.monotonic() + 6  # the claim's lease is 3 s
    wait_until(lambda: time.monotonic() >= thaw_at, 10, "6 s of freeze")  # the fault's duration, not a sync
    a.thaw()
    assert [w.wait(180) for w in workers] == [0, 0], procs.tails()
    assert re.search(r"stepped down with no standby: wrote the exact state", a.stderr()), a.tail()
    a.send(15)
    assert a.wait(60) == 0, a.tail()
    report = check_ledger(tmp_path / "audit.log")
    assert report.problems == [] and report.final_version == 800, report.problems[:5]


@pytest.mark.slow  # a 6-7 s freeze inside a 30-40 s run: CI's slow pass
@pytest.mark.timeout(240)
def test_a_member_dropped_as_gone_while_frozen_puts_itself_back_in_the_member_list(
    procs: ProcessGroup, tmp_path: Path, etcd: EtcdCluster
) -> None:
    """A worker frozen past its liveness key's TTL looks gone: the next join drops it from the member
    list (joins then would not call it). Thawed, it takes its key again and puts itself back in the
    list; both workers finish, every step applied once."""
    url = etcd.url("relist")
    server, _, metrics = procs.ps("ps", "--store", url)
    w0, _ = procs.worker("w0", url, 0, 2, "--steps", "400", *PACED, env=child_env(**{INTERVAL_ENV: "0.05"}))
    registered = wait_until(lambda: re.search(r"worker slot 0 registered as (worker0_r\d+)", server.stderr()), 60, "w0 to register")
    name = registered[1]
    store = open_store(parse_store_address(url), timeout_s=5.0)
    members = "rpc_prefix_0/names/_ALL_WORKER_INFOS"  # torch's member list (rpcps.transport.membership)
    wait_until(lambda: _version(metrics) >= 20, 60, "20 updates")
    w0.freeze()
    wait_until(lambda: not store.check([f"rpcps/alive/{name}"]), 20, "the frozen worker's liveness key to end")
    w1, _ = procs.worker("w1", url, 1, 2, "--steps", "50", *PACED)
    wait_until(lambda: f"dropped 1 members whose processes are gone from the group's member list: ['{name}']" in w1.stderr()
               or not w1.alive(), 60, "the next join to drop the frozen worker")
    assert name not in store.get(members).decode(), store.get(members)
    w0.thaw()
    wait_until(lambda: f"{name}-" in store.get(members).decode(), 20, "the thawed worker back in the member list")
    assert [w.wait(120) for w in (w0, w1)] == [0, 0], procs.tails()
    assert _version(metrics) == 450
