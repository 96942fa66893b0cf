"""The outer optimizer of ``--mode local-steps``: Nesterov SGD over the deltas workers push.

In local-steps mode a worker takes H steps of its own inner optimizer and pushes the parameter
delta ``pulled - local`` (DiLoCo's "outer gradient", Douillard et al. 2023; torchft's ``DiLoCo``).
The server treats each delta as a gradient of this optimizer, one delta per update, so the apply
step, exactly-once, snapshots (the momentum buffer is optimizer state), standby replay and digests
are the gradient modes' own.

Defaults are not DiLoCo's (lr 0.7, Nesterov momentum 0.9), which are for one outer step per round
from the *average* of every worker's delta, over hundreds of rounds. Here each delta is a step of
its own as it arrives (asynchronous), so DiLoCo's step came to about ``workers`` times its size
and the byte-level transformer diverged (docs/EXAMPLES.md). The default lr is 1 / the workers the
job expects (``--min-workers``; ``local`` sets it to ``--workers``) and no momentum: each delta
applied at its share, the round's average (FedAvg's step), which measured +4.8 % over sync's
bits/char on that model with 4 workers (mean of 2 seeds) where momentum 0.5 cost +16 %. One worker
then takes its own inner steps exactly.

Only ``torch.optim.SGD`` is built here: it is element-wise (the flat-chunk equivalence of
``ps.core.optim`` holds) and its fused CPU kernel steps a chunk in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rpcps.settings import setting

OUTER_NAME = "nesterov-sgd"
"""What ``status`` and the resolved config call this optimizer."""


@dataclass(kw_only=True, frozen=True)
class OuterConfig:
    """Outer optimizer (--mode local-steps)."""

    lr: float | None = setting(
        None,
        flag="--outer-lr",
        help="with --mode local-steps: the outer SGD's learning rate over each pushed delta "
        "(default 1 / --min-workers: each delta applied at its share of the round, the workers' average)",
    )
    momentum: float = setting(
        0.0, flag="--outer-momentum", help="with --mode local-steps: the outer SGD's Nesterov momentum (0: none; DiLoCo's 0.9 assumes averaged rounds)"
    )

    def __post_init__(self) -> None:
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"outer lr must be > 0 (--outer-lr), got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1) (--outer-momentum), got {self.momentum}")


    def lr_for(self, expected_workers: int) -> float:
        """The lr the server steps with: --outer-lr, or 1 / the workers the job expects."""
        return self.lr if self.lr is not None else 1.0 / expected_workers


def build_outer(config: OuterConfig, expected_workers: int, params: list[torch.Tensor]) -> torch.optim.SGD:
    """Nesterov SGD over the server's flat chunks (plain SGD at momentum 0, which Nesterov refuses)."""
    lr = config.lr_for(expected_workers)
    return torch.optim.SGD(params, lr=lr, momentum=config.momentum, nesterov=config.momentum > 0, fused=True)
