"""Putting back what a member holds in the group's store after the coordinator restarted.

The coordinator (``rpcps store``) keeps the store in memory: killed and started again on the same
port, it serves an empty store. The live members hold what it held, so each one writes its own part
back as soon as it sees the new store (a new ``INCARNATION_KEY``, ``rpcps.transport.store_client``):

- every member raises the rank counter to at least the highest rank its RPC agent maps to a process,
  its own or a peer's (a process joining later must not take such a rank: the member would call the
  process it maps under it, a live one, or a dead one over a broken connection; seen in a test, where
  a worker that died while the coordinator was down left its rank to a new standby its primary then
  could not reach; the coordinator hands out no rank for ``REBUILD_GRACE_S`` after it starts, so the
  members come first), and puts its address
  and its entry back in torch's member list (``membership.relist_self``), so a process that joins
  later calls it; the coordinator's janitor adopts it into its own agent (``membership.tidy``);
- a server writes its shard count and its replica record again (``on_restart`` hooks, ``ps.runner``);
- a primary writes its shard's view again: its keeper puts its own view back over an empty key
  within a heartbeat (``ps.replication.primary``), and a standby whose primary died while the
  coordinator was down promotes itself from the view it followed (``ps.replication.standby``).

Members cannot call the restarted coordinator (their agents keep the dead one's connection under
its rank, 0, for good): a member that leaves is removed by the janitor's next sweep instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rpcps.periodic import Periodic
from rpcps.transport import membership
from rpcps.transport.membership import RANK_COUNTER_KEY
from rpcps.transport.store_client import INCARNATION_KEY, ReconnectingStore

logger = logging.getLogger(__name__)


REBUILD_INTERVAL_S = 0.5
REBUILD_GRACE_S = 2.0
"""How long a coordinator lets the live members write their part back before a joining process
may take a rank (``group.serve``): four of their checks; a member slower than that (a frozen one)
may see a joiner take its rank."""
SNAPSHOT_CLAIM_GRACE_S = 6.0
"""How long a coordinator keeps a shard without a view from being served from a snapshot
(``ps.replication.claim``): a standby whose primary died while the coordinator was down promotes
from the view it followed once the store is back, and a server restarted meanwhile (the dead
primary's supervisor restarts it from its snapshot) must find that view instead of writing its own
first and losing what the standby applied after the snapshot. Joiners take ranks after
``REBUILD_GRACE_S``; this leaves the standby 4 s more, for a loaded machine (promotion took 0.05 s
after the store was back, measured in ``tests/integration/store/test_coordinator.py``)."""


class StoreRebuild:
    """Watches the store's incarnation (every ``interval_s``) and, on a new one, runs this member's rewrites."""

    def __init__(self, store: ReconnectingStore, highest_rank: Callable[[], int], interval_s: float = REBUILD_INTERVAL_S) -> None:
        """``highest_rank``: the highest rank this member's agent maps to a process, read at each rebuild."""
        self._store = store
        self._highest_rank = highest_rank
        self._hooks: list[Callable[[], None]] = []
        self._seen = ""
        """The incarnation whose store holds this member's part ('' until one was read)."""
        self._task = Periodic("store-rebuild", interval_s, self.check)
        self.rebuilds = 0
        """Restarts of the coordinator this member wrote its part back after."""
        self.store_down = False
        """The last check found nobody answering at the store (said once in the log, not per check)."""

    def on_restart(self, hook: Callable[[], None]) -> None:
        """Adds a rewrite run after each restart of the store (it may raise: all are run again next time)."""
        self._hooks.append(hook)

    def start(self) -> StoreRebuild:
        self.check()
        self._task.start()
        return self

    def stop(self) -> None:
        self._task.stop()

    def check(self) -> None:
        """Reads the incarnation; on a new one, writes this member's part back (a rewrite that fails raises)."""
        try:
            now = self._store.compare_set(INCARNATION_KEY, "", "").decode()
        except (RuntimeError, OSError) as e:
            # Expected while the coordinator (or the server hosting the store) restarts: one line,
            # not a traceback with torch's C++ frames every half second.
            if not self.store_down:
                reason = (str(e).splitlines() or [type(e).__name__])[0]
                logger.warning("the group's store does not answer (%s); this member writes its part back once it is back", reason)
            self.store_down = True
            return
        self.store_down = False
        if not now or now == self._seen:
            return  # '' : a coordinator that has not written it yet (or a store hosted by a server)
        if self._seen:
            for hook in self._hooks:
                hook()
            # Last: the coordinator's store guard takes a counter above every rank it knows of for
            # tampering, and it knows of this member's rank once the member is listed (a hook).
            self._store.raise_counter_to(RANK_COUNTER_KEY, self._highest_rank())
            self.rebuilds += 1
            logger.warning("the group's coordinator restarted with an empty store; wrote this member's part back")
        self._seen = now


def start_rebuild(store: ReconnectingStore | None) -> StoreRebuild | None:
    """A started ``StoreRebuild`` for this member of a group whose store a coordinator hosts; None
    with an etcd store, or with a store hosted by shard 0's server (no incarnation: the coordinator
    writes one before it hands out any rank). A server that hosted the store restarts from its
    snapshot and the members rejoin it: there is nothing to write back, and nothing to watch."""
    if store is None or not store.compare_set(INCARNATION_KEY, "", "").decode():
        return None
    address = membership.own_address()  # read now: the store that holds it may be gone when it is needed
    rebuild = StoreRebuild(store, membership.highest_known_rank)
    rebuild.on_restart(lambda: membership.relist_self(address))
    return rebuild.start()
