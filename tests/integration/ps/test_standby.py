"""Hot standby (``--replicas 2``): a shard's second server process follows its primary's log and
takes over when the primary dies. Real processes on 127.0.0.1; the audit ledger (both replicas
write one file) is the proof.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness import control as control_plane
from harness.faults import ChaosPlan, FailPoint, Kill, run_chaos
from harness.ledger import check_ledger, recovery_after
from harness.procs import (
    ENTRY,
    REPO,
    Proc,
    ProcessGroup,
    child_env,
    free_port,
    freeze_past_promotion,
    start_replica_pair,
    try_scrape,
    wait_until,
)
from tests.integration.paced_data import INTERVAL_ENV

pytestmark = pytest.mark.integration

PACED = ("--data", "tests.integration.paced_data:paced_data")


def _scrape(port: int, key: str) -> float:
    return try_scrape(port).get(key, -1)


def _start_pair(
    procs: ProcessGroup, tmp_path: Path, *extra: str, control: str | None = None, store_lease_s: float = 3.0
) -> tuple[int, list[tuple[Proc, int]]]:
    """A coordinator and two replicas of shard 0, the second in the view as standby. Returns (store
    port, [(process, metrics port)] primary first). ``control``: the primary's control-plane address."""
    _store, port, _ = procs.store("store", "--lease-s", str(store_lease_s))
    common = ("--store", f"127.0.0.1:{port}", "--replicas", "2", "--audit-log", str(tmp_path / "audit.log"),
              "--digest-every", "10", *extra)
    own = ("--control-port", control.rsplit(":", 1)[1]) if control is not None else ()
    [(a, ma), (b, mb)] = start_replica_pair(procs, common, own)
    wait_until(lambda: _scrape(mb, "rpcps_replica_role") == 1, 10, "ps_b to report itself an in-sync standby")
    return port, [(a, ma), (b, mb)]


@pytest.mark.timeout(240)
def test_a_standby_applies_every_update_bit_identically(procs: ProcessGroup, tmp_path: Path) -> None:
    """Synchronous replication: every version the primary applied, the standby applied with the same
    (slot, step)s, and their digests (parameters + optimizer state + version) agree every 10 versions."""
    port, [(a, ma), (b, mb)] = _start_pair(procs, tmp_path)
    workers = [procs.worker(f"w{i}", port, i, 2, "--steps", "150", *PACED)[0] for i in range(2)]
    assert [w.wait(150) for w in workers] == [0, 0], procs.tails()
    wait_until(lambda: _scrape(mb, "rpcps_server_model_version") == 300, 30, "the standby to apply version 300")
    assert _scrape(ma, "rpcps_server_model_version") == 300
    for proc in (a, b):
        proc.send(15)
    assert a.wait(60) == 0, a.tail()
    b.wait(60)
    report = check_ledger(tmp_path / "audit.log")
    assert report.problems == [], report.problems[:5]
    assert report.final_version == 300
    assert report.mirrored == 300, "the standby applied every update"
    assert report.digests_compared >= 29, f"compared {report.digests_compared} digests"


@pytest.mark.timeout(240)
def test_kill_9_of_the_primary_loses_nothing_and_applies_nothing_twice(procs: ProcessGroup, tmp_path: Path) -> None:
    """The standby notices the crash, promotes itself (epoch 1 -> 2) and serves; the workers resend
    what was not acknowledged. The ledger proves one history: versions 1..N once each, every
    (slot, step) once, and the final version is workers x steps.

    On defaults (Adam, async) with the default staleness remedy: pulls are moved ahead by weight
    prediction (ps.core.prediction) on the primary and, after the kill, on the promoted standby; it
    changes only what pulls send, so the digests (parameters + optimizer state + version) the two
    replicas wrote for the same version still agree."""
    port, [(a, ma), (b, mb)] = _start_pair(procs, tmp_path)
    workers = [procs.worker(f"w{i}", port, i, 2, "--steps", "400", *PACED)[0] for i in range(2)]
    wait_until(lambda: _scrape(ma, "rpcps_server_model_version") >= 150 and _scrape(ma, "rpcps_server_prediction_ahead_updates") > 0,
               90, "150 updates with predicted pulls")
    killed_at = time.time()
    a.kill()
    wait_until(lambda: _scrape(mb, "rpcps_server_prediction_ahead_updates") > 0, 60, "the promoted standby to predict its pulls")
    assert [w.wait(180) for w in workers] == [0, 0], procs.tails()
    assert _scrape(mb, "rpcps_server_model_version") == 800
    assert _scrape(mb, "rpcps_replica_role") == 2 and _scrape(mb, "rpcps_replica_epoch") == 2
    assert _scrape(mb, "rpcps_replica_failovers_total") == 1
    b.send(15)
    b.wait(60)
    report = check_ledger(tmp_path / "audit.log")
    assert report.problems == [], report.problems[:5]
    assert report.final_version == 800
    assert report.digests_compared >= 10, f"compared {report.digests_compared} digests"
    assert [p[1] for p in report.promotions][:1] == [2]
    recovery = recovery_after(report, killed_at, a.pid)
    assert recovery is not None
    print(f"kill -> next applied update: {recovery:.3f}s")


@pytest.mark.timeout(240)
def test_a_worker_the_primary_removed_stays_removed_after_a_failover(
    procs: ProcessGroup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The removal is replicated: a hand-driven worker on slot 2 is frozen until the primary's reaper
    removes it (silent past --lease-s 2); kill -9 of the primary; once thawed, the same incarnation
    is refused by the new primary with WorkerRemoved, and the two real workers' history is exact.
    (The coordinator's own lease is long, so the frozen member stays in the RPC group.)"""
    monkeypatch.setenv(INTERVAL_ENV, "0.02")
    port, [(a, ma), (b, mb)] = _start_pair(procs, tmp_path, "--lease-s", "2", store_lease_s=120.0)
    workers = [procs.worker(f"w{i}", port, i, 2, "--steps", "600", *PACED)[0] for i in range(2)]
    client = procs.start("removed", [str(REPO / "tests/integration/ps/rpc_client.py"), f"127.0.0.1:{port}", "removed_then_failover"],
                         script=None)
    wait_until(lambda: "registered" in client.stdout() or not client.alive(), 60, "the hand-driven worker to register")
    client.freeze()
    removed = 'rpcps_server_workers_removed_total{why="dead"}'
    wait_until(lambda: _scrape(ma, removed) >= 1, 30, "the primary's reaper to remove the frozen worker")
    # The primary counts a removal when it sequences it; the guarantee holds for one its standby
    # applied (a primary killed before that dies with it, and its successor's reaper removes the
    # worker itself). The standby lists slot 2 live from its replicated push until then.
    slot_2 = 'rpcps_server_worker_last_push_age_seconds{slot="2"}'
    wait_until(lambda: slot_2 not in try_scrape(mb), 30, "the standby to apply the removal")
    a.kill()
    wait_until(lambda: _scrape(mb, "rpcps_replica_role") == 2, 30, "the standby to take over")
    client.thaw()
    assert client.wait(120) == 0, client.tail()
    outcome = json.loads(client.stdout().splitlines()[-1])
    assert outcome["first_push"]["raised"] == "", outcome
    assert outcome["epoch"] == 2 and outcome["after_failover"]["raised"] == "WorkerRemoved", outcome
    assert "was removed from this server; register again" in outcome["after_failover"]["message"]
    assert [w.wait(180) for w in workers] == [0, 0], procs.tails()
    assert _scrape(mb, "rpcps_server_model_version") == 1201  # 2 x 600 steps, and the removed worker's step 0 once
    b.send(15)
    b.wait(60)
    report = check_ledger(tmp_path / "audit.log")
    assert report.problems == [], report.problems[:5]
    assert report.final_version == 1201


@pytest.mark.slow  # a fault run of 20-25 s on 2 cores: CI runs it in its slow pass
@pytest.mark.timeout(240)
def test_a_frozen_primary_never_applies_again_and_comes_back_as_standby(procs: ProcessGroup, tmp_path: Path) -> None:
    """SIGSTOP of the primary for 5 s: the standby promotes after its lease (1.5 s of silence). On
    SIGCONT the old primary's lease has run out, so it applies and answers nothing; it learns of the
    newer epoch, steps down, restarts itself and attaches to the new primary as its standby. The
    ledger proves exactly one primary applied at any time, and the history is exact. 700 steps per
    worker keep training going past the thaw, so the old primary has pushes it could wrongly apply."""
    port, [(a, ma), (b, mb)] = _start_pair(procs, tmp_path)
    workers = [procs.worker(f"w{i}", port, i, 2, "--steps", "700", *PACED)[0] for i in range(2)]
    wait_until(lambda: _scrape(ma, "rpcps_server_model_version") >= 150, 90, "150 updates")
    freeze_past_promotion(a, mb)
    assert [w.wait(180) for w in workers] == [0, 0], procs.tails()
    assert _scrape(mb, "rpcps_server_model_version") == 1400
    wait_until(lambda: _scrape(ma, "rpcps_replica_role") == 1, 60, "the old primary to return as an in-sync standby")
    assert a.alive()
    for proc in (a, b):
        proc.send(15)
    b.wait(60)
    a.wait(60)
    report = check_ledger(tmp_path / "audit.log")
    assert report.problems == [], report.problems[:5]
    assert report.final_version == 1400
    assert [epoch for _, epoch, _, _ in report.promotions][:1] == [2]
    assert [epoch for _, epoch, _ in report.stepdowns] == [1], report.stepdowns


@pytest.mark.timeout(240)
def test_local_with_two_replicas_runs_a_coordinator_and_a_standby(tmp_path: Path) -> None:
    """``rpcps local --replicas 2``: the coordinator, two server processes, the workers; the run ends
    with every step applied once and nothing restarted."""
    summary = tmp_path / "summary.json"
    done = subprocess.run(
        [sys.executable, str(ENTRY), "local", "--replicas", "2", "--workers", "2", "--steps", "100",
         "--run-dir", str(tmp_path / "run"), "--summary-json", str(summary), "--audit-log", str(tmp_path / "audit.log"),
         "--digest-every", "20"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=200, check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(summary.read_text())
    assert result["updates_applied"] == 200
    assert result["restarts"] == {"store": 0, "ps": 0, "ps_b": 0, "worker0": 0, "worker1": 0}
    # The coordinator's summary is a file of its own: local's --summary-json is local's alone.
    assert result["role"] == "local" and result["store"]["role"] == "store", result.get("store")
    report = check_ledger(tmp_path / "audit.log")
    assert report.problems == [] and report.final_version == 200, report.problems[:5]


@pytest.mark.slow  # over 40 s on 2 cores: CI runs it in its slow pass
@pytest.mark.timeout(480)
def test_ten_kills_of_the_primary_in_one_run_lose_nothing_and_recover_within_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's fault run: ``local --replicas 2``, 2 workers, the built-in task; kill -9 of
    whichever process is primary, 10 times, each once the restarted one is back in sync. The ledger:
    one history (versions never go back, no step applied twice, final version workers x steps),
    digests equal; recovery (kill -> next update applied by another process) <= 1 s at the median
    and <= 2 s at worst."""
    # ~50 updates/s. Each kill waits for the restarted replica to be back in sync (a fresh interpreter
    # importing torch: 3-6 s on a loaded 2-core machine); run_chaos holds training with the servers'
    # pause meanwhile, so every kill fires before the end however slow the start-ups (with 1600 steps
    # and no hold, a loaded run once ended before the tenth).
    monkeypatch.setenv(INTERVAL_ENV, "0.04")
    kills = tuple(Kill("primary", v) for v in range(200, 2200, 200))
    # Two pushes in flight per worker (the default is one): a kill then lands with pushes a dead
    # primary may or may not have applied, which the successor must resolve exactly once each.
    plan = ChaosPlan(workers=2, steps=2400, replicas=2, kills=kills, timeout_s=420,
                     extra_args=(*PACED, "--digest-every", "25", "--max-in-flight", "2"))
    result = run_chaos(plan, tmp_path / "run")
    assert result.problems(plan) == [], (result.problems(plan)[:5], result.notes)
    ledger = result.ledger
    assert len(result.recovery_s) == 10
    median, worst = statistics.median(result.recovery_s), max(result.recovery_s)
    print(f"recovery over 10 kills: median {median:.3f}s, worst {worst:.3f}s: {[round(r, 3) for r in result.recovery_s]}; "
          f"{ledger.mirrored} updates mirrored, {ledger.digests_compared} digests compared")
    assert [epoch for _, epoch, _, _ in ledger.promotions] == list(range(2, 12))
    # Each kill fires as soon as the restarted replica is back in sync, so standbys mirror only a
    # share of the run; every digest two replicas wrote for one version was compared (and agreed).
    assert ledger.mirrored > 0 and ledger.digests_compared > 0
    assert median <= 1.0 and worst <= 2.0


@pytest.mark.timed  # the longest stall after the kill
@pytest.mark.timeout(240)
def test_a_killed_standby_is_dropped_and_a_new_one_catches_up(
    procs: ProcessGroup, tmp_path: Path, wall_clock_bound: Callable[[float, float], float]
) -> None:
    """kill -9 of the standby: the primary drops it from the view and goes on alone (training pauses
    for at most about a second); a standby started afresh copies the live state, follows the log
    while the workers train, and is handed into the view again; digests agree from then on.

    Training is held with the control plane's pause (a log entry, so it holds every push) wherever
    the test needs it not to have ended: while the new standby's process starts (a fresh interpreter
    importing torch takes seconds on a loaded machine, as long as the whole rest of the run), and
    for its hand-over. Between the two, the workers train while the standby follows the log."""
    control = f"127.0.0.1:{free_port()}"
    port, [(a, ma), (b, _)] = _start_pair(procs, tmp_path, control=control)
    workers = [procs.worker(f"w{i}", port, i, 2, "--steps", "700", *PACED)[0] for i in range(2)]
    wait_until(lambda: _scrape(ma, "rpcps_server_model_version") >= 150, 90, "150 updates")
    killed_at = time.time()
    b.kill()
    wait_until(lambda: _scrape(ma, "rpcps_replica_standby_in_sync") == 0, 10, "the primary to drop its standby")
    assert _scrape(ma, "rpcps_replica_standby_drops_total") == 1
    dropped_at = _scrape(ma, "rpcps_server_model_version")
    wait_until(lambda: _scrape(ma, "rpcps_server_model_version") >= dropped_at + 20, 30, "the primary to go on alone")
    held_at = control_plane.pause(control)
    c, _, mc = procs.ps("ps_c", "--store", f"127.0.0.1:{port}", "--replicas", "2", "--audit-log", str(tmp_path / "audit.log"),
                        "--digest-every", "10")
    wait_until(lambda: _scrape(mc, "rpcps_server_model_version") == held_at or not c.alive(), 60, "the new standby to copy the state")
    assert c.alive(), c.tail()
    control_plane.resume(control)
    # Entries reach the catching-up standby while the workers train; then the hand-over is held.
    wait_until(lambda: _scrape(ma, "rpcps_server_model_version") >= held_at + 100, 60, "100 updates after the copy")
    control_plane.pause(control)
    wait_until(lambda: _scrape(ma, "rpcps_replica_standby_in_sync") == 1 or not c.alive(), 60, "the new standby to be in sync")
    assert c.alive(), c.tail()
    handed_over_at = control_plane.resume(control)
    assert handed_over_at < 1400, "the new standby joined while training ran"
    assert [w.wait(180) for w in workers] == [0, 0], procs.tails()
    assert _scrape(ma, "rpcps_server_model_version") == 1400 and _scrape(ma, "rpcps_replica_role") == 2
    for proc in (c, a):
        proc.send(15)
    c.wait(60)
    a.wait(60)
    report = check_ledger(tmp_path / "audit.log")
    assert report.problems == [], report.problems[:5]
    assert report.final_version == 1400
    assert report.mirrored >= 1400 - held_at, "the new standby applied every update after the state it copied"
    # The gaps that tell how long the standby's death stalled training: from the kill to the first pause.
    alone = [t for t, v in report.applies if t > killed_at and v <= held_at]
    gaps = [second - first for first, second in itertools.pairwise(alone)]
    print(f"longest gap between applied updates after the standby's kill: {max(gaps):.3f}s")
    assert max(gaps) <= wall_clock_bound(1.5, 10.0)


@pytest.mark.slow  # 7 processes on 2 cores: over 40 s
@pytest.mark.timeout(420)
def test_two_shards_each_with_a_standby_survive_a_kill_of_each_primary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``local --shards 2 --replicas 2``: a pair per shard. kill -9 of shard 1's primary, then of
    shard 0's: each shard's ledger keeps one history (nothing lost, nothing applied twice, final
    version workers x steps on both) and each failover resumes within the issue's 2 s bound."""
    monkeypatch.setenv(INTERVAL_ENV, "0.04")
    kills = (Kill("primary1", 200), Kill("primary", 500))
    plan = ChaosPlan(workers=2, steps=600, shards=2, replicas=2, kills=kills, extra_args=(*PACED, "--digest-every", "25"),
                     timeout_s=360)
    result = run_chaos(plan, tmp_path / "run")
    assert result.problems(plan) == [], (result.problems(plan)[:5], result.notes)
    print(f"recovery: shard 1 {result.recovery_s[0]:.3f}s, shard 0 {result.recovery_s[-1]:.3f}s")
    assert len(result.recovery_s) == 2 and max(result.recovery_s) <= 2.0, result.recovery_s
    for shard in result.shard_ledgers:
        assert [epoch for _, epoch, _, _ in shard.promotions] == [2], shard.promotions


@pytest.mark.slow  # a fault run of 20-25 s on 2 cores: CI runs it in its slow pass
@pytest.mark.timeout(360)
def test_async_replication_keeps_the_standby_within_its_lag_and_a_failover_recomputes_what_it_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``local --replicas 2 --replication async --max-replica-lag 2``; the primary is killed -9 twice:
    once the moment it has answered pushes while its standby lacks 2 of its applied entries (a fail
    point: the worst moment this mode allows), once at version 400. The primary never reports more
    than 2 applied entries its standby lacks (sampled each poll); the ledger allows a promotion at
    most 2 versions behind the dead primary and checks that no step is twice in the history that
    survived and that digests agree; every acknowledged step a failover lost is recomputed by its
    worker (and every unacknowledged one resent), so the final version is still workers x steps."""
    # The fail point can fire within the first few versions; the replacement standby then needs
    # ~6 s to start on a loaded 2-core machine. At 50 steps/s per worker the whole run took 6.3 s
    # and no digest was ever compared (a CI failure); at 25 it lasts ~12 s and the standby mirrors
    # the versions before the second kill (which waits for it to be in sync).
    monkeypatch.setenv(INTERVAL_ENV, "0.04")
    lag = 2
    # Left to the scheduler, the standby fell 2 entries behind in about half the runs on 2 cores: the
    # in-view standby holds its acknowledgements for 0.5 s (less than the 1 s after which a primary
    # drops it) from its 10th append with entries, so the primary reaches the moment (2 pushes at
    # 50/s) and the fail point kills it there.
    hold = FailPoint("replication.standby_before_ack", 10, hold_s=0.5)
    plan = ChaosPlan(workers=2, steps=300, replicas=2, kills=(hold, FailPoint("replication.at_max_lag", 1), Kill("primary", 400)),
                     extra_args=(*PACED, "--digest-every", "10"), timeout_s=200, max_replica_lag=lag)
    run_dir = tmp_path / "run"
    result = run_chaos(plan, run_dir)
    problems = result.problems(plan)
    assert problems == [], (problems[:5], result.notes)
    ledger = result.ledger
    assert 0 <= result.worst_unreplicated <= lag
    assert len(ledger.promotions) == 2 and all(0 <= lost <= lag for lost in ledger.failover_losses), ledger.failover_losses
    assert ledger.mirrored > 0 and ledger.digests_compared > 0
    recomputed = sum(log.read_text().count("lost with the old primary") for log in run_dir.glob("worker*.log"))
    print(f"async, lag <= {lag}: worst unreplicated seen {result.worst_unreplicated:.0f}, versions lost per failover "
          f"{ledger.failover_losses}, workers' log lines on recomputing lost steps {recomputed}, "
          f"recovery {[round(r, 3) for r in result.recovery_s]}")
