"""Finds worker processes that died or left and removes them from the RPC group.

Without this, the first worker that dies makes every later join fail (see ``rpcps.rpc_membership``).
A worker silent for longer than its lease is pinged: a refused or reset connection means the process
is gone and it is removed; a ping that times out means it is hung, so it is marked not live but kept,
because it may wake up and carry on. Group members that never registered a slot (a worker refused
for its model, or killed while starting) are pinged every sweep, and joins that failed half-way are
dropped from the member list. A removal that finds a join in progress is retried on the next sweep,
never dropped.
"""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed.rpc as rpc

from ps import rpc_api
from ps.server import ParameterServer
from rpcps import rpc_membership
from rpcps.transport import PEER_DEAD, SERVER_NAME, classify_failure

logger = logging.getLogger(__name__)


class MembershipReaper:
    def __init__(self, server: ParameterServer, lease_s: float, token_max_age_s: float, interval_s: float = 1.0) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.server = server
        self.lease_s = lease_s
        self.interval_s = interval_s
        self._token_watch = rpc_membership.JoinTokenWatch(token_max_age_s)
        self._to_forget: set[str] = set()
        """Members to remove from the group; kept until a removal succeeds."""
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
            except Exception:  # noqa: BLE001 - one bad sweep must not end membership upkeep
                logger.exception("membership sweep failed; trying again in %.1fs", self.interval_s)

    def sweep(self) -> None:
        self._token_watch.check(time.monotonic())
        self._to_forget.update(self.server.take_retired_rpc_names())
        registered = self.server.rpc_names()
        silent = self.server.silent_workers(self.lease_s)
        unregistered = [name for name in rpc_membership.member_names() if name != SERVER_NAME and name not in registered]
        names = [name for _, _, name in silent] + unregistered
        pings = [rpc.rpc_async(name, rpc_api.ping, timeout=2.0) for name in names]
        owners: list[tuple[int, str] | None] = [(slot, inc) for slot, inc, _ in silent] + [None] * len(unregistered)
        for name, owner, ping in zip(names, owners, pings):
            try:
                ping.wait()
            except RuntimeError as e:
                if classify_failure(e) == PEER_DEAD:
                    logger.warning("%s is gone: %s", name, str(e).splitlines()[0])
                    if owner is not None:
                        self.server.mark_dead(*owner)
                    self._to_forget.add(name)
                elif owner is not None:
                    logger.warning("worker slot %d (%s) does not answer (hung?); keeping it", owner[0], name)
                    self.server.mark_silent(*owner)
        self._forget_pending()

    def _forget_pending(self) -> None:
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
