"""The training settings an example ships with: what bench/reference_train.py uses by default."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class Recipe:
    """Optimizer settings under which an example visibly learns; the same names the server's flags take."""

    optimizer: str
    """A name from ps.core.optim.OPTIMIZERS (``--optimizer`` on the server)."""
    lr: float
    """Learning rate (``--optimizer-args '{"lr": ...}'`` on the server), > 0."""
    steps: int
    """Optimizer steps a one-process run needs to reach the figures quoted in the example's docstring, >= 1."""
    loss: str = "cross_entropy"
    """The ``--loss`` spec the example's model output and targets are shaped for."""

    def __post_init__(self) -> None:
        if not self.optimizer:
            raise ValueError("optimizer must name one of ps.core.optim.OPTIMIZERS, got ''")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
