"""The functions workers invoke over torch RPC. Each takes the server's RRef and runs on its owner.

Errors rpcps raises on purpose come back as ``ErrorReply`` values (torch RPC would lose their type);
anything else propagates as the transport's own error.
"""

from __future__ import annotations

from typing import Any

from torch.distributed import rpc
from torch.futures import Future

from ps.server import ParameterServer
from rpcps.errors import ERROR_TYPES, RpcpsError
from rpcps.messages import ErrorReply

_server_rref: rpc.RRef | None = None


def publish(server: ParameterServer) -> rpc.RRef:
    """Makes ``server`` reachable: workers fetch this RRef with ``server_rref``."""
    global _server_rref
    _server_rref = rpc.RRef(server)
    return _server_rref


def withdraw() -> None:
    global _server_rref
    _server_rref = None


def server_rref() -> rpc.RRef:
    if _server_rref is None:
        raise RuntimeError("the parameter server is still starting (no model loaded yet); retry shortly")
    return _server_rref


def call(rref: rpc.RRef, method: str, *args: Any) -> Any:
    """Runs ``method`` of the server behind ``rref``; rpcps errors are returned, not raised."""
    try:
        return getattr(rref.local_value(), method)(*args)
    except RpcpsError as e:
        return ErrorReply(_public_name(e), str(e))


@rpc.functions.async_execution
def call_async(rref: rpc.RRef, method: str, *args: Any) -> Future:
    """Like ``call`` for methods that return a torch Future (a sync round completes it later)."""
    try:
        return getattr(rref.local_value(), method)(*args)
    except RpcpsError as e:
        future: Future = Future()
        future.set_result(ErrorReply(_public_name(e), str(e)))
        return future


def ping() -> bool:
    return True


def _public_name(error: RpcpsError) -> str:
    """The nearest class the client knows (internal subclasses exist to pick metric labels)."""
    for cls in type(error).__mro__:
        if cls.__name__ in ERROR_TYPES:
            return cls.__name__
    return "RpcpsError"
