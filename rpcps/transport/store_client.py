"""``ReconnectingStore``: a client of the group's TCPStore that outlives a restart of the store.

torch's TCPStore client never reconnects: once the coordinator (``rpcps store``) that hosts the
store dies, every later call on that client fails ("Broken pipe"), even after a new coordinator
listens on the same port (measured with torch 2.13). The registry (``rpcps.transport.registry``)
reads and changes the shards' views through this client instead, so a standby can promote itself
and a worker find the new primary once the coordinator is back, without restarting.

Every member but the store's host (rank 0) holds two of them: the registry's, and the one its RPC
agent was given at init (``rendezvous_url``): torch's agent reads a joining member's address from
its store, so with torch's client no process could join the group after a coordinator restart.

Each call runs on the current connection; when that fails, the connection is dropped and the call
made once more on a fresh one (the store may have restarted since the last call). When nothing
listens on the port, the call fails at once (one refused TCP connect: torch's client would retry
for its whole timeout and print a C++ stack trace per attempt). Every failure is a RuntimeError
(``dist.DistError``), as from torch's own client, so callers keep their handling.

It also reads the store's incarnation (``INCARNATION_KEY``, written by each coordinator at start):
a new one means the store restarted empty, and the members put back what they hold
(``rpcps.transport.rebuild``).

What must not live here: anything about what the keys mean (``registry``, ``membership``).
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

logger = logging.getLogger(__name__)

INCARNATION_KEY = "rpcps/store_incarnation"
"""Written by the coordinator when it starts serving a store (a fresh, empty one): its value differs per start."""

_T = TypeVar("_T")


RENDEZVOUS_SCHEME = "rpcps-tcp"
"""The scheme of the ``init_method`` that gives a joining member's agent a ``ReconnectingStore``."""


class ReconnectingStore(dist.Store):
    """A TCPStore client of ``host:port`` that opens a new connection after the old one failed. Thread-safe.

    Its timeout (``set_timeout``; init_rpc sets the agent's to the RPC timeout) bounds each call and
    how long ``get``/``wait`` wait for a missing key.
    """

    def __init__(self, host: str, port: int, timeout_s: float, connect_timeout_s: float | None = None) -> None:
        super().__init__()
        self.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.host = host
        self.port = port
        self.connect_timeout = datetime.timedelta(seconds=max(timeout_s, connect_timeout_s or 0.0))
        """How long opening a connection may take once something listens: a store on a loaded host
        (nine processes starting on 2 cores) took over 2 s to accept a client that a call's short
        timeout would give up on."""
        self._client: dist.TCPStore | None = None
        self._connected = False
        self._lock = threading.Lock()
        """One call at a time: a TCPStore client is one connection."""
        self.reconnects = 0
        """Connections opened after the first (each after a failure)."""

    def _connect(self) -> dist.TCPStore:
        try:
            with socket.create_connection((self.host, self.port), timeout=min(self.timeout.total_seconds(), 1.0)):
                pass
        except OSError as e:
            raise dist.DistNetworkError(f"nothing answers at the group's store {self.host}:{self.port} ({e})") from None
        return open_client(self.host, self.port, self.connect_timeout.total_seconds(), self.timeout)

    def _run(self, call: Callable[[dist.TCPStore], _T]) -> _T:
        with self._lock:
            fresh = self._client is None
            for attempt in range(2):
                if self._client is None:
                    self._client = self._connect()
                    if self._connected:
                        self.reconnects += 1
                        logger.info("reconnected to the group's store at %s:%d", self.host, self.port)
                    self._connected = True
                try:
                    return call(self._client)
                except (RuntimeError, OSError):
                    self._client = None
                    if fresh or attempt:
                        raise  # a connection opened for this very call failed: the store is down, not restarted
            raise AssertionError("unreachable")

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._run(lambda c: c.compare_set(key, _text(expected), _text(desired)))

    def set(self, key: str, value: Any) -> None:
        self._run(lambda c: c.set(key, _text(value)))

    def add(self, key: str, amount: int) -> int:
        return int(self._run(lambda c: c.add(key, amount)))

    def check(self, keys: list[str]) -> bool:
        return bool(self._run(lambda c: c.check(keys)))

    def get(self, key: str) -> bytes:
        return self._run(lambda c: c.get(key))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._run(lambda c: c.wait(keys, timeout or self.timeout))

    def delete_key(self, key: str) -> bool:
        return bool(self._run(lambda c: c.delete_key(key)))

    def num_keys(self) -> int:
        return int(self._run(lambda c: c.num_keys()))

    def raise_counter_to(self, key: str, floor: int) -> int:
        """Sets counter ``key`` to at least ``floor`` (compare-and-set, so it never goes back); returns its value."""
        while True:
            now = self.add(key, 0)
            if now >= floor:
                return now
            if self.compare_set(key, str(now), str(floor)) == str(floor).encode():
                return floor

    def close(self) -> None:
        with self._lock:
            self._client = None



def open_client(host: str, port: int, within_s: float, call_timeout: datetime.timedelta) -> dist.TCPStore:
    """A torch TCPStore client of ``host:port``, its calls bounded by ``call_timeout``.

    torch's client sometimes does not connect to a healthy store: measured with torch 2.13 on the
    2-core machine, about 1 in 38 fresh connections to an in-process store (either backend, at a
    regular period) failed after 5 s whatever its timeout, and a second connection, opened at once,
    succeeded every time (9 of 9). So a failed connection is followed by a new one, with what is
    left of ``within_s`` (and once more even when nothing is left); the last failure is raised.
    Each try gets the whole remaining budget: a shorter one expires on a store that is merely
    slow (a server restarting under load), and torch logs every expiry with its C++ frames.
    """
    deadline = time.monotonic() + within_s
    tries = 0
    while True:
        tries += 1
        left = max(deadline - time.monotonic(), 1.0)
        try:
            client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=left))
        except dist.DistNetworkError:
            if tries >= 2 and deadline - time.monotonic() <= 0:
                raise
            continue
        client.set_timeout(call_timeout)
        return client


def _text(value: Any) -> bytes:
    # Values come as str from rpcps and as bytes or a list of ints from torch's C++ side.
    return value if isinstance(value, bytes) else bytes(value) if isinstance(value, (bytearray, list)) else str(value).encode()


def rendezvous_url(host: str, port: int) -> str:
    """The ``init_method`` that gives a joining member's agent a ``ReconnectingStore`` (``register_rendezvous``)."""
    return f"{RENDEZVOUS_SCHEME}://{host}:{port}"


_agent_stores: list[ReconnectingStore] = []


def _rendezvous(url: str, timeout: datetime.timedelta = datetime.timedelta(seconds=30), **_kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    # torch appends ?rank=..&world_size=-1; the group is dynamic and rpcps chose the rank already.
    parsed = urlparse(url)
    if parsed.hostname is None or parsed.port is None:
        raise ValueError(f"{url}: the group's store needs HOST:PORT")
    rank = int(parse_qs(parsed.query).get("rank", ["-1"])[0])
    store = ReconnectingStore(parsed.hostname, parsed.port, timeout.total_seconds())
    # init_rpc keeps only the C++ side (in a PrefixStore); once the Python object is collected,
    # every call from C++ fails with "Not implemented". The agent lives as long as the process.
    _agent_stores.append(store)
    yield store, rank, -1


def register_rendezvous() -> None:
    """Makes ``rpcps-tcp://`` an ``init_method`` torch understands (once per process)."""
    try:
        dist.register_rendezvous_handler(RENDEZVOUS_SCHEME, _rendezvous)
    except ValueError:
        pass  # registered already (torch refuses a second handler for a scheme)
