"""``ChaosPlan.every_role``: which kills a soak plans, and how pair targets count (pure logic)."""

from __future__ import annotations

from collections import Counter

from harness.faults import ChaosPlan, Kill, _hits_server, _shard_of


def test_every_role_kills_each_role_its_rounds_and_the_pairs_in_a_seeded_order_within_the_run() -> None:
    plan = ChaosPlan.every_role(3, 2, seed=5, workers=2, steps=1000)
    targets = Counter(k.target for k in plan.kills)
    assert targets == {"worker0": 3, "worker1": 3, "primary": 3, "standby": 3, "store": 3, "evaluator": 3, "primary+store": 2}
    versions = [k.at_version for k in plan.kills]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert 2000 // 20 <= versions[0] and versions[-1] <= 2000 * 17 // 20
    assert plan.replicas == 2
    assert [k.target for k in ChaosPlan.every_role(3, 2, seed=5).kills] == [k.target for k in plan.kills]
    assert [k.target for k in ChaosPlan.every_role(3, 2, seed=6).kills] != [k.target for k in plan.kills]


def test_a_pair_with_the_primary_is_a_server_crash_of_its_shard() -> None:
    assert _hits_server(Kill("primary+store", 10)) and _hits_server(Kill("store+primary1", 10))
    assert _shard_of(Kill("store+primary1", 10)) == 1 and _shard_of(Kill("standby2", 10)) == 2
    assert not _hits_server(Kill("store", 10)) and not _hits_server(Kill("evaluator", 10)) and not _hits_server(Kill("standby", 10))
