"""Builds the server's single optimizer and optional learning-rate schedule by name.

Only element-wise optimizers are offered: the server steps them over flat fp32 chunks instead of the
model's own tensors, which gives the same result only when every update is element-wise.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from rpcps.optim_kernels import FAST_KERNELS
from rpcps.settings import setting

DEFAULT_LR = 3e-3

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}

ADAM_OPTIMIZERS = frozenset({"adam", "adamw"})
"""Optimizers with Adam's moments (``betas``, ``exp_avg``, ``exp_avg_sq``)."""

SCHEDULES: dict[str, type[torch.optim.lr_scheduler.LRScheduler]] = {
    "step": torch.optim.lr_scheduler.StepLR,
    "cosine": torch.optim.lr_scheduler.CosineAnnealingLR,
    "exponential": torch.optim.lr_scheduler.ExponentialLR,
    "linear": torch.optim.lr_scheduler.LinearLR,
}

# Keyword arguments that change what the optimizer computes per element, or that would break the
# flat-chunk equivalence, are refused rather than silently ignored.
_REFUSED_KWARGS = {"params", "differentiable", "capturable"}

_KERNEL_KWARGS = ("fused", "foreach")


def check_kwargs(cls: type[Any], kwargs: dict[str, Any], what: str) -> None:
    """Refuses a keyword ``cls`` does not take (or one that breaks the flat-chunk equivalence), naming the usable ones."""
    allowed = list(inspect.signature(cls.__init__).parameters)[2:]  # after self and params/optimizer
    for key in kwargs:
        if key in _REFUSED_KWARGS or key not in allowed:
            usable = [a for a in allowed if a not in _REFUSED_KWARGS]
            raise ValueError(f"{what} has no setting {key!r}; it accepts {usable}")


def torch_kwargs(config: OptimizerConfig) -> dict[str, Any]:
    """What the torch.optim class is built with: the configured arguments, plus the fast kernel
    (``rpcps.optim_kernels``; the server steps flat fp32 chunks on the CPU) when they name none."""
    kwargs = config.optimizer_kwargs
    if any(k in kwargs for k in _KERNEL_KWARGS):
        return kwargs
    return {**FAST_KERNELS.get(config.name, {}), **kwargs}


def load_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Loads a snapshot's optimizer state and keeps this optimizer's kernel.

    torch takes every param-group setting from the snapshot, ``fused`` and ``foreach`` included, so
    a snapshot from a server that stepped with another kernel would otherwise switch this one's.
    """
    kernels = [{k: group[k] for k in _KERNEL_KWARGS if k in group} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, kernel in zip(optimizer.param_groups, kernels):
        group.update(kernel)


@contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
    """Steps taken inside use every group's learning rate times ``scale``; the rates are restored after
    (before a schedule reads them), also when a step raises."""
    if scale == 1.0:
        yield
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr * scale
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, rates):
            group["lr"] = lr


def build_optimizer(
    config: OptimizerConfig, params: list[torch.Tensor]
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
    kwargs = torch_kwargs(config)
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


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """Optimizer (one, on the server)."""

    name: str = setting("adam", flag="--optimizer", help="the server's optimizer", choices=lambda: sorted(OPTIMIZERS))
    kwargs: dict[str, Any] | None = setting(
        None,
        flag="--optimizer-args",
        help="keyword arguments of the torch.optim class as JSON, e.g. '{\"lr\":0.1,\"momentum\":0.9,\"nesterov\":true}' "
        f"(unset: {{\"lr\": {DEFAULT_LR}}})",
        metavar="JSON",
    )
    lr: float | None = setting(None, help="learning rate; overrides lr in --optimizer-args")
    schedule: str | None = setting(
        None, flag="--lr-schedule", help="learning-rate schedule stepped once per applied update", choices=lambda: sorted(SCHEDULES)
    )
    schedule_kwargs: dict[str, Any] | None = setting(
        None, flag="--lr-schedule-args", help="schedule keyword arguments as JSON, e.g. '{\"T_max\":1000}'", metavar="JSON"
    )

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.name!r} is not supported; choose one of {sorted(OPTIMIZERS)}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        check_kwargs(OPTIMIZERS[self.name], self.optimizer_kwargs, f"optimizer {self.name!r}")
        if self.schedule is not None:
            if self.schedule not in SCHEDULES:
                raise ValueError(f"lr schedule {self.schedule!r} is not supported; choose one of {sorted(SCHEDULES)}")
            check_kwargs(SCHEDULES[self.schedule], self.schedule_kwargs or {}, f"lr schedule {self.schedule!r}")
        elif self.schedule_kwargs:
            raise ValueError("schedule_kwargs given without a schedule (--lr-schedule-args needs --lr-schedule)")

    @property
    def optimizer_kwargs(self) -> dict[str, Any]:
        """What the torch.optim class is built with: the JSON arguments, with --lr on top."""
        kwargs = dict(self.kwargs) if self.kwargs is not None else {"lr": DEFAULT_LR}
        if self.lr is not None:
            kwargs["lr"] = self.lr
        return kwargs
