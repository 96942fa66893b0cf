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
made once more on a fresh one (the store may have restarted since the last call). A connection is
opened on a helper thread, and a call waits for it no longer than the call itself may take. When
nothing listens on the port, the call fails at once (one refused TCP connect: torch's client would retry
for its whole timeout and print a C++ stack trace per attempt). Every failure is a RuntimeError
(``dist.DistError``), as from torch's own client, so callers keep their handling.

It also reads the store's incarnation (``INCARNATION_KEY``, written by each coordinator at start):
a new one means the store restarted empty, and the members put back what they hold
(``rpcps.transport.rebuild``).

Rank 0 hosts the store itself (``host_store``), from a listener of its own rather than torch's:
torch's makes the store's one thread ask DNS for every connecting peer's name.

What must not live here: anything about what the keys mean (``registry``, ``membership``).
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

from rpcps.store_waits import hopeless

logger = logging.getLogger(__name__)

INCARNATION_KEY = "rpcps/store_incarnation"
"""Written by the coordinator when it starts serving a store (a fresh, empty one): its value differs per start."""
SNAPSHOT_CLAIMS_HELD_KEY = "rpcps/snapshot_claims_held"
"""'1' while a coordinator that just started keeps shards without a view from being served from a
snapshot ('0' after ``group.serve``'s ``hold_snapshot_claims_s``; never written by other stores):
``ps.replication.claim``."""

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
        self._opening: Future[dist.TCPStore] | None = None
        """The connection being opened on a helper thread, while one is."""
        self._connected = False
        self._lock = threading.Lock()
        """Guards the three fields above. Calls on one connection are serialized by torch's client."""
        self.reconnects = 0
        """Connections opened after the first (each after a failure)."""

    def _connection(self) -> tuple[dist.TCPStore, bool]:
        """The open connection, and whether it was opened for this call.

        Opening one may take the whole connect timeout (a store restarting under load, a connect
        whose DNS query was dropped) and runs on a helper thread, one at a time: a caller waits for
        it only as long as its own call may last (the connect timeout until the first connection,
        then the call's timeout), so no call is held behind another's connect (a standby's promotion
        behind a store-rebuild check), and a later call finds the connection the helper opened. A
        call that finds nothing listening gives the opening up (``_give_up``).
        """
        with self._lock:
            client, opening = self._client, self._opening
        if client is not None:
            return client, False
        try:
            self._probe()
        except dist.DistNetworkError:
            if opening is not None:
                self._give_up(opening)
            raise
        if opening is None:
            with self._lock:
                if self._client is not None:
                    return self._client, False
                if self._opening is None:
                    self._opening = self._open_in_background()
                opening = self._opening
        wait = self.timeout if self._connected else self.connect_timeout  # type: ignore[attr-defined]  # dist.Store.timeout: a pybind property its stubs lack
        try:
            return opening.result(timeout=wait.total_seconds()), True
        except FutureTimeout:
            raise dist.DistNetworkError(
                f"the group's store at {self.host}:{self.port} accepted a connection but has not answered within "
                f"{wait.total_seconds():.1f}s (still trying)"
            ) from None

    def _probe(self) -> None:
        """Fails at once when nothing listens (one refused connect: torch's client would retry for its
        whole timeout and log a C++ stack trace per attempt)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=min(self.timeout.total_seconds(), 1.0)):  # type: ignore[attr-defined]  # dist.Store.timeout: a pybind property its stubs lack
                pass
        except OSError as e:
            raise dist.DistNetworkError(f"nothing answers at the group's store {self.host}:{self.port} ({e})") from None

    def _give_up(self, opening: Future[dist.TCPStore]) -> None:
        """Nothing listens any more while ``opening`` runs: the store it was reaching died. torch's
        constructor now retries refused connects with a growing back-off (measured with torch 2.13:
        after a 5 s outage it connected 5 s after the store was back), so it is left to finish alone
        and the first call that finds the port listening again opens a new connection (a standby's
        promotion waited out that back-off while a restarted server claimed the shard first)."""
        with self._lock:
            if self._opening is opening:
                self._opening = None

    def _open_in_background(self) -> Future[dist.TCPStore]:
        # The helper thread takes the lock before it touches _opening, and the caller holds it until it
        # has set _opening to this future, so `mine` is filled before the helper reads it.
        mine: list[Future[dist.TCPStore]] = []

        def open_and_install() -> dist.TCPStore:
            try:
                client = open_client(self.host, self.port, self.connect_timeout.total_seconds(), self.timeout)  # type: ignore[attr-defined]  # dist.Store.timeout: a pybind property its stubs lack
            except (RuntimeError, OSError):
                self._give_up(mine[0])
                raise
            with self._lock:  # installed before the waiters wake, so they find it
                if self._opening is mine[0]:
                    self._opening = None
                if self._client is not None:
                    return self._client  # a newer opening, started after this one was given up, connected first
                self._client = client
                if self._connected:
                    self.reconnects += 1
                    logger.info("reconnected to the group's store at %s:%d", self.host, self.port)
                self._connected = True
            return client

        mine.append(_on_thread(open_and_install))
        return mine[0]

    def _run(self, call: Callable[[dist.TCPStore], _T]) -> _T:
        for attempt in range(2):
            client, fresh = self._connection()
            try:
                return call(client)
            except (RuntimeError, OSError):
                with self._lock:
                    if self._client is client:
                        self._client = None
                if fresh or attempt:
                    raise  # a connection opened for this very call failed: the store is down, not restarted
        raise AssertionError("unreachable")

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._run(lambda c: c.compare_set(key, _text(expected), _text(desired)))  # type: ignore[arg-type]  # the stubs say str; the C++ takes bytes

    def set(self, key: str, value: Any) -> None:
        self._run(lambda c: c.set(key, _text(value)))  # type: ignore[arg-type]  # the stubs say str; the C++ takes bytes

    def add(self, key: str, amount: int) -> int:
        return int(self._run(lambda c: c.add(key, amount)))

    def check(self, keys: list[str]) -> bool:
        return bool(self._run(lambda c: c.check(keys)))

    def get(self, key: str) -> bytes:
        return self._run(lambda c: c.get(key))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if (why := hopeless(keys)) is not None:
            raise dist.DistStoreError(why)
        self._run(lambda c: c.wait(keys, timeout or self.timeout))  # type: ignore[attr-defined]  # dist.Store.timeout: a pybind property its stubs lack

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
    succeeded every time (9 of 9); the cause, found later, was a DNS query the store dropped
    (``host_store``). So a failed connection is followed by a new one, with what is
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
            client = _construct(host, port, left)
        except dist.DistNetworkError:
            if tries >= 2 and deadline - time.monotonic() <= 0:
                raise
            continue
        client.set_timeout(call_timeout)
        return client


_GIVE_UP_SLACK_S = 1.0
"""How long past its own timeout a constructor runs before it is given up: torch's returns a moment
after it (a random back-off of its last retry), unless it is stuck for good."""
MAX_STUCK_CONNECTS = 8
"""Constructors running at once per process, those given up included: a store stuck for long is not
worth one more thread per call."""
_connecting = threading.BoundedSemaphore(MAX_STUCK_CONNECTS)


def _construct(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """``dist.TCPStore(host, port)`` as a client, given up ``timeout_s`` (and a moment) from now.

    torch 2.13's constructor, against a port that accepts TCP connections but never answers (a
    frozen store; a listener whose process stopped serving), blocks for good whatever its timeout
    (measured: still blocked 15 s into a 2 s timeout), with the calling thread's locks held. So it
    runs on a helper thread that is left behind (a daemon, blocked in its socket until the peer
    closes it) when it is late, and the caller gets a DistNetworkError as for any failed connect.
    """
    if not _connecting.acquire(blocking=False):
        raise dist.DistNetworkError(
            f"{MAX_STUCK_CONNECTS} connections to the group's store at {host}:{port} are still being opened (accepted, "
            "never answered); not opening another until one ends"
        )

    def connect() -> dist.TCPStore:
        try:
            return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        finally:
            _connecting.release()

    try:
        return _on_thread(connect).result(timeout=timeout_s + _GIVE_UP_SLACK_S)
    except FutureTimeout:
        raise dist.DistNetworkError(
            f"the group's store at {host}:{port} accepted a connection but did not answer within {timeout_s:.1f}s"
        ) from None


def _on_thread(work: Callable[[], _T]) -> Future[_T]:
    """``work()`` on a daemon thread of its own; its result, or the RuntimeError (torch's DistError) or
    OSError it raised, in the future returned."""
    future: Future[_T] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except (RuntimeError, OSError) as e:
            future.set_exception(e)

    threading.Thread(target=run, name="store-connect", daemon=True).start()
    return future


def _text(value: Any) -> bytes:
    # Values come as str from rpcps and as bytes or a list of ints from torch's C++ side.
    return value if isinstance(value, bytes) else bytes(value) if isinstance(value, (bytearray, list)) else str(value).encode()


def rendezvous_url(host: str, port: int) -> str:
    """The ``init_method`` that gives a joining member's agent a ``ReconnectingStore``, and rank 0's
    the store it hosts (``register_rendezvous``)."""
    return f"{RENDEZVOUS_SCHEME}://{host}:{port}"


_agent_stores: list[ReconnectingStore] = []


def _rendezvous(url: str, timeout: datetime.timedelta = datetime.timedelta(seconds=30), **_kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    # torch appends ?rank=..&world_size=-1; the group is dynamic and rpcps chose the rank already.
    parsed = urlparse(url)
    if parsed.hostname is None or parsed.port is None:
        raise ValueError(f"{url}: the group's store needs HOST:PORT")
    rank = int(parse_qs(parsed.query).get("rank", ["-1"])[0])
    if rank == 0:
        yield host_store(parsed.hostname, parsed.port, timeout), rank, -1
        return
    store = ReconnectingStore(parsed.hostname, parsed.port, timeout.total_seconds())
    # init_rpc keeps only the C++ side (in a PrefixStore); once the Python object is collected,
    # every call from C++ fails with "Not implemented". The agent lives as long as the process.
    _agent_stores.append(store)
    yield store, rank, -1


LISTEN_BACKLOG = 2048


def host_store(host: str, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's TCPStore, served by this process on ``host:port`` (rank 0: a coordinator, or a
    server with ``--listen``), from a listening socket of the address's own family.

    torch's own listener is an IPv6 socket that takes IPv4 connections too, so it sees a peer on
    127.0.0.1 as ``::ffff:127.0.0.1`` and, accepting it, asks DNS for that address's name (/etc/hosts
    names only the plain form): one query per connection, made by the store's one thread. When the
    resolver drops a query, every call of every client waits out its 5 s timeout. Measured with
    torch 2.13 on the 2-core machine (its resolver drops some): 52 DNS queries for 50 connections,
    and 1 in 40-80 new connections stalled every client, a call of another process's open client
    included, for 5.0 s. On an IPv4 socket, peers on loopback are named from /etc/hosts: 1 query in
    all for the same 50 connections. (A client still asks for the name of the address it connects
    to, the IPv6 form; when that query is dropped only its own connect waits, on its helper thread,
    ``ReconnectingStore``.) ``timeout`` bounds the store's own client too, so it should be longer
    than a resolver's 5 s.
    """
    family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted coordinator takes its port back at once
        listener.bind(where)
        listener.listen(LISTEN_BACKLOG)
    except OSError as e:
        listener.close()
        raise dist.DistNetworkError(f"could not serve the group's store on {host}:{port}: {e}") from None
    # The store owns the socket from here (it closes it when it is destroyed); if its constructor
    # fails, the descriptor is left open rather than closed twice: the process is about to exit.
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=listener.detach())


def register_rendezvous() -> None:
    """Makes ``rpcps-tcp://`` an ``init_method`` torch understands (once per process)."""
    try:
        dist.register_rendezvous_handler(RENDEZVOUS_SCHEME, _rendezvous)
    except ValueError:
        pass  # registered already (torch refuses a second handler for a scheme)
