"""Longer chaos runs: random crashes of servers and workers (marked slow; CI runs them separately).

Each CI run draws fresh seeds, so the suite keeps looking where bugs hide instead of replaying the
same plans; the seeds are in the test ids and printed, so a failure can be replayed with
``RPCPS_CHAOS_SEEDS=<seed>,... pytest -m slow tests/integration/test_chaos_soak.py`` or
``python tools/chaos.py --seed <seed> ...`` with the same settings.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from harness.faults import ChaosPlan, Kill, run_chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEEDS_ENV = "RPCPS_CHAOS_SEEDS"


def _seeds(count: int) -> list[int]:
    chosen = os.environ.get(SEEDS_ENV)
    if chosen:
        return [int(s) for s in chosen.split(",")]
    return [random.SystemRandom().randrange(1_000_000) for _ in range(count)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", _seeds(3), ids=lambda seed: f"seed{seed}")
def test_random_crashes_of_server_and_workers(tmp_path: Path, seed: int) -> None:
    plan = ChaosPlan.random(6, seed, workers=2, steps=500, checkpoint_every_updates=37, timeout_s=480)
    print(f"chaos seed {seed}: {[str(k) for k in plan.kills]}")
    result = run_chaos(plan, tmp_path / "run")
    problems = result.problems(plan)
    assert problems == [], f"seed {seed} (replay: {SEEDS_ENV}={seed}): {problems}\n" + (tmp_path / "run" / "local.log").read_text()[-3000:]


@pytest.mark.timeout(600)
def test_random_crashes_with_two_shards(tmp_path: Path) -> None:
    seed = _seeds(1)[0]
    drawn = ChaosPlan.random(3, seed, workers=2, steps=400, shards=2, timeout_s=480)
    # Aim the version-triggered server kills at shard 1 too: shard 0 hosts the group's store.
    kills = tuple(Kill("ps1", k.at_version) if isinstance(k, Kill) and k.target == "ps" else k for k in drawn.kills)
    plan = ChaosPlan(workers=2, steps=400, shards=2, kills=kills, timeout_s=480)
    print(f"chaos seed {seed} (two shards): {[str(k) for k in plan.kills]}")
    result = run_chaos(plan, tmp_path / "run")
    assert result.problems(plan) == [], f"seed {seed}\n" + (tmp_path / "run" / "local.log").read_text()[-3000:]
