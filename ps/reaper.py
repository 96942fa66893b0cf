"""Watches the server's registered workers and the group's store host.

Every sweep (1 s) pings every registered worker in parallel and tells the roster what it found:

- a refused or reset connection means the process is gone: its slot is marked dead at once (so a
  sync round stops waiting for it);
- a ping that times out means the process is hung: it is marked not live, and dead once it has been
  silent for longer than its lease.

Removing members from the RPC group is the group janitor's job (``rpcps.transport.coordinator``),
which runs where the store lives; the reaper only asks it to drop the workers whose slot was taken
over by a newer registration. It also pings that store host when it is another process: when it is
gone the whole group is gone (no join, no view change can happen any more), and
``store_host_lost`` tells the runner to snapshot and rejoin the group of its successor.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from rpcps import transport
from rpcps.jobsecret import JobSecret
from rpcps.periodic import Periodic

logger = logging.getLogger(__name__)


class Roster(Protocol):
    """The server's view of its workers that the reaper reads and updates (``ps.service.WorkerService``)."""

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
    ) -> None:
        """``store_host``: the RPC name of the member hosting the group's store (this process's own
        name when it hosts it: then there is nothing to watch). ``secret``: the job's, which the store's
        host demands as proof before it drops a member."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.roster = roster
        self.lease_s = lease_s
        self.store_host = store_host
        self.secret = secret
        self.interval_s = interval_s
        self.ping_timeout_s = ping_timeout_s
        self.store_host_lost = False
        self._task = Periodic("membership-reaper", interval_s, self.sweep)

    def start(self) -> None:
        self._task.start()

    def stop(self) -> None:
        self._task.stop()

    def sweep(self) -> None:
        for name in self.roster.take_retired_rpc_names():
            transport.leave(name, self.store_host, self.secret, timeout_s=self.ping_timeout_s)  # best effort: the janitor's pings follow
        registered = {name: (slot, incarnation, last_seen) for slot, incarnation, name, last_seen in self.roster.member_workers()}
        watch_store = self.store_host != transport.membership.my_name()
        names = [*registered, *([self.store_host] if watch_store else [])]
        pings = [transport.ping(name, self.ping_timeout_s) for name in names]
        now = time.monotonic()
        for name, ping in zip(names, pings):
            owner = registered.get(name)
            try:
                ping.wait()
            except transport.CallFailed as e:
                if owner is not None:
                    self._on_failed_ping(name, owner, e, now)
                elif isinstance(e, transport.PeerUnreachable):
                    self.store_host_lost = True
                continue
            if owner is not None:
                self.roster.mark_alive(owner[0], owner[1])

    def _on_failed_ping(self, name: str, owner: tuple[int, str, float], error: transport.CallFailed, now: float) -> None:
        slot, incarnation, last_seen = owner
        if isinstance(error, (transport.PeerUnreachable, transport.PeerUnknown)):  # unknown: the janitor removed it
            logger.warning("%s (slot %d) is gone: %s", name, slot, str(error).splitlines()[0])
        elif now - last_seen <= self.lease_s:
            self.roster.mark_silent(slot, incarnation)
            return
        else:
            logger.warning("%s (slot %d) has not answered for %.0fs (hung)", name, slot, now - last_seen)
        self.roster.mark_dead(slot, incarnation)
