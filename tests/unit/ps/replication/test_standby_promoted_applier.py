"""A promoted standby's applier thread leaves what the new primary sequences to the primary, which
answers it.

CI (the etcd leader killed, then the primary): a worker's push, resent to the standby just promoted,
was sequenced before the new primary held its claim, so it waited; the standby's applier, not yet
ended, applied it once the claim came and dropped its reply (a standby's entries have no callers to
answer). The update was in the model and the worker heard nothing for its 30 s RPC timeout.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from harness.inprocess import grads_like, make_server, pack
from ps.config import ReplicationConfig
from ps.core.server import answer
from ps.replication.standby import Standby
from rpcps.messages import PushReply, PushStatus

from .fakes import COMPAT, metrics


def test_an_update_sequenced_after_the_promotion_is_answered_by_whoever_applies_it() -> None:
    server, model = make_server()
    core = server.core
    registration = server.register(0, "w0", core.signature.to_wire())
    standby = Standby(
        core, SimpleNamespace(), 0, "server1", ReplicationConfig(replicas=2), metrics(), COMPAT, None,
        on_promoted=lambda record, took: None, on_detached=lambda why: None, rpc_timeout_s=5.0,
    )
    core.mirroring = True  # following a primary (what catch_up sets)
    applier = standby._threads[0]
    applier.start()
    # The promotion, as _take_over makes it: stop following, apply what arrived, serve.
    assert standby._leave(promoting=True)
    standby._drain()
    with core.lock:
        core.mirroring, core.epoch = False, 2
    core.lease = lambda: None  # the new primary's claim is not held yet: its first update waits
    reply = server.submit(0, registration.incarnation, 0, core.version, pack(core.layout, grads_like(model, 0)), 1.0)
    assert not reply.done()
    core.lease = time.time  # the claim is held
    applier.join(timeout=10)
    assert not applier.is_alive(), "the standby's applier should end once this process serves"
    # The primary's own apply loop (ps.replication.primary) would do this: apply and answer.
    with core.lock:
        done = core.apply_committed_locked()
    answer(done)
    assert reply.done(), "the update was applied and its reply dropped: the worker would wait for its RPC timeout"
    value = reply.value()
    assert isinstance(value, PushReply) and value.status == PushStatus.APPLIED and core.version == 1
