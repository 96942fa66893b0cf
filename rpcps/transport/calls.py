"""Calling other members of the group, and telling apart the ways a call can fail.

torch RPC raises plain RuntimeErrors for every failure, so the message is all there is; this module
turns them into classes the roles can act on, pinned by integration tests that kill and stop real
processes:

- ``PeerUnreachable``: the peer's process is gone (or removed us from its group); its connection
  never works again, only a fresh process that rejoins can talk to it.
- ``PeerTimeout``: the call ran past its deadline; the peer is hung or overloaded. Safe to retry
  when the call is idempotent (rpcps pushes are: the server deduplicates them).
- ``PeerUnknown``: this process's agent does not know the name yet (the peer has not joined).
- ``CallFailed``: anything else the transport reports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch.distributed import rpc
from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT
from torch.futures import Future

F = TypeVar("F", bound=Callable[..., Any])

class CallFailed(RuntimeError):
    """A call failed in the transport (not an error the callee raised on purpose)."""


class PeerUnreachable(CallFailed):
    """The peer's process is gone or dropped us from its group; reconnecting needs a fresh process."""


class PeerTimeout(CallFailed):
    """The call ran past its deadline: the peer is hung or overloaded."""


class PeerUnknown(CallFailed):
    """This process's agent has no member of that name (it has not joined yet)."""


_DEAD_MARKERS = (
    "eof", "econnreset", "econnrefused", "connection reset", "connection refused", "broken pipe", "epipe",
    "pipe closed", "rpc agent is not running", "shutdown",
    # No route to the peer (its host or our link is cut): tests/integration/deploy/test_multihost.py saw
    # "EHOSTUNREACH: host is unreachable" on the reaper's ping while the server's cable was pulled.
    "ehostunreach", "host is unreachable", "enetunreach", "network is unreachable",
    # The peer is alive but removed us from its group (we were unreachable past the lease, e.g. a
    # cut link that healed): seen by tests/integration/deploy/test_multihost.py as "could not find destination id 2".
    "could not find destination id",
)
_TIMEOUT_MARKERS = ("ran for more than set timeout", "rpcerr:1", "timed out")
# torch 2.13 says "could not find destination name <name>" for a member that has not joined yet
# (a worker asking for shard 1 before that shard's process joined the group), and "could not find
# destination url for name <name>" for one that joined while this process did: the member list
# names it, this agent has not learnt its address yet (CI: bench.push_throughput's ping of ps1_r2).
_UNKNOWN_MARKERS = (
    "unknown destination worker", "unknown worker name", "could not find destination name",
    "could not find destination url",
)


def classify(error: BaseException) -> BaseException:
    """The classified form of a torch RPC failure (``error`` itself when it is not one)."""
    if isinstance(error, CallFailed) or not isinstance(error, RuntimeError):
        return error
    text = str(error).lower()
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    if any(m in text for m in _TIMEOUT_MARKERS):
        return PeerTimeout(first)
    if any(m in text for m in _UNKNOWN_MARKERS):
        return PeerUnknown(first)
    if any(m in text for m in _DEAD_MARKERS):
        return PeerUnreachable(first)
    return error


class Pending:
    """A call in flight. ``wait`` returns its value or raises the classified failure."""

    __slots__ = ("_future",)

    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> Any:
        try:
            return self._future.wait()
        except RuntimeError as e:
            raise classify(e) from e

    def on_done(self, callback: Callable[[Pending], None]) -> None:
        """Calls ``callback(self)`` once the call finished (on a transport thread: keep it short)."""
        self._future.add_done_callback(lambda _: callback(self))


def call(to: str | rpc.WorkerInfo, fn: Callable[..., Any], args: tuple[Any, ...] = (), timeout_s: float | None = None) -> Any:
    """Runs ``fn(*args)`` in member ``to`` and returns its value (blocking)."""
    return call_async(to, fn, args, timeout_s).wait()


def call_async(
    to: str | rpc.WorkerInfo, fn: Callable[..., Any], args: tuple[Any, ...] = (), timeout_s: float | None = None
) -> Pending:
    """Starts ``fn(*args)`` in member ``to``; ``wait()`` on the result gives its value."""
    try:
        future = rpc.rpc_async(to, fn, args=args, timeout=timeout_s if timeout_s is not None else UNSET_RPC_TIMEOUT)
    except RuntimeError as e:
        raise classify(e) from e
    return Pending(future)


def alive() -> bool:
    """The liveness probe every member answers (see ``ping``)."""
    return True


def ping(to: str, timeout_s: float) -> Pending:
    """Asks member ``to`` whether it is alive; ``wait()`` raises the classified failure if not.

    Starting the call can fail too (``PeerUnknown`` for a name this agent does not know): upkeep
    that pings many members uses ``ping_all``, which cannot raise for one of them.
    """
    return call_async(to, alive, (), timeout_s)


def ping_all(names: Sequence[str], timeout_s: float) -> list[Exception | None]:
    """Pings every member of ``names`` in parallel; for each, None when it answered, else why not.

    The failure is the classified one (``PeerUnreachable``, ``PeerTimeout``, ``PeerUnknown``, or any
    other exception starting or waiting for the call raised), whether the call failed when it was
    started or while it ran. Never raises for one member: a sweep that stops at one bad member
    (a name this agent forgot) never judges the others again, every second for good.
    """
    pending: list[Pending | Exception] = []
    for name in names:
        try:
            pending.append(ping(name, timeout_s))
        except Exception as e:  # noqa: BLE001 - the caller judges each member's failure
            pending.append(e)
    results: list[Exception | None] = []
    for started in pending:
        if isinstance(started, Exception):
            results.append(started)
            continue
        try:
            started.wait()
        except Exception as e:  # noqa: BLE001 - as above
            results.append(e)
        else:
            results.append(None)
    return results


def async_endpoint(fn: F) -> F:
    """Marks a function callable over RPC that returns a torch Future the reply waits for."""
    return rpc.functions.async_execution(fn)
