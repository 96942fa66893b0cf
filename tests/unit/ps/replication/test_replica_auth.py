"""Who may use the replication API (``ps.replication.auth``): each call accepted with the right
credentials and refused, logged and counted without them."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from torch.distributed.rpc import internal

from ps.replication import auth, standby
from ps.replication.auth import ReplicaRefused, attach_proof
from ps.replication.metrics import ReplicationMetrics
from rpcps import replica_endpoints, rpc_policy
from rpcps.errors import AttachRefused, RpcpsError
from rpcps.jobsecret import JobSecret
from rpcps.messages import Ack, Attached, ErrorReply, Fenced, Mark, View
from rpcps.transport import pickling
from worker import trainer

from .fakes import COMPAT, make_primary, make_standby

SECRET = JobSecret("s" * 40)
OTHER = JobSecret("o" * 40)


def _refused(metrics: ReplicationMetrics, reason: str) -> float:
    return metrics.refused.labels(reason)._value.get()


# ---- attach ------------------------------------------------------------------------------------


def test_an_attach_with_a_valid_proof_gets_an_unguessable_attach_id() -> None:
    primary = make_primary(SECRET)
    attached = primary.attach("server1", COMPAT, *attach_proof(SECRET, "server1", "server0"))
    assert isinstance(attached, Attached) and attached.pieces == 1
    assert len(attached.attach_id) == 32 and int(attached.attach_id, 16) >= 0  # 128 random bits
    again = primary.attach("server1", COMPAT, *attach_proof(SECRET, "server1", "server0"))
    assert again.attach_id != attached.attach_id


@pytest.mark.parametrize(
    ("proof", "reason"),
    [
        (lambda: ("", 0.0, ""), "no_proof"),  # a standby started without the secret
        (lambda: attach_proof(OTHER, "server1", "server0"), "bad_proof"),  # another job's secret
        (lambda: attach_proof(SECRET, "intruder", "server0"), "bad_proof"),  # made for another name
        (lambda: attach_proof(SECRET, "server1", "server9"), "bad_proof"),  # made for another primary
    ],
)
def test_an_attach_without_a_valid_proof_is_refused_and_copies_nothing(proof, reason: str) -> None:
    primary = make_primary(SECRET)
    with pytest.raises(ReplicaRefused):
        primary.attach("server1", COMPAT, *proof())
    assert _refused(primary.metrics, reason) == 1
    assert primary._follower is None  # no state was captured for the caller


def test_an_old_or_replayed_attach_proof_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    primary = make_primary(SECRET)
    proof = attach_proof(SECRET, "server1", "server0")
    primary.attach("server1", COMPAT, *proof)
    with pytest.raises(ReplicaRefused, match="used already"):
        primary.attach("server1", COMPAT, *proof)
    assert _refused(primary.metrics, "replayed_proof") == 1
    old = attach_proof(SECRET, "server1", "server0")
    monkeypatch.setattr(auth.time, "time", lambda: old[1] + auth.WINDOW_S + 1)
    with pytest.raises(ReplicaRefused, match="last"):
        primary.attach("server1", COMPAT, *old)
    assert _refused(primary.metrics, "stale_proof") == 1


def test_without_a_job_secret_any_attach_is_accepted_and_the_id_still_unguessable() -> None:
    primary = make_primary(None)
    attached = primary.attach("server1", COMPAT, *attach_proof(None, "server1", "server0"))
    assert len(attached.attach_id) == 32
    assert primary.attach("server1", COMPAT, "", 0.0, "").attach_id != attached.attach_id


def test_the_attach_endpoint_answers_a_refusal_with_an_error_reply() -> None:
    primary = make_primary(SECRET)
    replica_endpoints.publish_replica(primary)
    try:
        reply = replica_endpoints.replica_attach("intruder", COMPAT, "n", time.time(), "forged")
    finally:
        replica_endpoints.publish_replica(None)
    assert isinstance(reply, ErrorReply) and reply.kind == "ReplicaRefused" and "refused" in reply.message


# ---- the calls of an attachment ------------------------------------------------------------------


@pytest.mark.parametrize("secret", [SECRET, None])
def test_snapshot_ready_and_watch_need_the_issued_attach_id(secret: JobSecret | None) -> None:
    primary = make_primary(secret)
    for call in (lambda a: primary.snapshot_piece(a, 0), primary.ready, primary.watch):
        with pytest.raises(ReplicaRefused):
            call("0" * 32)  # nothing attached yet
    attached = primary.attach("server1", COMPAT, *attach_proof(secret, "server1", "server0"))
    guessed = "f" * 32
    for call in (lambda a: primary.snapshot_piece(a, 0), primary.ready, primary.watch):
        with pytest.raises(ReplicaRefused):
            call(guessed)
    assert _refused(primary.metrics, "bad_attach_id") == 6
    piece = primary.snapshot_piece(attached.attach_id, 0)
    assert piece.numel() == attached.size_bytes
    assert not primary.watch(attached.attach_id).done()
    primary.ready(attached.attach_id)
    assert primary._follower is not None and primary._follower.ready


def test_a_standby_takes_appends_only_with_its_attach_id() -> None:
    standby = make_standby(SECRET)
    standby.primary, standby.epoch, standby.attach_id = "server0", 1, "a" * 32
    with pytest.raises(ReplicaRefused):
        standby.append("b" * 32, 1, "server0", [Mark(1, 1, 0, 0)], 0.0, False)
    with pytest.raises(ReplicaRefused):
        standby.append(None, 1, "server0", [], 0.0, False)  # type: ignore[arg-type]
    assert _refused(standby.metrics, "bad_attach_id") == 2
    assert standby.log.last_index == 0  # nothing forged was taken in
    assert isinstance(standby.append("a" * 32, 1, "server0", [], 0.0, False), Ack)
    assert isinstance(standby.append("a" * 32, 2, "server0", [], 0.0, False), Fenced)  # right id, another epoch
    for call in (standby.watch, standby.ready, lambda a: standby.snapshot_piece(a, 0)):
        with pytest.raises(RpcpsError, match="is a standby"):
            call("a" * 32)  # nobody attaches to a standby
    with pytest.raises(RpcpsError, match="is a standby"):
        standby.attach("server2", COMPAT, *attach_proof(SECRET, "server2", "server1"))


def test_a_standby_that_never_attached_refuses_every_append() -> None:
    standby = make_standby(None)
    with pytest.raises(ReplicaRefused):
        standby.append("", 0, "", [], 0.0, False)


# ---- view_changed --------------------------------------------------------------------------------


def _announced(store_epoch: int | None, monkeypatch: pytest.MonkeyPatch) -> tuple[bool, set[int]]:
    monkeypatch.setattr(trainer, "shard_view", lambda shard: None if store_epoch is None else View(store_epoch, "p", None))
    worker = SimpleNamespace(_moved={0}, _hints_ignored=set())
    link = SimpleNamespace(index=0, client=SimpleNamespace(view=View(1, "p", None)))
    return trainer.Trainer._move_confirmed(worker, link), worker._moved  # type: ignore[arg-type]


def test_a_worker_moves_only_when_the_store_confirms_the_announced_view(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _announced(2, monkeypatch) == (True, {0})
    assert _announced(1, monkeypatch) == (False, set())  # a stranger's announcement: dropped
    assert _announced(None, monkeypatch) == (False, set())


def test_a_refusal_crossing_the_wire_arrives_as_itself() -> None:
    """A primary's refusal travels as an ``ErrorReply`` through torch's serializer and the allow-list
    unpickler, and the standby raises the refusal's own class (before it was in ``ERROR_TYPES`` it
    arrived as a plain RpcpsError)."""
    primary = make_primary(SECRET)
    replica_endpoints.publish_replica(primary)
    rpc_policy.protect(extra_calls=replica_endpoints.SERVER_ENDPOINTS)
    try:
        replies = [
            _over_the_wire(replica_endpoints.replica_attach("intruder", COMPAT, "n", time.time(), "forged")),
            _over_the_wire(replica_endpoints.replica_attach("server1", {"model": "other"}, *attach_proof(SECRET, "server1", "server0"))),
        ]
    finally:
        pickling.uninstall()
        replica_endpoints.publish_replica(None)
    with pytest.raises(ReplicaRefused, match="refused"):
        standby._unwrap(replies[0])
    with pytest.raises(AttachRefused, match="cannot be this primary's standby"):
        standby._unwrap(replies[1])


def _over_the_wire(reply: object) -> object:
    payload, tensors = internal.serialize(reply)
    return internal.deserialize(payload, tensors)
