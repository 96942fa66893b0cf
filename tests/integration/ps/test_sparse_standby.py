"""Sparse tables with a hot standby (``--replicas 2``): the built-in CTR task's rows, their admission,
eviction and row-optimizer state follow the primary's log, so a standby's tables are the primary's
(the audit ledger compares digests that cover every row), a kill -9 of the primary loses nothing,
and a new standby copies the tables with the rest of the state. Real processes on 127.0.0.1.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from harness import control as control_plane
from harness.faults import ChaosPlan, Kill, run_chaos
from harness.ledger import check_ledger
from harness.procs import ProcessGroup, free_port, try_scrape, wait_until

pytestmark = pytest.mark.integration

CTR = ("--model", "rpcps.examples.ctr:dlrm_model", "--data", "rpcps.examples.ctr:ctr_data_small", "--loss", "rpcps.examples.ctr:bce_loss")
SPARSE = ("--sparse-admit-count", "2", "--sparse-ttl", "5", "--sparse-evict-every-s", "0.2")
"""Admission by count and a TTL, so that admission and eviction decisions are part of what is replicated."""
STEPS = 40


def _metric(port: int, key: str) -> float:
    return try_scrape(port).get(key, -1)


def _table_sum(port: int, family: str) -> float:
    """A per-table sparse series summed over the tables (-1 when the server does not answer)."""
    metrics = try_scrape(port)
    values = [v for k, v in metrics.items() if k.startswith(f"rpcps_sparse_{family}{{")]
    return sum(values) if values else -1


@pytest.mark.timeout(300)
def test_a_sparse_standby_copies_the_tables_and_a_primary_killed_while_held_fails_over_exactly(
    procs: ProcessGroup, tmp_path: Path
) -> None:
    """CTR with admission and a TTL, ``--replicas 2``. The standby starts once the primary holds rows
    and has evicted some (training held with the control plane's pause meanwhile), copies them with
    the rest of the state and follows the log while training runs; training is held again, the
    primary killed -9 there, and the promoted standby (the pause is a log entry: it holds it too)
    resumed. The ledger: one history, final version = workers x steps, and every 10th version's
    digest (dense state, dedup records, every sparse row) equal on the two replicas."""
    ledger = tmp_path / "audit.log"
    _store, port, _ = procs.store("store", "--lease-s", "3")
    common = ("--store", f"127.0.0.1:{port}", "--replicas", "2", "--audit-log", str(ledger), "--digest-every", "10",
              "--model", CTR[1], *SPARSE)
    controls = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    a, _, ma = procs.ps("ps_a", *common, "--control-port", controls[0].rsplit(":", 1)[1])
    workers = [procs.worker(f"w{i}", port, i, 2, "--steps", str(STEPS), *CTR)[0] for i in range(2)]
    wait_until(lambda: _table_sum(ma, "evicted_rows_total") > 0, 120, "the primary's first evictions")
    copied_at = control_plane.pause(controls[0])
    b, _, mb = procs.ps("ps_b", *common, "--control-port", controls[1].rsplit(":", 1)[1])
    wait_until(lambda: _metric(ma, "rpcps_replica_standby_in_sync") == 1 or not b.alive(), 90, "the standby to copy the state")
    assert b.alive(), b.tail()
    assert _metric(mb, "rpcps_server_model_version") == copied_at
    wait_until(lambda: _table_sum(mb, "rows") == _table_sum(ma, "rows") > 0, 10, "the standby to hold the primary's rows")
    control_plane.resume(controls[0])
    wait_until(lambda: _metric(ma, "rpcps_server_model_version") >= copied_at + 20, 60, "20 updates with the standby")
    held_at = control_plane.pause(controls[0])
    wait_until(lambda: _metric(mb, "rpcps_server_model_version") == held_at, 30, "the standby to apply what the primary did")
    # Held, the primary's eviction thread may still decide (its entries reach the standby as they go).
    wait_until(lambda: _table_sum(mb, "rows") == _table_sum(ma, "rows"), 10, "the standby to hold the primary's rows")
    assert _table_sum(mb, "evicted_rows_total") > 0, "the standby applied eviction decisions after its copy"
    a.kill()
    wait_until(lambda: _metric(mb, "rpcps_replica_role") == 2, 30, "the standby to take over")
    control_plane.resume(controls[1])
    assert [w.wait(180) for w in workers] == [0, 0], procs.tails()
    assert _metric(mb, "rpcps_server_model_version") == 2 * STEPS
    b.send(15)
    b.wait(60)
    report = check_ledger(ledger)
    assert report.problems == [], report.problems[:5]
    assert report.final_version == 2 * STEPS
    assert [epoch for _, epoch, _, _ in report.promotions] == [2]
    # The pause answers with the version it saw; an update sequenced before it may still apply after.
    promoted_at = report.promotions[0][2]
    assert promoted_at >= held_at
    assert report.mirrored >= promoted_at - copied_at - 1, "the standby applied every update from its copy to the kill"
    assert report.digests_compared >= held_at // 10 - copied_at // 10, f"compared {report.digests_compared} digests"


@pytest.mark.slow  # a CTR fault run of about a minute on 2 cores: CI runs it in its slow pass
@pytest.mark.timeout(600)
def test_five_kills_of_a_sparse_primary_in_one_run_lose_nothing(tmp_path: Path) -> None:
    """``local --replicas 2`` on the CTR task with admission and a TTL: kill -9 of whichever process
    is primary, five times, each once the restarted one is back in sync (``run_chaos`` holds training
    with the pause while it catches up). One history in the ledger, final version workers x steps,
    digests over every sparse row equal wherever two replicas applied a version."""
    steps = 300
    kills = tuple(Kill("primary", v) for v in range(80, 580, 100))
    plan = ChaosPlan(workers=2, steps=steps, replicas=2, kills=kills, timeout_s=540,
                     extra_args=(*CTR, *SPARSE, "--digest-every", "10"))
    result = run_chaos(plan, tmp_path / "run")
    assert result.problems(plan) == [], (result.problems(plan)[:5], result.notes)
    ledger = result.ledger
    assert [epoch for _, epoch, _, _ in ledger.promotions] == list(range(2, 7))
    assert ledger.final_version == 2 * steps and ledger.digests_compared > 0
    print(f"recovery over 5 kills: {[round(r, 3) for r in result.recovery_s]}; {ledger.digests_compared} digests compared")
    assert len(result.recovery_s) == 5 and statistics.median(result.recovery_s) <= 1.0, result.recovery_s
    # The workers followed every failover, sparse pulls included, without restarting to rejoin.
    for worker in ("worker0", "worker1"):
        assert "restarting the worker to rejoin" not in (tmp_path / "run" / f"{worker}.log").read_text()
