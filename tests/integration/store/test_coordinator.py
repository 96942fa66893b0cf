"""The group's store in a process of its own (``rpcps store``): servers join it under fresh names and
claim their shard's view; workers find shards through the views; no server's death touches joins.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.ledger import check_ledger, first_apply_after
from harness.procs import Proc, ProcessGroup, child_env, free_port, start_replica_pair, try_scrape, wait_until
from tests.integration.conftest import model_version as version
from tests.integration.conftest import read_json, run_ctl

pytestmark = pytest.mark.integration

PACED = ("--data", "tests.integration.paced_data:paced_data")


@pytest.mark.timeout(240)
def test_a_killed_shard_is_taken_over_without_touching_the_other_shard(procs: ProcessGroup, tmp_path: Path) -> None:
    """Before the coordinator, shard 0 hosted the store: its death restarted every other shard and
    every worker. Now shard 1 never notices; a new shard-0 process joins while the dead one's
    workers are away, takes the shard over from its snapshot (view epoch 1 -> 2), and the workers
    find it through the view. The ledgers prove one update per worker step."""
    store, port, store_metrics = procs.store("store", "--lease-s", "3")
    common = ("--store", f"127.0.0.1:{port}", "--shards", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
              "--checkpoint-every-updates", "50", "--audit-log", str(tmp_path / "audit.log"))
    ps0, _, m0 = procs.ps("ps0", *common, "--shard-index", "0")
    ps1, _, _ = procs.ps("ps1", *common, "--shard-index", "1")
    workers = [procs.worker(f"w{i}", port, i, 2, "--steps", "600", *PACED)[0] for i in range(2)]
    wait_until(lambda: version(m0) >= 200, 90, "200 updates on shard 0")
    ps0.kill()
    ps0b, _, m0b = procs.ps("ps0b", *common, "--shard-index", "0")
    wait_until(lambda: version(m0b) > 0 or not ps0b.alive(), 90, "the new shard-0 process to serve")
    assert ps0b.alive(), ps0b.tail()
    assert "taking it over as primary, epoch 2" in ps0b.stderr()
    assert [w.wait(150) for w in workers] == [0, 0]
    assert ps1.alive() and "store host is gone" not in ps1.stderr()
    assert try_scrape(store_metrics)['rpcps_store_view_epoch{shard="0"}'] == 2
    assert "malloc_trim: every 3s" in store.stderr(), "the coordinator is long-lived: it gives free heap back too"
    assert try_scrape(store_metrics)['rpcps_store_view_epoch{shard="1"}'] == 1
    for proc in (ps0b, ps1):
        proc.send(15)
        assert proc.wait(60) == 0
    shard0, shard1 = (check_ledger(tmp_path / f"audit.log.shard{k}") for k in (0, 1))
    assert shard0.problems == [] and shard1.problems == [], (shard0.problems[:5], shard1.problems[:5])
    assert shard0.final_version == shard1.final_version == 1200
    assert shard0.restarts == 2 and len(shard0.updates_lost) == 1
    assert shard1.restarts == 1 and shard1.updates_lost == [], "shard 1 never restarted or rolled back"


@pytest.mark.timeout(60)
def test_the_coordinator_honours_threads_and_writes_its_summary_at_exit(procs: ProcessGroup, tmp_path: Path) -> None:
    """``--threads`` and ``--summary-json`` are the coordinator's flags like every role's: the start-up
    log says the thread budget, SIGUSR1 prints its threads' stacks and leaves it running, and a
    SIGTERM leaves a summary with the core keys and its own."""
    summary = tmp_path / "out" / "store.json"
    store, _, _ = procs.store("store", "--threads", "1", "--summary-json", str(summary))
    wait_until(lambda: "coordinator serving" in store.stderr() or not store.alive(), 30, "the coordinator to serve")
    assert store.alive(), store.tail()
    assert "intra-op threads: 1 (--threads)" in store.stderr()
    store.send(signal.SIGUSR1)
    wait_until(lambda: "most recent call first" in store.stderr() or not store.alive(), 30, "the coordinator to print its stacks")
    assert store.alive() and 'File "' in store.stderr(), store.tail()
    store.send(signal.SIGTERM)
    assert store.wait(30) == 0, store.tail()
    result = read_json(summary)
    assert result["role"] == "store" and result["updates_applied"] == 0 and result["wall_seconds"] > 0
    assert result["members_removed"] == 0 and result["store_repairs"] == {"members": 0, "address": 0, "rank_counter": 0}


@pytest.mark.timed  # the next update after the coordinator's return
@pytest.mark.timeout(300)
def test_a_restarted_coordinator_lets_a_primary_killed_while_it_was_down_fail_over_exactly(
    procs: ProcessGroup, tmp_path: Path, wall_clock_bound: Callable[[float, float], float]
) -> None:
    """kill -9 of the coordinator while a replicated shard trains: the workers and both replicas train
    on. kill -9 of the primary while the coordinator is down: the standby notices at once and waits
    for the store to promote. The coordinator is started again on the same port (as its supervisor
    would): it serves an empty store, the members write their part back, and the standby promotes
    from the view it followed (epoch 1 -> 2); a new standby then joins through the new store. The
    ledger: one history, final version workers x steps, nothing resumed from a checkpoint; recovery
    times printed."""
    _store, port, _ = procs.store("store", "--lease-s", "3")
    common = ("--store", f"127.0.0.1:{port}", "--replicas", "2", "--audit-log", str(tmp_path / "audit.log"), "--digest-every", "10")
    control_b = f"127.0.0.1:{free_port()}"
    [(a, ma), (b, mb)] = start_replica_pair(procs, common, second_only=("--control-port", control_b.rsplit(":", 1)[1]))
    wait_until(lambda: try_scrape(mb).get("rpcps_replica_role") == 1, 10, "ps_b to report itself an in-sync standby")
    workers = [procs.worker(f"w{i}", port, i, 2, "--steps", "800", "--failover-timeout-s", "60", *PACED)[0] for i in range(2)]
    wait_until(lambda: version(ma) >= 150, 90, "150 updates")
    store_killed_at = time.time()
    _store.kill()
    assert _store.wait(10) is not None
    down_at = version(ma)
    wait_until(lambda: version(ma) >= down_at + 50, 30, "training to go on without the coordinator")
    killed_at = time.time()
    a.kill()
    wait_until(lambda: "promoting once it is back" in b.stderr() or not b.alive(), 30, "the standby to wait for the store")
    assert b.alive(), b.tail()
    restarted_at = time.time()
    store, _, store_metrics = procs.store("store2", "--lease-s", "3", port=port)
    wait_until(lambda: "coordinator serving" in store.stderr() or not store.alive(), 60, "the coordinator to serve again")
    back_at = time.time()
    wait_until(lambda: try_scrape(mb).get("rpcps_replica_role") == 2, 30, "ps_b to promote once the coordinator is back")
    # The members put themselves back in the new store's member list: a new standby joins through
    # it, and the primary (which joined the old store) learns its address there. Training is held
    # while its process starts, so the run cannot end first.
    run_ctl(control_b, "pause")
    c, _, _ = procs.ps("ps_c", *common)
    wait_until(lambda: try_scrape(mb).get("rpcps_replica_standby_in_sync") == 1 or not c.alive(), 90, "ps_c to join and catch up")
    assert c.alive(), c.tail()
    # The coordinator, the new primary, the new standby and both workers: all in the new member list,
    # and the members that joined the old store adopted by the new coordinator's agent (and not
    # taken for dead by its janitor, which pings them every second).
    wait_until(lambda: try_scrape(store_metrics).get("rpcps_store_members") == 5, 30, "the member list to be rebuilt")
    wait_until(lambda: "members back in the group" in store.stderr(), 30, "the coordinator to adopt the members")
    assert "is gone" not in store.stderr() and "has not answered" not in store.stderr(), store.tail()
    run_ctl(control_b, "resume")
    assert [w.wait(180) for w in workers] == [0, 0], procs.tails()
    assert version(mb) == 1600
    assert try_scrape(store_metrics)['rpcps_store_view_epoch{shard="0"}'] == 2, "the view was rebuilt in the new store"
    assert "restarting" not in b.stderr() and "took the shard over" not in b.stderr(), b.tail()
    stop_standby_then_primary(standby=c, primary=b)
    report = check_ledger(tmp_path / "audit.log")
    assert report.problems == [], report.problems[:5]
    assert report.final_version == 1600
    assert report.restarts == 3 and report.updates_lost == [], "the three replicas' starts only: none from a checkpoint"
    assert [p[1] for p in report.promotions] == [2]
    promoted = report.promotions[0][0]
    applied = first_apply_after(report, killed_at, other_than=report.names[a.pid])
    assert applied is not None
    print(f"coordinator down {back_at - store_killed_at:.2f}s; "
          f"coordinator serving again -> promotion {promoted - back_at:.3f}s, -> next applied update {applied - back_at:.3f}s; "
          f"restart launched -> next update {applied - restarted_at:.3f}s; primary kill -> next update {applied - killed_at:.3f}s")
    assert applied - back_at <= wall_clock_bound(5.0, 15.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_primary_restarted_from_its_snapshot_while_the_coordinator_was_down_follows_the_standby_that_promotes(
    procs: ProcessGroup, tmp_path: Path
) -> None:
    """kill -9 of the primary and the coordinator together (the race of CI's chaos soak, seed 888045):
    the primary is started again at once, as its supervisor would, with a snapshot to resume, and
    waits for the store; the coordinator comes back. The standby is held for 3 s at the moment it
    promotes (a fail point: later than the 2 s after which the restarted server may join), yet it
    promotes, and the restarted server, finding no view in a coordinator that just started, waits
    instead of serving the shard from its snapshot, then attaches to it as its standby. The ledger: one
    history, final version workers x steps, no update lost, nothing resumed from a checkpoint.

    The standby is held at its promotion until the restarted server says it waits (the fail point's
    release file), not for a fixed 3 s: in CI a 3 s hold ended before the restarted server's join did,
    so it found the promoted view and the waiting path went untested."""
    _store, port, _ = procs.store("store", "--lease-s", "3")
    audit = tmp_path / "audit.log"
    common = ("--store", f"127.0.0.1:{port}", "--replicas", "2", "--audit-log", str(audit), "--digest-every", "10",
              "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every-updates", "50")
    a, _, ma = procs.ps("ps_a", *common)
    wait_until(lambda: try_scrape(ma).get("rpcps_replica_role", -1) == 2 or not a.alive(), 60, "ps_a to serve as primary")
    held = f"replication.standby_before_promote=hold-60@1:{tmp_path / 'promote.held'}"
    b, _, mb = procs.ps("ps_b", *common, env=child_env(RPCPS_FAILPOINTS=held))
    wait_until(lambda: try_scrape(ma).get("rpcps_replica_standby_in_sync", -1) == 1 or not b.alive(), 60, "ps_b to be in sync")
    workers = [procs.worker(f"w{i}", port, i, 2, "--steps", "800", "--failover-timeout-s", "60", *PACED)[0] for i in range(2)]
    wait_until(lambda: version(ma) >= 120, 90, "120 updates (a snapshot at 100)")
    _store.kill()
    a.kill()
    assert _store.wait(10) is not None and a.wait(10) is not None
    wait_until(lambda: "promoting once it is back" in b.stderr() or not b.alive(), 30, "the standby to wait for the store")
    restarted, _, _ = procs.ps("ps_a_restarted", *common)
    wait_until(lambda: "nothing answers at the group's store" in restarted.stderr() or not restarted.alive(), 60,
               "the restarted primary to wait for the store")
    procs.store("store2", "--lease-s", "3", port=port)
    wait_until(lambda: "waiting for a live replica to put it back" in restarted.stderr() or not restarted.alive(), 60,
               "the restarted server to find no view and wait for a live replica")
    assert (tmp_path / "promote.held").exists(), "the standby was held where it promotes"
    (tmp_path / "promote.held.release").touch()
    wait_until(lambda: try_scrape(mb).get("rpcps_replica_role") == 2 or not b.alive(), 60, "ps_b to promote once released")
    wait_until(lambda: try_scrape(mb).get("rpcps_replica_standby_in_sync") == 1 or not restarted.alive(), 90,
               "the restarted server to attach to the promoted standby and catch up")
    assert "copied shard 0's state from" in restarted.stderr(), restarted.tail()
    assert [w.wait(180) for w in workers] == [0, 0], procs.tails()
    assert version(mb) == 1600
    stop_standby_then_primary(standby=restarted, primary=b)
    report = check_ledger(audit)
    assert report.problems == [], report.problems[:5]
    assert report.final_version == 1600
    assert report.updates_lost == [] and [p[1] for p in report.promotions] == [2], (report.updates_lost, report.promotions)
    assert report.restarts == 3, "the three replicas' starts only: none from a checkpoint"


def stop_standby_then_primary(standby: Proc, primary: Proc) -> None:
    """SIGTERM to the standby, and once it ended, to the primary. Both at once race: a standby that
    sees its primary stop gracefully before its own signal is handled promotes (a planned hand-over),
    and the ledger then holds a second promotion (epoch 3) that the test did not cause (CI and a
    local run, with the test alone on the machine)."""
    standby.send(signal.SIGTERM)
    standby.wait(60)
    primary.send(signal.SIGTERM)
    assert primary.wait(60) == 0, primary.tail()
