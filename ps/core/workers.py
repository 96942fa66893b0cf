"""The server's record of worker slots: who is registered, their progress and liveness."""

from __future__ import annotations

import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from ps.core.dedup import SequenceTracker
from rpcps.errors import UnknownWorker, WorkerRemoved


@dataclass
class WorkerRecord:
    slot: int
    rpc_name: str
    incarnation: str
    tracker: SequenceTracker = field(default_factory=SequenceTracker)
    last_seen: float = field(default_factory=time.monotonic)
    last_push: float | None = None
    live: bool = True
    left: bool = False
    first_losses: list[float] = field(default_factory=list)
    recent_losses: deque[float] = field(default_factory=lambda: deque(maxlen=10))

    def note_loss(self, loss: float | None) -> None:
        if loss is None:
            return
        if len(self.first_losses) < 10:
            self.first_losses.append(loss)
        self.recent_losses.append(loss)


class WorkerTable:
    """Slot -> record. Not thread-safe: the server calls it under its own lock."""

    def __init__(self, max_workers: int) -> None:
        self.max_workers = max_workers
        self.records: dict[int, WorkerRecord] = {}
        self.retired_rpc_names: list[str] = []
        """RPC members whose slot was taken over or who left; the reaper makes the agent forget them."""

    def check_slot(self, slot: int) -> None:
        """Raises UnknownWorker for a slot outside this server's range."""
        if not 0 <= slot < self.max_workers:
            raise UnknownWorker(
                f"worker slot {slot} is outside this server's range [0, {self.max_workers}); "
                "raise the server's --max-workers or use a smaller --worker-index"
            )

    @staticmethod
    def new_incarnation() -> str:
        return uuid.uuid4().hex[:12]

    def register(self, slot: int, rpc_name: str, incarnation: str) -> WorkerRecord:
        """Gives ``slot`` to a new registration (the caller checked the slot and drew ``incarnation``)."""
        old = self.records.get(slot)
        record = WorkerRecord(slot=slot, rpc_name=rpc_name, incarnation=incarnation)
        if old is not None:
            record.tracker = old.tracker
            record.first_losses = old.first_losses
            record.recent_losses = old.recent_losses
            if old.rpc_name != rpc_name and not old.left:
                self.retired_rpc_names.append(old.rpc_name)
        self.records[slot] = record
        return record

    def restore(self, progress: dict[int, SequenceTracker]) -> None:
        """Recreates slots from a snapshot: progress only; each slot is absent until it registers again."""
        self.records = {
            slot: WorkerRecord(slot=slot, rpc_name="", incarnation="", tracker=tracker, live=False, left=True)
            for slot, tracker in progress.items()
        }

    def get(self, slot: int, incarnation: str) -> WorkerRecord:
        record = self.records.get(slot)
        if record is None:
            raise UnknownWorker(f"worker slot {slot} is not registered with this server; register before pushing or pulling")
        if record.incarnation != incarnation:
            raise UnknownWorker(
                f"worker slot {slot} was taken over by a newer registration ({record.rpc_name}); this process must stop"
            )
        if record.left:
            # Reaped after not answering for its lease (e.g. a cut link that healed), or it left: what
            # it sends now must not count, or the server would apply the steps of a worker it no longer tracks.
            raise WorkerRemoved(f"worker slot {slot} ({record.rpc_name}) was removed from this server; register again to go on")
        return record

    def live(self) -> list[WorkerRecord]:
        return [r for r in self.records.values() if r.live and not r.left]
