"""Rounds of synchronous training: one optimizer step from the averaged gradients of the live workers.

A round opens with the first push after the previous one closed; the workers live at that moment
are expected. It closes when every expected worker has contributed, or ``timeout_s`` after it
opened with whoever contributed (a worker that died mid-round never hangs the others; one that
the reaper declares dead is dropped at once). A worker that joins while a round is open waits for
the next one. Not thread-safe: the server calls it under its lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class SyncContribution:
    contribution: Any
    """The server's record of the push (``ps.core.server.Contribution``)."""
    reply: Any
    """The torch Future the worker's RPC waits on."""

    @property
    def slot(self) -> int:
        return self.contribution.record.slot


@dataclass
class SyncRound:
    expected: set[int]
    sums: list[torch.Tensor]
    needed: int = 1
    """Contributions required before the timeout: min_workers, lowered when expected workers die."""
    opened: float = field(default_factory=time.monotonic)
    contributions: dict[int, SyncContribution] = field(default_factory=dict)
    absent: int = -1
    """Parameters no contribution had a gradient for (``ps.core.presence``): the AND of their masks
    (-1, every bit, until the first contribution)."""

    def missing(self) -> set[int]:
        return self.expected - set(self.contributions)


class RoundKeeper:
    def __init__(self, chunk_numels: tuple[int, ...], timeout_s: float, min_workers: int = 1) -> None:
        if timeout_s <= 0:
            raise ValueError(f"round timeout must be > 0, got {timeout_s}")
        if min_workers < 1:
            raise ValueError(f"min_workers must be >= 1, got {min_workers}")
        self.chunk_numels = chunk_numels
        self.timeout_s = timeout_s
        self.min_workers = min_workers
        """A round waits (up to the timeout) until this many workers contributed: at start-up the
        first worker would otherwise run rounds alone while the others are still starting."""
        self.current: SyncRound | None = None
        self.waiting: list[Any] = []
        """Futures of workers that arrived mid-round; answered when it closes (they recompute)."""
        self._spare_sums: list[torch.Tensor] | None = None
        """The previous round's sum buffers, reused so a round does not allocate the model's size anew."""

    def add(
        self, live_slots: set[int], contribution: SyncContribution, chunks: list[torch.Tensor], known_slots: int = 0, absent: int = 0
    ) -> bool:
        """Adds a gradient to the open round (opening one if none). False: the slot waits for the next.

        ``known_slots`` counts the slots that ever registered: min_workers holds only until that many
        have shown up (start-up); after that a round needs just the live ones.
        """
        if self.current is None:
            needed = self.min_workers if known_slots < self.min_workers else 1
            sums, self._spare_sums = self._spare_sums, None
            if sums is None:
                sums = [torch.zeros(n) for n in self.chunk_numels]
            else:
                for total in sums:
                    total.zero_()
            self.current = SyncRound(set(live_slots) | {contribution.slot}, sums, needed)
        round_ = self.current
        if contribution.slot not in round_.expected and len(round_.expected) < self.min_workers:
            round_.expected.add(contribution.slot)
        if contribution.slot not in round_.expected or contribution.slot in round_.contributions:
            self.waiting.append(contribution.reply)
            return False
        for total, grad in zip(round_.sums, chunks):
            total.add_(grad)
        round_.contributions[contribution.slot] = contribution
        round_.absent &= absent
        return True

    def drop(self, slot: int) -> None:
        """A worker left or died: the open round stops waiting for it."""
        if self.current is not None and slot not in self.current.contributions:
            self.current.expected.discard(slot)
            self.current.needed = min(self.current.needed, max(len(self.current.expected), 1))

    def ready(self, now: float) -> bool:
        r = self.current
        if r is None or not r.contributions:
            return False
        if now - r.opened >= self.timeout_s:
            return True
        return not r.missing() and len(r.contributions) >= r.needed

    def recycle(self, sums: list[torch.Tensor]) -> None:
        """Hands a closed round's sum buffers back once the optimizer step has used them."""
        self._spare_sums = sums

    def take(self) -> tuple[SyncRound, list[Any]]:
        """Closes the open round: (the round, futures that waited for the next one)."""
        assert self.current is not None
        round_, waiting = self.current, self.waiting
        self.current, self.waiting = None, []
        return round_, waiting
