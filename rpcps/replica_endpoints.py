"""The replication API: what a server process may ask of the other replica of its shard, and what a
new primary tells workers. One function each, forwarding to the object the process published.

- on a primary: ``replica_attach`` (a standby asks to follow; it gets the state's size and the log
  index it continues from), ``replica_snapshot`` (one piece of that state), ``replica_ready`` (the
  standby restored it: start shipping the log);
- on a standby: ``replica_append`` (log entries in index order, acknowledged on receipt, and whether
  the shard's view names that standby yet);
- on a primary, for its standby: ``replica_watch``, a long-poll that never completes: its caller
  learns within tens of milliseconds that this process died (the call fails with end-of-file);
- on a worker: ``view_changed``, a shard's new view (a failover), so it need not wait to notice.

Who may call them (``ps.replication.auth``): ``replica_attach`` carries a proof of the job secret
(when the job has one) bound to a fresh nonce, its time and both names; every later call of that
attachment, and the primary's appends to that standby, carry the unguessable attach id it was
issued. ``view_changed`` is only a hint: workers confirm it in the store (a signed view) before acting on it.

Errors raised on purpose come back as ``ErrorReply`` values, as in ``rpcps.endpoints``.
``SERVER_ENDPOINTS`` and ``WORKER_ENDPOINTS`` list what may be called remotely in each role: the
transport's unpickler allows them only where the role adds them to its surface (``rpcps.rpc_policy``);
every record they carry is in ``rpcps.messages``, so it is allowed already.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.futures import Future

from rpcps import transport
from rpcps.errors import RpcpsError, ServerStarting, wire_name
from rpcps.messages import Ack, Attached, ErrorReply, Fenced, LogEntry, View


class ReplicaApi(Protocol):
    """What one server process offers the other replica of its shard (implemented by ``ps.replication``)."""

    def attach(self, name: str, compatibility: dict[str, str], nonce: str, issued_at: float, mac: str) -> Attached: ...

    def snapshot_piece(self, attach_id: str, piece: int) -> torch.Tensor: ...

    def ready(self, attach_id: str) -> None: ...

    def append(
        self, attach_id: str, epoch: int, sender: str, entries: list[LogEntry], sent_at: float, in_view: bool
    ) -> Ack | Fenced | ErrorReply: ...

    def watch(self, attach_id: str) -> Future: ...


class ViewListener(Protocol):
    def view_changed(self, shard: int, view: View) -> None: ...


_replica: ReplicaApi | None = None
_listener: ViewListener | None = None


def publish_replica(api: ReplicaApi | None) -> None:
    global _replica
    _replica = api


def publish_listener(listener: ViewListener | None) -> None:
    global _listener
    _listener = listener


def _api() -> ReplicaApi:
    if _replica is None:
        raise ServerStarting("this server is not ready to replicate yet; retry shortly")
    return _replica


def _reply(run: Any) -> Any:
    try:
        return run()
    except RpcpsError as e:
        return ErrorReply(wire_name(e), str(e))


# ---- the functions peers call ------------------------------------------------------------------


def replica_attach(name: str, compatibility: dict[str, str], nonce: str, issued_at: float, mac: str) -> Any:
    return _reply(lambda: _api().attach(name, compatibility, nonce, issued_at, mac))


def replica_snapshot(attach_id: str, piece: int) -> Any:
    return _reply(lambda: _api().snapshot_piece(attach_id, piece))


def replica_ready(attach_id: str) -> Any:
    return _reply(lambda: _api().ready(attach_id))


def replica_append(attach_id: str, epoch: int, sender: str, entries: list[LogEntry], sent_at: float, in_view: bool) -> Any:
    return _reply(lambda: _api().append(attach_id, epoch, sender, entries, sent_at, in_view))


@transport.async_endpoint
def replica_watch(attach_id: str) -> Future:
    try:
        return _api().watch(attach_id)
    except RpcpsError as e:
        future: Future = Future()
        future.set_result(ErrorReply(wire_name(e), str(e)))
        return future


def view_changed(shard: int, view: View) -> None:
    """Runs in a worker: only records a hint. Anyone may call it, so the training thread acts only
    once the shard's view in the store confirms a newer epoch, and only a view signed with the job
    secret confirms anything (``rpcps.transport.registry``)."""
    if _listener is not None:
        _listener.view_changed(shard, view)


SERVER_ENDPOINTS = (replica_attach, replica_snapshot, replica_ready, replica_append, replica_watch)
"""What a server process adds to the worker API's protected surface (``rpc_policy.protect``'s
``extra_calls``): the other replica of its shard calls these."""
WORKER_ENDPOINTS = (view_changed,)
"""What a worker process adds to its protected surface: a new primary calls it."""
