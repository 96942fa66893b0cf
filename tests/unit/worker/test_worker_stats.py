"""A worker's summary describes its slot's whole job, also after it restarted itself in place."""

from __future__ import annotations

import time

from worker.trainer import WorkerStats


def test_stats_carried_into_the_next_incarnation_keep_the_first_losses_and_counts() -> None:
    first = WorkerStats(started=time.monotonic() - 100.0)
    for step in range(300):
        first.note_loss(2.0 - step / 300)
        first.steps += 1
        first.applied += 1
    second = WorkerStats.from_carry(first.to_carry())  # what the restarted process starts from
    for step in range(300, 600):
        second.note_loss(1.0 - (step - 300) / 600)
        second.steps += 1
        second.applied += 1
    summary = second.summary(next_step=600, reconnects=1)
    assert summary["steps"] == 600 and summary["updates_applied"] == 600 and summary["next_step"] == 600
    assert summary["initial_loss"] > 1.9  # the first incarnation's first losses, not the restart's
    assert summary["final_loss"] < 0.6
    assert summary["wall_seconds"] >= 100.0  # counted from the first incarnation's start


def test_a_worker_that_never_restarted_starts_from_nothing() -> None:
    stats = WorkerStats.from_carry(None)
    assert stats.steps == 0 and stats.summary(0, 0)["initial_loss"] is None


def test_losses_kept_are_bounded() -> None:
    stats = WorkerStats()
    for step in range(10_000):
        stats.note_loss(float(step))
    assert len(stats.first_losses) == 10 and len(stats.recent_losses) == 10
