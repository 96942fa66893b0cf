"""``--data`` targets that are wrong: returns ``local`` refuses before it starts anything, and one that
only a worker finds wrong (its data ends before ``--steps``: ``local`` reads only the first batch)."""

from __future__ import annotations

import torch

from rpcps.tasks import TeacherStudentData


def not_iterable(worker_index: int, num_workers: int) -> int:
    return worker_index + num_workers


def labels_only(worker_index: int, num_workers: int) -> list[int]:
    return list(range(worker_index, 100, num_workers))


def too_short(worker_index: int, num_workers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = iter(TeacherStudentData(worker_index, num_workers))
    return [next(data) for _ in range(3)]
