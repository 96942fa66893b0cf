"""Row optimizers: in-place updates of a gathered block of slab rows [n, dim + state].

The table gathers the rows of one push's unique ids, calls ``step(block, grads)``, and scatters the
block back; rows that were not pushed are never read or written ("lazy" updates, the semantics every
sparse parameter server uses). Each optimizer is a frozen, validated config that is also its own
(stateless) update rule; the state lives in the row, after the embedding:

=================  =====================  ======================================================
optimizer          state columns          update of one row with gradient g (dim D)
=================  =====================  ======================================================
SGD                0                      w -= lr * g
Adagrad            D: acc                 acc += g*g; w -= lr * g / (sqrt(acc) + eps)
RowWiseAdagrad     1: acc                 acc += mean(g*g); w -= lr / (sqrt(acc) + eps) * g
LazyAdam           2D+1: m, v, step       torch.optim.Adam with a per-row step count
FTRL               2D: z, n               FTRL-Proximal, McMahan et al. 2013, Algorithm 1
=================  =====================  ======================================================

SGD, Adagrad and LazyAdam use the same torch ops, in the same order, as torch.optim's single-tensor
implementations, so a row's result is bit-identical to stepping that row alone with torch.optim
(the tests check it). LazyAdam keeps its step count as int32 bits in the last float32 column, so it
counts to 2**31 exactly rather than to 2**24.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

import torch


class RowOptimizer(Protocol):
    name: ClassVar[str]

    def state_width(self, dim: int) -> int:
        """Columns of optimizer state after the dim embedding columns."""
        ...

    def initial_state(self, n: int, dim: int) -> torch.Tensor:
        """float32 [n, state_width(dim)]: the state of n new rows."""
        ...

    def step(self, block: torch.Tensor, grads: torch.Tensor) -> None:
        """Updates block [n, dim + state] in place from grads [n, dim] (one row per unique id)."""
        ...

    def to_dict(self) -> dict[str, Any]: ...


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_lr(lr: float) -> None:
    _require(math.isfinite(lr) and lr > 0, f"lr must be a finite number > 0, got {lr}")


def _check_eps(eps: float) -> None:
    _require(math.isfinite(eps) and eps > 0, f"eps must be a finite number > 0, got {eps}")


def _check_accumulator(value: float) -> None:
    _require(math.isfinite(value) and value >= 0, f"initial_accumulator_value must be >= 0, got {value}")


class _Named:
    name: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **asdict(self)}  # type: ignore[call-overload]


@dataclass(kw_only=True, frozen=True)
class SGD(_Named):
    name: ClassVar[str] = "sgd"
    lr: float

    def __post_init__(self) -> None:
        _check_lr(self.lr)

    def state_width(self, dim: int) -> int:
        return 0

    def initial_state(self, n: int, dim: int) -> torch.Tensor:
        return torch.empty(n, 0, dtype=torch.float32)

    def step(self, block: torch.Tensor, grads: torch.Tensor) -> None:
        dim = grads.shape[1]
        block[:, :dim].add_(grads, alpha=-self.lr)


@dataclass(kw_only=True, frozen=True)
class _AccumulatorSettings(_Named):
    """Settings shared by the Adagrad variants; state columns start at initial_accumulator_value."""

    lr: float
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        _check_eps(self.eps)
        _check_accumulator(self.initial_accumulator_value)

    def initial_state(self, n: int, dim: int) -> torch.Tensor:
        return torch.full((n, self.state_width(dim)), self.initial_accumulator_value, dtype=torch.float32)

    def state_width(self, dim: int) -> int:
        raise NotImplementedError


@dataclass(kw_only=True, frozen=True)
class Adagrad(_AccumulatorSettings):
    name: ClassVar[str] = "adagrad"

    def state_width(self, dim: int) -> int:
        return dim

    def step(self, block: torch.Tensor, grads: torch.Tensor) -> None:
        dim = grads.shape[1]
        w, acc = block[:, :dim], block[:, dim:]
        acc.addcmul_(grads, grads, value=1)
        w.addcdiv_(grads, acc.sqrt().add_(self.eps), value=-self.lr)


@dataclass(kw_only=True, frozen=True)
class RowWiseAdagrad(_AccumulatorSettings):
    """One accumulator per row (the mean of g*g over the row), as FBGEMM's EXACT_ROWWISE_ADAGRAD."""

    name: ClassVar[str] = "rowwise_adagrad"

    def state_width(self, dim: int) -> int:
        return 1

    def step(self, block: torch.Tensor, grads: torch.Tensor) -> None:
        dim = grads.shape[1]
        w, acc = block[:, :dim], block[:, dim:]
        acc.add_(grads.square().mean(dim=1, keepdim=True))
        w.sub_(grads * (self.lr / (acc.sqrt() + self.eps)))


@dataclass(kw_only=True, frozen=True)
class LazyAdam(_Named):
    """Adam applied only to pushed rows, each with its own step count for the bias corrections."""

    name: ClassVar[str] = "lazy_adam"
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        _check_eps(self.eps)
        for field, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            _require(0 <= beta < 1, f"{field} must be in [0, 1), got {beta}")

    def state_width(self, dim: int) -> int:
        return 2 * dim + 1

    def initial_state(self, n: int, dim: int) -> torch.Tensor:
        return torch.zeros(n, 2 * dim + 1, dtype=torch.float32)  # all-zero bits: step 0 as int32 too

    def step(self, block: torch.Tensor, grads: torch.Tensor) -> None:
        dim = grads.shape[1]
        w, m, v = block[:, :dim], block[:, dim : 2 * dim], block[:, 2 * dim : 3 * dim]
        steps = block[:, 3 * dim].view(torch.int32)
        steps.add_(1)
        m.lerp_(grads, 1 - self.beta1)
        v.mul_(self.beta2).addcmul_(grads, grads, value=1 - self.beta2)
        # torch.optim.Adam computes these per tensor in float64 (Python floats); here they are per row,
        # still in float64, and rounded to float32 where torch rounds its Python scalars.
        t = steps.to(torch.float64)
        step_size = self.lr / (1 - torch.pow(self.beta1, t))
        bias_correction2_sqrt = (1 - torch.pow(self.beta2, t)).sqrt()
        denom = (v.sqrt() / bias_correction2_sqrt.to(torch.float32).unsqueeze(1)).add_(self.eps)
        w.add_((-step_size).to(torch.float32).unsqueeze(1) * m / denom)


@dataclass(kw_only=True, frozen=True)
class FTRL(_Named):
    """FTRL-Proximal per coordinate: z and n in the row, w recomputed from them on every update."""

    name: ClassVar[str] = "ftrl"
    lr: float
    """alpha in the paper."""
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0
    initial_accumulator_value: float = 0.0
    """Initial n."""

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        _check_accumulator(self.initial_accumulator_value)
        for field, value in (("beta", self.beta), ("l1", self.l1), ("l2", self.l2)):
            _require(math.isfinite(value) and value >= 0, f"{field} must be a finite number >= 0, got {value}")
        # With all three zero, the first update of a coordinate with n == 0 divides by zero.
        _require(
            self.beta > 0 or self.l2 > 0 or self.initial_accumulator_value > 0,
            "beta, l2 or initial_accumulator_value must be > 0",
        )

    def state_width(self, dim: int) -> int:
        return 2 * dim

    def initial_state(self, n: int, dim: int) -> torch.Tensor:
        state = torch.zeros(n, 2 * dim, dtype=torch.float32)
        state[:, dim:] = self.initial_accumulator_value
        return state

    def step(self, block: torch.Tensor, grads: torch.Tensor) -> None:
        dim = grads.shape[1]
        w, z, n = block[:, :dim], block[:, dim : 2 * dim], block[:, 2 * dim :]
        n_new = n + grads * grads
        sqrt_n_new = n_new.sqrt()
        sigma = (sqrt_n_new - n.sqrt()) / self.lr
        z.add_(grads - sigma * w)
        n.copy_(n_new)
        shrunk = z - z.sign() * self.l1
        w.copy_(torch.where(z.abs() <= self.l1, 0.0, -shrunk / ((sqrt_n_new + self.beta) / self.lr + self.l2)))


ROW_OPTIMIZERS: tuple[type[_Named], ...] = (SGD, Adagrad, RowWiseAdagrad, LazyAdam, FTRL)

