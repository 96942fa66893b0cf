"""Finds worker processes that died, hung or left, and removes them from the RPC group.

Without this, the first worker that dies makes every later join fail (see ``rpcps.rpc_membership``),
so dead members must go before their replacements arrive. Every sweep (1 s) pings every member in
parallel: a refused or reset connection means the process is gone, and it is removed at once. A ping
that times out means the process is hung: it is marked not live, and removed once it has been silent
for longer than its lease (a hung member would also block every join); if it wakes up later, its
calls fail and it restarts itself and rejoins.
"""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed.rpc as rpc

from ps import rpc_api
from ps.server import ParameterServer
from rpcps import rpc_membership
from rpcps.transport import PEER_DEAD, classify_failure

logger = logging.getLogger(__name__)


class MembershipReaper:
    def __init__(
        self,
        server: ParameterServer,
        lease_s: float,
        token_max_age_s: float = 5.0,
        interval_s: float = 1.0,
        ping_timeout_s: float = 2.0,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.server = server
        self.lease_s = lease_s
        self.interval_s = interval_s
        self.ping_timeout_s = ping_timeout_s
        self._token_watch = rpc_membership.JoinTokenWatch(token_max_age_s)
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
        for name in self.server.take_retired_rpc_names():
            self._forget(name)
        members = self.server.member_workers()
        pings = [rpc.rpc_async(name, rpc_api.ping, timeout=self.ping_timeout_s) for _, _, name, _ in members]
        now = time.monotonic()
        for (slot, incarnation, name, last_seen), ping in zip(members, pings):
            try:
                ping.wait()
                self.server.mark_alive(slot, incarnation)
                continue
            except RuntimeError as e:
                failure = e
            if classify_failure(failure) == PEER_DEAD:
                logger.warning("worker slot %d (%s) is gone: %s", slot, name, str(failure).splitlines()[0])
            elif now - last_seen > self.lease_s:
                logger.warning("worker slot %d (%s) has been hung for %.0fs; removing it", slot, name, now - last_seen)
            else:
                self.server.mark_silent(slot, incarnation)
                continue
            self.server.mark_dead(slot, incarnation)
            self._forget(name)

    def _forget(self, name: str) -> None:
        deadline = time.monotonic() + 5.0
        while True:
            try:
                if rpc_membership.forget_member(name):
                    self.server.metrics.workers_reaped.inc()
                return
            except RuntimeError as e:
                if time.monotonic() > deadline:
                    logger.error("could not remove %s from the RPC group: %s", name, e)
                    return
                time.sleep(0.1)
