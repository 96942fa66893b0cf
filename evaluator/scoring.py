"""Scoring a model on held-out data: the user's ``--eval-fn``, or mean ``--loss`` plus accuracy."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from rpcps import plugins
from rpcps.model_device import model_device
from rpcps.sparse.spec import declared_tables

Batch = tuple[torch.Tensor, torch.Tensor]
Scorer = Callable[[torch.nn.Module, list[Batch]], dict[str, float]]


class CannotScore(ValueError):
    """A model the sidecar evaluator cannot score (the message says what to do instead)."""


def check_scorable(model: torch.nn.Module, spec: str) -> None:
    """Raises CannotScore for a model with sparse tables: their rows live on the servers, and the
    evaluator, which holds no worker slot, has no read-only way to fetch them (a pull creates rows
    and counts towards admission). Refused at start rather than scoring garbage."""
    tables = declared_tables(model)
    if tables:
        raise CannotScore(
            f"the sidecar evaluator cannot score --model {spec} yet: it has {len(tables)} sparse tables, whose rows live "
            "on the servers; drop --eval-data, and score a checkpoint instead: `rpcps export --checkpoint DIR --out EXPORT_DIR`, "
            "then rpcps.sparse.serving.load_export(model, EXPORT_DIR) in any process (docs/SPARSE.md)"
        )


def check_model_spec(spec: str) -> None:
    """``check_scorable`` for ``--model spec`` (``rpcps local`` asks before starting anything)."""
    check_scorable(plugins.load_model(spec), spec)


def load_batches(spec: str) -> list[Batch]:
    """Calls the ``--eval-data`` factory once and keeps its batches (the held-out set does not change)."""
    factory = plugins.resolve_callable(spec, "eval-data")
    batches = list(factory())
    if not batches:
        raise plugins.PluginError(f"--eval-data {spec!r} gave no batches")
    return batches


def load_scorer(eval_fn: str | None, loss: str) -> Scorer:
    if eval_fn is None:
        return loss_and_accuracy(plugins.load_loss(loss))
    return plugins.resolve_callable(eval_fn, "eval-fn")


def loss_and_accuracy(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Scorer:
    """Mean loss per sample (each batch's mean loss weighted by its size) and, when the model gives
    class logits (N, C) for integer targets (N,), accuracy. In eval mode; the mode is restored."""

    def scores(model: torch.nn.Module, batches: list[Batch]) -> dict[str, float]:
        device = model_device(model)
        was_training = model.training
        model.eval()
        total, correct, count, classified = 0.0, 0, 0, True
        try:
            with torch.no_grad():
                for inputs, targets in batches:
                    inputs, targets = inputs.to(device), targets.to(device)
                    out = model(inputs)
                    n = len(targets)
                    total += float(loss_fn(out, targets)) * n
                    count += n
                    if classified and out.dim() == 2 and targets.dim() == 1 and not targets.dtype.is_floating_point:
                        correct += int((out.argmax(dim=1) == targets).sum())
                    else:
                        classified = False
        finally:
            model.train(was_training)
        result = {"loss": total / count}
        if classified:
            result["accuracy"] = correct / count
        return result

    return scores


def checked(scores: Any, where: str) -> dict[str, float]:
    """The scores as floats; raises ValueError unless they are a dict of numbers holding a non-NaN 'loss'."""
    if not isinstance(scores, dict) or "loss" not in scores:
        raise ValueError(f"{where} must return a dict of scores holding 'loss', got {scores!r:.200}")
    out = {str(k): float(v) for k, v in scores.items()}
    if math.isnan(out["loss"]):
        raise ValueError(f"{where} gave a NaN loss")
    return out
