"""The worker's handle on one server shard: typed calls to the worker API (``rpcps.endpoints``).

A shard is found through its view in the group's store (``rpcps.transport.registry``): the view
names the process serving it now (its primary) and, with replicas, its standby. The trainer sees
replies and three kinds of trouble: an rpcps error the server raised on purpose (``PushRejected``,
``UnknownWorker``, ``NotPrimary``, ...), ``PeerUnreachable`` (the server process is gone: fail over,
or reconnect) and ``PeerTimeout`` (the server is hung or slow: back off and retry). It never sees
raw torch RPC errors.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rpcps import endpoints, transport
from rpcps.errors import ERROR_TYPES, RegistrationRefused, RpcpsError, ServerStarting
from rpcps.jobsecret import JobSecret
from rpcps.messages import ErrorReply, FinishReply, PullReply, PushReply, Registration, RegistrationProof, View
from rpcps.signature import WireSpec
from rpcps.sparse.spec import SparsePull, SparsePush
from rpcps.transport.registry import ViewReading


def unwrap(value: Any) -> Any:
    """Turns an ErrorReply into its exception; passes every other reply through."""
    if isinstance(value, ErrorReply):
        raise ERROR_TYPES.get(value.kind, RpcpsError)(value.message)
    return value


def result(pending: transport.Pending) -> Any:
    """Waits for a call's reply, raising rpcps errors and classified transport failures."""
    return unwrap(pending.wait())


class ShardUnavailable(RuntimeError):
    """No process serves the shard yet (no view in the store), within the wait."""


def shard_view(shard: int) -> View | None:
    """The shard's view as the group's store has it now (None: no server has claimed it yet)."""
    record = transport.group_registry().view(shard)
    return record.view if record is not None else None


UNVERIFIED_VIEW_S = 10.0
"""How long a process that never verified a view waits on views it cannot verify before it gives up
(exit 5, not retried): a primary puts its own view back over a stranger's within a heartbeat, so
a view that stays unverifiable this long was signed with another job secret than this process's.
A process that verified one before (a worker failing over) waits out its usual timeouts instead."""


class _UnverifiedView:
    """Tells a process with the wrong job secret (or one where the job has none) from a passing
    forgery: the first waits forever otherwise, with nothing but the registry's refusal in its log."""

    def __init__(self, shard: int, has_secret: bool) -> None:
        self.shard = shard
        self.has_secret = has_secret
        self.since: float | None = None

    def check(self, reading: ViewReading) -> View | None:
        """The reading's view; raises RegistrationRefused once only unverifiable views were seen for long."""
        if reading.record is not None or reading.refused not in ("bad_signature", "unsigned"):
            self.since = None
            return reading.record.view if reading.record is not None else None
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        if now - self.since < UNVERIFIED_VIEW_S or transport.group_registry().verified_any():
            return None  # one that verified a view before has the job's secret: a stranger is writing, wait
        why = (
            "is signed with another job secret than this process's --job-secret-file" if reading.refused == "bad_signature"
            else "is not signed, but this process was given --job-secret-file" if self.has_secret
            else "cannot be verified without --job-secret-file"
        )
        raise RegistrationRefused(
            f"shard {self.shard}'s view in the group's store {why} (for {UNVERIFIED_VIEW_S:.0f}s): give every process of the "
            "job the same secret file; if they have it, someone outside the job keeps writing the store (docs/SECURITY.md)"
        )


def _max_lag(primary: str) -> int:
    """``--max-replica-lag`` of ``primary`` as its record in the store says (0 when it cannot be read:
    the worker then finds lost steps only at its end, ``worker.acked``)."""
    try:
        record = transport.group_registry().replica(primary)
    except transport.StoreUnavailable:
        return 0
    return int(record.get("max_lag", 0)) if record else 0


class ServerClient:
    """Calls on the process serving one shard (its view's primary, as read when this client was made)."""

    def __init__(
        self, timeout_s: float, shard: int = 0, wait_s: float = 0.0, newer_than: int = -1, secret: JobSecret | None = None
    ) -> None:
        """Finds the shard's primary and fetches its reference; waits up to ``wait_s`` for a shard that
        has no view, or whose primary has not joined, loaded its model, or replaced a dead one yet.
        ``newer_than``: take only a view of a later epoch (a failover in progress). ``secret`` proves
        this worker belongs to the job when it registers."""
        self.timeout_s = timeout_s
        self.shard = shard
        self.secret = secret
        deadline = time.monotonic() + wait_s
        unverified = _UnverifiedView(shard, secret is not None)
        while True:
            try:
                view = unverified.check(transport.group_registry().read_view(shard))
                if view is None or view.epoch <= newer_than:
                    raise ShardUnavailable(f"no server has claimed shard {shard} yet" if view is None else
                                           f"shard {shard} has not failed over from epoch {newer_than} yet")
                self._ref = unwrap(transport.call(view.primary, endpoints.server_ref, (), timeout_s))
                break
            except (transport.PeerUnknown, transport.PeerUnreachable, transport.StoreUnavailable, ServerStarting,
                    ShardUnavailable):
                # A stale view may name a primary that died; its successor claims the shard shortly.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05 if newer_than >= 0 else 0.2)
        self.view = view
        """The view this client was made from (its primary is the process it calls)."""
        self.max_lag = _max_lag(view.primary)
        """Acknowledged updates the primary may apply before its standby holds them (asynchronous
        replication; 0 when synchronous, without a standby, or unknown)."""
        self._owner = view.primary  # the reference is a token, not an RRef: it names no owner of its own

    def _call(self, fn: Any, *args: Any, timeout: float | None = None) -> transport.Pending:
        return transport.call_async(self._owner, fn, (self._ref, *args), timeout or self.timeout_s)

    def shard_count(self) -> int:
        """How many shards the server has (asked of shard 0 before registering anywhere)."""
        return int(result(self._call(endpoints.shard_count)))

    def register(self, slot: int, rpc_name: str, signature: list[WireSpec]) -> Registration:
        """Takes ``slot``; with a job secret, answers a fresh challenge of the server's to prove it."""
        proof = None
        if self.secret is not None:
            challenge = str(result(self._call(endpoints.challenge)))
            proof = RegistrationProof(challenge, self.secret.registration_proof(challenge, slot, rpc_name))
        return result(self._call(endpoints.register, slot, rpc_name, signature, proof))

    def push(
        self,
        slot: int,
        incarnation: str,
        seq: int,
        base_version: int,
        chunks: list[Any],
        loss: float | None,
        have_version: int | None = None,
        sparse: SparsePush | None = None,
        absent: int = 0,
    ) -> transport.Pending:
        """Starts a push (with this shard's sparse rows, if any); ``result(pending)`` gives a PushReply.
        In 'sync' mode the reply waits for the round, which closes within the server's round timeout
        (below the RPC timeout). With ``have_version`` the reply brings the parameters too
        (``PushReply.pulled``). ``absent``: the presence mask, bit i set when this shard's parameter i
        got no gradient this step (the server leaves it as it is)."""
        if absent:
            return self._call(endpoints.submit, slot, incarnation, seq, base_version, chunks, loss, have_version, sparse, absent)
        if sparse is None:  # the dense-only call stays exactly what it was
            return self._call(endpoints.submit, slot, incarnation, seq, base_version, chunks, loss, have_version)
        return self._call(endpoints.submit, slot, incarnation, seq, base_version, chunks, loss, have_version, sparse)

    def push_named(
        self, slot: int, incarnation: str, seq: int, base_version: int, grads: dict[str, torch.Tensor], loss: float | None
    ) -> PushReply:
        return result(self._call(endpoints.push_named, slot, incarnation, seq, base_version, grads, loss))

    def pull(self, slot: int, incarnation: str, have_version: int) -> transport.Pending:
        """Starts a pull; ``result(pending)`` gives a PullReply."""
        return self._call(endpoints.pull, slot, incarnation, have_version)

    def pull_rows(self, slot: int, incarnation: str, request: SparsePull) -> transport.Pending:
        """Starts a pull of sparse rows; ``result(pending)`` gives ``{table: rows}`` in the wire dtype."""
        return self._call(endpoints.pull_rows, slot, incarnation, request)

    def pull_now(self, slot: int, incarnation: str, have_version: int) -> PullReply:
        return result(self.pull(slot, incarnation, have_version))

    def heartbeat(self, slot: int, incarnation: str) -> int:
        return result(self._call(endpoints.heartbeat, slot, incarnation, timeout=min(self.timeout_s, 10.0)))

    def finish(self, slot: int, incarnation: str, steps: int) -> FinishReply:
        """Returns once the server committed a snapshot holding the slot's ``steps`` (a disk write:
        it may take a while, hence the full RPC timeout)."""
        return result(self._call(endpoints.finish, slot, incarnation, steps))

    def observe(self, have_version: int) -> transport.Pending:
        """Starts a read-only look at the newest model (no slot needed); ``result`` gives an Observation.
        With a job secret it first answers a fresh challenge (one more round trip per observation)."""
        if self.secret is None:
            return self._call(endpoints.observe, have_version)
        challenge = str(result(self._call(endpoints.challenge)))
        return self._call(endpoints.observe, have_version, RegistrationProof(challenge, self.secret.observe_proof(challenge)))

    def leave(self, slot: int, incarnation: str) -> None:
        result(self._call(endpoints.leave, slot, incarnation, timeout=min(self.timeout_s, 10.0)))
