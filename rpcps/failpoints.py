"""Named fail points: places where a fault-injection run can make this process crash on purpose.

A window of microseconds (between a snapshot's ledger line and the rename that commits it, say) can
never be hit reliably by a signal sent from outside, so the code names such places and a test asks
for a crash there, the way TiKV's ``fail`` crate and etcd's gofail do. Production never sets the
variable; an unset variable costs one dictionary lookup per point.

    RPCPS_FAILPOINTS="snapshot.before_commit=kill@3:/run/fp-1.fired;finish.after_snapshot=kill@1:/run/fp-2.fired"

Each entry is ``NAME=kill@N:MARKER``: the N-th time NAME is reached, counted over every process
of the run that inherits the variable (a restarted server goes on counting, in ``MARKER.count``),
the process creates the file MARKER and kills itself with SIGKILL. Once MARKER exists the point is
inert, so each planned crash happens once per run.

``NAME=hold-S@N:MARKER`` holds instead of killing: from the N-th hit, every thread that reaches NAME
in this process during the next S seconds waits until they have passed (a slow peer, made on
purpose: a standby that holds its acknowledgements lets its asynchronous primary run ahead of it,
a moment the scheduler alone gives in some runs and not in others), or until a file
``MARKER.release`` exists: a test that holds a point until something else happened lets it go then,
rather than betting that S seconds cover that on a loaded machine.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV = "RPCPS_FAILPOINTS"
_RELEASE_POLL_S = 0.05
_COUNT_DIGITS = 12
"""A hit count is written zero-padded to this width, so each write covers the one before."""
POINTS = {
    "server.after_apply": "a server (a standby too) just applied an update: its version is the update's, no worker has "
    "been answered for it and no snapshot holds it yet",
    "snapshot.before_commit": "a snapshot is durable under its temporary name and in the ledger, not yet renamed into place",
    "snapshot.after_commit": "a snapshot was just committed",
    "finish.after_snapshot": "a finishing worker's steps were just made durable; its reply is not sent yet",
    "worker.after_push": "a worker just sent a step's pushes (in --mode local-steps, a round's delta: the inner optimizer's "
    "state dies with the process)",
    "replication.at_max_lag": "an asynchronous primary is applying the update that puts it --max-replica-lag entries ahead "
    "of its standby (the ones before it were answered: a crash now loses them unless they are still on the wire)",
    "replication.standby_before_ack": "a standby holds the log entries of an append and is about to acknowledge them",
    "replication.standby_before_promote": "a standby whose primary failed read the shard's view and is about to change it "
    "to promote itself",
}
REPLICATED_POINTS = frozenset({"replication.at_max_lag", "replication.standby_before_ack", "replication.standby_before_promote"})
"""Points only a server with a standby (or a standby) reaches (a run without replicas never hits them)."""


@dataclass
class _Point:
    hit_at: int
    marker: str
    hold_s: float | None = None
    """None: kill; else how long hits wait once the point fired."""
    held_until: float = 0.0
    """Monotonic end of this process's hold (0 before it fired here)."""

    def count(self) -> int:
        """This hit's number across the run (the count lives beside the marker, so it survives restarts).

        Read and written under an exclusive lock on the file: two servers of a sharded run reach the
        same point side by side, and a read between another's truncate and write took the count back
        to 1, so a point counted over both shards never reached its hit (CI's two-shard chaos run)."""
        fd = os.open(f"{self.marker}.count", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            hits = int(os.read(fd, 32) or 0) + 1
            # One fixed-width write over the same bytes, never a truncate: a process SIGKILLed between
            # a truncate and its write left the file empty and the run's count began again at 0 (a CI
            # chaos run counted 557 of 1017 applies and never reached its planned hit at 660).
            os.pwrite(fd, f"{hits:0{_COUNT_DIGITS}d}".encode(), 0)
        finally:
            os.close(fd)  # and the lock with it
        return hits


def _parse(text: str) -> dict[str, _Point]:
    points: dict[str, _Point] = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        name, _, action = entry.partition("=")
        kind, _, rest = action.partition("@")
        count, _, marker = rest.partition(":")
        hold_s = _seconds(kind.removeprefix("hold-")) if kind.startswith("hold-") else None
        if name not in POINTS or (kind != "kill" and hold_s is None) or not count.isdigit() or not marker:
            raise ValueError(
                f"{ENV}: bad entry {entry!r}; expected NAME=kill@N:MARKER or NAME=hold-SECONDS@N:MARKER with NAME in {sorted(POINTS)}"
            )
        points[name] = _Point(int(count), marker, hold_s)
    return points


def _seconds(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value <= 60 else None


_points = _parse(os.environ.get(ENV, ""))


def hit(name: str) -> None:
    """Marks that this process reached fail point ``name``; crashes (or holds) here if a run asked for it."""
    point = _points.get(name)
    if point is None:
        return
    if point.held_until > time.monotonic():
        _hold(point)
        return
    if os.path.exists(point.marker) or point.count() != point.hit_at:
        return
    try:
        fd = os.open(point.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return  # this planned crash already happened (in an earlier incarnation of this process)
    os.close(fd)
    if point.hold_s is not None:
        logger.warning("fail point %s: holding for %.1fs on purpose (%s)", name, point.hold_s, ENV)
        point.held_until = time.monotonic() + point.hold_s
        _hold(point)
        return
    logger.warning("fail point %s: killing this process on purpose (%s)", name, ENV)
    os.kill(os.getpid(), signal.SIGKILL)


def _hold(point: _Point) -> None:
    """Waits out ``point``'s hold: the fault itself (a slow peer), not synchronisation."""
    release = f"{point.marker}.release"
    while not os.path.exists(release):
        left = point.held_until - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, _RELEASE_POLL_S))
