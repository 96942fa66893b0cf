"""A background thread that runs one step every N seconds until stopped (the reaper, the store guard)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Periodic:
    """Runs ``step`` every ``interval_s`` on a daemon thread; a step that raises is logged, never fatal.

    One bad round (a store that timed out, a peer that answered garbage) must not end upkeep that
    the process relies on for the rest of its life.
    """

    def __init__(self, name: str, interval_s: float, step: Callable[[], None]) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.name = name
        self.interval_s = interval_s
        self._step = step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._step()
            except Exception:
                logger.exception("%s failed; trying again in %.1fs", self.name, self.interval_s)
