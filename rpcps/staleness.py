"""Staleness remedies for Adam: pure, element-wise functions of tensors (no server, no state of their own).

An async gradient was computed on parameters ``stale`` that are ``tau`` updates older than the
parameters ``now`` it is applied to. Each rule below changes the step so that it hurts less; the
simulator (``bench/stale_gradients.py``) and the server's apply step call the same functions, so what
the simulator measured is what the server does. Every function is deterministic (the same inputs give
the same bits), which a standby that replays the primary's log relies on.

- ``lr_scale``: the learning rate divided by ``1 + tau``; ``lr_inverse``: divided by ``tau`` once a
  gradient is at least one update old, Zhang et al. 2016's own rule ("Staleness-aware Async-SGD").
- ``dc_asgd``: delay compensation with an adaptive lambda (DC-ASGD-a, Zheng et al. 2017):
  ``g + lam * g*g / sqrt(v) * (now - stale)``, Adam's second moment ``v`` as the mean square.
- ``gap_aware``: ``g / (1 + |now - stale| / C)`` (Barkai et al. 2020), ``C`` the running RMS of the
  steps each parameter took (``StepRms``).
- ``predict``: the parameters a worker is served, moved ahead by ``ahead`` Adam steps along the
  optimizer's own moments (weight prediction as in PipeOptim / FTPipe), so the gradient is computed
  near where the parameters will be when it lands; ``extrapolate_into`` is the same for Adam, from
  the last step, in one pass (what the server uses).

What must not live here: anything that knows about versions, rings, snapshots or metrics; the
caller owns those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamView:
    """What the rules read of one tensor's Adam state (torch.optim.Adam's ``exp_avg``, ``exp_avg_sq``, ``step``)."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int
    """Optimizer steps taken so far (0: no moments yet)."""
    lr: float
    beta1: float
    beta2: float
    eps: float


def adam_view(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> AdamView | None:
    """``param``'s Adam state in ``optimizer`` (Adam or AdamW), or None before its first step."""
    state = optimizer.state.get(param)
    if not state or "exp_avg" not in state:
        return None
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    beta1, beta2 = group["betas"]
    return AdamView(state["exp_avg"], state["exp_avg_sq"], int(state["step"]), float(group["lr"]), beta1, beta2, group["eps"])


def lr_scale(tau: int) -> float:
    """The factor a gradient ``tau`` updates old scales the learning rate by: ``1 / (1 + tau)``."""
    if tau < 0:
        raise ValueError(f"staleness must be >= 0, got {tau}")
    return 1.0 / (1 + tau)


def lr_inverse(tau: int) -> float:
    """The factor Zhang et al.'s rule scales the learning rate by: ``1 / tau``, and 1 for ``tau`` 0 or 1.

    A gradient one update old keeps the full rate, so what two async workers see (one update of
    staleness each) is unchanged; a gradient three updates old (four workers) takes a third of it.
    """
    if tau < 0:
        raise ValueError(f"staleness must be >= 0, got {tau}")
    return 1.0 / max(1, tau)


def dc_asgd(grad: torch.Tensor, now: torch.Tensor, stale: torch.Tensor, adam: AdamView | None, lam: float) -> torch.Tensor:
    """The compensation DC-ASGD-a adds to ``grad``: ``lam * g*g / (sqrt(v_hat) + eps) * (now - stale)``.

    ``v_hat`` is Adam's second moment with this gradient already folded in and bias-corrected (what
    the coming step divides by), so the term is at most ``lam * |g| / sqrt(1 - beta2) * |now - stale|``
    even for a parameter whose moment is still near zero. Returns the compensation (add it to the
    gradient); zeros before Adam has moments.
    """
    if adam is None:
        return torch.zeros_like(grad)
    t = adam.step + 1
    v_hat = (adam.exp_avg_sq * adam.beta2 + grad * grad * (1 - adam.beta2)) / (1 - adam.beta2**t)
    return grad * grad / (v_hat.sqrt() + adam.eps) * (now - stale) * lam


def gap_aware(grad: torch.Tensor, now: torch.Tensor, stale: torch.Tensor, step_rms: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """The penalty Gap-Aware divides ``grad`` by: ``1 + |now - stale| / step_rms`` (>= 1 everywhere).

    A parameter that moved as far as it usually moves in one step since the gradient's parameters
    were served gets half its gradient; one that did not move gets all of it.
    """
    return (now - stale).abs_().div_(step_rms + eps).add_(1.0)


class StepRms:
    """Gap-Aware's ``C``: a bias-corrected running RMS of each element's applied steps.

    Its state (``mean_square``, ``count``) must travel with a snapshot, or restart from zero on both
    a primary and its standby alike.
    """

    def __init__(self, like: torch.Tensor, beta: float = 0.999) -> None:
        self.beta = beta
        self.mean_square = torch.zeros_like(like)
        self.count = 0

    def record(self, before: torch.Tensor, after: torch.Tensor) -> None:
        delta = after - before
        self.mean_square.mul_(self.beta).addcmul_(delta, delta, value=1 - self.beta)
        self.count += 1

    def rms(self) -> torch.Tensor:
        if self.count == 0:
            return torch.zeros_like(self.mean_square)
        return (self.mean_square / (1 - self.beta**self.count)).sqrt_()


def predict(params: torch.Tensor, adam: AdamView | None, ahead: float) -> torch.Tensor:
    """``params`` moved ``ahead`` Adam steps along the current moments, as the next steps would move
    them if their gradients looked like the recent ones:
    ``params - ahead * lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``.

    A new tensor; ``params`` itself is not changed. Before Adam's first step (no moments), a copy.
    """
    out = torch.empty_like(params)
    predict_into(out, params, adam, ahead, torch.empty_like(params))
    return out


def predict_into(out: torch.Tensor, params: torch.Tensor, adam: AdamView | None, ahead: float, scratch: torch.Tensor) -> None:
    """``predict`` written into ``out`` (``scratch``: a tensor like ``params`` it may overwrite), so a
    caller that predicts every version allocates nothing."""
    out.copy_(params)
    if adam is None or adam.step == 0 or ahead == 0:
        return
    t = adam.step
    torch.sqrt(adam.exp_avg_sq, out=scratch)
    scratch.div_(math.sqrt(1 - adam.beta2**t)).add_(adam.eps)
    out.addcdiv_(adam.exp_avg, scratch, value=-ahead * adam.lr / (1 - adam.beta1**t))


def extrapolate_into(out: torch.Tensor, now: torch.Tensor, previous: torch.Tensor, ahead: float) -> None:
    """``now + ahead * (now - previous)`` written into ``out`` (one pass): the parameters moved ``ahead``
    more steps like the last one.

    After an Adam step with a constant learning rate this is ``predict`` (the last step was
    ``-lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)`` with the moments Adam holds
    now), up to rounding, at a fraction of its cost; the server predicts this way
    (tests/unit/rpcps/test_staleness.py checks the two agree).
    """
    torch.lerp(previous, now, 1.0 + ahead, out=out)


class StalenessMean:
    """A running mean of the staleness of applied pushes (exponential, weight ``alpha`` on the newest):
    how far ahead a prediction should look. A function of the applied updates alone, so it is the same
    on every replica that applied the same log."""

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.value = 0.0

    def record(self, tau: int) -> None:
        self.value += self.alpha * (tau - self.value)
