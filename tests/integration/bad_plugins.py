"""``--data`` targets that only a worker can find wrong (``local`` checks that a factory is callable, not
what it returns: calling it may read a whole dataset)."""

from __future__ import annotations


def not_iterable(worker_index: int, num_workers: int) -> int:
    return worker_index + num_workers
