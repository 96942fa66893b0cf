"""Stop signals acted on by a watcher thread, never inside the main thread's own locks.

A Python signal handler runs in the main thread between two of its bytecodes, which can be inside
``threading.Event.wait`` or ``set`` while the main thread holds the event's (non-reentrant) lock.
A handler that calls ``Event.set()`` there waits for a lock its own thread holds: the process never
stops. The tests saw exactly that: now and then a server, a coordinator or a worker ignored SIGTERM
until SIGKILL, more often when a supervisor or launcher passed on a second SIGTERM. So the handler
installed here only writes the signal's number to a pipe (a system call, no Python lock) and a
daemon thread reads it and runs the callback.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def on_signals(callback: Callable[[int], None], signals: Iterable[signal.Signals] = STOP_SIGNALS) -> None:
    """From now on, each of ``signals`` makes a watcher thread call ``callback(signum)``."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def handler(signum: int, _frame: object) -> None:
        try:
            os.write(write_fd, bytes((signum,)))
        except BlockingIOError:
            pass  # the pipe is full of signals the watcher has not read yet: it acts on those

    def watch() -> None:
        while True:
            for signum in os.read(read_fd, 64):
                try:
                    callback(signum)
                except Exception:  # a failing callback must not leave the process deaf to the next signal
                    logger.exception("acting on signal %d failed", signum)

    threading.Thread(target=watch, name="signals", daemon=True).start()
    for sig in signals:
        signal.signal(sig, handler)
