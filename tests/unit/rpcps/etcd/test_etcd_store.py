"""``EtcdStore.wait`` for a key only this process could set fails at once (``rpcps.store_waits.never_wait_for``):
torch's failed join waits for its own join token that way, for the store's whole timeout."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from rpcps import store_waits
from rpcps.address import Address
from rpcps.etcd import store as etcd_store
from rpcps.etcd.client import EtcdClient
from rpcps.ports import free_port

pytestmark = pytest.mark.timeout(30)


def test_a_wait_for_a_key_only_this_process_could_set_fails_at_once_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_waits, "_never_waited", {})
    store_waits.never_wait_for("Token_for_worker0_r2_join", "a listed member did not answer this join")
    # Nothing listens there: a wait that reached etcd would poll it for the store's whole timeout.
    store = etcd_store.EtcdStore(EtcdClient([Address("127.0.0.1", free_port())], timeout_s=1.0), "job")
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="a listed member did not answer this join"):
        store.wait(["rpc_prefix_0/Token_for_worker0_r2_join"])
    assert time.monotonic() - started < 0.5
    with pytest.raises(dist.DistStoreError, match="did not answer"):  # any other key is waited for (and etcd is asked)
        store.wait(["rpc_prefix_0/Token_for_worker1_r3_join"], timeout=timedelta(seconds=1))
