"""``HeldKey``: a key held under an etcd lease, so one process at a time does a job (the group
janitor in a job whose store is in etcd), and another takes it over when the holder dies or is cut off;
or, taken once and never again (``retake=False``), a primary's claim on its shard, whose end lets
another server take the shard over (``ps.replication.primary``, ``ps.replication.claim``).

The holder renews its lease every third of its time to live. It counts itself the holder only
until ``ttl_s`` minus a margin after the last renewal etcd acknowledged: a holder frozen or cut
off from etcd stops before etcd lets the lease end and another process take the key (etcd ends a
lease no sooner than its TTL after the last renewal it granted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from rpcps.etcd import rpc_pb2
from rpcps.etcd.client import EtcdClient, EtcdUnavailable, absent, put_op

logger = logging.getLogger(__name__)

MARGIN_S = 0.5
"""A holder stops counting itself the holder this long before its lease can have ended."""
_FIRST_TAKE_RETRY_S = 0.1
"""A claim (``retake=False``) etcd did not answer is asked for again this soon: its primary applies
nothing alone until it holds it. A duty is contended by every server: it waits a renewal period."""


class HeldKey:
    """Tries to hold ``key`` (with ``holder`` as its value) for as long as this process runs."""

    def __init__(
        self,
        client: EtcdClient,
        key: bytes,
        holder: str,
        ttl_s: int = 3,
        conditions: Callable[[], Sequence[rpc_pb2.Compare]] = tuple,
        retake: bool = True,
        on_retaken: Callable[[], None] | None = None,
    ) -> None:
        """
        Args:
            conditions: more comparisons the transaction that takes the key must pass (asked each time).
            retake: False: once lost (its lease ended) or refused (a comparison failed), the key is
                never taken again and ``ended`` says so.
            on_retaken: called (on the renewal thread) each time the key is taken again after it was
                lost: what others did while it was absent may need undoing.
        """
        if ttl_s < 2:
            raise ValueError(f"ttl_s must be >= 2 (etcd's leases count whole seconds), got {ttl_s}")
        self._client = client
        self._key = key
        self._holder = holder.encode()
        self.ttl_s = ttl_s
        self._lease = 0
        self._valid_until = 0.0
        self._conditions = conditions
        self._retake = retake
        self._on_retaken = on_retaken
        self._ended = threading.Event()
        self._taken = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"etcd-lease-{key.decode(errors='replace')}", daemon=True)

    def start(self) -> HeldKey:
        self._thread.start()
        return self

    def held(self) -> bool:
        """Whether this process holds the key now (and will until at least the next renewal is due)."""
        return time.monotonic() < self._valid_until

    def wait_taken(self, timeout_s: float) -> bool:
        """Whether the key was taken (at least once) within ``timeout_s``."""
        return self._taken.wait(timeout_s)

    @property
    def ended(self) -> bool:
        """With ``retake=False``: the key was lost or refused and will not be held again."""
        return self._ended.is_set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._valid_until = 0.0
        if self._lease:
            self._client.revoke(self._lease)  # the next holder need not wait out the TTL

    def _loop(self) -> None:
        while True:
            try:
                self._step()
            except EtcdUnavailable as e:
                logger.warning("etcd did not answer for the lease on %s: %s", self._key.decode(errors="replace"), e)
            pause = self.ttl_s / 3 if self._lease or self._retake else _FIRST_TAKE_RETRY_S
            if self._ended.is_set() or self._stop.wait(pause):
                return

    def _step(self) -> None:
        if self._ended.is_set():
            return
        if self._lease:
            asked = time.monotonic()
            if self._client.keep_alive(self._lease) > 0:
                self._valid_until = asked + self.ttl_s - MARGIN_S
                return
            logger.warning("lost the etcd lease on %s (it ended before it was renewed)", self._key.decode(errors="replace"))
            self._lease, self._valid_until = 0, 0.0
            if not self._retake:
                self._ended.set()
                return
        asked = time.monotonic()
        lease = self._client.grant(self.ttl_s)
        if self._client.txn([absent(self._key), *self._conditions()], [put_op(self._key, self._holder, lease)]).succeeded:
            self._lease, self._valid_until = lease, asked + self.ttl_s - MARGIN_S
            logger.info("holding %s in etcd", self._key.decode(errors="replace"))
            if self._taken.is_set() and self._on_retaken is not None:
                try:
                    self._on_retaken()
                except Exception:  # the renewals must outlive it
                    logger.exception("after taking %s in etcd again", self._key.decode(errors="replace"))
            self._taken.set()
        else:
            self._client.revoke(lease)
            if not self._retake:
                logger.warning("could not take %s in etcd (it is held, or a condition failed)", self._key.decode(errors="replace"))
                self._ended.set()
