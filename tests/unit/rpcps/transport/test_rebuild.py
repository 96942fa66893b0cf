"""``StoreRebuild`` against a real TCPStore in this process: a member writes its part back once per
new incarnation of the store (not at the first one it sees), raises the rank counter to the highest
rank its agent maps (its own or a peer's), and tries again on the next check when a rewrite failed."""

from __future__ import annotations

import datetime
import gc
import logging

import pytest
import torch.distributed as dist

from harness.procs import wait_until
from rpcps.ports import free_port
from rpcps.transport.membership import RANK_COUNTER_KEY
from rpcps.transport.rebuild import StoreRebuild
from rpcps.transport.store_client import INCARNATION_KEY, ReconnectingStore, host_store

pytestmark = pytest.mark.timeout(30)


def _coordinator(port: int, incarnation: str) -> dist.TCPStore:
    """A store as a freshly started coordinator serves it: empty but for its incarnation."""
    master = host_store("127.0.0.1", port, datetime.timedelta(seconds=30))
    master.set(INCARNATION_KEY, incarnation)
    return master


def _answers(store: ReconnectingStore) -> bool:
    try:
        return store.check([INCARNATION_KEY])
    except RuntimeError:
        return False


def test_a_member_writes_its_part_back_once_per_restart_and_again_after_a_failed_rewrite(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    master = _coordinator(port, "first")
    store = ReconnectingStore("127.0.0.1", port, timeout_s=2.0, connect_timeout_s=20.0)  # past a dropped DNS query's 5 s
    rebuild = StoreRebuild(store, highest_rank=lambda: 5)  # e.g. its own rank 3, a peer's 5: a joiner must take neither
    rewrites: list[str] = []
    failing = [True]

    def rewrite() -> None:
        if failing[0]:
            failing[0] = False
            raise RuntimeError("the group token is held")
        rewrites.append(store.compare_set(INCARNATION_KEY, "", "").decode())

    rebuild.on_restart(rewrite)
    rebuild.check()
    assert rewrites == [] and rebuild.rebuilds == 0, "the first incarnation seen is the one the member joined"
    del master
    gc.collect()
    with caplog.at_level(logging.WARNING, logger="rpcps.transport.rebuild"):
        rebuild.check()  # the coordinator is down: nothing to do but say so once, and ask again later
        rebuild.check()
    assert rebuild.store_down and [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "the group's store does not answer"
    ], "once, in one line, without C++ frames"
    assert "frame #" not in caplog.text
    master = _coordinator(port, "second")
    # The client reconnects on a helper thread; a call fails after its own timeout meanwhile.
    wait_until(lambda: _answers(store), 20.0, "the client to reach the restarted store")
    with pytest.raises(RuntimeError, match="token"):
        rebuild.check()
    rebuild.check()
    assert not rebuild.store_down
    assert store.add(RANK_COUNTER_KEY, 0) == 5, "a later joiner must not take a rank a member maps to another process"
    rebuild.check()
    assert rewrites == ["second"] and rebuild.rebuilds == 1
    del master
