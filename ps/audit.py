"""An optional append-only ledger of what the server did (``--audit-log``), for fault-injection checks.

One line per event, written with a single ``write`` each (line-buffered), so a SIGKILL loses nothing
already recorded: ``start PID``, ``resume V``, ``apply V SLOT SEQ`` (update V applied SLOT's step SEQ),
``capture V`` (snapshot V was copied from the live state; its write starts), ``snapshot V`` (written
just before snapshot V is committed, so a crash can never leave a committed snapshot the ledger does
not know), ``committed V`` (renamed into place; the next copy may be taken); each line ends with its
unix time. ``harness.ledger`` replays it
and checks the recovery promises of docs/FAULT_TOLERANCE.md.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ps.server import UpdateApplied


class AuditLog:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the server
        self.write(f"start {os.getpid()}")

    def write(self, line: str) -> None:
        self._file.write(f"{line} {time.time():.6f}\n")

    def on_applied(self, event: UpdateApplied) -> None:
        """An ``on_applied`` listener of the server: runs under its lock, so lines are in version order."""
        for slot, seq, _ in event.applied:
            self.write(f"apply {event.version} {slot} {seq}")

    def captured(self, version: int) -> None:
        self.write(f"capture {version}")

    def snapshot(self, version: int) -> None:
        self.write(f"snapshot {version}")

    def committed(self, version: int) -> None:
        self.write(f"committed {version}")

    def resumed(self, version: int) -> None:
        self.write(f"resume {version}")

    def close(self) -> None:
        self._file.close()
