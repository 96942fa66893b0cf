"""The worker's side of ``--mode local-steps``: the parameters a round started from, and its delta.

A round is one step of the slot: H inner steps of the loop's own optimizer on the step's H
micro-batches, then one push of ``start - now`` (DiLoCo's outer gradient) where a gradient mode
pushes gradients. The server's outer optimizer (``ps.core.outer``) applies it, and the next round
starts from the parameters it returns. The inner optimizer and its state belong to the loop and
live in this process only: a restarted worker starts them afresh (docs/FAULT_TOLERANCE.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.optim.adam import adam
from torch.optim.adamw import adamw
from torch.optim.sgd import sgd

from rpcps.optim_kernels import fast_kernel
from worker.config import INNER_OPTIMIZERS, WorkerConfig


class RoundStart:
    """A copy of the parameters as a round began (after the pull), turned into the delta at its push."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = params
        self.origin = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in params]
        self._index = {id(p): i for i, p in enumerate(params)}

    def begin(self) -> None:
        with torch.no_grad():
            for o, p in zip(self.origin, self.params):
                o.copy_(p)

    def rebase(self, params: Sequence[torch.Tensor], load: Callable[[], None]) -> None:
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


class FusedInnerStep:
    """torch.optim's Adam, AdamW or SGD update, taken by its public functional form on the fused kernel
    (``torch.optim.adamw.adamw``, ``torch.optim.adam.adam``, ``torch.optim.sgd.sgd``) on state kept
    here: bit for bit what ``torch.optim.AdamW(fused=True).step()`` does, without the bookkeeping of
    an Optimizer's step (the profiler's record, the dynamo guard, gathering each group's state). On
    the 22k-parameter MLP that bookkeeping cost as much as the update itself: 0.15 against 0.075 ms a
    step, a tenth of a local-steps worker's CPU per batch (docs/EXAMPLES.md, local steps). The
    hyperparameters are the ``defaults`` of the torch.optim optimizer built with the same arguments
    (torch's own but ``lr``), which keep no state this class would have to (no amsgrad, no SGD momentum)."""

    def __init__(self, name: str, params: list[torch.Tensor], lr: float) -> None:
        self.name = name
        self.params = params
        self.hyper = _TORCH_OPTIMIZERS[name](params, lr=lr, fused=True).defaults
        if self.hyper.get("amsgrad") or self.hyper.get("momentum"):
            raise ValueError(f"{name}'s defaults changed: amsgrad or momentum needs state FusedInnerStep does not keep")
        stateful = name != "sgd"
        self.exp_avgs = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params] if stateful else []
        self.exp_avg_sqs = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params] if stateful else []
        self.steps = [torch.zeros((), dtype=torch.float32, device=p.device) for p in params] if stateful else []

    def step(self) -> None:
        live: list[int] = []
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for i, p in enumerate(self.params):
            if p.grad is None:  # as torch.optim: no gradient, no step
                continue
            if p.grad.is_sparse:
                raise ValueError(f"the inner step of --mode local-steps takes dense gradients ({self.name} on its fused kernel); "
                                 "the model produced a sparse one (an nn.Embedding with sparse=True): build it with sparse=False")
            live.append(i)
            params.append(p)
            grads.append(p.grad)
        h = self.hyper
        with torch.no_grad():
            if self.name == "sgd":  # without momentum (checked above) there are no buffers to keep
                sgd(params, grads, [None] * len(params), fused=True, weight_decay=h["weight_decay"], momentum=0.0,
                    lr=h["lr"], dampening=0.0, nesterov=False, maximize=h["maximize"])
                return
            _ADAM_STEPS[self.name](
                params, grads, [self.exp_avgs[i] for i in live], [self.exp_avg_sqs[i] for i in live], [],
                [self.steps[i] for i in live], fused=True, amsgrad=False, beta1=h["betas"][0], beta2=h["betas"][1],
                lr=h["lr"], weight_decay=h["weight_decay"], eps=h["eps"], maximize=h["maximize"],
            )

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


_TORCH_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
}

_ADAM_STEPS = {"adamw": adamw, "adam": adam}


def inner_optimizer(config: WorkerConfig, params: list[torch.Tensor]) -> FusedInnerStep | torch.optim.Optimizer:
    """The CLI loop's inner optimizer (``--inner-optimizer``, ``--inner-lr``; torch's other defaults):
    ``FusedInnerStep`` where the device has fused kernels (``rpcps.optim_kernels``), else torch.optim's
    own optimizer on its default kernel."""
    assert config.inner_optimizer in INNER_OPTIMIZERS
    if fast_kernel(config.inner_optimizer, params):
        return FusedInnerStep(config.inner_optimizer, params, config.inner_lr)
    return _TORCH_OPTIMIZERS[config.inner_optimizer](params, lr=config.inner_lr)
