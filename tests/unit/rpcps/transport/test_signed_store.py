"""Signed records in the group's store (issue 24): views, replica records and dead records carry an
HMAC bound to their kind, shard or member, epoch and writer; readers ignore (and count, once) what
does not verify, a primary puts its own view back over it, and a claim neither follows nor replaces it.

All against a real TCPStore in this process: what a stranger writes is what it would write over the
network (``tests/integration/security/test_hostile_store.py`` does it to real processes)."""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from prometheus_client import CollectorRegistry, Counter

from ps.config import ReplicationConfig
from ps.replication.claim import ClaimTimeout, claim_shard
from ps.replication.metrics import ReplicationMetrics
from ps.replication.primary import Primary
from rpcps import rpc_policy
from rpcps.errors import RegistrationRefused
from rpcps.jobsecret import JobSecret
from rpcps.messages import View
from rpcps.ports import free_port
from rpcps.transport.registry import Refusal, Registry, encode_view, require_secret_off_loopback
from rpcps.transport.store_client import host_store
from tests.unit.ps.replication.fakes import FakeServer
from tests.unit.rpcps.transport.test_registry import Clock
from worker import client

SECRET = JobSecret("s" * 40)
OTHER = JobSecret("o" * 40)


class Store:
    """A TCPStore master and a stranger's raw client to it; ``registry`` makes job processes' clients."""

    def __init__(self) -> None:
        self.port = free_port()
        self.master = host_store("127.0.0.1", self.port, datetime.timedelta(seconds=10))
        self.raw = self.client()
        self.refusals: list[Refusal] = []

    def client(self) -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=datetime.timedelta(seconds=10))

    def registry(self, secret: JobSecret | None = SECRET, writer: str = "ps0_r1", trust_unsigned: bool = True) -> Registry:
        registry = Registry(self.client())
        registry.authenticate(secret, writer, trust_unsigned=trust_unsigned, on_refused=self.refusals.append)
        return registry

    def get(self, key: str) -> str:
        return self.raw.get(key).decode()

    def set(self, key: str, value: str) -> None:
        self.raw.set(key, value)
        # TCPStore does not acknowledge a set: without a read on the same connection, which the store
        # answers only after the set, another client's next read could still see the old value.
        self.raw.get(key)


@pytest.fixture
def store() -> Iterator[Store]:
    store = Store()
    yield store
    del store.raw, store.master


def _edited(raw: str, **changes: object) -> str:
    """The stored text with some fields changed and its HMAC kept (what a stranger can make of a real one)."""
    data = json.loads(raw)
    data.update(changes)
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def test_a_signed_view_reads_back_and_compare_and_set_still_decides(store: Store) -> None:
    r1, r2 = store.registry(writer="ps0_r1"), store.registry(writer="ps0_r2")
    first = r1.change_view(0, None, View(1, "ps0_r1"))
    assert first is not None and "mac" in json.loads(first.raw) and json.loads(first.raw)["writer"] == "ps0_r1"
    assert r2.view(0) == first, "another process of the job verifies it"
    assert r2.change_view(0, None, View(1, "ps0_r2")) is None, "a second bootstrap must lose"
    promoted = r2.change_view(0, first, View(2, "ps0_r2"))
    assert promoted is not None and r1.change_view(0, first, View(1, "ps0_r1", "ps0_r3")) is None
    assert r1.view(0) == promoted and store.refusals == []


def _put(store: Store, shard: int, text: str) -> int:
    store.set(f"rpcps/view/{shard}", text)
    return shard


@pytest.mark.parametrize(
    "tamper, reason",
    [
        (lambda s, raw: _put(s, 1, raw), "bad_signature"),  # moved to another shard
        (lambda s, raw: _put(s, 0, _edited(raw, epoch=9)), "bad_signature"),  # another epoch
        (lambda s, raw: _put(s, 0, _edited(raw, writer="stranger_r9")), "bad_signature"),  # another writer
        (lambda s, raw: _put(s, 0, _edited(raw, primary="stranger_r9")), "bad_signature"),  # another primary
        (lambda s, raw: _put(s, 0, encode_view(View(9, "stranger_r9"), OTHER, 0, "stranger_r9")), "bad_signature"),
        (lambda s, raw: _put(s, 0, encode_view(View(9, "stranger_r9"))), "unsigned"),
        (lambda s, raw: _put(s, 0, "not json"), "malformed"),
    ],
    ids=["other shard", "other epoch", "other writer", "other primary", "other key", "unsigned", "garbage"],
)
def test_a_view_that_does_not_verify_is_ignored_and_counted_once(store: Store, tamper, reason: str, caplog) -> None:  # type: ignore[no-untyped-def]
    writer = store.registry(writer="ps0_r1")
    raw = writer.change_view(0, None, View(3, "ps0_r1")).raw  # type: ignore[union-attr]
    shard = tamper(store, raw)
    reader = store.registry(writer="worker0_r5")
    with caplog.at_level(logging.ERROR, logger="rpcps.transport.registry"):
        for _ in range(3):  # read every heartbeat: still one log line and one count
            reading = reader.read_view(shard)
            assert reading.record is None and reading.refused == reason and reader.view(shard) is None
    assert store.refusals == [Refusal("view", f"rpcps/view/{shard}", reason)]
    assert len([r for r in caplog.records if "ignoring the view record" in r.getMessage()]) == 1


def test_a_replayed_older_view_is_stale_for_whoever_saw_a_newer_one(store: Store) -> None:
    primary, worker = store.registry(writer="ps0_r1"), store.registry(writer="worker0_r4")
    old = primary.change_view(0, None, View(1, "ps0_r1", "ps0_r2"))
    assert worker.view(0) == old
    newer = store.registry(writer="ps0_r2").change_view(0, old, View(2, "ps0_r2"))
    assert newer is not None and worker.view(0) == newer
    store.set("rpcps/view/0", old.raw)  # type: ignore[union-attr]  # a genuine text, replayed
    reading = worker.read_view(0)
    assert reading.record is None and reading.refused == "stale"
    assert store.refusals == [Refusal("view", "rpcps/view/0", "stale")]


def test_replica_and_dead_records_verify_for_their_own_member_only(store: Store) -> None:
    r1, reader = store.registry(writer="ps0_r1"), store.registry(writer="ps0_r2")
    r1.put_replica("ps0_r1", {"shard": 0, "pid": 7, "host": "h", "max_lag": 4})
    assert reader.replica("ps0_r1") == {"shard": 0, "pid": 7, "host": "h", "max_lag": 4}
    store.set("rpcps/replica/ps0_r9", store.get("rpcps/replica/ps0_r1"))  # moved to another member
    store.set("rpcps/replica/ps0_r1", _edited(store.get("rpcps/replica/ps0_r1"), pid=1, max_lag=0))  # a forged pid and lag
    assert reader.replica("ps0_r9") is None and reader.replica("ps0_r1") is None
    janitor = store.registry(writer="store")
    janitor.mark_dead("ps0_r1")
    assert reader.is_dead("ps0_r1")
    store.set("rpcps/dead/ps0_r2", store.get("rpcps/dead/ps0_r1"))  # moved to another member
    store.set("rpcps/dead/ps0_r3", "gone")  # what the store held before records were signed
    assert not reader.is_dead("ps0_r2") and not reader.is_dead("ps0_r3")
    assert sorted((r.record, r.reason) for r in store.refusals) == [
        ("dead", "bad_signature"), ("dead", "malformed"), ("replica", "bad_signature"), ("replica", "bad_signature")
    ]


def test_without_a_secret_the_store_is_trusted_only_on_loopback(store: Store) -> None:
    store.registry(secret=None).change_view(0, None, View(1, "ps0_r1"))
    assert store.registry(secret=None).view(0) is not None  # loopback: unsigned records are taken as they are
    off_loopback = store.registry(secret=None, trust_unsigned=False)
    assert off_loopback.view(0) is None and store.refusals == [Refusal("view", "rpcps/view/0", "unsigned")]
    with pytest.raises(ValueError, match="not on loopback and there is no --job-secret-file"):
        require_secret_off_loopback(False, None, "10.0.0.1:29500")
    require_secret_off_loopback(False, SECRET, "10.0.0.1:29500")
    require_secret_off_loopback(True, None, "127.0.0.1:29500")


def test_the_refusal_counter_has_every_series_from_the_start() -> None:
    registry = CollectorRegistry()
    counter = rpc_policy.store_refusal_counter(registry)
    rpc_policy.counting_store_refusals(counter)(Refusal("view", "rpcps/view/0", "unsigned"))
    assert registry.get_sample_value("rpcps_store_records_refused_total", {"record": "view", "reason": "unsigned"}) == 1
    assert registry.get_sample_value("rpcps_store_records_refused_total", {"record": "dead", "reason": "stale"}) == 0


def test_a_claim_neither_follows_nor_replaces_a_view_it_cannot_verify(store: Store) -> None:
    store.set("rpcps/view/0", encode_view(View(7, "stranger_r9")))
    clock = Clock()
    with pytest.raises(ClaimTimeout):
        claim_shard(store.registry(writer="ps0_r2"), 0, "ps0_r2", 1, lambda: {"ps0_r2", "stranger_r9"}, absent_grace_s=1.0,
                    timeout_s=5.0, clock=clock, sleep=clock.sleep)
    assert store.get("rpcps/view/0") == encode_view(View(7, "stranger_r9")), "a claim must not write over it"
    store.registry(writer="ps0_r1").change_view(0, encode_view(View(7, "stranger_r9")), View(1, "ps0_r1"))  # the primary puts its own back
    claim = claim_shard(store.registry(writer="ps0_r2"), 0, "ps0_r2", 1, lambda: {"ps0_r1", "ps0_r2"}, absent_grace_s=1.0,
                        timeout_s=5.0, clock=clock, sleep=clock.sleep)
    assert claim.attach_to == "ps0_r1"


# ---- the primary's keeper against a tampered view --------------------------------------------------


class _Server(FakeServer):
    """A fake server whose store-repair counter can be read back."""

    def __init__(self) -> None:
        super().__init__()
        self.not_primary_reason = ""
        registry = CollectorRegistry()
        self.metrics = SimpleNamespace(store_repairs=Counter("rpcps_server_store_repairs", "", ["what"], registry=registry))
        self.registry = registry

    def repairs(self) -> float:
        return self.registry.get_sample_value("rpcps_server_store_repairs_total", {"what": "view"}) or 0.0


def _primary(store: Store) -> tuple[Primary, _Server, list[str]]:
    registry = store.registry(writer="ps0_r1")
    record = registry.change_view(0, None, View(2, "ps0_r1"))
    assert record is not None
    server, stepped = _Server(), []
    primary = Primary(
        server, registry, 0, "ps0_r1", record, ReplicationConfig(), ReplicationMetrics(CollectorRegistry(), 1), {}, None,  # type: ignore[arg-type]
        on_step_down=stepped.append, secret=SECRET,
    )
    return primary, server, stepped


@pytest.mark.parametrize(
    "tamper",
    [
        lambda s, p: s.set("rpcps/view/0", encode_view(View(3, "stranger_r9", "stranger_r9"))),  # unsigned
        lambda s, p: s.set("rpcps/view/0", encode_view(View(3, "stranger_r9"), OTHER, 0, "stranger_r9")),  # another key
        lambda s, p: s.set("rpcps/view/0", encode_view(View(1, "ps0_r7"), SECRET, 0, "ps0_r7")),  # an older epoch, replayed
        lambda s, p: s.set("rpcps/view/0", encode_view(View(2, "ps0_r1", "ps0_r5"), SECRET, 0, "ps0_r1")),  # its own epoch, replayed
        lambda s, p: s.raw.delete_key("rpcps/view/0"),
    ],
    ids=["unsigned", "other key", "older epoch", "own epoch", "deleted"],
)
def test_a_primary_puts_its_own_view_back_over_one_that_does_not_replace_it(store: Store, tamper) -> None:  # type: ignore[no-untyped-def]
    primary, server, stepped = _primary(store)
    lease_from = primary._view_read_at
    tamper(store, primary)
    primary._read_view()
    assert stepped == [] and not server.deposed
    assert store.get("rpcps/view/0") == primary.record.raw and server.repairs() == 1
    assert primary._view_read_at == lease_from, "putting it back does not renew the store lease; reading it back does"
    primary._read_view()
    assert primary._view_read_at > lease_from and server.repairs() == 1


def test_a_primary_steps_down_for_a_signed_newer_view(store: Store) -> None:
    primary, server, stepped = _primary(store)
    store.registry(writer="ps0_r3").change_view(0, primary.record, View(3, "ps0_r3"))
    primary._read_view()
    assert server.deposed and len(stepped) == 1 and "View(epoch=3" in stepped[0]


def test_a_primary_changes_its_view_through_a_stranger_s_text(store: Store) -> None:
    primary, _server, stepped = _primary(store)
    store.set("rpcps/view/0", encode_view(View(3, "stranger_r9")))
    record = primary._change_view(primary.record, View(2, "ps0_r1", "ps0_r2"))
    assert record is not None and record.view == View(2, "ps0_r1", "ps0_r2") and stepped == []
    assert store.registry(writer="worker0_r3").view(0) == record


def test_a_worker_that_never_verified_a_view_gives_up_after_10s_and_one_that_did_waits(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.registry(writer="ps0_r1").change_view(0, None, View(1, "ps0_r1"))
    clock = Clock()
    monkeypatch.setattr(client.time, "monotonic", clock)
    wrong = store.registry(secret=OTHER, writer="worker0_r2")  # another secret than the job's
    monkeypatch.setattr(client.transport, "group_registry", lambda: wrong)
    waiting = client._UnverifiedView(0, has_secret=True)
    assert waiting.check(wrong.read_view(0)) is None
    clock.now += client.UNVERIFIED_VIEW_S - 0.1
    assert waiting.check(wrong.read_view(0)) is None, "a stranger's view is put back within a heartbeat: wait"
    clock.now += 0.2
    with pytest.raises(RegistrationRefused, match="signed with another job secret than this process's --job-secret-file"):
        waiting.check(wrong.read_view(0))

    right = store.registry(writer="worker0_r3")
    monkeypatch.setattr(client.transport, "group_registry", lambda: right)
    failing_over = client._UnverifiedView(0, has_secret=True)
    assert failing_over.check(right.read_view(0)) == View(1, "ps0_r1")
    store.set("rpcps/view/0", encode_view(View(9, "stranger_r9"), OTHER, 0, "stranger_r9"))
    for _ in range(3):  # a stranger keeps its view there: a worker that verified one before waits it out
        assert failing_over.check(right.read_view(0)) is None
        clock.now += client.UNVERIFIED_VIEW_S
