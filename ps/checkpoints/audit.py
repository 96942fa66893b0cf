"""An optional append-only ledger of what the server did (``--audit-log``), for fault-injection checks.

One line per event, written with a single ``write`` each (line-buffered, ``O_APPEND``), so a SIGKILL
loses nothing already recorded and both replicas of a shard can append to one file. Each line ends
with its writer's RPC name (where one applies) and a unix time:

- ``start PID NAME``: a server process joined the group as NAME;
- ``view E PRIMARY STANDBY NAME``: the shard's view this process serves under (taken or changed);
- ``apply V SLOT SEQ E NAME``: update V (sequenced in epoch E) applied SLOT's step SEQ on the primary,
  stamped with the time of the lease check that allowed it;
- ``mirror V SLOT SEQ E NAME``: the same, applied by a standby following its primary;
- ``promote E V NAME``: NAME became the primary of epoch E holding version V;
- ``stepdown E NAME``: a primary of epoch E learned of a newer one and stopped;
- ``digest V HEX NAME``: a fingerprint of the state at version V (replicas must agree);
- ``resume V NAME``, ``capture V NAME`` (snapshot V copied from the live state), ``snapshot V NAME``
  (written just before snapshot V is committed, so a crash can never leave a committed snapshot the
  ledger does not know), ``committed V NAME`` (renamed into place).

``harness.ledger`` replays it and checks the promises of docs/FAULT_TOLERANCE.md.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ps.core.update_log import UpdateApplied
    from rpcps.messages import View


class AuditLog:
    def __init__(self, path: str, name: str) -> None:
        self.name = name
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the server
        self.write(f"start {os.getpid()} {name}")

    def write(self, line: str, stamp: float | None = None) -> None:
        self._file.write(f"{line} {time.time() if stamp is None else stamp:.6f}\n")

    def on_applied(self, event: UpdateApplied) -> None:
        """An ``on_applied`` listener of the server: runs under its lock, so lines are in version order."""
        kind = "mirror" if event.mirrored else "apply"
        for slot, seq, _ in event.applied:
            self.write(f"{kind} {event.version} {slot} {seq} {event.epoch} {self.name}", event.stamp)

    def view(self, view: View) -> None:
        self.write(f"view {view.epoch} {view.primary} {view.standby or '-'} {self.name}")

    def promoted(self, epoch: int, version: int) -> None:
        self.write(f"promote {epoch} {version} {self.name}")

    def stepped_down(self, epoch: int) -> None:
        self.write(f"stepdown {epoch} {self.name}")

    def digest(self, version: int, digest: str) -> None:
        self.write(f"digest {version} {digest} {self.name}")

    def captured(self, version: int) -> None:
        self.write(f"capture {version} {self.name}")

    def snapshot(self, version: int) -> None:
        self.write(f"snapshot {version} {self.name}")

    def committed(self, version: int) -> None:
        self.write(f"committed {version} {self.name}")

    def resumed(self, version: int) -> None:
        self.write(f"resume {version} {self.name}")

    def close(self) -> None:
        self._file.close()
