"""Builds the server's single optimizer and optional learning-rate schedule by name.

Only element-wise optimizers are offered: the server steps them over flat fp32 chunks instead of the
model's own tensors, which gives the same result only when every update is element-wise.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ps.config import OptimizerConfig

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}

SCHEDULES: dict[str, type[torch.optim.lr_scheduler.LRScheduler]] = {
    "step": torch.optim.lr_scheduler.StepLR,
    "cosine": torch.optim.lr_scheduler.CosineAnnealingLR,
    "exponential": torch.optim.lr_scheduler.ExponentialLR,
    "linear": torch.optim.lr_scheduler.LinearLR,
}

# Keyword arguments that change what the optimizer computes per element, or that would break the
# flat-chunk equivalence, are refused rather than silently ignored.
_REFUSED_KWARGS = {"params", "differentiable", "capturable"}


def check_kwargs(cls: type, kwargs: dict[str, Any], what: str) -> None:
    """Refuses a keyword ``cls`` does not take (or one that breaks the flat-chunk equivalence), naming the usable ones."""
    allowed = list(inspect.signature(cls.__init__).parameters)[2:]  # after self and params/optimizer
    for key in kwargs:
        if key in _REFUSED_KWARGS or key not in allowed:
            usable = [a for a in allowed if a not in _REFUSED_KWARGS]
            raise ValueError(f"{what} has no setting {key!r}; it accepts {usable}")


def build_optimizer(
    config: OptimizerConfig, params: list[torch.Tensor]
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
    kwargs = config.optimizer_kwargs
    try:
        optimizer = OPTIMIZERS[config.name](params, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"optimizer {config.name!r} rejected its settings {kwargs}: {e}") from e
    schedule = None
    if config.schedule is not None:
        try:
            schedule = SCHEDULES[config.schedule](optimizer, **(config.schedule_kwargs or {}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"lr schedule {config.schedule!r} rejected its settings {config.schedule_kwargs}: {e}") from e
    return optimizer, schedule
