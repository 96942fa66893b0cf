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
from rpcps.transport.store_client import ReconnectingStore

pytestmark = pytest.mark.timeout(30)


def _master(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))


def test_a_restarted_store_is_reached_again_and_a_dead_one_fails_at_once() -> None:
    port = free_port()
    master = _master(port)
    client = ReconnectingStore("127.0.0.1", port, timeout_s=2.0)
    plain = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2))
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
