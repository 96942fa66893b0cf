"""A worker's batches: a --data iterable that ends before --steps is an error naming the data and the step.

``next()`` on an ended iterator raises a bare StopIteration, which reached the command line as a
traceback ending in one word; the worker now says which data ran out where.
"""

from __future__ import annotations

import pytest
import torch

from rpcps.examples.stream import Batch
from worker.config import WorkerConfig
from worker.trainer import DataExhausted, next_batch, open_batches

SPEC = f"{__name__}:three_batches"


def three_batches(worker_index: int, num_workers: int) -> list[Batch]:
    """Finite data without ``seek``: batch k holds the number k."""
    return [(torch.full((1, 1), float(k)), torch.zeros(1)) for k in range(3)]


def test_a_finite_iterable_serves_its_batches_then_names_the_step_it_lacks() -> None:
    config = WorkerConfig(data=SPEC, steps=10)
    batches = open_batches(config, start=1)  # a restarted worker skips what it already computed
    assert [float(next_batch(batches, step, config)[0]) for step in (1, 2)] == [1.0, 2.0]
    with pytest.raises(DataExhausted, match=r"--data '.*:three_batches' \(slot 0 of 1\) ended before step 3 of --steps 10"):
        next_batch(batches, 3, config)


def test_resuming_past_the_end_fails_on_the_first_step() -> None:
    config = WorkerConfig(data=SPEC, steps=10)
    with pytest.raises(DataExhausted, match="ended before step 5"):
        next_batch(open_batches(config, start=5), 5, config)


def test_an_endless_stream_resumes_at_its_seek_position() -> None:
    config = WorkerConfig(data="rpcps.tasks:teacher_student_data", steps=10)
    resumed = open_batches(config, start=4)
    fresh = open_batches(config, start=0)
    for step in range(4):
        next_batch(fresh, step, config)
    assert torch.equal(next_batch(resumed, 4, config)[0], next_batch(fresh, 4, config)[0])
