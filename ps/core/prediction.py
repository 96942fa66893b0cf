"""Weight prediction for async training: pulls get the parameters where they will be when the push lands.

An async push is applied to parameters some updates newer than the ones its gradient was computed
on (its staleness). Weight prediction serves each pull the parameters moved ahead along the last
applied step by ``factor`` times the recent mean staleness (``rpcps.staleness.extrapolate_into``;
for Adam and AdamW that step is the optimizer's own ``m / sqrt(v)`` direction), so the gradient is
computed near where it will be applied. Measured in bench/stale_gradients.py and bench/convergence.py
(docs/EXAMPLES.md, "Staleness remedies").

It changes only what pulls are sent, never the masters or the optimizer state: a standby that replays
the primary's log reaches the same digests whether or not either predicts, and a snapshot needs
nothing of it. What it keeps (the parameters before the last step, the mean staleness) is rebuilt by
the next applied update: after a restore the first pulls get the parameters as they are.

Sparse rows are served as they are (their row optimizers keep no direction to extrapolate).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ps.core.optim import ADAM_OPTIMIZERS
from rpcps.staleness import StalenessMean, extrapolate_into

PREDICTED_OPTIMIZERS = ADAM_OPTIMIZERS
"""Optimizers whose last step is a smoothed direction (a momentum over steps) worth extrapolating."""


class WeightPrediction:
    def __init__(self, masters: Sequence[torch.Tensor], factor: float) -> None:
        self.factor = factor
        self._masters = masters
        self._before = [torch.empty_like(m) for m in masters]
        """The masters before the last applied step."""
        self._valid_at: int | None = None
        """The version whose step ``_before`` precedes (None: no such step since start or restore)."""
        self.staleness = StalenessMean()
        self._scratch: list[torch.Tensor] | None = None

    def before_step_locked(self) -> None:
        """Under the server's lock, right before the optimizer steps."""
        with torch.no_grad():
            for before, master in zip(self._before, self._masters):
                before.copy_(master)

    def after_step_locked(self, version: int, staleness: list[int]) -> None:
        """Under the lock, once the step made ``version``; ``staleness``: its contributions'."""
        self._valid_at = version
        for tau in staleness:
            self.staleness.record(tau)

    def forget_locked(self) -> None:
        """The masters changed without a step (a restore): nothing to extrapolate until the next one."""
        self._valid_at = None
        self.staleness = StalenessMean()

    def ahead(self, version: int) -> float:
        """How many steps a pull of ``version`` is moved ahead (0 when there is no step to extrapolate)."""
        return self.factor * self.staleness.value if self._valid_at == version else 0.0

    def write(self, targets: list[torch.Tensor], version: int) -> float:
        """Under the lock: the served parameters of ``version`` written into ``targets`` (the wire dtype);
        returns how many steps ahead they are."""
        ahead = self.ahead(version)
        with torch.no_grad():
            for i, (target, master, before) in enumerate(zip(targets, self._masters, self._before)):
                if ahead == 0.0:
                    target.copy_(master)
                elif target.dtype == master.dtype:
                    extrapolate_into(target, master, before, ahead)
                else:  # a narrower wire dtype: predict in fp32, then round once
                    if self._scratch is None:
                        self._scratch = [torch.empty_like(m) for m in self._masters]
                    extrapolate_into(self._scratch[i], master, before, ahead)
                    target.copy_(self._scratch[i])
        return ahead
