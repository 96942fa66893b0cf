"""A background thread that runs one step every N seconds until stopped (the reaper, the store guard)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Self

logger = logging.getLogger(__name__)


class Periodic:
    """Runs ``step`` every ``interval_s`` on a daemon thread; a step that raises is logged (a repeat
    only counted: ``RepeatedFailure``), never fatal.

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
        repeats = RepeatedFailure(self.name)
        while not self._stop.wait(self.interval_s):
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 - upkeep outlives any one bad round
                repeats.failed(e, self.interval_s)
            else:
                repeats.succeeded()


class RepeatedFailure:
    """Logs a failure that repeats every round once, with a count, instead of a traceback per round.

    The first failure is logged with its traceback; the same error again (same type and first line)
    only counts, with one line at 10, 100, 1000, ... in a row; a different error is logged afresh,
    and the first success after failures says how many there were. A step that fails every second
    for an hour is a dozen lines, not 3,600 tracebacks that bury everything else in the log.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0
        self._key: tuple[str, str] | None = None

    def failed(self, error: Exception, retry_s: float) -> None:
        key = (type(error).__name__, (str(error).splitlines() or [""])[0])
        if key != self._key:
            if self.count > 1:
                logger.warning("%s failed %d times in a row with: %s: %s", self.name, self.count, *self._key)  # type: ignore[misc]
            self._key, self.count = key, 1
            logger.error("%s failed; trying again every %.1fs (repeats are counted, not logged)", self.name, retry_s, exc_info=error)
            return
        self.count += 1
        if self.count >= 10 and str(self.count).strip("0") == "1":  # 10, 100, 1000, ...
            logger.warning("%s has failed %d times in a row with the same error: %s: %s", self.name, self.count, *key)

    def succeeded(self) -> None:
        if self._key is not None:
            logger.info("%s works again after %d failure(s) in a row", self.name, self.count)
        self._key, self.count = None, 0


class WaitNotice:
    """Says what a process waits for at once, then every ``every_s`` while it still waits.

    For waits inside calls that say nothing until they give up (joining a server that is not up yet
    waits up to --connect-timeout-s): whoever watches the log sees at once what the process is doing,
    instead of a minute of silence and then an error.

    Use as a context manager around the wait::

        with WaitNotice("the parameter server at host:29500", limit_s=60):
            join(...)
    """

    def __init__(self, what: str, limit_s: float, every_s: float = 5.0) -> None:
        self.what = what
        self.limit_s = limit_s
        self.every_s = every_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="wait-notice", daemon=True)

    def __enter__(self) -> Self:
        logger.info("waiting for %s (up to %.0fs)", self.what, self.limit_s)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join(timeout=1.0)

    def _loop(self) -> None:
        waited = 0.0
        while not self._done.wait(self.every_s):
            waited += self.every_s
            logger.info("still waiting for %s: %.0fs of %.0fs", self.what, waited, self.limit_s)
