"""Longer chaos runs: random crashes of servers and workers, and a soak that kills every role (marked
slow; CI runs them separately).

Each CI run draws fresh seeds, so the suite keeps looking where bugs hide instead of replaying the
same plans; the seeds are in the test ids and printed, so a failure can be replayed with
``RPCPS_CHAOS_SEEDS=<seed>,... pytest -m slow tests/integration/ps/test_chaos_soak.py`` or
``python tools/chaos.py --seed <seed> ...`` with the same settings.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from harness.faults import EVALUATOR_ARGS, ChaosPlan, Kill, run_chaos
from tests.integration.paced_data import INTERVAL_ENV

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEEDS_ENV = "RPCPS_CHAOS_SEEDS"
PACED = ("--data", "tests.integration.paced_data:paced_data")
SOAK_PACE_S = "0.04"
SOAK_ROUNDS = 4
"""Kills of each role, and of the primary with the coordinator at once: 28 in all."""
SOAK_STEPS = 14000
"""At 25 steps/s per worker the soak trains for 9.3 minutes undisturbed; its 28 kills, each waiting
for the shard to have its standby back in sync (or its target to be back), stretch it to about 10
(at 12,000 steps: 509 s with seed 710878). The run's own limit is 900 s."""


def _seeds(count: int) -> list[int]:
    chosen = os.environ.get(SEEDS_ENV)
    if chosen:
        return [int(s) for s in chosen.split(",")]
    # Under pytest-xdist every worker collects the tests and must draw the same seeds: the run's id,
    # one per run and the same in each worker, seeds them (a fresh draw per run either way).
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    draw = random.Random(run_id) if run_id else random.SystemRandom()
    return [draw.randrange(1_000_000) for _ in range(count)]


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


@pytest.mark.timeout(960)
def test_a_10_minute_soak_kills_every_role_four_times_and_in_pairs_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak: ``local --replicas 2`` with an evaluator for about 10 minutes; each worker, the
    primary, the standby, the coordinator and the evaluator killed 4 times, and the primary with the
    coordinator at once 4 times, in an order drawn from the seed. Every planned kill fires; the ledger holds one history
    (no version twice, no (slot, step) twice) and the final version is workers x steps."""
    seed = _seeds(1)[0]
    monkeypatch.setenv(INTERVAL_ENV, SOAK_PACE_S)
    plan = ChaosPlan.every_role(
        SOAK_ROUNDS, SOAK_ROUNDS, seed, workers=2, steps=SOAK_STEPS, extra_args=(*PACED, *EVALUATOR_ARGS), timeout_s=900
    )
    print(f"chaos seed {seed} (every role): {[str(k) for k in plan.kills]}")
    result = run_chaos(plan, tmp_path / "run")
    problems = result.problems(plan)
    fired = [str(k) for k, _ in result.fired]
    print(f"seed {seed}: fired {fired}; recovery after server kills {[round(r, 3) for r in result.recovery_s]}; notes {result.notes}")
    assert problems == [], f"seed {seed} (replay: {SEEDS_ENV}={seed}): {problems}\n" + (tmp_path / "run" / "local.log").read_text()[-3000:]
    assert not [n for n in result.notes if "was not running" in n], result.notes  # every kill hit its role
    for role in ("worker0", "worker1", "primary", "standby", "store", "evaluator"):
        assert sum(role in k.split("@")[0].split("+") for k in fired) >= SOAK_ROUNDS, (role, fired)  # "primary+store@756"
