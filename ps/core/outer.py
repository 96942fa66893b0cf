"""The outer optimizer of ``--mode local-steps``: Nesterov SGD over the deltas workers push.

In local-steps mode a worker takes H steps of its own inner optimizer and pushes the parameter
delta ``pulled - local`` (DiLoCo's "outer gradient", Douillard et al. 2023; torchft's ``DiLoCo``).
The server treats each delta as a gradient of this optimizer, one delta per update, so the apply
step, exactly-once, snapshots (the momentum buffer is optimizer state), standby replay and digests
are the gradient modes' own. Defaults are DiLoCo's: lr 0.7, momentum 0.9, Nesterov.

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

    lr: float = setting(0.7, flag="--outer-lr", help="with --mode local-steps: the outer Nesterov SGD's learning rate over pushed deltas")
    momentum: float = setting(0.9, flag="--outer-momentum", help="with --mode local-steps: the outer Nesterov SGD's momentum")

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"outer lr must be > 0 (--outer-lr), got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1) (--outer-momentum), got {self.momentum}")


def build_outer(config: OuterConfig, params: list[torch.Tensor]) -> torch.optim.SGD:
    """Nesterov SGD over the server's flat chunks (plain SGD at momentum 0, which Nesterov refuses)."""
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, nesterov=config.momentum > 0, fused=True)
