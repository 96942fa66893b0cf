"""bench/push_throughput.py still measures the product: its ours side starts real sharded servers.

The benchmark is not a test, but it rotted once unseen (shard 0 was told to join a store at its own
--listen and waited for itself, so no row was measured). This runs its smallest sharded setup.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.procs import ProcessGroup

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_the_push_benchmark_measures_two_shards_and_the_raw_baseline(procs: ProcessGroup, tmp_path: Path) -> None:
    out = tmp_path / "push.json"
    # procs reaps the bench and every process under it (its servers and clients), even when the test fails.
    bench = procs.start(
        "bench",
        ["-m", "bench.push_throughput", "--models", "mlp_5m", "--workers", "1", "--shards", "2", "--sides", "ours,raw",
         "--calls", "20", "--json", out],
        script=None,
    )
    assert bench.wait(200) == 0, bench.tail(60)
    (row,) = json.loads(out.read_text())
    assert row["setup"]["shards"] == 2
    assert row["best"]["ours"] > 0 and row["best"]["raw"] > 0, row
