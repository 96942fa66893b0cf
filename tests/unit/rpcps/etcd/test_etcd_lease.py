"""``HeldKey``: one holder of a duty at a time under an etcd lease, and the janitor that sweeps only
while it holds it (pure logic: a fake etcd that keeps one key and its lease)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from rpcps.etcd import rpc_pb2
from rpcps.etcd.client import modified_at
from rpcps.etcd.lease import MARGIN_S, HeldKey
from rpcps.transport import membership
from rpcps.transport.coordinator import Janitor


class FakeEtcd:
    """One key, leases by id; a lease ends (taking the key with it) when ``expire`` says so."""

    def __init__(self) -> None:
        self.holder: tuple[bytes, int] | None = None
        self.live: set[int] = set()
        self.revoked: list[int] = []
        self.conditions_hold = True
        """What the comparisons beyond the key's absence (a claim's: the view is still the primary's) find."""
        self._next = 1

    def grant(self, ttl_s: int) -> int:
        self._next += 1
        self.live.add(self._next)
        return self._next

    def keep_alive(self, lease: int) -> int:
        return 3 if lease in self.live else 0

    def revoke(self, lease: int) -> None:
        self.revoked.append(lease)
        self.expire(lease)

    def expire(self, lease: int) -> None:
        self.live.discard(lease)
        if self.holder is not None and self.holder[1] == lease:
            self.holder = None

    def txn(self, compare: Sequence[rpc_pb2.Compare], success: Sequence[rpc_pb2.RequestOp]) -> rpc_pb2.TxnResponse:
        (guard, *others), (op,) = compare, success
        assert guard.target == rpc_pb2.Compare.CREATE and guard.create_revision == 0
        if self.holder is not None or (others and not self.conditions_hold):
            return rpc_pb2.TxnResponse(succeeded=False)
        self.holder = (op.request_put.value, op.request_put.lease)
        return rpc_pb2.TxnResponse(succeeded=True)


def _held(etcd: FakeEtcd, holder: str) -> HeldKey:
    return HeldKey(etcd, b"/job/rpcps/duty/janitor", holder)  # type: ignore[arg-type]


def test_one_holder_at_a_time_and_the_next_takes_over_when_its_lease_ends() -> None:
    etcd = FakeEtcd()
    a, b = _held(etcd, "ps0_r1"), _held(etcd, "ps0_r2")
    a._step()
    b._step()
    assert a.held() and not b.held()
    assert etcd.revoked == [3], "the loser gives its unused lease back"
    a._step()  # a renewal
    assert a.held()
    assert etcd.holder is not None
    etcd.expire(etcd.holder[1])  # a frozen or cut-off holder: etcd ends its lease
    b._step()
    assert b.held() and etcd.holder is not None and etcd.holder[0] == b"ps0_r2"
    a._step()
    assert not a.held(), "a holder whose lease ended stops at its next renewal"


def test_a_holder_stops_counting_itself_the_holder_before_its_lease_can_end() -> None:
    etcd = FakeEtcd()
    a = _held(etcd, "ps0_r1")
    asked = time.monotonic()
    a._step()
    assert a._valid_until <= asked + a.ttl_s - MARGIN_S + 0.01


def test_stop_gives_the_key_back_at_once() -> None:
    etcd = FakeEtcd()
    a = _held(etcd, "ps0_r1").start()
    try:
        deadline = time.monotonic() + 5
        while not a.held():
            assert time.monotonic() < deadline, "never took the free key"
            time.sleep(0.01)
    finally:
        a.stop()
    assert not a.held() and etcd.holder is None


def test_wait_taken_says_whether_the_key_was_taken_in_time() -> None:
    etcd = FakeEtcd()
    etcd.holder = (b"ps0_r1", 99)  # another process holds it
    b = _held(etcd, "ps0_r2").start()
    try:
        assert not b.wait_taken(0.2)
        etcd.expire(99)
        assert b.wait_taken(10) and etcd.holder is not None and etcd.holder[0] == b"ps0_r2"
    finally:
        b.stop()


def test_a_key_taken_again_after_its_lease_ended_says_so_once_per_retake() -> None:
    etcd, retaken = FakeEtcd(), []
    a = HeldKey(etcd, b"/job/rpcps/alive/ps0_r1", "ps0_r1", on_retaken=lambda: retaken.append(1))  # type: ignore[arg-type]
    a._step()
    a._step()  # a renewal
    assert retaken == []
    assert etcd.holder is not None
    etcd.expire(etcd.holder[1])  # cut off from etcd past its TTL
    a._step()  # finds it lost and takes it again
    a._step()  # a renewal
    assert a.held() and retaken == [1]


def test_a_claim_is_taken_only_under_its_conditions_and_never_again_once_lost() -> None:
    """A primary's claim (``retake=False``): refused when its condition fails (the view moved on),
    and once its lease ended not taken again though the key is free: ``ended`` steps the primary down."""
    etcd = FakeEtcd()

    def claim(holder: str) -> HeldKey:
        return HeldKey(
            etcd, f"/job/rpcps/claim/0/{holder}".encode(), holder,  # type: ignore[arg-type]
            conditions=lambda: [modified_at(b"/job/rpcps/view/0", 7)], retake=False,
        )

    etcd.conditions_hold = False
    refused = claim("ps0_r1")
    refused._step()
    assert refused.ended and not refused.held() and etcd.holder is None
    etcd.conditions_hold = True
    held = claim("ps0_r2")
    held._step()
    assert held.held() and not held.ended and etcd.holder is not None
    etcd.expire(etcd.holder[1])  # frozen or cut off past its lease
    held._step()
    assert held.ended and not held.held()
    held._step()
    assert etcd.holder is None, "a lost claim is never taken again"


def test_a_lease_shorter_than_two_seconds_is_refused() -> None:
    with pytest.raises(ValueError, match="ttl_s must be >= 2"):
        HeldKey(FakeEtcd(), b"k", "x", ttl_s=1)  # type: ignore[arg-type]


class _Duty:
    def __init__(self) -> None:
        self.holding = False
        self.stopped = False

    def held(self) -> bool:
        return self.holding

    def stop(self) -> None:
        self.stopped = True


@pytest.mark.timeout(20)
def test_the_janitor_sweeps_only_while_it_holds_the_duty(monkeypatch: pytest.MonkeyPatch) -> None:
    duty = _Duty()
    swept = threading.Event()
    janitor = Janitor(registry=None, lease_s=1.0, interval_s=0.01, duty=duty)  # type: ignore[arg-type]
    monkeypatch.setattr(janitor, "sweep", swept.set)
    janitor._to_forget.add("ps1_r3")  # what a former holder's sweep left behind
    janitor.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # 1 s of rounds (every 10 ms) without the duty
            assert not swept.is_set(), "swept without holding the duty"
            time.sleep(0.01)
        assert janitor._to_forget == set(), "what it saw while it held the duty is forgotten"
        duty.holding = True
        assert swept.wait(5), "never swept once it held the duty"
    finally:
        janitor.stop()
    assert duty.stopped


def test_a_sweep_with_nothing_to_remove_leaves_the_group_token_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Taking the token every sweep delayed joins, and a janitor killed while holding it (a server,
    with the store in etcd) stalled every join and removal until the token was taken over."""
    tidied: list[set[str]] = []
    monkeypatch.setattr(membership, "tidy", lambda names, dead_holder="": (tidied.append(set(names)), ([], []))[1])
    unknown: list[str] = []
    monkeypatch.setattr(membership, "unknown_listed", lambda: unknown)
    janitor = Janitor(registry=None, lease_s=1.0)  # type: ignore[arg-type]
    janitor._forget_pending("")
    assert tidied == []
    unknown.append("worker3_r9")  # a join in progress, or one that failed
    janitor._forget_pending("")
    janitor._to_forget.add("ps0_r1")
    janitor._forget_pending("")
    assert tidied == [set(), {"ps0_r1"}]
