"""Watches the server's registered workers and the group's store host.

Every sweep (1 s) pings every registered worker in parallel and tells the roster what it found:

- a refused or reset connection means the process is gone: its slot is marked dead at once (so a
  sync round stops waiting for it); so does a name this process's agent does not know
  (``PeerUnknown``, raised when the ping is started: a worker that exited without leaving, which the
  janitor removed first, or a registration under a name that is no member);
- a ping that times out means the process is hung: it is marked not live, and dead once it has been
  silent for longer than its lease. Any other failure (an error no one foresaw) counts the same.

Removing members from the RPC group is the group janitor's job (``rpcps.transport.coordinator``),
which runs where the store lives; the reaper only asks it to drop the workers whose slot was taken
over by a newer registration. It also pings that store host when it is another process: when it is
gone the whole group is gone (no join, no view change can happen any more), and
``store_host_lost`` tells the runner to snapshot and rejoin the group of its successor.

Each member's failure is judged on its own (``transport.ping_all`` never raises for one), so one bad
member never stops the sweep of the others: a sweep that raised before judging anyone once left
every later dead worker undetected. A failure that repeats every sweep is logged once, then once a
minute with its count (``RepeatedFailures``); every failed ping bumps
``rpcps_server_reaper_ping_failures_total`` by kind.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import Counter

from rpcps import transport
from rpcps.jobsecret import JobSecret
from rpcps.logsafe import MESSAGE_LIMIT, peer_text
from rpcps.periodic import Periodic

logger = logging.getLogger(__name__)

class Roster(Protocol):
    """The server's view of its workers that the reaper reads and updates (``ps.api.service.WorkerService``)."""

    def take_retired_rpc_names(self) -> list[str]: ...

    def member_workers(self) -> list[tuple[int, str, str, float]]: ...

    def mark_alive(self, slot: int, incarnation: str) -> None: ...

    def mark_silent(self, slot: int, incarnation: str) -> None: ...

    def mark_dead(self, slot: int, incarnation: str) -> None: ...


class MembershipReaper:
    def __init__(
        self,
        roster: Roster,
        lease_s: float,
        store_host: str,
        secret: JobSecret | None = None,
        interval_s: float = 1.0,
        ping_timeout_s: float = 2.0,
        failures: Counter | None = None,
    ) -> None:
        """``store_host``: the RPC name of the member hosting the group's store (this process's own
        name when it hosts it: then there is nothing to watch). ``secret``: the job's, which the store's
        host demands as proof before it drops a member. ``failures``: counts failed pings, labelled
        by kind (``ps.core.metrics.PING_FAILURES``)."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.roster = roster
        self.lease_s = lease_s
        self.store_host = store_host
        self.secret = secret
        self.interval_s = interval_s
        self.ping_timeout_s = ping_timeout_s
        self.failures = failures
        self.store_host_lost = False
        self.repeats = RepeatedFailures()
        self._task = Periodic("membership-reaper", interval_s, self.sweep)

    def start(self) -> None:
        self._task.start()

    def stop(self) -> None:
        self._task.stop()

    def sweep(self) -> None:
        for name in self.roster.take_retired_rpc_names():
            try:  # best effort: the janitor's pings follow
                transport.leave(name, self.store_host, self.secret, timeout_s=self.ping_timeout_s)
            except Exception as e:  # noqa: BLE001 - the name is what a worker registered with; the rest must go on
                logger.warning("could not ask for %s to be dropped from the RPC group: %s", peer_text(name), _describe(e))
        registered = {name: (slot, incarnation, last_seen) for slot, incarnation, name, last_seen in self.roster.member_workers()}
        watch_store = self.store_host != transport.membership.my_name()
        names = [*registered, *([self.store_host] if watch_store and self.store_host not in registered else [])]
        failures = transport.ping_all(names, self.ping_timeout_s)
        now = time.monotonic()
        for name, failure in zip(names, failures):
            if failure is not None and self.failures is not None:
                self.failures.labels(failure_kind(failure)).inc()
            owner = registered.get(name)
            try:
                if owner is None:
                    self._on_store_host(name, failure, now)
                elif failure is None:
                    self.roster.mark_alive(owner[0], owner[1])
                    self.repeats.cleared(name, now)
                else:
                    self._on_failed_ping(name, owner, failure, now)
            except Exception as e:
                if self.repeats.failed(name, "reaper", _describe(e), now):
                    logger.exception("the reaper could not act on %s's ping%s", peer_text(name), _COUNTED)
        self.repeats.keep_only(set(names), now)

    def _on_store_host(self, name: str, failure: Exception | None, now: float) -> None:
        if failure is None:
            self.repeats.cleared(name, now)
        elif isinstance(failure, transport.PeerUnreachable):
            self.store_host_lost = True  # the runner logs it and acts
        elif self.repeats.failed(name, failure_kind(failure), _describe(failure), now):
            # It may answer again (a timeout, an error on this side): not lost, but not silent either.
            logger.warning("pinging the group's store host %s failed: %s%s", peer_text(name), _describe(failure), _COUNTED)

    def _on_failed_ping(self, name: str, owner: tuple[int, str, float], error: Exception, now: float) -> None:
        slot, incarnation, last_seen = owner
        kind, detail = failure_kind(error), _describe(error)
        if kind in ("unreachable", "unknown"):  # unknown: the janitor removed it, or it never joined under that name
            if self.repeats.failed(name, "gone", detail, now):
                logger.warning("%s (slot %d) is gone: %s", peer_text(name), slot, detail)
        elif now - last_seen <= self.lease_s:
            # A timeout is what a busy worker does (one is not news); an error no one foresaw is.
            if kind == "error" and self.repeats.failed(name, kind, detail, now):
                logger.warning("pinging %s (slot %d) failed: %s; dead if it lasts %.0fs%s", peer_text(name), slot, detail,
                               self.lease_s, _COUNTED)
            self.roster.mark_silent(slot, incarnation)
            return
        elif self.repeats.failed(name, "hung", detail, now):
            logger.warning("%s (slot %d) has not answered for %.0fs (%s)", peer_text(name), slot, now - last_seen,
                           "hung" if kind == "timeout" else f"its pings failed: {detail}")
        self.roster.mark_dead(slot, incarnation)  # it leaves member_workers, and with it the next sweep


_COUNTED = "; while it lasts, repeats are counted and logged once a minute"


def failure_kind(error: BaseException) -> str:
    """The ``ps.core.metrics.PING_FAILURES`` label of a failed ping."""
    if isinstance(error, transport.PeerUnreachable):
        return "unreachable"
    if isinstance(error, transport.PeerUnknown):
        return "unknown"
    if isinstance(error, transport.PeerTimeout):
        return "timeout"
    return "error"


def _describe(error: BaseException) -> str:
    """One escaped line: torch's messages run to dozens of lines and quote the peer's name."""
    first = str(error).splitlines()[0] if str(error).strip() else ""
    return peer_text(f"{type(error).__name__}: {first}" if first else type(error).__name__, MESSAGE_LIMIT)


@dataclass
class _Streak:
    kind: str
    detail: str
    count: int
    since: float
    logged_at: float


class RepeatedFailures:
    """Counts a member's failures in a row, so that the caller logs only the first: a sweep runs
    every second, and a failure that lasts (a member this agent forgot; a roster that does not let
    go of a dead worker) must not write the same line every second.

    While a streak lasts, one line every ``remind_s`` gives its count; when it ends (the member
    answers, fails another way, or is no longer swept), one line says how many there were.
    """

    def __init__(self, remind_s: float = 60.0) -> None:
        self.remind_s = remind_s
        self._streaks: dict[str, _Streak] = {}

    def failed(self, name: str, kind: str, detail: str, now: float) -> bool:
        """Counts one failure of ``name``; True when it starts a streak (the caller logs it then)."""
        streak = self._streaks.get(name)
        if streak is not None and streak.kind == kind:
            streak.count += 1
            streak.detail = detail
            if now - streak.logged_at >= self.remind_s:
                streak.logged_at = now
                logger.warning("%s still fails (%s): %d times in a row over %.0fs; last: %s", peer_text(name), kind,
                               streak.count, now - streak.since, detail)
            return False
        self._end(name, now)
        self._streaks[name] = _Streak(kind, detail, 1, now, now)
        return True

    def cleared(self, name: str, now: float) -> None:
        """``name`` answered: its streak, if any, ends."""
        self._end(name, now)

    def keep_only(self, names: set[str], now: float) -> None:
        """Ends the streaks of members no longer swept."""
        for name in [n for n in self._streaks if n not in names]:
            self._end(name, now)

    def count(self, name: str) -> int:
        """Failures in ``name``'s current streak (0: none)."""
        streak = self._streaks.get(name)
        return streak.count if streak is not None else 0

    def _end(self, name: str, now: float) -> None:
        streak = self._streaks.pop(name, None)
        if streak is not None and streak.count > 1:
            logger.info("%s failed %d times in a row (%s) over %.0fs; last: %s", peer_text(name), streak.count,
                        streak.kind, now - streak.since, streak.detail)
