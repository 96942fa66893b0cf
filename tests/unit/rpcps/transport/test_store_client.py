"""``ReconnectingStore`` against a real TCPStore in this process that stops and starts again on the
same port, as a restarted coordinator does: torch's own client stays broken; this one fails fast
while nothing listens and works again on the first call after the store is back."""

from __future__ import annotations

import datetime
import gc
import time

import pytest
import torch.distributed as dist

from rpcps.ports import free_port
from rpcps.transport.registry import Registry, StoreUnavailable
from rpcps.transport.store_client import ReconnectingStore, open_client

pytestmark = pytest.mark.timeout(30)


def _master(port: int) -> dist.TCPStore:
    """A store on ``port``; tried again when torch's own client of it stalls (see ``open_client``)."""
    for attempt in range(3):
        try:
            return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=2))
        except dist.DistNetworkError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def test_a_restarted_store_is_reached_again_and_a_dead_one_fails_at_once() -> None:
    port = free_port()
    master = _master(port)
    client = ReconnectingStore("127.0.0.1", port, timeout_s=2.0)
    plain = open_client("127.0.0.1", port, 5.0, datetime.timedelta(seconds=2))  # torch's own client, opened past a stall
    client.set("k", "before")
    assert client.get("k") == b"before" and client.reconnects == 0
    del master
    gc.collect()
    with pytest.raises(RuntimeError, match="nothing answers"):
        client.compare_set("k", "", "")
    master = _master(port)
    assert client.compare_set("k", "", "") == b"", "the new store is empty: the old key is gone"
    assert client.reconnects == 1
    with pytest.raises(RuntimeError):
        plain.get("k")  # what every member had before: torch's client never reconnects
    del plain, master


def test_a_counter_is_raised_to_a_floor_and_never_lowered() -> None:
    port = free_port()
    master = _master(port)
    client = ReconnectingStore("127.0.0.1", port, timeout_s=2.0)
    assert client.raise_counter_to("n", 7) == 7
    assert client.raise_counter_to("n", 3) == 7
    assert client.add("n", 1) == 8
    del master


def test_the_registry_reads_views_again_once_its_store_is_back() -> None:
    port = free_port()
    master = _master(port)
    registry = Registry(ReconnectingStore("127.0.0.1", port, timeout_s=2.0))
    registry.claim_shard_count(1)
    del master
    gc.collect()
    with pytest.raises(StoreUnavailable):
        registry.shard_count()
    master = _master(port)
    assert registry.shard_count() is None
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
