"""Routes a step's sparse ids to the server shards that own them: one pull per shard, one push part per shard.

Ids go to shards by ``BucketManifest.even(shard count)``, the manifest every server checks requests
against. A pull for all tables is split by shard, sent to every shard at once and reassembled in
the caller's order; a step's summed gradients are split the same way and ride on that shard's dense
push (``worker.trainer``), so they share its (slot, step) deduplication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rpcps.sparse.sharding import BucketManifest
from rpcps.sparse.spec import SparsePull, SparsePush, TableSpec
from worker.client import ServerClient, result


class SparseRouter:
    """A ``RowSource`` over server shards (``rpcps.sparse.embedding``).

    Args:
        specs: every table the model declares.
        clients: one per shard, in shard order; ``incarnations`` the worker's registration on each.
        slot: this worker's slot.
        wire: the dtype rows and gradients travel in.
        retry: runs a call, retrying it on timeouts (the trainer's policy).
    """

    def __init__(
        self,
        specs: Sequence[TableSpec],
        clients: Sequence[ServerClient],
        incarnations: Sequence[str],
        slot: int,
        wire: torch.dtype,
        retry: Callable[[Callable[[], Any]], Any],
    ) -> None:
        self.specs = {s.name: s for s in specs}
        self.clients = list(clients)
        self.incarnations = list(incarnations)
        self.slot = slot
        self.wire = wire
        self.retry = retry
        self.manifest = BucketManifest.even(len(self.clients))
        self.rows_pulled = 0

    def pull(self, request: SparsePull) -> SparsePull:
        shards = len(self.clients)
        owners = {name: self._owners(name, ids) for name, ids in request.items()} if shards > 1 else {}
        parts: list[SparsePull] = [{} for _ in range(shards)]
        for name, ids in request.items():
            for shard in range(shards):
                parts[shard][name] = ids if shards == 1 else ids[owners[name] == shard]

        def fetch() -> list[SparsePull]:
            pending = [
                c.pull_rows(self.slot, inc, part) for c, inc, part in zip(self.clients, self.incarnations, parts)
            ]
            return [result(p) for p in pending]

        replies = self.retry(fetch)
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
        shards = len(self.clients)
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
