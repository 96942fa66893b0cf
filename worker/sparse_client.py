"""Routes a step's sparse ids to the server shards that own them: one pull per shard, one push part per shard.

Ids go to shards by ``BucketManifest.even(shard count)``, the manifest every server checks requests
against. A pull for all tables is split by shard, sent to every shard at once (by the trainer, which
follows each shard's primary through a failover) and reassembled in the caller's order; a step's summed gradients are split the same way and ride on that shard's dense
push (``worker.trainer``), so they share its (slot, step) deduplication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rpcps.sparse.sharding import BucketManifest
from rpcps.sparse.spec import SparsePull, SparsePush, TableSpec

Fetch = Callable[[list[SparsePull]], list[SparsePull]]
"""Sends each shard its part of a pull (index = shard), all at once, and returns their replies in
shard order: the trainer's, which follows each shard's primary through a failover."""


class SparseRouter:
    """A ``RowSource`` over server shards (``rpcps.sparse.embedding``).

    Args:
        specs: every table the model declares.
        shard_count: the servers' shard count.
        wire: the dtype rows and gradients travel in.
        fetch: calls the shards (``Fetch``).
    """

    def __init__(self, specs: Sequence[TableSpec], shard_count: int, wire: torch.dtype, fetch: Fetch) -> None:
        self.specs = {s.name: s for s in specs}
        self.shard_count = shard_count
        self.wire = wire
        self.fetch = fetch
        self.manifest = BucketManifest.even(shard_count)
        self.rows_pulled = 0

    def pull(self, request: SparsePull) -> SparsePull:
        shards = self.shard_count
        owners = {name: self._owners(name, ids) for name, ids in request.items()} if shards > 1 else {}
        parts: list[SparsePull] = [{} for _ in range(shards)]
        for name, ids in request.items():
            for shard in range(shards):
                parts[shard][name] = ids if shards == 1 else ids[owners[name] == shard]
        replies = self.fetch(parts)
        rows: SparsePull = {}
        for name, ids in request.items():
            if shards == 1:
                rows[name] = replies[0][name].float()
                continue
            out = torch.empty(ids.numel(), self.specs[name].dim, dtype=torch.float32)
            for shard in range(shards):
                out[owners[name] == shard] = replies[shard][name].float()
            rows[name] = out
        self.rows_pulled += sum(ids.numel() for ids in request.values())
        return rows

    def split_push(self, grads: SparsePush) -> list[SparsePush]:
        """Per shard, its part of ``{table: (ids, fp32 grads)}``, grads in the wire dtype."""
        shards = self.shard_count
        parts: list[SparsePush] = [{} for _ in range(shards)]
        for name, (ids, grad) in grads.items():
            grad = grad.to(self.wire)
            if shards == 1:
                parts[0][name] = (ids, grad)
                continue
            owner = self._owners(name, ids)
            for shard in range(shards):
                mine = owner == shard
                parts[shard][name] = (ids[mine], grad[mine])
        return parts

    def _owners(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return self.manifest.server_of(ids, self.specs[name].table_id)
