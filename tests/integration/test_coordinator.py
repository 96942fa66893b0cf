"""The group's store in a process of its own (``rpcps store``): servers join it under fresh names and
claim their shard's view; workers find shards through the views; no server's death touches joins.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from harness.ledger import check_ledger
from harness.procs import ProcessGroup, try_scrape, wait_until
from tests.integration.conftest import model_version as version
from tests.integration.conftest import read_json

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
    log says the thread budget, and a SIGTERM leaves a summary with the core keys and its own."""
    summary = tmp_path / "out" / "store.json"
    store, _, _ = procs.store("store", "--threads", "1", "--summary-json", str(summary))
    wait_until(lambda: "coordinator serving" in store.stderr() or not store.alive(), 30, "the coordinator to serve")
    assert store.alive(), store.tail()
    assert "intra-op threads: 1 (--threads)" in store.stderr()
    store.send(signal.SIGTERM)
    assert store.wait(30) == 0, store.tail()
    result = read_json(summary)
    assert result["role"] == "store" and result["updates_applied"] == 0 and result["wall_seconds"] > 0
    assert result["members_removed"] == 0 and result["store_repairs"] == {"members": 0, "address": 0, "rank_counter": 0}
