"""Built-in tasks that need no download.

``teacher_student``: a fixed random "teacher" network labels Gaussian inputs; a student MLP learns to
imitate it. Batches are generated from (worker, batch index) seeds, so every worker reads its own
shard, a restarted worker can seek straight to its recorded position, and runs are reproducible.
``teacher_student_held_out`` is its held-out set (for ``rpcps evaluate --eval-data``): batches from
seeds no worker reads.

``mlp_5m`` / ``mlp_25m``: wide MLPs for throughput benchmarks (each weight <= 16 MB so one weight is
one wire chunk).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

IN_FEATURES = 32
CLASSES = 10
BATCH_SIZE = 64
_TEACHER_SEED = 1234


def teacher_student_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN_FEATURES, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES))


def _teacher() -> nn.Module:
    g = torch.Generator().manual_seed(_TEACHER_SEED)
    teacher = nn.Sequential(nn.Linear(IN_FEATURES, 64), nn.Tanh(), nn.Linear(64, CLASSES))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 1.5)
    return teacher.eval()


class TeacherStudentData:
    """An endless, seekable stream of labelled batches for one worker."""

    def __init__(self, worker_index: int, num_workers: int, batch_size: int = BATCH_SIZE) -> None:
        if not 0 <= worker_index < num_workers:
            raise ValueError(f"worker_index must be in [0, {num_workers}), got {worker_index}")
        self.worker_index = worker_index
        self.batch_size = batch_size
        self.position = 0
        self._teacher = _teacher()

    def seek(self, batch_index: int) -> None:
        self.position = batch_index

    def batch(self, batch_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_003 * (self.worker_index + 1) + batch_index)
        x = torch.randn(self.batch_size, IN_FEATURES, generator=g)
        with torch.no_grad():
            y = self._teacher(x).argmax(dim=1)
        return x, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.batch(self.position)
            self.position += 1


def teacher_student_data(worker_index: int, num_workers: int) -> TeacherStudentData:
    return TeacherStudentData(worker_index, num_workers)


HELD_OUT_BATCHES = 8


def teacher_student_held_out() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Held-out batches of the teacher-student task: a stream of a slot no run has (batches are seeded by
    slot and index, and slots stop at --max-workers, at most 32000)."""
    stream = TeacherStudentData(0, 1)
    stream.worker_index = 1_000_000
    return [stream.batch(i) for i in range(HELD_OUT_BATCHES)]


def _wide_mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


def mlp_5m() -> nn.Module:
    return _wide_mlp(1024, 5)  # 5.25M parameters


def mlp_25m() -> nn.Module:
    return _wide_mlp(2048, 6)  # 25.2M parameters


class RegressionData:
    """Random regression batches (targets of the model's output width) for the benchmark MLPs."""

    def __init__(self, worker_index: int, width: int, batch_size: int = 32) -> None:
        g = torch.Generator().manual_seed(worker_index)
        self._x = torch.randn(batch_size, width, generator=g)
        self._y = torch.randn(batch_size, width, generator=g)

    def seek(self, batch_index: int) -> None:
        del batch_index  # every batch is the same

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self._x, self._y


def mlp_5m_data(worker_index: int, num_workers: int) -> RegressionData:
    del num_workers
    return RegressionData(worker_index, 1024)


def mlp_25m_data(worker_index: int, num_workers: int) -> RegressionData:
    del num_workers
    return RegressionData(worker_index, 2048)
