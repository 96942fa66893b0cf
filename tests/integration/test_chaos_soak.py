"""Longer chaos runs: random kills of servers and workers (marked slow; CI runs them separately)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.faults import ChaosPlan, run_chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [1, 2])
def test_random_kills_of_server_and_workers(tmp_path: Path, seed: int) -> None:
    plan = ChaosPlan.random(5, seed, workers=3, steps=500, checkpoint_every_updates=150, timeout_s=480)
    result = run_chaos(plan, tmp_path / "run")
    assert result.problems(plan) == [], (tmp_path / "run" / "local.log").read_text()[-3000:]
    assert all(r < 10.0 for r in result.recovery_s), result.recovery_s


@pytest.mark.timeout(600)
def test_random_kills_with_two_shards(tmp_path: Path) -> None:
    plan = ChaosPlan.random(3, 11, workers=2, steps=500, shards=2, timeout_s=480)
    plan = ChaosPlan(workers=2, steps=500, shards=2, timeout_s=480,
                     kills=tuple(k if k.target != "ps" else type(k)("ps1", k.at_version) for k in plan.kills))
    result = run_chaos(plan, tmp_path / "run")
    assert result.problems(plan) == [], (tmp_path / "run" / "local.log").read_text()[-3000:]
