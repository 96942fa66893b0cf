"""The worker's handle on its server: typed calls over torch RPC through the server's RRef.

This is the transport seam on the worker side: the trainer sees futures of replies and two kinds
of trouble, ``ServerUnreachable`` (the server process is gone: reconnect) and timeouts (the server
is hung or slow: back off and retry), never raw torch RPC errors.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed import rpc
from torch.futures import Future

from ps import rpc_api
from rpcps.errors import ERROR_TYPES, RpcpsError
from rpcps.messages import ErrorReply, PullReply, PushReply, Registration
from rpcps.transport import PEER_DEAD, TIMEOUT, classify_failure, server_name


class ServerUnreachable(RuntimeError):
    """The server process died or went away; its RPC connection will never work again."""


class ServerTimeout(RuntimeError):
    """A call ran past its deadline: the server is hung or overloaded. Safe to retry."""


def unwrap(value: Any) -> Any:
    """Turns an ErrorReply into its exception; passes every other reply through."""
    if isinstance(value, ErrorReply):
        raise ERROR_TYPES.get(value.kind, RpcpsError)(value.message)
    return value


def translate(error: BaseException) -> BaseException:
    """Maps a torch RPC failure onto ServerUnreachable / ServerTimeout (or returns it unchanged)."""
    kind = classify_failure(error)
    if kind == PEER_DEAD:
        return ServerUnreachable(str(error).splitlines()[0])
    if kind == TIMEOUT:
        return ServerTimeout(str(error).splitlines()[0])
    return error


def result(future: Future) -> Any:
    """Waits for a call's reply, raising rpcps errors and translated transport errors."""
    try:
        value = future.wait()
    except RuntimeError as e:
        raise translate(e) from e
    return unwrap(value)


class ServerClient:
    """Calls on one server shard (``ps<shard>``)."""

    def __init__(self, timeout_s: float, shard: int = 0, wait_s: float = 0.0) -> None:
        """Fetches the shard's RRef; waits up to ``wait_s`` for a shard that has not joined yet."""
        self.timeout_s = timeout_s
        self.shard = shard
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._rref = rpc.rpc_sync(server_name(shard), rpc_api.server_rref, timeout=timeout_s)
                break
            except RuntimeError as e:
                text = str(e).lower()
                # The shard has not joined the group yet, or has not published its server object.
                starting = any(m in text for m in ("unknown destination", "could not find destination", "still starting"))
                if not starting or time.monotonic() > deadline:
                    raise translate(e) from e
                time.sleep(0.2)
        self._owner = self._rref.owner()

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Future:
        try:
            return rpc.rpc_async(
                self._owner, rpc_api.call, args=(self._rref, method, *args), timeout=timeout or self.timeout_s
            )
        except RuntimeError as e:
            raise translate(e) from e

    def register_probe(self) -> int:
        """How many shards the server has (asked of shard 0 before registering anywhere)."""
        return int(result(self._call("shard_count")))

    def register(self, slot: int, rpc_name: str, signature: list[tuple[str, list[int], str]]) -> Registration:
        return result(self._call("register", slot, rpc_name, signature))

    def push(
        self, slot: int, incarnation: str, seq: int, base_version: int, chunks: list[torch.Tensor], loss: float | None
    ) -> Future:
        """Starts a push; ``result(future)`` gives a PushReply."""
        try:
            return rpc.rpc_async(
                self._owner,
                rpc_api.call_async,
                args=(self._rref, "submit", slot, incarnation, seq, base_version, chunks, loss),
                # A sync round may wait for the slowest worker; never time out before the round does.
                timeout=self.timeout_s,
            )
        except RuntimeError as e:
            raise translate(e) from e

    def push_named(
        self, slot: int, incarnation: str, seq: int, base_version: int, grads: dict[str, torch.Tensor], loss: float | None
    ) -> PushReply:
        return result(self._call("push_named", slot, incarnation, seq, base_version, grads, loss))

    def pull(self, slot: int, incarnation: str, have_version: int) -> Future:
        """Starts a pull; ``result(future)`` gives a PullReply."""
        return self._call("pull", slot, incarnation, have_version)

    def pull_now(self, slot: int, incarnation: str, have_version: int) -> PullReply:
        return result(self.pull(slot, incarnation, have_version))

    def heartbeat(self, slot: int, incarnation: str) -> int:
        return result(self._call("heartbeat", slot, incarnation, timeout=min(self.timeout_s, 10.0)))

    def leave(self, slot: int, incarnation: str) -> None:
        result(self._call("leave", slot, incarnation, timeout=min(self.timeout_s, 10.0)))
