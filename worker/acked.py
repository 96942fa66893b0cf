"""The worker's memory of its newest acknowledged pushes, for finding those a failover lost.

With asynchronous replication (``--replication async``) a shard's primary answers a push once it
applied it, before its standby holds it; the standby may be up to ``--max-replica-lag`` updates
behind. When the primary dies, the promoted standby continues from the version it holds, so the
newest acknowledged updates may be gone. A worker can tell which of its own: an ``applied`` reply
names the version the push produced, and a push whose version is above the new primary's version
is not in the new primary's history. Those steps are recomputed from their batches and sent again
with the same step number: the new primary deduplicates by (slot, step), so a step it does hold
(a version it reached by applying other pushes) is answered 'duplicate' and nothing is applied twice.

Only the newest ``keep`` acknowledged pushes per shard are remembered (their batches, not their
gradients). A lost step older than that, or one hidden because the new primary's version passed it
before this worker asked, leaves a gap in the steps the shard holds for this slot: the worker's
final ``finish`` sees it (``ServerBehind``) and the worker rejoins to recompute from there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

Batch = TypeVar("Batch")

DEFAULT_KEEP = 64
"""Acknowledged pushes remembered per shard: above the default --max-replica-lag (16), so a failover
that loses a worker's share of that lag is repaired without a rejoin."""


@dataclass(frozen=True)
class Acked(Generic[Batch]):
    seq: int
    version: int
    """The version the push's update produced (its 'applied' reply)."""
    batch: Batch


class AckedPushes(Generic[Batch]):
    """Per shard, the newest acknowledged pushes (see the module docstring). Used by one thread."""

    def __init__(self, shards: int, keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._by_shard: list[deque[Acked[Batch]]] = [deque(maxlen=keep) for _ in range(shards)]

    def note(self, shard: int, seq: int, version: int, batch: Batch) -> None:
        """A push to ``shard`` was answered 'applied' as ``version``."""
        self._by_shard[shard].append(Acked(seq, version, batch))

    def lost(self, shard: int, version: int) -> list[Acked[Batch]]:
        """The remembered pushes to ``shard`` whose versions are above ``version`` (the shard's new
        primary's), in step order; they are forgotten here (their recomputed pushes are new ones)."""
        kept = self._by_shard[shard]
        gone = sorted((a for a in kept if a.version > version), key=lambda a: a.seq)
        if gone:
            self._by_shard[shard] = deque((a for a in kept if a.version <= version), maxlen=kept.maxlen)
        return gone
