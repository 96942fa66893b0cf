"""``EtcdStore``: a ``torch.distributed.Store`` whose keys live in an etcd cluster, and the rendezvous
handler that hands it to torch RPC.

torch's dynamic RPC group keeps its member list, its agents' addresses and its join token in the
store it rendezvoused through; rpcps keeps its rank counter and the group's shared facts (views,
replica and dead records: ``rpcps.transport.registry``) there too. With ``--store etcd://...`` all of
it is in etcd, so no rpcps process holds state the group cannot do without. Every operation is one
etcd request or transaction, with TCPStore's semantics (the code on top was written against it):

- ``compare_set(key, expected, desired)``: one transaction comparing the value; a missing key counts
  as holding '' (so ``compare_set(k, "", "")`` reads without waiting, creating k empty as TCPStore
  does), and a missing key compared with anything else answers ``expected`` unchanged;
- ``add``: read, then a transaction on the key's mod revision, retried on a conflict;
- ``get_revision``/``set_at_revision`` (not in torch's interface; ``rpcps.transport.registry.RevisionStore``):
  a key's text with the revision it was last changed at, and a write that holds only if the key is
  still at that revision: the registry changes views this way, so a view changed and changed back
  (the same text again) still makes a stale writer lose;
- ``get``/``wait``: poll until the keys exist or the store's timeout passes (``DistStoreError``).

What must not live here: anything about rpcps's own records (the registry), or about torch's keys.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from rpcps.address import ETCD_SCHEME, EtcdAddress
from rpcps.etcd.client import EtcdClient, EtcdUnavailable, absent, get_op, modified_at, prefix_end, put_op, value_is
from rpcps.store_waits import hopeless

RENDEZVOUS_SCHEME = "rpcps-etcd"
"""The scheme of the ``init_method`` torch RPC is given for an etcd store (``rendezvous_url``)."""

_POLL_FIRST_S = 0.005
_POLL_MAX_S = 0.1
"""``get``/``wait`` poll a missing key at these intervals (doubling): a join's token is released in
milliseconds; a long wait should not load the cluster."""


AGENT_CALL_TIMEOUT_S = 5.0
"""Deadline of one etcd request made for torch's agent (joins): an election after a member's death
takes about a second; init_rpc sets how long a key may be waited for (the RPC timeout)."""


def _text(value: Any) -> bytes:
    return value if isinstance(value, bytes) else bytes(value) if isinstance(value, (bytearray, list)) else str(value).encode()


class EtcdStore(dist.Store):
    """The keys of one job, under ``/<prefix>/`` in etcd."""

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=30)) -> None:
        super().__init__()
        self.client = client
        self._prefix = f"/{prefix}/".encode()
        self.set_timeout(timeout)

    def key(self, key: str) -> bytes:
        """The etcd key that holds store key ``key``."""
        return self._prefix + key.encode()

    def _failed(self, e: EtcdUnavailable) -> dist.DistStoreError:
        # The callers (torch's agent, the registry) handle a store failure as a RuntimeError.
        return dist.DistStoreError(str(e))

    def set(self, key: str, value: Any) -> None:
        try:
            self.client.put(self.key(key), _text(value))
        except EtcdUnavailable as e:
            raise self._failed(e) from e

    def get(self, key: str) -> bytes:
        k = self.key(key)
        for _ in self._polling([key]):
            try:
                record = self.client.get(k)
            except EtcdUnavailable as e:
                raise self._failed(e) from e
            if record is not None:
                return bytes(record.value)
        raise AssertionError("unreachable")  # _polling raises at its deadline

    def add(self, key: str, value: int) -> int:
        k = self.key(key)
        try:
            while True:
                record = self.client.get(k)
                held = int(record.value) if record is not None and record.value else 0
                now = held + int(value)
                guard = modified_at(k, record.mod_revision) if record is not None else absent(k)
                if self.client.txn([guard], [put_op(k, str(now).encode())]).succeeded:
                    return now
        except EtcdUnavailable as e:
            raise self._failed(e) from e

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        k, want, new = self.key(key), _text(expected), _text(desired)
        try:
            while True:
                reply = self.client.txn([value_is(k, want)], [put_op(k, new)], [get_op(k)])
                if reply.succeeded:
                    return new
                found = reply.responses[0].response_range.kvs
                if found:
                    return bytes(found[0].value)
                if want:
                    return want  # TCPStore's answer for a missing key compared with a value
                if self.client.txn([absent(k)], [put_op(k, new)]).succeeded:
                    return new
                # Created between the two transactions: compare again with what it holds now.
        except EtcdUnavailable as e:
            raise self._failed(e) from e

    def get_revision(self, key: str) -> tuple[bytes, int]:
        """The key's text and the revision it was last changed at (b'' and 0: it does not exist);
        a linearizable read that neither waits nor creates the key."""
        try:
            record = self.client.get(self.key(key))
        except EtcdUnavailable as e:
            raise self._failed(e) from e
        return (bytes(record.value), int(record.mod_revision)) if record is not None else (b"", 0)

    def set_at_revision(self, key: str, revision: int, desired: Any, absent_keys: Sequence[str] = ()) -> int | None:
        """Writes ``desired`` if the key was last changed at ``revision`` (0: it does not exist) and
        none of ``absent_keys`` exists, in one transaction. Returns the key's new revision, None when
        a comparison failed (nothing written)."""
        k = self.key(key)
        try:
            reply = self.client.txn([modified_at(k, revision), *(absent(self.key(a)) for a in absent_keys)], [put_op(k, _text(desired))])
        except EtcdUnavailable as e:
            raise self._failed(e) from e
        return int(reply.header.revision) if reply.succeeded else None

    def check(self, keys: list[str]) -> bool:
        try:
            reply = self.client.txn([], [get_op(self.key(k)) for k in keys])
        except EtcdUnavailable as e:
            raise self._failed(e) from e
        return all(r.response_range.kvs for r in reply.responses)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if (why := hopeless(keys)) is not None:
            raise dist.DistStoreError(why)
        for _ in self._polling(keys, timeout):
            if self.check(keys):
                return

    def delete_key(self, key: str) -> bool:
        try:
            return self.client.delete(self.key(key)) > 0
        except EtcdUnavailable as e:
            raise self._failed(e) from e

    def keys_under(self, prefix: str) -> list[str]:
        """The store keys that start with ``prefix``, in one read."""
        start = self.key(prefix)
        try:
            reply = self.client.range(start, prefix_end(start), keys_only=True)
        except EtcdUnavailable as e:
            raise self._failed(e) from e
        return [kv.key[len(self._prefix):].decode() for kv in reply.kvs]

    def num_keys(self) -> int:
        try:
            return int(self.client.range(self._prefix, prefix_end(self._prefix), count_only=True).count)
        except EtcdUnavailable as e:
            raise self._failed(e) from e

    def _polling(self, keys: list[str], timeout: timedelta | None = None) -> Iterator[None]:
        """Yields until the caller returns; raises DistStoreError once the timeout has passed."""
        limit = (timeout or self.timeout).total_seconds()  # type: ignore[attr-defined]  # dist.Store.timeout: a pybind property its stubs lack
        deadline = time.monotonic() + limit
        pause = _POLL_FIRST_S
        while True:
            yield
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"waited {limit:g}s for {keys} in the etcd store {self._prefix.decode()}; they never appeared")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)


def rendezvous_url(address: EtcdAddress) -> str:
    """The ``init_method`` that makes torch RPC rendezvous through ``address`` (``register_rendezvous``)."""
    return str(address).replace(ETCD_SCHEME, f"{RENDEZVOUS_SCHEME}://", 1)


def open_store(address: EtcdAddress, timeout_s: float) -> EtcdStore:
    """A store client of the job's keys in etcd; each call bounded by ``timeout_s``."""
    return EtcdStore(EtcdClient(address.endpoints, timeout_s, address.tls), address.prefix, timedelta(seconds=timeout_s))


_agent_stores: list[EtcdStore] = []


def _rendezvous(url: str, **_kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    # torch appends rank=..&world_size=-1 to the query; the group is dynamic and rpcps chose the rank
    # already. The rest of the query is the URL's own (TLS).
    parsed = urlparse(url)
    own = "&".join(p for p in parsed.query.split("&") if p and p.split("=", 1)[0] not in ("rank", "world_size"))
    address = EtcdAddress.parse(f"{ETCD_SCHEME}{parsed.netloc}{parsed.path}" + (f"?{own}" if own else ""))
    # Each agent's own client; init_rpc sets its timeout to the RPC timeout.
    store = open_store(address, timeout_s=AGENT_CALL_TIMEOUT_S)
    # init_rpc keeps only the C++ side (wrapped in a PrefixStore); once the Python object is
    # collected, every call from C++ fails with "Not implemented". The agent lives as long as the process.
    _agent_stores.append(store)
    yield store, -1, -1


def register_rendezvous() -> None:
    """Makes ``rpcps-etcd://`` an ``init_method`` torch understands (once per process)."""
    try:
        dist.register_rendezvous_handler(RENDEZVOUS_SCHEME, _rendezvous)
    except ValueError:
        pass  # registered already (torch refuses a second handler for a scheme)
