#!/usr/bin/env python3
"""Trains an example in one plain process with a plain torch.optim optimizer; prints held-out scores as JSON (not a test).

    python -m bench.reference_train --example digits                   # its RECIPE: Adam 3e-3, 300 steps
    python -m bench.reference_train --example charlm --steps 400 --eval-every 100
    python -m bench.reference_train --example digits --streams 2 --steps 600   # = async, 2 workers x 300
    python -m bench.reference_train --example digits --batches-per-step 2 --steps 300   # = sync, 2 workers

The "one plain process" column of a convergence table. The data is cut into ``--streams`` shards
exactly as an rpcps run with that many workers cuts it (``data(i, streams)``), and batches are read
from the shards in turn: batch ``j`` of the run is batch ``j // streams`` of shard ``j % streams``.
Each optimizer step averages the gradients of ``--batches-per-step`` consecutive batches (one
forward/backward each, as that many sync workers would; BatchNorm sees each batch on its own). So
with K workers of N steps each, "equal samples seen" is ``--streams K --steps K*N`` for async and
``--streams K --batches-per-step K --steps N`` for sync.

The optimizer is built by the server's own ps.core.optim.build_optimizer, from the same names and
arguments the server's ``--optimizer`` and ``--optimizer-args`` take. Threads are left at torch's
defaults (the figures measure the defaults); the JSON records how many there were.

Prints one JSON object on stdout: the settings, ``curve`` (held-out scores at step 0, every
``--eval-every`` steps and at the end, each with the training seconds so far and the mean training
loss since the previous point), ``final`` (the last scores), ``final_params_only`` (the trained
parameters scored with an untrained model's buffers, i.e. BatchNorm statistics lost; null for a model
without buffers) and ``train_seconds`` (training only, without evaluation).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bench.common import emit_json
from ps.core.optim import OPTIMIZERS, OptimizerConfig, build_optimizer
from rpcps import examples, plugins
from rpcps.examples.stream import Batch


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    example: str
    """One of rpcps.examples.NAMES."""
    steps: int
    """Optimizer steps, >= 1."""
    optimizer: str
    """One of ps.core.optim.OPTIMIZERS."""
    lr: float
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments for the optimizer (momentum, betas...); ``lr`` comes from ``lr``."""
    batches_per_step: int = 1
    """Batches whose gradients one step averages (the global batch), >= 1."""
    streams: int = 1
    """Shards the training data is cut into, as for that many workers, >= 1."""
    seed: int = 0
    """Seeds the model's initialisation and the data's shuffling."""
    eval_every: int = 0
    """Score the held-out set every this many steps as well as at the start and end; 0: only those."""
    eval_batches: int | None = None
    """Score only the first this many held-out batches (quick checks); None: all of them."""

    def __post_init__(self) -> None:
        if self.example not in examples.NAMES:
            raise ValueError(f"example must be one of {list(examples.NAMES)}, got {self.example!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {self.optimizer!r}")
        if "lr" in self.optimizer_args:
            raise ValueError("optimizer_args must not hold 'lr'; it is given by lr")
        for name in ("steps", "batches_per_step", "streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"eval_batches must be >= 1 (or None for all), got {self.eval_batches}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (0: only at the start and end), got {self.eval_every}")


@dataclass(frozen=True)
class Run:
    model: torch.nn.Module
    """The trained model, in training mode."""
    report: dict[str, Any]
    """What main prints (see the module docstring)."""


def train(config: RunConfig) -> Run:
    """Trains as ``config`` says, scoring the held-out set along the way."""
    example = examples.load(config.example)
    model = example.model(seed=config.seed)
    loss_fn = plugins.load_loss(example.RECIPE.loss)
    optimizer, _ = build_optimizer(
        OptimizerConfig(name=config.optimizer, kwargs={"lr": config.lr, **config.optimizer_args}),
        list(model.parameters()),
    )
    streams = [iter(example.data(i, config.streams, seed=config.seed)) for i in range(config.streams)]
    held_out = example.eval_batches()[: config.eval_batches]
    curve: list[dict[str, Any]] = []
    losses: list[float] = []
    train_seconds = 0.0

    def record(step: int) -> None:
        scores = example.evaluate(model, held_out)
        mean_loss = sum(losses) / len(losses) if losses else None
        curve.append({"step": step, "train_seconds": train_seconds, "train_loss": mean_loss, **scores})
        losses.clear()
        print(json.dumps(curve[-1]), file=sys.stderr, flush=True)

    record(0)
    batch_number = 0
    for step in range(1, config.steps + 1):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for _ in range(config.batches_per_step):
            inputs, targets = next(streams[batch_number % config.streams])
            batch_number += 1
            # Dividing each batch's loss makes the summed gradients their mean, as a sync round's are.
            loss = loss_fn(model(inputs), targets) / config.batches_per_step
            loss.backward()
            step_loss += float(loss.detach())
        optimizer.step()
        train_seconds += time.perf_counter() - started
        losses.append(step_loss)
        if step == config.steps or (config.eval_every and step % config.eval_every == 0):
            record(step)
    return Run(model, {
        **asdict(config),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "batches_seen": batch_number,
        "train_seconds": train_seconds,
        "curve": curve,
        "final": curve[-1],
        "final_params_only": _params_only_scores(example, model, held_out),
    })


def _params_only_scores(example: examples.Example, model: torch.nn.Module, held_out: list[Batch]) -> dict[str, Any] | None:
    """Scores of the trained parameters with a freshly built model's buffers; None if it has none.

    What a model restored from a server that keeps only parameters (and no BatchNorm running
    statistics) would score: the gap to ``final`` is what losing the buffers costs.
    """
    fresh = example.model(seed=0)
    if not list(fresh.buffers()):
        return None
    fresh.load_state_dict(dict(model.named_parameters()), strict=False)
    return example.evaluate(fresh, held_out)


def parse_args(argv: list[str] | None = None) -> RunConfig:
    p = argparse.ArgumentParser(prog="python -m bench.reference_train", description=__doc__.split("\n\n")[0])
    p.add_argument("--example", required=True, choices=examples.NAMES)
    p.add_argument("--steps", type=int, help="default: the example's RECIPE")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), help="default: the example's RECIPE")
    p.add_argument("--lr", type=float, help="default: the example's RECIPE")
    p.add_argument("--optimizer-args", type=json.loads, default={}, help='JSON, e.g. \'{"momentum": 0.9}\'')
    p.add_argument("--batches-per-step", type=int, default=1, help="batches averaged per step (the global batch)")
    p.add_argument("--streams", type=int, help="workers' shards to read in turn; default: --batches-per-step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0, help="steps between held-out scores; 0: start and end only")
    p.add_argument("--eval-batches", type=int, help="score only the first N held-out batches; default: all")
    a = p.parse_args(argv)
    recipe = examples.load(a.example).RECIPE
    return RunConfig(
        example=a.example,
        steps=a.steps if a.steps is not None else recipe.steps,
        optimizer=a.optimizer or recipe.optimizer,
        lr=a.lr if a.lr is not None else recipe.lr,
        optimizer_args=a.optimizer_args,
        batches_per_step=a.batches_per_step,
        streams=a.streams if a.streams is not None else a.batches_per_step,
        seed=a.seed,
        eval_every=a.eval_every,
        eval_batches=a.eval_batches,
    )


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    emit_json(train(config).report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
