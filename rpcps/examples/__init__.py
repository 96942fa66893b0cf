"""Real training examples that need no download, usable through ``--model/--data/--loss`` specs.

- ``digits``: scikit-learn's bundled 8x8 handwritten digits, a small CNN with BatchNorm (so the model
  has buffers, one of them int64). Needs ``pip install rpcps[examples]``.
- ``charlm``: a byte-level transformer language model on this interpreter's own standard library
  source.

``ctr`` (the built-in CTR task: a Criteo-shaped generator and a DLRM model with sparse tables) lives
here too, so a server building its model loads no worker code; it is named by spec
(``--model rpcps.examples.ctr:dlrm_model``, docs/SPARSE.md), not in ``NAMES``: its evaluation is AUC
on sparse batches, not this protocol.

Each example module offers ``model()``, ``data(worker_index, num_workers)`` (an endless stream with
``seek``), ``eval_batches()``, ``evaluate(model, batches) -> dict`` and ``RECIPE`` (the optimizer
settings it trains well with). ``bench/reference_train.py`` trains one in a single plain process.
Importing this package imports neither example, so listing them needs neither scikit-learn nor the
corpus.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Protocol

import torch

from rpcps.examples.recipe import Recipe
from rpcps.examples.stream import Batch, ShardedStream

NAMES = ("digits", "charlm")


class Example(Protocol):
    """What an example module provides (the modules themselves satisfy it)."""

    RECIPE: Recipe

    def model(self, seed: int = ...) -> torch.nn.Module: ...

    def data(self, worker_index: int, num_workers: int, seed: int = ...) -> ShardedStream: ...

    def eval_batches(self) -> list[Batch]: ...

    def evaluate(self, model: torch.nn.Module, batches: Iterable[Batch] | None = None) -> dict[str, float]: ...


def load(name: str) -> Example:
    """Imports example ``name`` (one of NAMES)."""
    if name not in NAMES:
        raise ValueError(f"example must be one of {list(NAMES)}, got {name!r}")
    module = importlib.import_module(f"{__name__}.{name}")
    return module  # a module satisfies the Protocol structurally
