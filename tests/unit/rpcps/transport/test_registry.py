"""The group's shared facts in a real TCPStore (in this process): views by compare-and-set, the shard
count, dead members; and how a starting server claims its shard from them."""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from ps.replication.claim import ClaimTimeout, claim_shard
from rpcps.messages import View
from rpcps.ports import free_port
from rpcps.transport.registry import Registry, ShardCountMismatch, StoreUnavailable
from rpcps.transport.store_client import host_store


@pytest.fixture
def registry() -> Iterator[Registry]:
    port = free_port()
    master = host_store("127.0.0.1", port, datetime.timedelta(seconds=30))
    # 10 s to connect, room for a loaded 2-core run; no test here waits on the store's timeout.
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    yield Registry(client)
    del client, master


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


def _claim(registry: Registry, me: str, members: set[str], clock: Clock, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    return claim_shard(registry, 0, me, 1, lambda: members, absent_grace_s=11.0, timeout_s=timeout_s, clock=clock, sleep=clock.sleep)


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


def test_a_live_standby_is_left_to_promote_itself(registry: Registry) -> None:
    clock = Clock()
    registry.change_view(0, None, View(3, "ps0_r1", "ps0_r2"))
    registry.mark_dead("ps0_r1")
    with pytest.raises(ClaimTimeout):
        _claim(registry, "ps0_r5", {"ps0_r2", "ps0_r5"}, clock, timeout_s=5.0)
    assert registry.view(0).view == View(3, "ps0_r1", "ps0_r2")  # type: ignore[union-attr]
