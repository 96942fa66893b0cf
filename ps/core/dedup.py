"""Remembers which sequence numbers of one worker slot the server has already processed.

Pushes from one worker may arrive out of order (several are in flight and the RPC thread pool runs
them concurrently) and may be retried after a timeout, so "seq <= last seen" is not enough: we keep
the highest contiguous processed sequence number plus the few processed above it.
"""

from __future__ import annotations

from typing import cast


class SequenceTracker:
    def __init__(self, floor: int = -1) -> None:
        self.floor = floor
        """Every seq <= floor has been processed."""
        self._above: set[int] = set()

    def seen(self, seq: int) -> bool:
        return seq <= self.floor or seq in self._above

    def mark(self, seq: int) -> None:
        if self.seen(seq):
            return
        self._above.add(seq)
        while self.floor + 1 in self._above:
            self.floor += 1
            self._above.remove(self.floor)

    def processed(self) -> tuple[int, tuple[int, ...]]:
        """(floor, the processed seqs above it, sorted)."""
        return self.floor, tuple(sorted(self._above))

    @property
    def pending_above_floor(self) -> int:
        return len(self._above)

    def state(self) -> dict[str, object]:
        return {"floor": self.floor, "above": sorted(self._above)}

    @classmethod
    def from_state(cls, state: dict[str, object]) -> SequenceTracker:
        t = cls(int(cast(int, state["floor"])))
        t._above = {int(s) for s in cast("list[int]", state["above"])}
        return t
