"""A shard's log of applied updates: every state change in index order, from sequenced to committed to
applied, and the ``UpdateApplied`` event each applied update tells its listeners (metrics, checkpointer,
audit, the primary). The core keeps it; ``ps.replication`` ships it to a standby.

The primary *sequences* an entry under the server's lock (it gets the next index and, for an update,
the next version), *commits* it once the standby holds it (or at once without a standby in the
view), and *applies* it in index order; a push is answered only after that. In asynchronous
replication an entry commits once the standby holds the one ``max_lag`` entries before it: the
primary runs ahead of its standby by at most that many entries, and a push that would take it
further waits (it is sequenced, not applied) until the standby catches up. The standby receives
entries in any order (TensorPipe runs handlers concurrently), puts them back in order
(``ReorderBuffer``) and applies everything it holds, with the same code. Entries are kept until
they are applied here and no follower still needs them.

Thread-safety: appends happen under the server's lock; readers that must not wait for that lock
(the sender, the applier waiting for a commit) use ``cond``, which every change notifies. Lock order:
server lock, then ``cond``; never the reverse.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future

from rpcps.messages import Control, LogEntry, Update


@dataclass(frozen=True)
class UpdateApplied:
    """Told to every ``on_applied`` listener, under the lock, in version order."""

    version: int
    step_seconds: float
    applied: tuple[tuple[int, int, int], ...]
    """(slot, step, staleness) of every contribution."""
    grad_bytes: int
    epoch: int = 0
    """The epoch of the primary that sequenced the update."""
    stamp: float | None = None
    """Unix time of the check that allowed this apply (a primary's lease check): what the ledger records."""
    mirrored: bool = False
    """Applied by a standby following its primary (not served to anyone yet)."""
    sparse_rows: int = 0
    """Sparse rows this update changed."""


@dataclass(eq=False)
class Sequenced:
    """One entry in this process's log, with what only this process needs beside the shipped record."""

    entry: LogEntry
    grads: list[torch.Tensor] | None = None
    """An update's fp32 gradient, when this process already has it (the primary widened it when it checked the push)."""
    replies: list[tuple[Future, Any]] = field(default_factory=list)
    """Futures to complete, and with what, once the entry is applied."""
    at: float = field(default_factory=time.monotonic)
    """When it was sequenced (or received): replication lag in seconds is measured from here."""
    on_release: Callable[[], None] | None = None
    """Called once nobody needs the entry any more (a sync round's sum buffers go back to the pool)."""

    @property
    def index(self) -> int:
        return self.entry.index

    @property
    def nbytes(self) -> int:
        entry = self.entry
        if not isinstance(entry, Update):
            return 0
        dense = sum(t.numel() * t.element_size() for c in entry.chunks for t in (c if isinstance(c, tuple) else (c,)))
        sparse = [t for ids, grads in (entry.sparse or {}).values() for t in (ids, grads)] + list((entry.admitted or {}).values())
        return dense + sum(t.numel() * t.element_size() for t in sparse)


class ReplicationLog:
    def __init__(self, applied_index: int = 0, version: int = 0) -> None:
        self.cond = threading.Condition()
        self._entries: deque[Sequenced] = deque()
        self.last_index = applied_index
        """The newest index sequenced (or received)."""
        self.last_version = version
        """The version the newest sequenced update produces (the applied version when none waits)."""
        self.applied_index = applied_index
        self.acked_index: int | None = None
        """Highest index the in-sync standby holds; None while no standby's acknowledgement is needed to commit."""
        self.max_lag = 0
        """Committed entries the in-sync standby may lack: 0 in synchronous replication (``ReplicationConfig.allowed_lag``)."""
        self.retain_from: int | None = None
        """A follower still needs entries from this index on (it has not acknowledged them yet)."""
        self.pending: dict[tuple[int, int], Sequenced] = {}
        """(slot, step) of every update sequenced and not yet applied: a retry joins the original."""
        self._last_control: Control | None = None
        """The newest pause or resume sequenced (or received), applied or not (``unapplied_control``)."""
        self.unwatched = False
        """Set by a primary that no standby ever attached to: every entry commits at once and the thread
        that sequenced it applies it, so appends and applies need to wake nobody. (Each notify woke the
        primary's sender and applier threads: four thread wake-ups per update, which on a small model
        cost more CPU than the optimizer step.) Cleared for good once a standby attaches."""

    # ---- sequencing (under the server's lock) -------------------------------------------------

    def append(self, sequenced: Sequenced) -> None:
        """Adds the next entry; its index must be ``last_index + 1``."""
        entry = sequenced.entry
        if entry.index != self.last_index + 1:
            raise ValueError(f"log entry {entry.index} does not follow {self.last_index}")
        with self.cond:
            self._entries.append(sequenced)
            self.last_index = entry.index
            if isinstance(entry, Update):
                self.last_version = entry.version
                for slot, seq, _, _ in entry.contributions:
                    self.pending[(slot, seq)] = sequenced
            elif isinstance(entry, Control):
                self._last_control = entry
            if not self.unwatched:
                self.cond.notify_all()

    @property
    def next_index(self) -> int:
        return self.last_index + 1

    @property
    def unapplied_control(self) -> str | None:
        """The action of a pause or resume sequenced and not applied yet (it waits for the standby), or
        None. Until it applies, the serving state it sets is already the one the next entry follows."""
        control = self._last_control
        return control.action if control is not None and control.index > self.applied_index else None

    # ---- commit and apply ------------------------------------------------------------------------

    @property
    def commit_index(self) -> int:
        return self.last_index if self.acked_index is None else min(self.acked_index + self.max_lag, self.last_index)

    @property
    def unreplicated(self) -> int:
        """Entries applied here (their pushes answered) that the in-sync standby does not hold yet:
        what a failover would lose. Never above ``max_lag``."""
        return 0 if self.acked_index is None else max(self.applied_index - self.acked_index, 0)

    def next_to_apply(self) -> Sequenced | None:
        """The next entry in index order, if it is committed."""
        with self.cond:
            if self.applied_index >= self.commit_index:
                return None
            return self._entries[self.applied_index + 1 - self._first_index]

    def applied(self, sequenced: Sequenced) -> None:
        """Records that ``sequenced`` (the one ``next_to_apply`` gave) was applied; frees what nobody needs."""
        entry = sequenced.entry
        with self.cond:
            self.applied_index = entry.index
            if isinstance(entry, Update):
                for slot, seq, _, _ in entry.contributions:
                    if self.pending.get((slot, seq)) is sequenced:
                        del self.pending[(slot, seq)]
            self._trim_locked()
            if not self.unwatched:
                self.cond.notify_all()

    def acknowledged(self, index: int, retain: bool) -> None:
        """A follower holds every entry up to ``index``; ``retain``: it is the in-sync standby (commits need it)."""
        with self.cond:
            if retain:
                self.acked_index = max(self.acked_index or 0, index)
            if self.retain_from is not None:
                self.retain_from = max(self.retain_from, index + 1)
            self._trim_locked()
            self.cond.notify_all()

    def _trim_locked(self) -> None:
        keep_from = self.applied_index + 1 if self.retain_from is None else min(self.applied_index + 1, self.retain_from)
        while self._entries and self._entries[0].index < keep_from:
            released = self._entries.popleft()
            if released.on_release is not None:
                released.on_release()

    @property
    def _first_index(self) -> int:
        return self._entries[0].index if self._entries else self.last_index + 1

    # ---- what followers read ---------------------------------------------------------------------

    def entries_from(self, index: int, max_bytes: int) -> list[Sequenced]:
        """Consecutive entries from ``index``: at least one when there is one, then up to ``max_bytes``.

        Raises LookupError when ``index`` was already trimmed (the follower fell too far behind).
        """
        with self.cond:
            if index < self._first_index:
                raise LookupError(f"log entry {index} is no longer kept (oldest is {self._first_index})")
            out: list[Sequenced] = []
            size = 0
            for i in range(index - self._first_index, len(self._entries)):
                s = self._entries[i]
                if out and size + s.nbytes > max_bytes:
                    break
                out.append(s)
                size += s.nbytes
            return out

    def oldest_unacked_age(self, acked: int, now: float) -> float:
        """Seconds since the oldest entry above ``acked`` was sequenced (0 when there is none)."""
        with self.cond:
            i = acked + 1 - self._first_index
            if acked >= self.last_index or i < 0 or i >= len(self._entries):
                return 0.0
            return now - self._entries[i].at

    def unapplied(self) -> list[Sequenced]:
        """Every entry sequenced or received and not applied yet, in index order."""
        with self.cond:
            return [s for s in self._entries if s.index > self.applied_index]

    def restart_at(self, applied_index: int, version: int) -> None:
        """Empties the log to continue after ``applied_index`` (a standby that just copied a snapshot)."""
        with self.cond:
            self._entries.clear()
            self.pending.clear()
            self._last_control = None
            self.last_index = self.applied_index = applied_index
            self.last_version = version
            self.cond.notify_all()


class ReorderBuffer:
    """Puts entries that may arrive out of order back in index order (the standby's receiving side)."""

    def __init__(self, have_through: int) -> None:
        self.have_through = have_through
        """Every entry up to here was handed on, in order."""
        self._early: dict[int, LogEntry] = {}

    def add(self, entries: list[LogEntry]) -> list[LogEntry]:
        """Takes ``entries``; returns those that are now next in line (duplicates are dropped)."""
        for entry in entries:
            if entry.index > self.have_through:
                self._early[entry.index] = entry
        ready = []
        while self.have_through + 1 in self._early:
            self.have_through += 1
            ready.append(self._early.pop(self.have_through))
        return ready

    @property
    def waiting(self) -> int:
        return len(self._early)
