"""Fakes for unit tests of one replica's side of replication: a server with only what ``Primary``
and ``Standby`` touch, and a primary or standby of shard 0 built around one."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch
from prometheus_client import CollectorRegistry

from ps.config import ReplicationConfig
from ps.core.update_log import ReplicationLog
from ps.replication.metrics import ReplicationMetrics
from ps.replication.primary import Primary
from ps.replication.standby import Standby
from rpcps.jobsecret import JobSecret
from rpcps.messages import View
from rpcps.transport.registry import ViewRecord, encode_view

COMPAT = {"model": "m"}


def metrics() -> ReplicationMetrics:
    return ReplicationMetrics(CollectorRegistry(), replicas=2)


class FakeServer:
    """What ``Primary.attach`` and ``Standby.append`` touch of a ParameterServer."""

    def __init__(self) -> None:
        self.log = ReplicationLog()
        self.lock = threading.Lock()
        self.deposed = False
        self.epoch = 0
        self.lease = None
        self.sparse = None

    def capture_replica_state_locked(self, include_sparse: bool = True) -> dict:
        del include_sparse  # no sparse tables
        return {"version": 3, "weights": torch.arange(4.0)}


def make_primary(secret: JobSecret | None) -> Primary:
    view = View(1, "server0", None)
    return Primary(
        FakeServer(), SimpleNamespace(), 0, "server0", ViewRecord(view, encode_view(view)), ReplicationConfig(replicas=2),
        metrics(), COMPAT, None, on_step_down=lambda why: None, secret=secret,
    )


def make_standby(secret: JobSecret | None) -> Standby:
    return Standby(
        FakeServer(), SimpleNamespace(), 0, "server1", ReplicationConfig(replicas=2), metrics(), COMPAT, None,
        on_promoted=lambda record, took: None, on_detached=lambda why: None, rpc_timeout_s=5.0, secret=secret,
    )
