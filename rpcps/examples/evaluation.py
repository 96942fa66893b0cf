"""Held-out cross-entropy and accuracy of a classifier whose output is (N, classes) logits."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rpcps.examples.stream import Batch
from rpcps.model_device import model_device


@dataclass(frozen=True)
class Scores:
    loss: float
    """Mean cross-entropy per target, in nats."""
    accuracy: float
    """Share of targets whose arg-max logit is right."""
    targets: int
    """How many targets were scored."""


def score(model: torch.nn.Module, batches: Iterable[Batch]) -> Scores:
    """Scores ``model`` in eval mode (BatchNorm uses its running statistics), then restores its mode.

    Losses are summed per target and divided once at the end, so a short last batch weighs what its
    targets weigh and the figure does not depend on how the held-out set was cut into batches.
    """
    was_training = model.training
    device = model_device(model)
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    try:
        with torch.no_grad():
            for inputs, targets in batches:
                inputs, targets = inputs.to(device), targets.to(device)
                logits = model(inputs)
                total_loss += float(F.cross_entropy(logits, targets, reduction="sum"))
                correct += int((logits.argmax(dim=-1) == targets).sum())
                count += targets.numel()
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("no held-out targets to score: the batches were empty")
    return Scores(loss=total_loss / count, accuracy=correct / count, targets=count)
