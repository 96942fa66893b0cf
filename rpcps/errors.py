"""Errors that cross the wire: from a server to a worker, and between the two replicas of a shard.

torch RPC does not keep a remote exception's type (a ValueError subclass comes back as a plain
ValueError with the remote traceback glued into its message), so the endpoints return these as
``ErrorReply`` values named by ``wire_name`` and the caller raises the class ``ERROR_TYPES`` gives that
name, with the clean message. A class missing from ``ERROR_TYPES`` arrives as a plain ``RpcpsError``:
every class an endpoint raises on purpose belongs there, so the caller can tell them apart.
"""

from __future__ import annotations


class RpcpsError(RuntimeError):
    """Base class for errors rpcps raises on purpose (as opposed to transport failures)."""


class PushRejected(RpcpsError, ValueError):
    """A gradient push was refused; the parameters were not touched."""


class SignatureMismatch(RpcpsError, ValueError):
    """A worker's model does not match the server's."""


class UnknownWorker(RpcpsError, LookupError):
    """A call named a worker slot that has not registered, or an incarnation that was replaced."""


class WorkerRemoved(UnknownWorker):
    """The server removed this worker's registration (it stopped answering, or it left): register
    again to go on. Unlike a slot taken over by a newer registration, the slot is still this worker's."""


class ServerStopping(RpcpsError):
    """The server is shutting down and takes no more pushes."""


class ServerStarting(RpcpsError):
    """The server process is up but has not loaded its model yet; retry shortly."""


class NotPrimary(RpcpsError):
    """This server process does not serve its shard now (a standby, or a primary that was replaced):
    read the shard's view and call the primary it names."""


class CheckpointFailed(RpcpsError):
    """The server could not commit a snapshot (full disk, I/O error); nothing committed was lost."""


class RegistrationRefused(RpcpsError, PermissionError):
    """The server requires the job secret and the registration did not prove it (docs/SECURITY.md)."""


class ReplicaRefused(RpcpsError):
    """A replication call without the credentials its attachment needs (the message says which)."""


class AttachRefused(RpcpsError):
    """A primary will not take the asking process as its standby (the message says why)."""


ERROR_TYPES: dict[str, type[RpcpsError]] = {
    cls.__name__: cls
    for cls in (
        PushRejected, SignatureMismatch, UnknownWorker, WorkerRemoved, ServerStopping, ServerStarting, NotPrimary, CheckpointFailed,
        RegistrationRefused, ReplicaRefused, AttachRefused,
    )
}


def wire_name(error: RpcpsError) -> str:
    """The nearest class of ``error`` that ``ERROR_TYPES`` lists (internal subclasses exist to pick metric labels)."""
    for cls in type(error).__mro__:
        if cls.__name__ in ERROR_TYPES:
            return cls.__name__
    return "RpcpsError"
