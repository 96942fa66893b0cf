"""One plain process whose gradients are N updates old: what staleness alone costs, and what each remedy wins back.

    python -m bench.stale_gradients --example charlm --delay 1      # ~1 min on two cores
    python -m bench.stale_gradients --example digits --delay 2
    python -m bench.stale_gradients --example charlm --delay 2 --predict --eval-at 100,200

Step t computes its gradient on the parameters (and buffers) served at step t - N and applies it to
the current ones, with the example's recipe (optimizer and learning rate, built by the server's own
``ps.core.optim``) and its data order for one worker. That is what an async worker sees when its
gradient is N updates old, without any process, RPC or other worker, so it tells staleness apart
from everything else rpcps does. ``--delay 0`` is ``bench.reference_train``'s one-process run.

The remedies (``rpcps.staleness``, the functions the server applies; any may be combined):
``--lr-scale`` (lr / (1 + tau); ``--lr-scale inverse``: lr / tau from tau 2 on, the server's
``--staleness-lr``), ``--dc-lambda`` (DC-ASGD-a), ``--gap-aware``, ``--predict`` (the served
parameters moved ahead by the delay with Adam's moments), ``--warmup W`` (the first W steps fresh),
``--beta1`` and ``--beta2`` (Adam's moment decays; the server's async default is beta2 0.99,
``--async-beta2``). Prints one JSON object: the settings, the held-out scores at the end (and at each ``--eval-at`` step) and the seconds the training steps took.

``--accumulate K`` is K-async SGD (Dutta et al. 2018, "Slow and Stale Gradients Can Win the Race"):
one update from the mean of every K gradients, whichever workers sent them, and ``--delay`` counts
gradients then (the pushes of the other workers between a worker's pull and its push), so a
gradient is ``floor(t / K) - floor((t - delay) / K)`` updates old. ``--steps`` counts gradients (equal
samples); K = 1 is the plain run. Of the remedies only ``--predict`` combines with it.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import deque

import torch

from bench.common import emit_json
from ps.core.optim import OptimizerConfig, build_optimizer
from rpcps import examples, plugins, staleness

LR_SCALES = {"plus-one": staleness.lr_scale, "inverse": staleness.lr_inverse}


def _served(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ahead: float) -> dict[str, torch.Tensor]:
    """What a pull returns now: the model's state, its parameters moved ``ahead`` steps when predicting."""
    state = copy.deepcopy(model.state_dict())
    if ahead:
        for name, p in model.named_parameters():
            state[name] = staleness.predict(p.detach(), staleness.adam_view(optimizer, p), ahead)
    return state


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stale_gradients", description=__doc__.split("\n\n")[0])
    p.add_argument("--example", required=True, choices=examples.NAMES)
    p.add_argument("--delay", type=int, default=1, help="updates a gradient is old when applied (>= 0)")
    p.add_argument("--steps", type=int, help="default: the example's RECIPE")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    p.add_argument("--eval-at", default="", help="comma-separated steps to also score the held-out set at")
    p.add_argument("--lr-scale", nargs="?", const="plus-one", choices=sorted(LR_SCALES), metavar="RULE",
                   help="plus-one (no value): learning rate / (1 + staleness); inverse: / staleness from 2 on (the server's --staleness-lr)")
    p.add_argument("--dc-lambda", type=float, default=0.0, help="DC-ASGD-a's lambda0 (0: off)")
    p.add_argument("--gap-aware", action="store_true", help="gradient / (1 + |gap| / running RMS of steps)")
    p.add_argument("--predict", nargs="?", type=float, const=-1.0, default=0.0, metavar="AHEAD",
                   help="served parameters moved AHEAD Adam steps ahead (no value: the delay; Adam only)")
    p.add_argument("--warmup", type=int, default=0, help="the first W steps use fresh gradients")
    p.add_argument("--beta1", type=float, help="Adam's beta1 (default: torch's 0.9)")
    p.add_argument("--beta2", type=float, help="Adam's beta2 (default: torch's 0.999)")
    p.add_argument("--lr", type=float, help="default: the example's RECIPE")
    p.add_argument("--accumulate", type=int, default=1, metavar="K",
                   help="one update from the mean of every K gradients (K-async SGD; --delay then counts gradients)")
    a = p.parse_args(argv)
    if a.delay < 0:
        p.error("--delay must be >= 0")
    if a.accumulate < 1 or (a.accumulate > 1 and (a.lr_scale or a.dc_lambda or a.gap_aware or a.warmup)):
        p.error("--accumulate must be >= 1, and above 1 it combines with --predict only")
    example = examples.load(a.example)
    recipe = example.RECIPE
    steps = a.steps or recipe.steps
    eval_at = {int(s) for s in a.eval_at.split(",") if s}
    model, stale = example.model(seed=a.seed), example.model(seed=a.seed)
    loss_fn = plugins.load_loss(recipe.loss)
    lr = a.lr or recipe.lr
    kwargs: dict = {"lr": lr}
    if a.beta1 is not None or a.beta2 is not None:
        kwargs["betas"] = (0.9 if a.beta1 is None else a.beta1, 0.999 if a.beta2 is None else a.beta2)
    optimizer, _ = build_optimizer(OptimizerConfig(name=recipe.optimizer, kwargs=kwargs), list(model.parameters()))
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    step_rms = [staleness.StepRms(p_.detach()) for p_ in params] if a.gap_aware else []
    batches = iter(example.data(0, 1, seed=a.seed))
    k = a.accumulate
    lag = -(-a.delay // k)  # the most updates a gradient is old
    ahead = lag if a.predict == -1.0 else a.predict
    history: deque[dict[str, torch.Tensor]] = deque([_served(model, optimizer, ahead)], maxlen=lag + 1)
    """Served states of the newest versions, history[-1] the current one."""
    scores: dict[str, dict[str, float]] = {}
    train_s = 0.0
    for t in range(steps):
        started = time.perf_counter()
        inputs, targets = next(batches)
        fresh = t < a.warmup
        version = t // k
        tau = 0 if fresh else min(version - max(t - a.delay, 0) // k, len(history) - 1)
        served = copy.deepcopy(model.state_dict()) if fresh else history[len(history) - 1 - tau]
        stale.load_state_dict(served)
        if t % k == 0:
            stale.zero_grad()  # gradients add up in the stale copy until their update
        loss_fn(stale(inputs), targets).backward()
        # The stale copy's forward pass updated its buffers (BatchNorm): those become the model's, as
        # a push's buffers become the server's.
        if (t + 1) % k:
            train_s += time.perf_counter() - started
            continue
        with torch.no_grad():
            for (_, b), (_, s) in zip(model.named_buffers(), stale.named_buffers()):
                b.copy_(s)
            for i, (p_, s_) in enumerate(zip(params, stale.parameters())):
                g = s_.grad / k
                if tau and a.dc_lambda:
                    g = g + staleness.dc_asgd(g, p_, served[names[i]], staleness.adam_view(optimizer, p_), a.dc_lambda)
                if tau and a.gap_aware:
                    g = g / staleness.gap_aware(g, p_, served[names[i]], step_rms[i].rms())
                p_.grad = g
            before = [p_.detach().clone() for p_ in params] if a.gap_aware else []
            scale = LR_SCALES[a.lr_scale](tau) if a.lr_scale else 1.0
            for group in optimizer.param_groups:
                group["lr"] = lr * scale
            optimizer.step()
            for rms, b, p_ in zip(step_rms, before, params):
                rms.record(b, p_)
        history.append(_served(model, optimizer, ahead))
        train_s += time.perf_counter() - started
        if t + 1 in eval_at and t + 1 < steps:
            scores[str(t + 1)] = example.evaluate(model)
    scores[str(steps)] = example.evaluate(model)
    report = {"example": a.example, "delay": a.delay, "steps": steps, "seed": a.seed, "optimizer": recipe.optimizer,
              "lr": lr, "lr_scale": a.lr_scale, "dc_lambda": a.dc_lambda, "gap_aware": a.gap_aware,
              "predict": ahead, "warmup": a.warmup, "beta1": a.beta1, "beta2": a.beta2, "accumulate": k, "train_s": round(train_s, 2),
              "held_out": scores[str(steps)], "held_out_at": scores}
    emit_json(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
