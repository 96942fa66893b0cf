"""Finds worker processes that died, hung or left, and removes them from the RPC group.

Without this, the first worker that dies makes every later join fail (see ``rpcps.rpc_membership``),
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
import threading
import time

from torch.distributed import rpc

from ps import rpc_api
from ps.server import ParameterServer
from rpcps import rpc_membership
from rpcps.transport import PEER_DEAD, SERVER_NAME, classify_failure

logger = logging.getLogger(__name__)


class MembershipReaper:
    def __init__(
        self,
        server: ParameterServer,
        lease_s: float,
        token_max_age_s: float = 5.0,
        interval_s: float = 1.0,
        ping_timeout_s: float = 2.0,
        owns_group: bool = True,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.server = server
        self.lease_s = lease_s
        self.interval_s = interval_s
        self.ping_timeout_s = ping_timeout_s
        self.owns_group = owns_group
        self.store_host_lost = False
        self._token_watch = rpc_membership.JoinTokenWatch(token_max_age_s)
        self._to_forget: set[str] = set()
        """Members to remove from the group; kept until a removal succeeds."""
        self._first_silent: dict[str, float] = {}
        """Unregistered members that stopped answering pings, and since when."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="membership-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sweep()
            except Exception:  # one bad sweep must not end membership upkeep
                logger.exception("membership sweep failed; trying again in %.1fs", self.interval_s)

    def sweep(self) -> None:
        retired = self.server.take_retired_rpc_names()
        if self.owns_group:
            self._token_watch.check(time.monotonic())
            self._to_forget.update(retired)
        registered = {name: (slot, incarnation, last_seen) for slot, incarnation, name, last_seen in self.server.member_workers()}
        me = rpc_membership.my_name()
        if self.owns_group:
            names = [n for n in rpc_membership.member_names() if n != me and n not in self._to_forget]
        else:
            names = [*registered, SERVER_NAME]
        pings = [rpc.rpc_async(name, rpc_api.ping, timeout=self.ping_timeout_s) for name in names]
        now = time.monotonic()
        for name, ping in zip(names, pings):
            owner = registered.get(name)
            try:
                ping.wait()
            except RuntimeError as e:
                self._on_failed_ping(name, owner, e, now)
                continue
            self._first_silent.pop(name, None)
            if owner is not None:
                self.server.mark_alive(owner[0], owner[1])
        self._forget_pending()

    def _on_failed_ping(self, name: str, owner: tuple[int, str, float] | None, error: RuntimeError, now: float) -> None:
        if name == SERVER_NAME and not self.owns_group:
            if classify_failure(error) == PEER_DEAD:
                self.store_host_lost = True
            return
        if classify_failure(error) == PEER_DEAD:
            logger.warning("%s is gone: %s", name, str(error).splitlines()[0])
        else:
            silent_since = owner[2] if owner is not None else self._first_silent.setdefault(name, now)
            if now - silent_since <= self.lease_s:
                if owner is not None:
                    self.server.mark_silent(owner[0], owner[1])
                return
            logger.warning("%s has not answered for %.0fs (hung); removing it", name, now - silent_since)
        if owner is not None:
            self.server.mark_dead(owner[0], owner[1])
        self._first_silent.pop(name, None)
        self._to_forget.add(name)

    def _forget_pending(self) -> None:
        if not self.owns_group:
            self._to_forget.clear()
            return
        try:
            for name in sorted(self._to_forget):
                if rpc_membership.forget_member(name):
                    self.server.metrics.workers_reaped.inc()
                self._to_forget.discard(name)
            for name in rpc_membership.forget_failed_joins():
                logger.warning("removed %s, whose join failed, from the RPC group", name)
                self.server.metrics.workers_reaped.inc()
        except rpc_membership.TokenBusy:
            logger.debug("a join is in progress; removing %s on the next sweep", sorted(self._to_forget))
