"""The group token's take-over from a dead join, against a real TCPStore (one process, no agent).

The race it closes: a freed token went to the join waiting on it before the janitor could remove
the dead members that join would call, so that join failed too and left the token behind again
(tests/integration/security/test_hostile_peers.py::test_a_worker_without_the_job_secret_is_refused_with_exit_5
failed 2 of 6 runs that way). Over real RPC: tests/integration/rpcps/test_membership.py.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from rpcps.transport import membership
from rpcps.transport.store_client import host_store

pytestmark = pytest.mark.timeout(30)

_TOKEN_KEY = "RpcGroupManagementToken"  # torch's key (torch/distributed/rpc/api.py)
_DEAD = "Token_for_worker0_r2_join"


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.Store]:
    store = host_store("127.0.0.1", 0, datetime.timedelta(seconds=10))
    agent = SimpleNamespace(store=store, get_worker_infos=list)  # no member known to this agent
    monkeypatch.setattr(membership.api, "_get_current_rpc_agent", lambda: agent)
    yield store


def _holder(store: dist.Store) -> str:
    return store.compare_set(_TOKEN_KEY, "", "").decode()


def test_a_dead_holders_token_is_taken_over_not_freed_and_its_waiters_woken(store: dist.Store) -> None:
    store.set(_TOKEN_KEY, _DEAD)
    woken = threading.Event()
    # A join waiting for the dead holder, the way torch's _group_membership_management waits (its own client).
    joiner = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    waiter = threading.Thread(target=lambda: (joiner.wait([_DEAD]), woken.set()), daemon=True)
    waiter.start()
    with membership._holding_token(_DEAD):
        held_by = _holder(store)
        assert held_by.startswith("Token_for_rpcps-") and held_by != _DEAD
        # The waiter is not handed the token while the dead members are removed.
        assert store.compare_set(_TOKEN_KEY, "", "Token_for_worker0_r3_join").decode() == held_by
        assert not woken.is_set()
    assert _holder(store) == ""
    waiter.join(timeout=10)
    assert woken.is_set()


def test_a_token_that_changed_hands_is_not_taken(store: dist.Store) -> None:
    store.set(_TOKEN_KEY, "Token_for_worker0_r3_join")  # the dead join's token was freed and taken since
    with pytest.raises(membership.TokenBusy, match="worker0_r3"), membership._holding_token(_DEAD):
        pass
    assert _holder(store) == "Token_for_worker0_r3_join"


def test_a_free_token_is_taken_only_without_a_dead_holder(store: dist.Store) -> None:
    with membership._holding_token():
        assert _holder(store).startswith("Token_for_rpcps-")
    assert _holder(store) == ""
    with pytest.raises(membership.TokenBusy), membership._holding_token(_DEAD):
        pass


def test_the_watch_names_a_holder_only_once_it_has_held_the_token_past_its_age(store: dist.Store) -> None:
    watch = membership.JoinTokenWatch(max_age_s=5.0)
    assert watch.stale_holder(0.0) == ""  # free
    store.set(_TOKEN_KEY, _DEAD)
    assert watch.stale_holder(1.0) == ""  # first seen
    assert watch.stale_holder(5.9) == ""
    assert watch.stale_holder(6.0) == _DEAD
    store.set(_TOKEN_KEY, "Token_for_worker0_r3_join")
    assert watch.stale_holder(7.0) == ""  # a new holder starts its own clock
    assert watch.stale_holder(12.0) == "Token_for_worker0_r3_join"


def test_a_holder_whose_join_beats_is_never_stale_and_one_that_stops_beating_is(store: dist.Store) -> None:
    """A live join slower than the age (a member slow to answer it) kept its token; CI's coordinator-restart
    test saw a 5 s join lose it to the takeover and fail with 'does not hold the group's join token'."""
    watch = membership.JoinTokenWatch(max_age_s=5.0)
    store.set(_TOKEN_KEY, _DEAD)
    beat_key = "rpcps_join_beat/worker0_r2"
    for second in range(0, 30, 4):
        store.add(beat_key, 1)
        assert watch.stale_holder(float(second)) == "", f"stale at {second}s though it beat"
    assert watch.stale_holder(32.0) == ""  # its last beat was at 28 s
    assert watch.stale_holder(33.0) == _DEAD


def test_a_holder_that_beats_is_taken_over_after_the_longest_a_join_may_take(store: dist.Store) -> None:
    """The store has no authentication: a stranger holding the token and beating must not keep joins out for good."""
    watch = membership.JoinTokenWatch(max_age_s=5.0, beating_max_age_s=60.0)
    store.set(_TOKEN_KEY, _DEAD)
    for second in range(0, 60, 2):
        store.add("rpcps_join_beat/worker0_r2", 1)
        assert watch.stale_holder(float(second)) == ""
    store.add("rpcps_join_beat/worker0_r2", 1)
    assert watch.stale_holder(60.0) == _DEAD


def test_a_join_beats_while_it_runs_and_clears_its_beat_after(store: dist.Store) -> None:
    beat_key = "rpcps_join_beat/worker0_r2"
    with membership.beating_while_joining(store, "worker0_r2"):
        first = int(store.get(beat_key))  # waits for the first beat
        deadline = time.monotonic() + 10
        while int(store.get(beat_key)) == first:  # polls the beat under test, within a deadline
            assert time.monotonic() < deadline, "the beat did not move within 10 s"
            time.sleep(0.05)
    assert not store.check([beat_key])


def test_tidy_removes_failed_joins_while_holding_the_dead_holders_token(store: dist.Store) -> None:
    store.set("names/_ALL_WORKER_INFOS", "worker0_r1-1,worker0_r2-2,")  # listed, unknown to this agent
    store.set(_TOKEN_KEY, _DEAD)
    removed, failed = membership.tidy([], _DEAD)
    assert (removed, failed) == ([], ["worker0_r1", "worker0_r2"])
    assert store.get("names/_ALL_WORKER_INFOS") == b""
    assert _holder(store) == "" and store.get(_DEAD) == b"Done"


_MEMBERS_KEY = "names/_ALL_WORKER_INFOS"  # torch's key (agent_utils.cpp)


def _members(store: dist.Store) -> str:
    return store.get(_MEMBERS_KEY).decode()


def test_before_a_join_departed_members_are_unlisted_and_a_dead_joins_token_taken_over(store: dist.Store) -> None:
    """A lone process about to join a group whose store nobody hosts (etcd): the members whose
    liveness ended are taken off the list, the token a dead join held is freed, and whoever waited
    on that dead join is woken."""
    store.set(_MEMBERS_KEY, "ps0_r1-1,worker0_r2-2,worker1_r3-3,")
    store.set(_TOKEN_KEY, _DEAD)
    assert membership.prune_departed(store, "ps0_r4", lambda: {"worker1_r3"}) == ["ps0_r1", "worker0_r2"]
    assert _members(store) == "worker1_r3-3," and _holder(store) == ""
    assert store.get(_DEAD) == b"Done" and store.get("Token_for_ps0_r4_prune") == b"Done"


@pytest.mark.parametrize("holder", ["Token_for_worker1_r3_join", "Token_for_rpcps-812-0_join", "Token_for_ps0_r4_join"])
def test_a_token_held_by_a_live_member_or_by_no_member_or_by_the_joiner_is_left_alone(store: dist.Store, holder: str) -> None:
    store.set(_MEMBERS_KEY, "worker0_r2-2,worker1_r3-3,")
    store.set(_TOKEN_KEY, holder)
    assert membership.prune_departed(store, "ps0_r4", lambda: {"worker1_r3"}) == []
    assert _holder(store) == holder and _members(store) == "worker0_r2-2,worker1_r3-3,"


def test_a_failed_join_frees_its_own_token_and_takes_itself_off_the_list(store: dist.Store) -> None:
    store.set(_MEMBERS_KEY, "ps0_r1-1,worker0_r2-2,")
    store.set(_TOKEN_KEY, membership.join_token("worker0_r2"))
    membership.withdraw_failed_join(store, "worker0_r2")
    assert _holder(store) == "" and _members(store) == "ps0_r1-1,"
    assert store.get(membership.join_token("worker0_r2")) == b"Done"  # what waiters on the failed join wait for


def test_a_failed_join_leaves_another_members_token_alone(store: dist.Store) -> None:
    store.set(_MEMBERS_KEY, "ps0_r1-1,worker0_r2-2,")
    store.set(_TOKEN_KEY, "Token_for_worker1_r3_join")
    membership.withdraw_failed_join(store, "worker0_r2")
    assert _holder(store) == "Token_for_worker1_r3_join" and _members(store) == "ps0_r1-1,worker0_r2-2,"
