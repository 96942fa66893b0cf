"""The seam between the control plane and the checkpointer.

The control plane does not know how checkpoints are written; it calls whatever object the runner
hands it, as long as it has these.
"""

from __future__ import annotations

from typing import Protocol


class CheckpointHook(Protocol):
    def checkpoint_now(self) -> tuple[str, int]:
        """Writes and commits a checkpoint of the current model; returns (path, model version).

        Raises:
            OSError: the write failed on the storage side (disk full, permissions, I/O).
            RuntimeError: the write failed for another reason (e.g. the server is stopping).
        """
        ...

    def newest(self) -> tuple[str, int, float] | None:
        """(path, model version, unix time of commit) of the newest committed checkpoint, or None."""
        ...

    @property
    def durable_progress(self) -> dict[int, int]:
        """Per worker slot, its first step the newest committed checkpoint does not hold."""
        ...

    def finished_slots(self) -> dict[int, int]:
        """Slot -> steps of every worker slot that finished and made its steps durable."""
        ...
