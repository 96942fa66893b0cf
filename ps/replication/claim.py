"""What a starting server process becomes for its shard: the primary, or a standby of a live primary.

A starting server has joined the group under a fresh name and reads its shard's view:

- no view (a new job, or a new store): it bootstraps, ``None -> {epoch, me, -}``, and serves from
  its newest snapshot (or fresh). A process with a snapshot to resume first waits while a
  coordinator that just started holds such claims (``Registry.snapshot_claims_held``): the store
  may be a restarted one, and a live standby whose primary died meanwhile is about to promote from
  the view it followed, holding every update after that snapshot. After that grace it still waits
  while a live member of the group served this shard before the store restarted (its replica
  record says ``held_state``, written back by ``ps.runner``'s rebuild hook): that replica puts the
  view back (a primary's keeper within a heartbeat, a standby by promoting). The grace alone lost
  updates when a restarted primary's first join failed and its retry found the grace over while
  its standby was still to promote (CI, ``tests/integration/store/test_coordinator.py``);
- a view whose primary is a live member: it attaches to that primary as a standby and copies its
  state (``ps.replication.catchup``); it never resumes from disk while a live primary exists;
- a view whose replicas are gone: it takes the shard over, ``{e, P, S} -> {e+1, me, -}``, from its
  newest snapshot. "Gone" is what the group janitor recorded (a refused or reset connection: the
  process exited), or, for a member that simply vanished from the group (hung or cut off, removed
  after its lease), an absence longer than ``absent_grace_s``: such a primary may still be alive
  behind a cut link, holding its store lease, and must be given time to notice and stop. With the
  store in etcd, a primary whose claim is gone (its etcd lease ended: ``ps.replication.primary``)
  counts as gone at once, and the takeover's transaction holds only while that claim is still gone.

A view whose standby is still a live member waits: that standby promotes itself. A view this
process cannot verify (unsigned or wrongly signed where the job has a secret, or a replay of an
older one, ``rpcps.transport.registry``) is waited out too: it is no one's to follow or replace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from rpcps.endpoints import server_name
from rpcps.logsafe import peer_text
from rpcps.messages import View
from rpcps.transport.registry import Registry, StoreUnavailable, ViewRecord

logger = logging.getLogger(__name__)

_POLL_S = 0.2


@dataclass(frozen=True)
class Claim:
    """The outcome: ``record`` is the view this process now serves as primary (``attach_to`` None),
    or the view it found with a live primary to attach to as a standby."""

    record: ViewRecord
    attach_to: str | None = None
    took_over: bool = False
    """The shard's replicas were gone: this process serves it from a snapshot (what they applied after
    that snapshot is lost, and recomputed by the workers)."""


class ClaimTimeout(RuntimeError):
    """The shard could not be claimed in time (its replicas neither came back nor were declared gone)."""


def claim_shard(
    registry: Registry,
    shard: int,
    me: str,
    bootstrap_epoch: int,
    members: Callable[[], set[str]],
    absent_grace_s: float,
    timeout_s: float,
    attach_only: bool = False,
    from_snapshot: bool = False,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Claim:
    """Decides this process's role for ``shard`` (see the module docstring).

    Args:
        bootstrap_epoch: the epoch of a new view (one past the epoch of the snapshot it resumes).
        members: the group's current member names (the store's list).
        absent_grace_s: how long a primary that vanished without being declared gone is waited for.
        timeout_s: give up after this long (raises ClaimTimeout).
        attach_only: never serve the shard from a snapshot; only attach to a live primary (a standby
            restarting after the store was lost: its primary's final snapshot is the one to go on from).
        from_snapshot: this process would serve the shard from a snapshot (it has one to resume).
    """
    deadline = clock() + timeout_s
    absent_since: dict[str, float] = {}
    said: set[str] = set()

    def say_once(message: str) -> None:
        if message not in said:
            said.add(message)
            logger.info("%s", message)

    while True:
        try:
            claim = _try_claim(
                registry, shard, me, bootstrap_epoch, members(), absent_since, absent_grace_s, clock(), attach_only,
                from_snapshot, say_once,
            )
        except StoreUnavailable as e:
            logger.warning("reading shard %d's view: %s; retrying", shard, e)
            claim = None
        if claim is not None:
            return claim
        if clock() >= deadline:
            raise ClaimTimeout(f"could not claim shard {shard} within {timeout_s:.0f}s: its replicas neither answered nor were declared gone")
        sleep(_POLL_S)


def _live_state_holders(registry: Registry, shard: int, me: str, members: set[str]) -> list[str]:
    """The live members that served ``shard`` before the group's store restarted (sorted)."""
    prefix = f"{server_name(shard)}_r"
    candidates = sorted(m for m in members if m.startswith(prefix) and m != me)
    return [m for m in candidates if (record := registry.replica(m)) is not None and record.get("held_state") and record.get("shard") == shard]


def _try_claim(
    registry: Registry,
    shard: int,
    me: str,
    bootstrap_epoch: int,
    members: set[str],
    absent_since: dict[str, float],
    absent_grace_s: float,
    now: float,
    attach_only: bool,
    from_snapshot: bool,
    say_once: Callable[[str], None],
) -> Claim | None:
    """One look at the view; None: look again. ``say_once`` logs why this process waits (once per reason)."""
    reading = registry.read_view(shard)
    record = reading.record
    if reading.refused is not None:
        # Not a view of this job (a stranger's, or a replay): neither attach to it nor write over it.
        # The shard's live primary puts its own view back within a heartbeat (ps.replication.primary);
        # with none, an operator must (the store was written by someone outside the job).
        return None
    if attach_only:
        return Claim(record, attach_to=record.view.primary) if record is not None and record.view.primary in members else None
    if record is None:
        if from_snapshot and registry.snapshot_claims_held():
            say_once(f"shard {shard} has no view in a coordinator that just started: waiting for a live replica to put "
                     "it back before serving the shard from the snapshot")
            return None
        holders = _live_state_holders(registry, shard, me, members) if from_snapshot else []
        if holders:
            say_once(f"shard {shard} has no view but {peer_text(holders[0])} served it before the group's store restarted "
                     "and is alive: waiting for a live replica to put it back before serving the shard from the snapshot")
            return None
        won = registry.change_view(shard, reading, View(bootstrap_epoch, me))
        if won is not None:
            logger.info("shard %d has no view yet: serving it as primary, epoch %d", shard, bootstrap_epoch)
            return Claim(won)
        return None  # another replica bootstrapped first: read its view
    view = record.view
    if view.primary in members:
        return Claim(record, attach_to=view.primary)
    if view.standby is not None and view.standby in members:
        # The primary is gone and its standby is alive: it promotes itself; wait for that.
        say_once(f"shard {shard}'s primary {peer_text(view.primary)} is gone and its standby {peer_text(view.standby)} "
                 "is alive: waiting for it to promote, then copying its state")
        return None
    declared = [_declared_gone(registry, name, absent_since, absent_grace_s, now) for name in view.names()]  # every timer starts now
    unclaimed = not declared[0] and registry.claim_ended(shard, view.primary)
    if not all(declared[1:]) or not (declared[0] or unclaimed):
        return None
    won = registry.change_view(shard, record, View(view.epoch + 1, me), unclaimed_by=view.primary if unclaimed else None)
    if won is None:
        return None
    logger.warning(
        "shard %d's replicas %s are gone: taking it over as primary, epoch %d, from the newest snapshot", shard,
        peer_text(list(view.names())), view.epoch + 1,  # names from the store, which has no authentication
    )
    return Claim(won, took_over=True)


def _declared_gone(registry: Registry, name: str, absent_since: dict[str, float], grace_s: float, now: float) -> bool:
    if registry.is_dead(name):
        return True
    first = absent_since.setdefault(name, now)
    return now - first >= grace_s
