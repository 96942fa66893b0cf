"""The group's shared facts in a real TCPStore (in this process): views by compare-and-set, the shard
count, dead members; and how a starting server claims its shard from them."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from ps.replication.claim import ClaimTimeout, claim_shard
from rpcps.messages import View
from rpcps.ports import free_port
from rpcps.transport.registry import Registry, ShardCountMismatch, StoreUnavailable
from rpcps.transport.store_client import SNAPSHOT_CLAIMS_HELD_KEY, host_store


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    port = free_port()
    master = host_store("127.0.0.1", port, datetime.timedelta(seconds=30))
    # 10 s to connect, room for a loaded 2-core run; no test here waits on the store's timeout.
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    yield client
    del client, master


@pytest.fixture
def registry(store: dist.TCPStore) -> Registry:
    return Registry(store)


def test_a_view_changes_only_from_what_it_was(registry: Registry) -> None:
    assert registry.view(0) is None
    first = registry.change_view(0, None, View(1, "ps0_r1"))
    assert first is not None and registry.view(0) == first
    assert registry.change_view(0, None, View(1, "ps0_r2")) is None, "a second bootstrap must lose"
    with_standby = registry.change_view(0, first, View(1, "ps0_r1", "ps0_r2"))
    assert with_standby is not None
    # Both replicas act on the view they read: the standby promotes, the primary drops it. One wins.
    promoted = registry.change_view(0, with_standby, View(2, "ps0_r2"))
    dropped = registry.change_view(0, with_standby, View(1, "ps0_r1"))
    assert promoted is not None and dropped is None
    assert registry.view(0).view == View(2, "ps0_r2")  # type: ignore[union-attr]


def test_shards_keep_separate_views(registry: Registry) -> None:
    registry.change_view(0, None, View(1, "ps0_r1"))
    registry.change_view(1, None, View(4, "ps1_r2", "ps1_r3"))
    assert registry.view(0).view == View(1, "ps0_r1")  # type: ignore[union-attr]
    assert registry.view(1).view == View(4, "ps1_r2", "ps1_r3")  # type: ignore[union-attr]


def test_the_shard_count_is_claimed_once_and_checked(registry: Registry) -> None:
    assert registry.shard_count() is None
    registry.claim_shard_count(2)
    registry.claim_shard_count(2)
    with pytest.raises(ShardCountMismatch, match="run 2 shard.*--shards 3"):
        registry.claim_shard_count(3)
    assert registry.shard_count() == 2


def test_dead_members_and_replica_records(registry: Registry) -> None:
    assert not registry.is_dead("ps0_r1")
    registry.mark_dead("ps0_r1")
    assert registry.is_dead("ps0_r1")
    registry.put_replica("ps0_r1", {"shard": 0, "pid": 7})
    assert registry.replica("ps0_r1") == {"shard": 0, "pid": 7}
    assert registry.replica("nobody") is None


def test_a_store_that_is_gone_fails_the_call_instead_of_hanging() -> None:
    port = free_port()
    master = host_store("127.0.0.1", port, datetime.timedelta(seconds=30))
    registry = Registry(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=1)))
    del master
    with pytest.raises(StoreUnavailable):
        registry.view(0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _claim(registry: Registry, me: str, members: set[str], clock: Clock, timeout_s: float = 30.0, **kwargs: Any):  # type: ignore[no-untyped-def]
    return claim_shard(
        registry, 0, me, 1, lambda: members, absent_grace_s=11.0, timeout_s=timeout_s, clock=clock, sleep=clock.sleep, **kwargs
    )


def test_the_first_server_bootstraps_and_the_next_attaches_to_it(registry: Registry) -> None:
    clock = Clock()
    first = _claim(registry, "ps0_r1", {"ps0_r1"}, clock)
    assert first.attach_to is None and first.record.view == View(1, "ps0_r1") and not first.took_over
    second = _claim(registry, "ps0_r2", {"ps0_r1", "ps0_r2"}, clock)
    assert second.attach_to == "ps0_r1"


def test_a_shard_whose_primary_died_is_taken_over_at_once(registry: Registry) -> None:
    clock = Clock()
    registry.change_view(0, None, View(3, "ps0_r1"))
    registry.mark_dead("ps0_r1")
    claim = _claim(registry, "ps0_r5", {"ps0_r5"}, clock)
    assert claim.took_over and claim.record.view == View(4, "ps0_r5") and clock.now == 0.0


def test_a_primary_that_vanished_without_dying_is_waited_for_past_its_store_lease(registry: Registry) -> None:
    clock = Clock()
    registry.change_view(0, None, View(3, "ps0_r1"))
    claim = _claim(registry, "ps0_r5", {"ps0_r5"}, clock)
    assert claim.took_over and clock.now >= 11.0, "it may still be alive behind a cut link, applying until its lease ends"


def test_a_live_standby_is_left_to_promote_itself(registry: Registry, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    registry.change_view(0, None, View(3, "ps0_r1", "ps0_r2"))
    registry.mark_dead("ps0_r1")
    with caplog.at_level(logging.INFO, logger="ps.replication.claim"), pytest.raises(ClaimTimeout):
        _claim(registry, "ps0_r5", {"ps0_r2", "ps0_r5"}, clock, timeout_s=5.0)
    assert registry.view(0).view == View(3, "ps0_r1", "ps0_r2")  # type: ignore[union-attr]
    waits = [r.getMessage() for r in caplog.records if "waiting for it to promote" in r.getMessage()]
    said = "shard 0's primary ps0_r1 is gone and its standby ps0_r2 is alive: waiting for it to promote, then copying its state"
    assert waits == [said], "said once, naming both, though it looked every 0.2 s for 5 s"


def test_a_coordinator_that_just_started_holds_a_snapshot_claim_until_a_live_standby_promoted(
    registry: Registry, store: dist.TCPStore
) -> None:
    """A store restarted empty: a server with a snapshot finds no view and waits while the coordinator
    holds snapshot claims; the standby that promotes meanwhile (its view written from nothing) is
    the shard's primary, and the server attaches to it instead of serving its older snapshot."""
    store.set(SNAPSHOT_CLAIMS_HELD_KEY, "1")
    clock = Clock()

    def standby_promotes_meanwhile(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now >= 1.0 and registry.view(0) is None:
            registry.change_view(0, None, View(2, "ps0_r2"))

    claim = claim_shard(registry, 0, "ps0_r5", 2, lambda: {"ps0_r2", "ps0_r5"}, absent_grace_s=11.0, timeout_s=30.0,
                        from_snapshot=True, clock=clock, sleep=standby_promotes_meanwhile)
    assert claim.attach_to == "ps0_r2" and not claim.took_over


def test_a_held_snapshot_claim_is_served_once_the_coordinator_releases_it_and_a_fresh_start_is_not_held(
    registry: Registry, store: dist.TCPStore
) -> None:
    store.set(SNAPSHOT_CLAIMS_HELD_KEY, "1")
    clock = Clock()

    def released_after_6s(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now >= 6.0:
            store.set(SNAPSHOT_CLAIMS_HELD_KEY, "0")

    fresh = claim_shard(registry, 1, "ps1_r4", 1, lambda: {"ps1_r4"}, absent_grace_s=11.0, timeout_s=30.0, clock=Clock())
    assert fresh.record.view == View(1, "ps1_r4"), "nothing to resume, so nothing newer to lose: not held"
    claim = claim_shard(registry, 0, "ps0_r5", 2, lambda: {"ps0_r5"}, absent_grace_s=11.0, timeout_s=30.0,
                        from_snapshot=True, clock=clock, sleep=released_after_6s)
    assert claim.attach_to is None and claim.record.view == View(2, "ps0_r5") and clock.now >= 6.0


def test_past_the_grace_a_live_replica_that_served_the_shard_before_the_store_restarted_is_waited_for(
    registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    """The coordinator's grace is over (CI: the restarted primary's first join failed and its retry
    came 8 s after the store), but the standby that followed the shard before the store restarted
    is alive and wrote its record back (``held_state``): the restarted server waits for it to
    promote and attaches, instead of serving its older snapshot."""
    registry.put_replica("ps0_r2", {"shard": 0, "held_state": True})
    clock = Clock()

    def standby_promotes_after_3s(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now >= 3.0 and registry.view(0) is None:
            registry.change_view(0, None, View(2, "ps0_r2"))

    with caplog.at_level(logging.INFO, logger="ps.replication.claim"):
        claim = claim_shard(registry, 0, "ps0_r5", 2, lambda: {"ps0_r2", "ps0_r5"}, absent_grace_s=11.0, timeout_s=30.0,
                            from_snapshot=True, clock=clock, sleep=standby_promotes_after_3s)
    assert claim.attach_to == "ps0_r2" and not claim.took_over and clock.now >= 3.0
    assert any("ps0_r2 served it before the group's store restarted" in r.getMessage() for r in caplog.records)


def test_a_holder_that_left_the_group_is_waited_for_no_longer(registry: Registry) -> None:
    registry.put_replica("ps0_r6", {"shard": 0, "held_state": True})
    members = {"ps0_r6", "ps0_r7"}
    clock = Clock()

    def holder_leaves_after_2s(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now >= 2.0:
            members.discard("ps0_r6")  # the janitor removed it: it died, or restarted under a new name

    claim = claim_shard(registry, 0, "ps0_r7", 2, lambda: set(members), absent_grace_s=11.0, timeout_s=30.0,
                        from_snapshot=True, clock=clock, sleep=holder_leaves_after_2s)
    assert claim.attach_to is None and claim.record.view == View(2, "ps0_r7") and clock.now >= 2.0


def test_replicas_that_all_start_from_the_snapshot_do_not_wait_for_each_other(registry: Registry) -> None:
    """A whole job restarted from its snapshots: the other replica of the shard holds no state (no
    ``held_state``), and another shard's holder is not this shard's."""
    registry.put_replica("ps0_r2", {"shard": 0})
    registry.put_replica("ps1_r3", {"shard": 1, "held_state": True})
    clock = Clock()
    claim = claim_shard(registry, 0, "ps0_r5", 2, lambda: {"ps0_r2", "ps1_r3", "ps0_r5"}, absent_grace_s=11.0,
                        timeout_s=30.0, from_snapshot=True, clock=clock, sleep=clock.sleep)
    assert claim.attach_to is None and claim.record.view == View(2, "ps0_r5") and clock.now == 0.0
