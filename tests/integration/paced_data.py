"""A ``--data`` plug-in for tests: the built-in teacher-student data, at most one batch per N seconds.

Fault tests that cut links need training to still be running when the fault lands and after it
heals, whatever the machine's speed: pacing each worker's batches makes a run last long enough
without making it longer than needed on a slow machine. ``RPCPS_TEST_BATCH_INTERVAL_S`` sets the
pace (default 0.01 s, i.e. at most 100 steps per second per worker).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import torch

from rpcps.tasks import TeacherStudentData

INTERVAL_ENV = "RPCPS_TEST_BATCH_INTERVAL_S"


class PacedData:
    def __init__(self, worker_index: int, num_workers: int, interval_s: float) -> None:
        self.inner = TeacherStudentData(worker_index, num_workers)
        self.interval_s = interval_s

    def seek(self, batch_index: int) -> None:
        self.inner.seek(batch_index)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        next_at = time.monotonic()
        for batch in self.inner:
            # A rate limit, not synchronisation: nothing waits for anything else here.
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            next_at = max(next_at, time.monotonic() - self.interval_s) + self.interval_s
            yield batch


def paced_data(worker_index: int, num_workers: int) -> PacedData:
    return PacedData(worker_index, num_workers, float(os.environ.get(INTERVAL_ENV, "0.01")))
