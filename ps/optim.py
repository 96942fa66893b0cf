"""Builds the server's single optimizer and optional learning-rate schedule by name.

Only element-wise optimizers are offered: the server steps them over flat fp32 chunks instead of the
model's own tensors, which gives the same result only when every update is element-wise.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

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


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """Which optimizer the server runs, and with what settings."""

    name: str = "adam"
    """One of OPTIMIZERS."""
    kwargs: dict[str, Any] = field(default_factory=lambda: {"lr": 3e-3})
    """Keyword arguments for the torch.optim class, e.g. {"lr": 0.1, "momentum": 0.9, "nesterov": true}."""
    schedule: str | None = None
    """One of SCHEDULES, or None for a constant learning rate. Stepped once per applied update."""
    schedule_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.name!r} is not supported; choose one of {sorted(OPTIMIZERS)}")
        _check_kwargs(OPTIMIZERS[self.name], self.kwargs, f"optimizer {self.name!r}", skip=1)
        if self.schedule is not None:
            if self.schedule not in SCHEDULES:
                raise ValueError(f"lr schedule {self.schedule!r} is not supported; choose one of {sorted(SCHEDULES)}")
            _check_kwargs(SCHEDULES[self.schedule], self.schedule_kwargs, f"lr schedule {self.schedule!r}", skip=1)
        elif self.schedule_kwargs:
            raise ValueError("schedule_kwargs given without a schedule")


def _check_kwargs(cls: type, kwargs: dict[str, Any], what: str, skip: int) -> None:
    allowed = list(inspect.signature(cls.__init__).parameters)[1 + skip :]
    for key in kwargs:
        if key in _REFUSED_KWARGS or key not in allowed:
            usable = [a for a in allowed if a not in _REFUSED_KWARGS]
            raise ValueError(f"{what} has no setting {key!r}; it accepts {usable}")


def build_optimizer(
    config: OptimizerConfig, params: list[torch.Tensor]
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
    try:
        optimizer = OPTIMIZERS[config.name](params, **config.kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"optimizer {config.name!r} rejected its settings {config.kwargs}: {e}") from e
    schedule = None
    if config.schedule is not None:
        try:
            schedule = SCHEDULES[config.schedule](optimizer, **config.schedule_kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"lr schedule {config.schedule!r} rejected its settings {config.schedule_kwargs}: {e}") from e
    return optimizer, schedule
