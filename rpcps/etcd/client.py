"""A small synchronous etcd v3 client: key ranges, puts, deletes, transactions and leases.

It speaks etcd's gRPC API through stubs generated from the subset of etcd's own ``.proto`` files
kept beside it (``rpc.proto``, ``kv.proto``; ``tools/gen_proto.sh``). One channel per endpoint;
a call that finds its endpoint unavailable (a member killed, its port closed) is sent to the next
one, round the list, until the call's deadline: a cluster that lost its leader answers again
through any member as soon as it has elected another.

Only calls that can be repeated without changing their outcome are retried after an unclear
failure (the request may have been applied): reads always, writes only when the endpoint refused
the connection (the request never left). Everything else raises ``EtcdUnavailable``.

A member whose host is cut off refuses nothing: the connection to it stays open and calls into it
time out. So a repeatable call gives each endpoint at most half its deadline before it tries the
next, and any call that timed out on an endpoint sends the calls after it to the next one. Measured
across hosts (tests/integration/deploy/test_multihost.py): without that, a standby whose first
endpoint was the cut-off primary's own member never reached the majority and never promoted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc

from rpcps.address import Address, EtcdTls
from rpcps.etcd import kv_pb2, rpc_pb2, rpc_pb2_grpc

logger = logging.getLogger(__name__)

T = TypeVar("T")

_RETRY_PAUSE_S = 0.05
"""Between two rounds of the endpoint list (a cluster electing a leader answers UNAVAILABLE)."""


class EtcdUnavailable(RuntimeError):
    """No member of the etcd cluster answered within the deadline: nothing is known to have changed."""


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of every key that starts with ``prefix`` (etcd's ``range_end``)."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


class EtcdClient:
    """Thread-safe; every call bounded by ``timeout_s``."""

    def __init__(self, endpoints: Sequence[Address], timeout_s: float = 2.0, tls: EtcdTls | None = None) -> None:
        if not endpoints:
            raise ValueError("an etcd client needs at least one endpoint")
        self.endpoints = tuple(endpoints)
        self.timeout_s = timeout_s
        self._tls = tls
        if tls is None:
            self._channels = [grpc.insecure_channel(str(e)) for e in self.endpoints]
        else:
            ca, key, chain = tls.credentials()
            credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)
            self._channels = [grpc.secure_channel(str(e), credentials) for e in self.endpoints]
        self._kv = [rpc_pb2_grpc.KVStub(c) for c in self._channels]
        self._lease = [rpc_pb2_grpc.LeaseStub(c) for c in self._channels]
        self._lock = threading.Lock()
        self._current = 0
        """The endpoint that answered last: calls start there."""

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def _call(self, what: str, call: Callable[[int, float], T], *, idempotent: bool) -> T:
        deadline = time.monotonic() + self.timeout_s
        # A repeatable call leaves time for another endpoint; a write keeps the whole deadline (a slow
        # leader's fsync must not fail it), and only the calls after it go elsewhere.
        per_try_s = self.timeout_s / 2 if idempotent and len(self.endpoints) > 1 else self.timeout_s
        with self._lock:
            start = self._current
        last: grpc.RpcError | None = None
        attempt = 0
        while True:
            index = (start + attempt) % len(self.endpoints)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                result = call(index, min(left, per_try_s))
            except grpc.RpcError as e:
                last = e
                code = e.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._move_past(index)
                retry = code == grpc.StatusCode.UNAVAILABLE or (idempotent and code == grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retry:
                    break
                attempt += 1
                if attempt % len(self.endpoints) == 0:
                    time.sleep(min(_RETRY_PAUSE_S, max(deadline - time.monotonic(), 0)))
                continue
            if index != start:
                with self._lock:
                    self._current = index
                logger.warning(
                    "etcd member %s did not answer %s; %s did, %.0f ms later (calls go there from now on)",
                    self.endpoints[start], what, self.endpoints[index], 1000 * (time.monotonic() + self.timeout_s - deadline),
                )
            return result
        detail = f"{last.code().name}: {last.details()}" if last is not None else "deadline passed"
        raise EtcdUnavailable(
            f"etcd ({','.join(map(str, self.endpoints))}) did not answer {what} within {self.timeout_s:g}s ({detail})"
            + _tls_hint(detail, self._tls is not None)
        )

    def _move_past(self, index: int) -> None:
        """Calls start at the endpoint after ``index`` from now on (it did not answer in time)."""
        with self._lock:
            if self._current == index:
                self._current = (index + 1) % len(self.endpoints)
                logger.warning("etcd member %s did not answer in time; calls go to %s from now on",
                               self.endpoints[index], self.endpoints[self._current])

    # ---- keys ----------------------------------------------------------------------------------

    def get(self, key: bytes) -> kv_pb2.KeyValue | None:
        """The key's current record (linearizable read), None when it does not exist."""
        reply = self.range(key)
        return reply.kvs[0] if reply.kvs else None

    def range(self, key: bytes, range_end: bytes = b"", *, count_only: bool = False, keys_only: bool = False) -> rpc_pb2.RangeResponse:
        request = rpc_pb2.RangeRequest(key=key, range_end=range_end, count_only=count_only, keys_only=keys_only)
        return self._call("a read", lambda i, t: self._kv[i].Range(request, timeout=t), idempotent=True)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        request = rpc_pb2.PutRequest(key=key, value=value, lease=lease)
        # Putting the same value twice leaves the same value: repeatable.
        self._call("a write", lambda i, t: self._kv[i].Put(request, timeout=t), idempotent=True)

    def delete(self, key: bytes, range_end: bytes = b"") -> int:
        """Deletes the key (or the range); returns how many keys were deleted."""
        request = rpc_pb2.DeleteRangeRequest(key=key, range_end=range_end)
        return int(self._call("a delete", lambda i, t: self._kv[i].DeleteRange(request, timeout=t), idempotent=False).deleted)

    def txn(
        self,
        compare: Sequence[rpc_pb2.Compare],
        success: Sequence[rpc_pb2.RequestOp],
        failure: Sequence[rpc_pb2.RequestOp] = (),
    ) -> rpc_pb2.TxnResponse:
        """One etcd transaction: ``success`` when every comparison holds, else ``failure``, atomically."""
        request = rpc_pb2.TxnRequest(compare=compare, success=success, failure=failure)
        return self._call("a transaction", lambda i, t: self._kv[i].Txn(request, timeout=t), idempotent=False)

    # ---- leases --------------------------------------------------------------------------------

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; returns its id."""
        request = rpc_pb2.LeaseGrantRequest(TTL=ttl_s)
        reply = self._call("a lease grant", lambda i, t: self._lease[i].LeaseGrant(request, timeout=t), idempotent=False)
        if reply.error:
            raise EtcdUnavailable(f"etcd refused a lease: {reply.error}")
        return int(reply.ID)

    def keep_alive(self, lease: int) -> int:
        """Renews the lease once; returns its new time to live in seconds (<= 0: it has expired)."""

        def once(i: int, t: float) -> int:
            replies = self._lease[i].LeaseKeepAlive(iter([rpc_pb2.LeaseKeepAliveRequest(ID=lease)]), timeout=t)
            for reply in replies:
                return int(reply.TTL)
            return 0

        return self._call("a lease renewal", once, idempotent=True)

    def revoke(self, lease: int) -> None:
        request = rpc_pb2.LeaseRevokeRequest(ID=lease)
        try:
            self._call("a lease revoke", lambda i, t: self._lease[i].LeaseRevoke(request, timeout=t), idempotent=True)
        except EtcdUnavailable as e:
            logger.debug("could not revoke etcd lease %x (it ends by itself): %s", lease, e)


def _tls_hint(detail: str, tls: bool) -> str:
    """What to check when the connection itself failed the way a TLS mismatch makes it fail."""
    if not tls and "Socket closed" in detail:
        return ("; if etcd serves TLS on that port, give the URL its CA: ?cacert=CA.pem (and &cert=...&key=... where etcd "
                "checks clients' certificates)")
    if tls and any(sign in detail.lower() for sign in ("tsi_", "ssl", "handshake", "certificate")):
        return ("; the TLS handshake failed: cacert= must be the CA of the members' certificates (issued for the HOST "
                "in the URL), and where etcd checks clients' certificates, cert= and key= one that CA signed")
    return ""


# ---- transaction parts ---------------------------------------------------------------------------


def value_is(key: bytes, value: bytes) -> rpc_pb2.Compare:
    """Holds when the key exists and holds ``value`` (etcd fails a value comparison on a missing key)."""
    return rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.VALUE, result=rpc_pb2.Compare.EQUAL, value=value)


def absent(key: bytes) -> rpc_pb2.Compare:
    return rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.CREATE, result=rpc_pb2.Compare.EQUAL, create_revision=0)


def modified_at(key: bytes, revision: int) -> rpc_pb2.Compare:
    """Holds when the key was last changed at ``revision`` (0: it does not exist)."""
    return rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.MOD, result=rpc_pb2.Compare.EQUAL, mod_revision=revision)


def put_op(key: bytes, value: bytes, lease: int = 0) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))


def get_op(key: bytes) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key))
