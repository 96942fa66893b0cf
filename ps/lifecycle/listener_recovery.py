"""When a server whose RPC listener was closed restarts itself (and when it does not need to).

A bare connect-and-close to TensorPipe's listening port closes that listener for good (a torch
limitation): the running workers carry on, but no new process can join until this server restarts
(a snapshot, ``execv``, workers rejoin: a few seconds without training). Restarting at once on every
such connection let a port scan (one connect every 2 s) keep the server restarting and cut training
to a third. So the restart waits until it is needed, and is rate-limited:

- needed: a process is trying to join (the group's rank counter moved since the listener was
  lost: every joiner takes a rank first), or the listener has been gone for ``MAX_WAIT_S``;
- rate-limited: never sooner than ``MIN_UPTIME_S`` after this process started, so a scan cannot
  restart it more often than that however joins and scans interleave.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

MIN_UPTIME_S = 10.0
MAX_WAIT_S = 60.0


class ListenerRecovery:
    def __init__(self, started: float, ranks_handed_out: Callable[[], int | None]) -> None:
        """
        Args:
            started: ``time.monotonic()`` when this process started serving.
            ranks_handed_out: reads the group's rank counter (None when it cannot be read).
        """
        self.started = started
        self._ranks = ranks_handed_out
        self.lost_since: float | None = None
        self._ranks_at_loss: int | None = None

    def on_lost(self, now: float) -> None:
        if self.lost_since is None:
            self.lost_since = now
            self._ranks_at_loss = self._ranks()

    def restart_due(self, now: float) -> str | None:
        """Why to restart now, or None to keep serving the workers already connected."""
        if self.lost_since is None or now - self.started < MIN_UPTIME_S:
            return None
        if now - self.lost_since >= MAX_WAIT_S:
            return f"the listener has been closed for {now - self.lost_since:.0f}s"
        ranks = self._ranks()
        if ranks is not None and self._ranks_at_loss is not None and ranks > self._ranks_at_loss:
            return "a process is trying to join"
        return None
