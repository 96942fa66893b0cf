"""The seams between the control plane and the checkpointer and replication.

The control plane does not know how checkpoints are written or how replicas follow each other; it
calls whatever the runner hands it, as long as it has these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ReplicaState:
    """This server process's place in its shard's replica set, for ``GetStatus``."""

    role: str
    """'primary', 'standby' (named in the view), 'catching up' or 'stepping down'."""
    epoch: int
    primary: str
    standby: str | None
    lag_updates: float
    lag_seconds: float
    failovers: int
    """Times this process promoted itself."""
    configured: int
    """--replicas."""
    replication: str = "sync"
    """--replication: 'sync' or 'async'."""
    max_lag: int = 0
    """Entries a primary may apply before its standby holds them (0 when synchronous)."""
    unreplicated: float = 0.0
    """On a primary: entries applied (acknowledged) that the standby lacks; what a failover now would lose."""


class CheckpointHook(Protocol):
    def checkpoint_now(self) -> tuple[str, int]:
        """Writes and commits a snapshot of the current model; returns (path, model version).

        Raises:
            OSError: the write failed on the storage side (disk full, permissions, I/O).
            RuntimeError: the write failed for another reason (e.g. the server is stopping).
        """
        ...

    def newest(self) -> tuple[str, int, float] | None:
        """(path, model version, unix time of commit) of the newest committed snapshot, or None."""
        ...

    @property
    def durable_progress(self) -> dict[int, int]:
        """Per worker slot, its first step the newest committed snapshot does not hold."""
        ...

    def finished_slots(self) -> dict[int, int]:
        """Slot -> steps of every worker slot that finished and made its steps durable."""
        ...
