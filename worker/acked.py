"""The worker's memory of its newest acknowledged pushes, for finding those a failover lost.

With asynchronous replication (``--replication async``) a shard's primary answers a push once it
applied it, before its standby holds it; the standby may be up to ``--max-replica-lag`` updates
behind. When the primary dies, the promoted standby continues from the version it holds, so the
newest acknowledged updates may be gone. A worker can tell which of its own: an ``applied`` reply
names the version the push produced, and a push whose version is above the new primary's version
is not in the new primary's history. Those steps are recomputed from their batches and sent again
with the same step number: the new primary deduplicates by (slot, step), so a step it does hold
(a version it reached by applying other pushes) is answered 'duplicate' and nothing is applied twice.

Per shard, the newest pushes are remembered (their batches, not their gradients): the shard's lag
bound plus the window of pushes in flight, so nothing is kept with synchronous replication. A lost
step the worker cannot see this way (its shard's lag bound was unknown, or the new primary's
version passed it before this worker asked) leaves a gap in the steps the shard holds for this
slot: the worker's final ``finish`` sees it (``ServerBehind``) and the worker rejoins to recompute
from there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

Batch = TypeVar("Batch")

@dataclass(frozen=True)
class Acked(Generic[Batch]):
    seq: int
    version: int
    """The version the push's update produced (its 'applied' reply)."""
    batch: Batch


class AckedPushes(Generic[Batch]):
    """Per shard, the newest acknowledged pushes (see the module docstring). Used by one thread."""

    def __init__(self, keep: list[int]) -> None:
        """``keep``: per shard, how many to remember (0: none, the shard replicates synchronously)."""
        if any(k < 0 for k in keep):
            raise ValueError(f"keep must be >= 0 per shard, got {keep}")
        self._by_shard: list[deque[Acked[Batch]]] = [deque(maxlen=k) for k in keep]

    def note(self, shard: int, seq: int, version: int, batch: Batch) -> None:
        """A push to ``shard`` was answered 'applied' as ``version``."""
        kept = self._by_shard[shard]
        if kept.maxlen:
            kept.append(Acked(seq, version, batch))

    def lost(self, shard: int, version: int) -> list[Acked[Batch]]:
        """The remembered pushes to ``shard`` whose versions are above ``version`` (the shard's new
        primary's), in step order; they are forgotten here (their recomputed pushes are new ones)."""
        kept = self._by_shard[shard]
        gone = sorted((a for a in kept if a.version > version), key=lambda a: a.seq)
        if gone:
            self._by_shard[shard] = deque((a for a in kept if a.version <= version), maxlen=kept.maxlen)
        return gone
