"""bench/push_throughput.py still measures the product: its ours side starts real sharded servers.

The benchmark is not a test, but it rotted once unseen (shard 0 was told to join a store at its own
--listen and waited for itself, so no row was measured). This runs its smallest sharded setup.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def test_the_push_benchmark_measures_two_shards_and_the_raw_baseline(tmp_path: Path) -> None:
    out = tmp_path / "push.json"
    argv = [sys.executable, "-m", "bench.push_throughput", "--models", "mlp_5m", "--workers", "1", "--shards", "2",
            "--sides", "ours,raw", "--calls", "20", "--json", str(out)]
    bench = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = bench.communicate(timeout=200)
    finally:
        if bench.poll() is None:
            # SIGINT, not SIGKILL: the bench's finally blocks stop the servers it started in their own sessions.
            bench.send_signal(signal.SIGINT)
            try:
                bench.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                bench.kill()
                bench.communicate()
    assert bench.returncode == 0, stdout[-3000:] + stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["setup"]["shards"] == 2
    assert row["best"]["ours"] > 0 and row["best"]["raw"] > 0, row
