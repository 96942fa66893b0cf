"""``ReconnectingStore`` against a real TCPStore in this process that stops and starts again on the
same port, as a restarted coordinator does: torch's own client stays broken; this one fails fast
while nothing listens and works again on the first call after the store is back."""

from __future__ import annotations

import datetime
import gc
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch.distributed as dist

from harness.procs import wait_until
from rpcps import store_waits
from rpcps.ports import free_port
from rpcps.transport.registry import Registry, StoreUnavailable
from rpcps.transport.store_client import ReconnectingStore, host_store, open_client

pytestmark = pytest.mark.timeout(30)

T = TypeVar("T")

FIRST_CONNECT_S = 20.0
"""The first connection's budget: a client's own DNS query for the store's address, when the resolver
drops it, holds that connect 5 s (``host_store``), longer than the calls' 2 s timeout these tests use."""


def _master(port: int) -> dist.TCPStore:
    """A store on ``port``, hosted as a coordinator hosts it."""
    return host_store("127.0.0.1", port, datetime.timedelta(seconds=30))


def _once_reached(call: Callable[[], T]) -> T:
    """``call()``'s result once the client reached a store that just came back: the connection is
    opened on a helper thread, and a call fails after its own timeout meanwhile (a dropped DNS query
    holds a connect 5 s), as the product's callers see and retry."""

    def attempt() -> tuple[T] | None:
        try:
            return (call(),)
        except RuntimeError:
            return None

    return wait_until(attempt, 20.0, "the client to reach the store that is back")[0]


def test_a_restarted_store_is_reached_again_and_a_dead_one_fails_at_once() -> None:
    port = free_port()
    master = _master(port)
    client = ReconnectingStore("127.0.0.1", port, timeout_s=2.0, connect_timeout_s=FIRST_CONNECT_S)
    plain = open_client("127.0.0.1", port, 5.0, datetime.timedelta(seconds=2))  # torch's own client, opened past a stall
    client.set("k", "before")
    assert client.get("k") == b"before" and client.reconnects == 0
    del master
    gc.collect()
    with pytest.raises(RuntimeError, match="nothing answers"):
        client.compare_set("k", "", "")
    master = _master(port)
    assert _once_reached(lambda: client.compare_set("k", "", "")) == b"", "the new store is empty: the old key is gone"
    assert client.reconnects == 1
    with pytest.raises(RuntimeError):
        plain.get("k")  # what every member had before: torch's client never reconnects
    del plain, master


def test_a_counter_is_raised_to_a_floor_and_never_lowered() -> None:
    port = free_port()
    master = _master(port)
    client = ReconnectingStore("127.0.0.1", port, timeout_s=2.0, connect_timeout_s=FIRST_CONNECT_S)
    assert client.raise_counter_to("n", 7) == 7
    assert client.raise_counter_to("n", 3) == 7
    assert client.add("n", 1) == 8
    del master


def test_the_registry_reads_views_again_once_its_store_is_back() -> None:
    port = free_port()
    master = _master(port)
    registry = Registry(ReconnectingStore("127.0.0.1", port, timeout_s=2.0, connect_timeout_s=FIRST_CONNECT_S))
    registry.claim_shard_count(1)
    del master
    gc.collect()
    with pytest.raises(StoreUnavailable):
        registry.shard_count()
    master = _master(port)
    assert _once_reached(registry.shard_count) is None
    registry.claim_shard_count(1)
    assert registry.shard_count() == 1
    del master


def test_a_long_connect_timeout_leaves_each_call_its_short_one() -> None:
    """A joining member waits long for a loaded store to accept it (``connect_timeout_s``), but a
    call on the open connection still gives up after the call's timeout."""
    port = free_port()
    master = _master(port)
    client = ReconnectingStore("127.0.0.1", port, timeout_s=0.5, connect_timeout_s=20.0)
    assert client.connect_timeout == datetime.timedelta(seconds=20)
    client.set("k", "v")
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        client.get("missing")  # waits for the key: bounded by the call's 0.5 s, not the 20 s connect
    assert time.monotonic() - started < 10.0
    del master



def test_a_failed_connection_is_tried_again_on_a_new_one_even_past_the_budget() -> None:
    """torch's client sometimes never connects to a healthy store (store_client.open_client): the
    first try gets the whole budget, and a failed one is followed by a new connection (at least
    one, with at least 1 s) before the failure is raised."""
    port = free_port()  # nothing listens: every try times out, as a stalled one does
    started = time.monotonic()
    with pytest.raises(dist.DistNetworkError):
        open_client("127.0.0.1", port, 2.0, datetime.timedelta(seconds=1))
    took = time.monotonic() - started
    # torch waits a random backoff of up to about 3 s inside each try after its first connect fails
    # (CI: 8.2 s in all): the upper bound says it gives up, not how fast.
    assert 2.8 <= took < 15.0, f"gave up after {took:.1f}s: expected a 2 s try and then a second one of 1 s"


def _mute_listener(port: int = 0) -> socket.socket:
    """A port that completes TCP connects (the kernel's backlog) and never answers: a frozen store."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    return listener


def test_a_store_that_accepts_and_never_answers_is_given_up_within_the_budget() -> None:
    """torch's own constructor blocks for good against such a port, whatever its timeout."""
    with _mute_listener() as listener:
        started = time.monotonic()
        with pytest.raises(dist.DistNetworkError, match="did not answer"):
            open_client("127.0.0.1", listener.getsockname()[1], 1.0, datetime.timedelta(seconds=1))
        took = time.monotonic() - started
    # A 1 s try and the one more that always follows, each given up a second past its timeout.
    assert took < 6.0, f"gave up after {took:.1f}s"


def test_a_reconnection_to_a_frozen_store_fails_the_call_and_leaves_other_calls_alone() -> None:
    """The store dies and something that never answers takes its port (a frozen coordinator): each
    call fails within its own timeout, not the long connect budget, and no call waits behind
    another's connect; once a real store is back on the port, the connection the client kept
    trying to open reaches it."""
    port = free_port()
    master = _master(port)
    client = ReconnectingStore("127.0.0.1", port, timeout_s=1.0, connect_timeout_s=30.0)
    client.set("k", "v")
    del master
    gc.collect()
    with _mute_listener(port):
        outcomes: list[BaseException | None] = []

        def call() -> None:
            try:
                client.compare_set("k", "", "")
                outcomes.append(None)
            except RuntimeError as e:
                outcomes.append(e)

        started = time.monotonic()
        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(25)
        took = time.monotonic() - started
        assert len(outcomes) == 2 and all(isinstance(e, RuntimeError) for e in outcomes), outcomes
        assert all("has not answered" in str(e) for e in outcomes), outcomes
        # Side by side, each a second's wait: far from the 30 s connect budget.
        assert took < 6.0, f"two calls took {took:.1f}s"
    master = _master(port)
    assert _once_reached(lambda: client.compare_set("k", "", "")) == b"", "the new store is empty"
    assert client.reconnects == 1
    del master


def test_a_connect_left_retrying_when_the_store_died_is_given_up_and_the_store_reached_as_soon_as_it_is_back() -> None:
    """The store dies while a connection to it is being opened (a coordinator killed with a primary:
    the standby's first read started on the dying store). torch's constructor then retries with a
    growing back-off and would reach the restarted store seconds late; a call that finds nothing
    listening gives it up, and the first call after the store is back opens a connection at once."""
    port = free_port()
    client = ReconnectingStore("127.0.0.1", port, timeout_s=1.0, connect_timeout_s=30.0)
    master = _master(port)
    client.set("k", "before")
    del master
    gc.collect()
    resets = _mute_listener(port)  # a client's first bytes get a reset: the store dying under its handshake

    def reset_each() -> None:
        while True:
            try:
                conn, _ = resets.accept()
            except OSError:
                return  # closed: the store is gone
            with conn:
                conn.recv(1)  # the probe sends nothing and closes; torch's constructor sends its handshake
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    threading.Thread(target=reset_each, daemon=True).start()
    # A few seconds of refused handshakes: long enough for torch's back-off to grow past a second.
    dying_until = time.monotonic() + 4.0
    while time.monotonic() < dying_until:
        with pytest.raises(RuntimeError, match="has not answered"):
            client.get("k")
    resets.shutdown(socket.SHUT_RDWR)  # wakes the accept above (a close alone leaves the port listening)
    resets.close()
    with pytest.raises(RuntimeError, match="nothing answers"):
        client.get("k")
    master = _master(port)
    back = time.monotonic()
    assert _once_reached(lambda: client.compare_set("k", "", "v")) == b"v"
    took = time.monotonic() - back
    assert took < 1.0, f"reached the store {took:.2f}s after it was back"
    del master


def test_a_wait_for_a_key_only_this_process_could_set_fails_at_once_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's failed join waits for its own join token on leaving: with the store's 30 s timeout,
    and once more after a reconnect, while every other join waited behind it (CI, 2026-12-03)."""
    monkeypatch.setattr(store_waits, "_never_waited", {})
    store_waits.never_wait_for("Token_for_ps0_r5_join", "a member listed in the group did not answer this join")
    master = _master(free_port())
    client = ReconnectingStore("127.0.0.1", master.port, timeout_s=30.0)
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="did not answer this join"):
        client.wait(["rpc_prefix_0/Token_for_ps0_r5_join"])
    assert time.monotonic() - started < 1.0
    master.set("rpc_prefix_0/Token_for_ps0_r6_join", "Done")
    client.wait(["rpc_prefix_0/Token_for_ps0_r6_join"])  # any other key is waited for as before
