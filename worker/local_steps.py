"""The worker's side of ``--mode local-steps``: the parameters a round started from, and its delta.

A round is one step of the slot: H inner steps of the loop's own optimizer on the step's H
micro-batches, then one push of ``start - now`` (DiLoCo's outer gradient) where a gradient mode
pushes gradients. The server's outer optimizer (``ps.core.outer``) applies it, and the next round
starts from the parameters it returns. The inner optimizer and its state belong to the loop and
live in this process only: a restarted worker starts them afresh (docs/FAULT_TOLERANCE.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rpcps.optim_kernels import fast_kernel
from worker.config import INNER_OPTIMIZERS, WorkerConfig


class RoundStart:
    """A copy of the parameters as a round began (after the pull), turned into the delta at its push."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.origin = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in params]
        self._index = {id(p): i for i, p in enumerate(params)}

    def begin(self) -> None:
        with torch.no_grad():
            for o, p in zip(self.origin, self.params):
                o.copy_(p)

    def rebase(self, params: list[torch.Tensor], load: Callable[[], None]) -> None:
        """Moves ``params`` (some of the model's) to a new start: ``load()`` sets them to it, and the
        round's progress so far is put back on top, so the round's delta stays what its inner steps did."""
        with torch.no_grad():
            progress = [p - self.origin[self._index[id(p)]] for p in params]
            load()
            for p, moved in zip(params, progress):
                self.origin[self._index[id(p)]].copy_(p)
                p.add_(moved)

    def deltas_as_grads(self) -> None:
        """Sets each parameter's ``.grad`` to ``start - now`` (the copy becomes it: one buffer per round)."""
        with torch.no_grad():
            for o, p in zip(self.origin, self.params):
                o.sub_(p)
                p.grad = o


def inner_optimizer(config: WorkerConfig, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The CLI loop's inner optimizer (``--inner-optimizer``, ``--inner-lr``; torch's other defaults,
    stepped with its fused kernel where the device has one: ``rpcps.optim_kernels``)."""
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[config.inner_optimizer]
    assert config.inner_optimizer in INNER_OPTIMIZERS
    return cls(params, lr=config.inner_lr, **fast_kernel(config.inner_optimizer, params))
