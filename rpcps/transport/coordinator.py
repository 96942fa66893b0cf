"""The group janitor: keeps the member list of a dynamic torch RPC group true.

Runs in whichever process hosts the group's store: the ``rpcps store`` coordinator, or a single
server with ``--listen`` (embedded); with the store in etcd, in every server, sweeping only while it
holds the etcd lease for the duty (``active``), so one sweeps at a time and another takes over
within the lease when it dies. In a dynamic group every join calls every listed member, so a
member that died stays a trap for every later join until someone removes it. Every sweep (1 s)
pings every member in parallel:

- a refused or reset connection means the process is gone: it is removed at once, and the registry
  records it (``rpcps/dead/<name>``), so a server starting for that member's shard may take over
  without waiting out a lease;
- a ping that times out means the process is hung or cut off: it is removed once it has been silent
  for longer than ``lease_s`` (a hung member would block every join); if it wakes up, its calls are
  refused by peers that forgot it, and it restarts itself and rejoins.

Joins that failed half-way are dropped from the member list, and a join token left behind by a dead
joiner is taken over, the dead members removed, and only then released. A removal that finds a join in progress is retried on the next sweep, never
dropped. The janitor holds no training state: nothing here knows what a shard or a worker slot is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from rpcps.logsafe import peer_text
from rpcps.transport import membership
from rpcps.transport.calls import PeerUnreachable, ping_all
from rpcps.transport.registry import Registry, StoreUnavailable

logger = logging.getLogger(__name__)


class Duty(Protocol):
    """One holder in the group at a time (``rpcps.etcd.lease.HeldKey``)."""

    def held(self) -> bool: ...

    def stop(self) -> None: ...


class Janitor:
    def __init__(
        self,
        registry: Registry,
        lease_s: float,
        on_removed: Callable[[str], None] = lambda name: None,
        token_max_age_s: float = 5.0,
        interval_s: float = 1.0,
        ping_timeout_s: float = 2.0,
        duty: Duty | None = None,
    ) -> None:
        """
        Args:
            registry: where dead members are recorded.
            lease_s: how long a member may go without answering before it is removed.
            on_removed: told the name of every member removed (a metric).
            duty: says whether this process is the one to sweep now (asked before every sweep; stopped
                with the janitor); None: it always is.
        """
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.registry = registry
        self.lease_s = lease_s
        self.interval_s = interval_s
        self.ping_timeout_s = ping_timeout_s
        self._on_removed = on_removed
        self._duty = duty
        self._token_watch = membership.JoinTokenWatch(token_max_age_s)
        self._to_forget: set[str] = set()
        """Members to remove from the group; kept until a removal succeeds."""
        self._first_silent: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="group-janitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self._duty is not None:
            self._duty.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._duty is not None and not self._duty.held():
                # What it saw while it swept may be stale when it sweeps again: start afresh.
                self._first_silent.clear()
                self._to_forget.clear()
                continue
            try:
                self.sweep()
            except Exception:  # one bad sweep must not end membership upkeep
                logger.exception("membership sweep failed; trying again in %.1fs", self.interval_s)

    def sweep(self) -> None:
        me = membership.my_name()
        names = [n for n in membership.member_names() if n != me and n not in self._to_forget]
        if self._duty is not None:
            # No process hosts the store (etcd): a member leaves by taking itself off the store's
            # list, and only this agent still knows it. Not a death: forgotten here, quietly. (Where
            # a process hosts the store, a name missing from its list is a stranger's doing, which
            # the store guard puts back from this agent's view: it must stay known there.)
            listed = membership.store_members()
            for name in [n for n in names if n not in listed]:
                membership.forget_here(name)
            names = [n for n in names if n in listed]
        failures = ping_all(names, self.ping_timeout_s)  # one member's failure, however it fails, is its own
        now = time.monotonic()
        for name, failure in zip(names, failures):
            if failure is not None:
                self._on_failed_ping(name, failure, now)
                continue
            self._first_silent.pop(name, None)
        self._forget_pending(self._token_watch.stale_holder(time.monotonic()))

    def _on_failed_ping(self, name: str, error: Exception, now: float) -> None:
        if isinstance(error, PeerUnreachable):
            if name not in membership.member_names():
                # It left in order while this sweep pinged it (every normal shutdown races a sweep):
                # nothing went wrong, and nothing is left to remove.
                logger.debug("%s left while being pinged: %s", name, str(error).splitlines()[0])
                self._first_silent.pop(name, None)
                return
            logger.warning("%s is gone: %s", name, str(error).splitlines()[0])
            try:
                self.registry.mark_dead(name)
            except StoreUnavailable as e:
                logger.warning("could not record %s as dead: %s", name, e)
        else:
            silent_since = self._first_silent.setdefault(name, now)
            if now - silent_since <= self.lease_s:
                return
            logger.warning("%s has not answered for %.0fs (hung or cut off); removing it", name, now - silent_since)
        self._first_silent.pop(name, None)
        self._to_forget.add(name)

    def _forget_pending(self, dead_holder: str) -> None:
        if not self._to_forget and not dead_holder and not membership.unknown_listed():
            # Nothing to remove: the group token stays free. Held every sweep, it delayed joins, and a
            # janitor that died holding it (a server, when the store is in etcd) left it to every
            # later join and removal until the next janitor took it over seconds later.
            return
        try:
            removed, failed = membership.tidy(self._to_forget, dead_holder)
        except membership.TokenBusy:
            logger.debug("a join is in progress; removing %s on the next sweep", sorted(self._to_forget))
            return
        if dead_holder:
            logger.warning("took over the RPC group token held by a dead join (%s)", peer_text(dead_holder))  # read from the store
        self._to_forget.clear()
        for name in removed:
            self._on_removed(name)
        for name in failed:
            logger.warning("removed %s, whose join failed, from the RPC group", peer_text(name))  # a name in the store
            self._on_removed(name)
