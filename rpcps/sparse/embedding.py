"""The model-side sparse embedding API: a module that replaces ``nn.EmbeddingBag`` / ``nn.Embedding``.

``SparseEmbeddingBagCollection`` holds no rows: it declares its tables (``sparse_tables``, read by
the server to create them) and, in each forward, fetches the rows of the ids it is given from the
servers through a ``RowSource`` (``worker.sparse_client.SparseRouter`` in training). Per step:

1. per table, ``torch.unique(ids, return_inverse=True)``: each distinct id is pulled once;
2. one pull per server shard for all tables together (the source splits ids by owning shard);
3. the pulled rows become a leaf tensor ``[n_unique, dim]`` that requires grad, and the output is
   ``F.embedding_bag`` (pooled) or ``F.embedding`` (per id) over it, indexed by the inverse;
4. after backward, that leaf's ``.grad`` is the gradient summed per unique id (the embedding
   backward is an index_add over the inverse): ``take_grads`` hands ``{table: (ids, grads)}`` to
   the trainer, which pushes each shard its part with the dense gradients of the same step.

The dense part of a model stays ordinary ``nn.Module`` parameters on the dense path.
Input, per table: ``(ids, offsets)`` with 1-D int64 ids and bag start offsets (like
``nn.EmbeddingBag``), ``(ids, None)`` with 2-D ids ``[bags, bag_size]``, or, with ``pooling="none"``,
ids of any shape (per-id vectors of shape ``ids.shape + (dim,)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from rpcps.sparse.spec import SparsePull, SparsePush, TableSpec, check_unique

Pooling = Literal["sum", "mean", "none"]
Features = dict[str, tuple[torch.Tensor, torch.Tensor | None]]


class RowSource(Protocol):
    def pull(self, request: SparsePull) -> SparsePull:
        """fp32 rows ``[n, dim]`` for ``{table name: unique ids}`` (one pull per server shard)."""
        ...


class NotAttached(RuntimeError):
    """The module was called before the trainer attached a RowSource."""


class SparseEmbeddingBagCollection(nn.Module):
    """Embedding tables whose rows live on the parameter servers (see the module docstring).

    Args:
        tables: the tables, unique names and ids.
        pooling: "sum" or "mean" pool each bag (nn.EmbeddingBag); "none" returns one vector per id
            (nn.Embedding).
    """

    def __init__(self, tables: Sequence[TableSpec], pooling: Pooling = "sum") -> None:
        super().__init__()
        if not tables:
            raise ValueError("tables must name at least one table")
        if pooling not in ("sum", "mean", "none"):
            raise ValueError(f"pooling must be 'sum', 'mean' or 'none', got {pooling!r}")
        check_unique(tables)
        self.sparse_tables = tuple(tables)
        self.pooling = pooling
        self._source: RowSource | None = None
        self._pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        """Per table, (unique ids, leaf rows) of every training forward since ``take_grads``: a step
        with accumulation makes several."""
        self._lookups = (0, 0)
        """(ids looked up, distinct ids pulled) by training forwards since ``take_lookup_counts``."""

    def attach(self, source: RowSource) -> None:
        self._source = source

    def forward(self, features: Features) -> dict[str, torch.Tensor]:
        if self._source is None:
            raise NotAttached("SparseEmbeddingBagCollection needs a RowSource: the worker's trainer attaches one")
        unknown = set(features) - {t.name for t in self.sparse_tables}
        if unknown:
            raise ValueError(f"features name unknown tables {sorted(unknown)}")
        uniques: dict[str, torch.Tensor] = {}
        inverses: dict[str, torch.Tensor] = {}
        for name, (ids, _) in features.items():
            if ids.dtype != torch.int64:
                raise TypeError(f"ids of table {name!r} must be int64, got {ids.dtype}")
            uniques[name], inverses[name] = torch.unique(ids, return_inverse=True)
        rows = self._source.pull(uniques)
        track = self.training and torch.is_grad_enabled()
        if track:
            looked_up, distinct = self._lookups
            self._lookups = (looked_up + sum(ids.numel() for ids, _ in features.values()),
                             distinct + sum(u.numel() for u in uniques.values()))
        out: dict[str, torch.Tensor] = {}
        for name, (_, offsets) in features.items():
            weight = rows[name].requires_grad_(track)
            if track:
                self._pending.setdefault(name, []).append((uniques[name], weight))
            if self.pooling == "none":
                out[name] = F.embedding(inverses[name], weight)
            else:
                out[name] = F.embedding_bag(inverses[name], weight, offsets, mode=self.pooling)
        return out

    def take_grads(self) -> SparsePush:
        """``{table: (unique ids, fp32 grads summed per id)}`` of the training forwards since the last
        call (one per micro-batch), after their backward; clears them. Ids whose gradient is all zeros
        are kept (the server counts them); rows whose forward got no gradient at all (its output did
        not reach the loss) are left out, so they do not move (no gradient, no move: ``ps.core.presence``)."""
        pending, self._pending = self._pending, {}
        grads: SparsePush = {}
        for name, entries in pending.items():
            got = [(ids, weight.grad.detach()) for ids, weight in entries if weight.grad is not None]
            if len(got) == 1:
                grads[name] = got[0]
            elif got:  # micro-batches: one sum per distinct id across them
                ids, inverse = torch.unique(torch.cat([i for i, _ in got]), return_inverse=True)
                rows = torch.cat([g for _, g in got])
                grads[name] = (ids, torch.zeros(len(ids), rows.shape[1], dtype=rows.dtype).index_add_(0, inverse, rows))
        return grads

    def drop_grads(self) -> None:
        """Forgets the rows of the forwards so far (a step cleared or skipped)."""
        self._pending = {}


    def take_lookup_counts(self) -> tuple[int, int]:
        """(ids looked up, distinct ids pulled) by training forwards since the last call; resets them.
        Their ratio is what deduplication saves on the wire (``rpcps_worker_sparse_*_ids_total``)."""
        counts, self._lookups = self._lookups, (0, 0)
        return counts


def collections_of(model: nn.Module) -> list[SparseEmbeddingBagCollection]:
    return [m for m in model.modules() if isinstance(m, SparseEmbeddingBagCollection)]
