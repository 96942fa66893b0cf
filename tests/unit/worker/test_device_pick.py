"""pick_device('auto'): one GPU per local rank on a multi-GPU node, the CPU without GPUs."""

from __future__ import annotations

import pytest
import torch

from worker.device import pick_device


@pytest.mark.parametrize(("local_rank", "gpus", "expected"), [(None, 4, "cuda:0"), ("0", 4, "cuda:0"), ("3", 4, "cuda:3"), ("5", 4, "cuda:1"), ("2", 1, "cuda:0")])
def test_auto_takes_the_gpu_of_the_local_rank(monkeypatch: pytest.MonkeyPatch, local_rank: str | None, gpus: int, expected: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert pick_device("auto") == torch.device(expected)


def test_auto_without_a_gpu_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert pick_device("auto") == torch.device("cpu")
