"""One plain process whose gradients are N updates old: what staleness alone costs an example.

    python -m bench.stale_gradients --example charlm --delay 1      # ~1 min on two cores
    python -m bench.stale_gradients --example digits --delay 2

Step t computes its gradient on the parameters (and buffers) of step t - N and applies it to the
current ones, with the example's recipe (optimizer and learning rate, built by the server's own
``ps.core.optim``) and its data order for one worker. That is what an async worker sees when its
gradient is N updates old, without any process, RPC or other worker, so it tells staleness apart
from everything else rpcps does. ``--delay 0`` is ``bench.reference_train``'s one-process run.
Prints one JSON object: the settings and the held-out scores.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections import deque

import torch

from bench.common import emit_json
from ps.core.optim import OptimizerConfig, build_optimizer
from rpcps import examples, plugins


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stale_gradients", description=__doc__.split("\n\n")[0])
    p.add_argument("--example", required=True, choices=examples.NAMES)
    p.add_argument("--delay", type=int, default=1, help="updates a gradient is old when applied (>= 0)")
    p.add_argument("--steps", type=int, help="default: the example's RECIPE")
    a = p.parse_args(argv)
    if a.delay < 0:
        p.error("--delay must be >= 0")
    example = examples.load(a.example)
    recipe = example.RECIPE
    steps = a.steps or recipe.steps
    model, stale = example.model(seed=0), example.model(seed=0)
    loss_fn = plugins.load_loss(recipe.loss)
    optimizer, _ = build_optimizer(OptimizerConfig(name=recipe.optimizer, kwargs={"lr": recipe.lr}), list(model.parameters()))
    batches = iter(example.data(0, 1))
    history: deque[dict[str, torch.Tensor]] = deque([copy.deepcopy(model.state_dict())], maxlen=a.delay + 1)
    for _ in range(steps):
        inputs, targets = next(batches)
        stale.load_state_dict(history[0])
        stale.zero_grad()
        loss_fn(stale(inputs), targets).backward()
        # The stale copy's forward pass updated its buffers (BatchNorm): those become the model's, as
        # a push's buffers become the server's.
        with torch.no_grad():
            for (_, b), (_, s) in zip(model.named_buffers(), stale.named_buffers()):
                b.copy_(s)
        for p_, s_ in zip(model.parameters(), stale.parameters()):
            p_.grad = s_.grad
        optimizer.step()
        history.append(copy.deepcopy(model.state_dict()))
    report = {"example": a.example, "delay": a.delay, "steps": steps, "optimizer": recipe.optimizer, "lr": recipe.lr,
              "held_out": example.evaluate(model)}
    emit_json(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
