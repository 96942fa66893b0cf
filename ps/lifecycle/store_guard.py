"""Puts back, every second, what a stranger changed in the group's store (in the process hosting it:
the ``rpcps store`` coordinator, or a server without --store).

The rendezvous store has no authentication, and one ``set`` used to block every later join for
good: an emptied member list, a rank counter thrown to its limit, the server's address pointed
elsewhere (a joining worker then handed its handshake to the stranger). ``membership.StoreKeeper``
knows what to check; this runs it, and says loudly what it repaired (a log line and
``rpcps_server_store_repairs_total{what}``, or ``rpcps_store_repairs_total{what}`` in the
coordinator): a repair means someone who should not reach the store did.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter

from rpcps.periodic import Periodic
from rpcps.transport import membership

logger = logging.getLogger(__name__)


class StoreGuard:
    def __init__(self, repairs: Counter, interval_s: float = 1.0) -> None:
        """``repairs``: counts each repair, labelled by ``what`` (``membership.REPAIR_KINDS``)."""
        self.repairs = repairs
        self._keeper = membership.StoreKeeper()  # remembers the store as it is now, right after joining
        self._task = Periodic("store-guard", interval_s, self.check)

    def start(self) -> None:
        self._task.start()

    def stop(self) -> None:
        self._task.stop()

    def check(self) -> None:
        for repair in self._keeper.check():
            self.repairs.labels(repair.what).inc()
            logger.error(
                "the group's store was changed by someone outside this job: %s. Keep the store port (--listen) "
                "reachable only from the training network (docs/SECURITY.md)", repair.detail,
            )
