"""Finds worker processes that died, hung or left, and removes them from the RPC group.

Without this, the first worker that dies makes every later join fail (see ``rpcps.transport.membership``),
so dead members must go before their replacements arrive. Every sweep (1 s) pings every group
member in parallel, registered or not (a worker refused for its model, or killed while starting):

- a refused or reset connection means the process is gone: it is removed at once;
- a ping that times out means the process is hung: it is marked not live, and removed once it has
  been silent for longer than its lease (a hung member would block every join); if it wakes up
  later, its calls fail and it restarts itself and rejoins.

Joins that failed half-way are dropped from the member list, and a join token left behind by a
dead joiner is released. A removal that finds a join in progress is retried on the next sweep,
never dropped.

Only shard 0, which hosts the group's store, changes the member list (``owns_group``). Other
shards only mark their workers dead or alive (so sync rounds stop waiting for the dead), and watch
shard 0: when it is gone the whole group is gone, and ``store_host_lost`` tells the runner to
snapshot and rejoin the group of shard 0's successor.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from ps.metrics import ServerMetrics
from rpcps import transport
from rpcps.endpoints import server_name
from rpcps.periodic import Periodic
from rpcps.transport import membership

STORE_HOST = server_name(0)


class Roster(Protocol):
    """The server's view of its workers that the reaper reads and updates (``ps.service.WorkerService``)."""

    def take_retired_rpc_names(self) -> list[str]: ...

    def member_workers(self) -> list[tuple[int, str, str, float]]: ...

    def mark_alive(self, slot: int, incarnation: str) -> None: ...

    def mark_silent(self, slot: int, incarnation: str) -> None: ...

    def mark_dead(self, slot: int, incarnation: str) -> None: ...

logger = logging.getLogger(__name__)


class MembershipReaper:
    def __init__(
        self,
        roster: Roster,
        metrics: ServerMetrics,
        lease_s: float,
        token_max_age_s: float = 5.0,
        interval_s: float = 1.0,
        ping_timeout_s: float = 2.0,
        owns_group: bool = True,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.roster = roster
        self.metrics = metrics
        self.lease_s = lease_s
        self.interval_s = interval_s
        self.ping_timeout_s = ping_timeout_s
        self.owns_group = owns_group
        self.store_host_lost = False
        self._token_watch = membership.JoinTokenWatch(token_max_age_s)
        self._to_forget: set[str] = set()
        """Members to remove from the group; kept until a removal succeeds."""
        self._first_silent: dict[str, float] = {}
        """Unregistered members that stopped answering pings, and since when."""
        self._task = Periodic("membership-reaper", interval_s, self.sweep)

    def start(self) -> None:
        self._task.start()

    def stop(self) -> None:
        self._task.stop()

    def sweep(self) -> None:
        retired = self.roster.take_retired_rpc_names()
        if self.owns_group:
            self._token_watch.check(time.monotonic())
            self._to_forget.update(retired)
        registered = {name: (slot, incarnation, last_seen) for slot, incarnation, name, last_seen in self.roster.member_workers()}
        me = membership.my_name()
        if self.owns_group:
            names = [n for n in membership.member_names() if n != me and n not in self._to_forget]
        else:
            names = [*registered, STORE_HOST]
        pings = [transport.ping(name, self.ping_timeout_s) for name in names]
        now = time.monotonic()
        for name, ping in zip(names, pings):
            owner = registered.get(name)
            try:
                ping.wait()
            except transport.CallFailed as e:
                self._on_failed_ping(name, owner, e, now)
                continue
            self._first_silent.pop(name, None)
            if owner is not None:
                self.roster.mark_alive(owner[0], owner[1])
        self._forget_pending()

    def _on_failed_ping(self, name: str, owner: tuple[int, str, float] | None, error: transport.CallFailed, now: float) -> None:
        gone = isinstance(error, transport.PeerUnreachable)
        if name == STORE_HOST and not self.owns_group:
            if gone:
                self.store_host_lost = True
            return
        if gone:
            logger.warning("%s is gone: %s", name, str(error).splitlines()[0])
        else:
            silent_since = owner[2] if owner is not None else self._first_silent.setdefault(name, now)
            if now - silent_since <= self.lease_s:
                if owner is not None:
                    self.roster.mark_silent(owner[0], owner[1])
                return
            logger.warning("%s has not answered for %.0fs (hung); removing it", name, now - silent_since)
        if owner is not None:
            self.roster.mark_dead(owner[0], owner[1])
        self._first_silent.pop(name, None)
        self._to_forget.add(name)

    def _forget_pending(self) -> None:
        if not self.owns_group:
            self._to_forget.clear()
            return
        try:
            for name in sorted(self._to_forget):
                if membership.forget_member(name):
                    self.metrics.workers_reaped.inc()
                self._to_forget.discard(name)
            for name in membership.forget_failed_joins():
                logger.warning("removed %s, whose join failed, from the RPC group", name)
                self.metrics.workers_reaped.inc()
        except membership.TokenBusy:
            logger.debug("a join is in progress; removing %s on the next sweep", sorted(self._to_forget))
