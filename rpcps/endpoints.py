"""The worker API: the only server operations a peer may call over RPC, one function each.

A server process publishes the object that implements ``WorkerApi`` with ``publish``; workers fetch
a reference to it with ``server_ref`` and pass that reference to every other call here, which runs
on the server and forwards to the published object. Nothing is looked up by a name the peer sends:
a reference that is not the published one is refused. The reference is a random token (``ServerRef``)
rather than a torch RRef: passing an RRef to its owner makes the owner send an extra acknowledgement
message back on every call (RRef fork protocol), which cost a third of a small push's round trip
(docs/BENCHMARKS.md), and RRef ids are a counter a peer could guess. ``observe`` is the one read-only call: it
needs no worker slot (the sidecar evaluator reads the model with it). Everything else a server can do (pause,
resume, finish, stop, snapshot, restore) is reachable only through the authenticated control plane.

Errors rpcps raises on purpose come back as ``ErrorReply`` values (torch RPC would lose their
type); the worker's client raises the matching class again. ``ENDPOINTS`` lists every function
here that may be called remotely (the transport's unpickler allows exactly these, plus, in server
processes, the replication API of ``rpcps.replica_endpoints`` and, in workers, its ``view_changed``).
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any, Protocol

import torch
from torch.futures import Future

from rpcps import transport
from rpcps.errors import RpcpsError, ServerStarting, UnknownWorker, wire_name
from rpcps.messages import ErrorReply, FinishReply, Observation, PullReply, PushReply, Registration, RegistrationProof
from rpcps.signature import WireSpec
from rpcps.sparse.spec import SparsePull, SparsePush

ServerRef = str
"""What ``server_ref`` hands out and every other call carries: this server incarnation's token."""

Chunks = list[Any]
"""Gradient chunks as sent: dense tensors, or (indices, values) pairs of sparse ones."""


def server_name(shard: int) -> str:
    """The base of the RPC names of shard ``shard``'s server processes: each joins as
    ``ps<shard>_r<rank>``, fresh per process; workers find the current one through the shard's view."""
    return f"ps{shard}"


class WorkerApi(Protocol):
    """What a server offers workers (implemented by ``ps``; called through the functions below)."""

    def shard_count(self) -> int: ...

    def challenge(self) -> str: ...

    def register(
        self, slot: int, rpc_name: str, signature: list[WireSpec], proof: RegistrationProof | None
    ) -> Registration: ...

    def submit(
        self,
        slot: int,
        incarnation: str,
        seq: int,
        base_version: int,
        chunks: Chunks,
        loss: float | None,
        have_version: int | None,
        sparse: SparsePush | None,
        absent: int,
    ) -> Future: ...

    def push_named(
        self, slot: int, incarnation: str, seq: int, base_version: int, grads: dict[str, torch.Tensor], loss: float | None
    ) -> PushReply: ...

    def pull(self, slot: int, incarnation: str, have_version: int) -> PullReply: ...

    def pull_rows(self, slot: int, incarnation: str, request: SparsePull) -> SparsePull: ...

    def heartbeat(self, slot: int, incarnation: str) -> int: ...

    def finish(self, slot: int, incarnation: str, steps: int) -> FinishReply: ...

    def leave(self, slot: int, incarnation: str) -> None: ...

    def observe(self, have_version: int, proof: RegistrationProof | None = None) -> Observation: ...


STARTING = "the parameter server is still starting (no model loaded yet); retry shortly"
WITHDRAWN = "the parameter server withdrew its API (it is stopping, or restarting itself after stepping down); retry shortly"
"""What a call hears while nothing is published: before the first publication, and after ``withdraw``
(the same ``ServerStarting`` kind, which a worker retries; the text is for whoever reads its log)."""

_published: tuple[WorkerApi, ServerRef] | None = None
_unpublished = STARTING


def publish(api: WorkerApi) -> None:
    """Makes ``api`` the object this process's endpoints serve, under a fresh token."""
    global _published
    _published = (api, secrets.token_hex(16))


def withdraw() -> None:
    global _published, _unpublished
    _published, _unpublished = None, WITHDRAWN


def _api(ref: Any) -> WorkerApi:
    published = _published
    if published is None:
        raise ServerStarting(_unpublished)
    api, token = published
    if not isinstance(ref, str) or not hmac.compare_digest(ref, token):
        raise UnknownWorker("the call named a server object this process does not serve; fetch it with server_ref")
    return api


def _reply(run: Any) -> Any:
    try:
        return run()
    except RpcpsError as e:
        return ErrorReply(wire_name(e), str(e))


# ---- the functions peers call ------------------------------------------------------------------


def server_ref() -> ServerRef | ErrorReply:
    published = _published
    if published is None:
        return ErrorReply("ServerStarting", _unpublished)
    return published[1]


def shard_count(ref: ServerRef) -> int | ErrorReply:
    return _reply(lambda: _api(ref).shard_count())


def challenge(ref: ServerRef) -> str | ErrorReply:
    """A fresh single-use challenge; a worker answers it in ``register`` to prove it holds the job secret."""
    return _reply(lambda: _api(ref).challenge())


def register(
    ref: ServerRef,
    slot: int,
    rpc_name: str,
    signature: list[WireSpec],
    proof: RegistrationProof | None = None,
) -> Any:
    return _reply(lambda: _api(ref).register(slot, rpc_name, signature, proof))


@transport.async_endpoint
def submit(
    ref: ServerRef,
    slot: int,
    incarnation: str,
    seq: int,
    base_version: int,
    chunks: Chunks,
    loss: float | None,
    have_version: int | None = None,
    sparse: SparsePush | None = None,
    absent: int = 0,
) -> Future:
    """A push (dense chunks, and this shard's sparse table rows when the model has any); its future
    completes at once, or in 'sync' mode when the round closes. With ``have_version`` the reply also
    carries the parameters, as a pull from that version would. ``absent``: bit i set when the
    shard's parameter i got no gradient (it does not move)."""
    try:
        return _api(ref).submit(slot, incarnation, seq, base_version, chunks, loss, have_version, sparse, absent)
    except RpcpsError as e:
        future: Future = Future()
        future.set_result(ErrorReply(wire_name(e), str(e)))
        return future


def push_named(
    ref: ServerRef, slot: int, incarnation: str, seq: int, base_version: int, grads: dict[str, torch.Tensor], loss: float | None
) -> Any:
    return _reply(lambda: _api(ref).push_named(slot, incarnation, seq, base_version, grads, loss))


def pull(ref: ServerRef, slot: int, incarnation: str, have_version: int) -> Any:
    return _reply(lambda: _api(ref).pull(slot, incarnation, have_version))


def pull_rows(ref: ServerRef, slot: int, incarnation: str, request: SparsePull) -> Any:
    """Rows of sparse tables for ``{table name: unique ids}`` (ids of this shard's buckets only)."""
    return _reply(lambda: _api(ref).pull_rows(slot, incarnation, request))


def heartbeat(ref: ServerRef, slot: int, incarnation: str) -> Any:
    return _reply(lambda: _api(ref).heartbeat(slot, incarnation))


def finish(ref: ServerRef, slot: int, incarnation: str, steps: int) -> Any:
    """The worker is done with ``steps`` steps; returns once they are durable (or cannot be)."""
    return _reply(lambda: _api(ref).finish(slot, incarnation, steps))


def leave(ref: ServerRef, slot: int, incarnation: str) -> Any:
    return _reply(lambda: _api(ref).leave(slot, incarnation))


def observe(ref: ServerRef, have_version: int, proof: RegistrationProof | None = None) -> Any:
    """Read-only: the newest parameters and buffers (None when ``have_version`` is current), for an
    observer that holds no worker slot and changes nothing (the sidecar evaluator). With a job secret
    the observer answers a fresh ``challenge`` (``JobSecret.observe_proof``)."""
    return _reply(lambda: _api(ref).observe(have_version, proof))


ENDPOINTS = (server_ref, shard_count, challenge, register, submit, push_named, pull, pull_rows, heartbeat, finish, leave, observe)
