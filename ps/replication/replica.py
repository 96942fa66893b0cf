"""This process's place in its shard: the primary or a standby, and the moves between them.

``ShardReplica`` starts the role the process claimed (``ps.replication.claim``), turns a standby
into the primary when it promotes itself (and tells the workers), and asks the runner to restart
the process when it must start over: a primary that stepped down (a newer epoch serves), or a
standby that cannot follow any more. A restarted process joins under a fresh name and attaches to
whoever serves the shard then, so a replaced primary comes back as a standby by itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from ps.checkpoints.audit import AuditLog
from ps.config import ReplicationConfig, ServerRunConfig
from ps.control.hooks import ReplicaState
from ps.core.server import ParameterServer
from ps.replication.metrics import ROLE_STEPPING_DOWN, ReplicationMetrics
from ps.replication.primary import Primary
from ps.replication.standby import Standby
from rpcps import replica_endpoints, transport
from rpcps.jobsecret import JobSecret
from rpcps.messages import View
from rpcps.transport.registry import Registry, ViewRecord

logger = logging.getLogger(__name__)


def compatibility(server: ParameterServer, config: ServerRunConfig) -> dict[str, str]:
    """What two replicas must share to stay bit-identical: the model, its partition and layout, the
    optimizer and its settings, the wire, and the kernels (torch version, CPU instruction set,
    intra-op threads): different ones may round differently."""
    optimizer = config.core.optimizer
    return {
        "model": server.model_signature.digest(),
        "partition": server.partition_digest,
        "chunk_bytes": str(config.core.chunk_bytes),
        "mode": str(config.core.mode),
        "max_staleness": str(config.core.max_staleness),
        "optimizer": f"{config.core.optimizer_name} {config.core.optimizer_settings}",
        "staleness_lr": str(config.core.scales_lr_by_staleness),
        "schedule": f"{optimizer.schedule} {sorted((optimizer.schedule_kwargs or {}).items())}",
        "wire_dtype": config.core.wire_dtype,
        "torch": str(torch.__version__),  # a TorchVersion, which the allow-list (rightly) does not let through
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": str(torch.get_num_threads()),
        # A promoted standby serves with its own settings: both must promise the same.
        "replication": f"{config.replication.replication} lag {config.replication.allowed_lag}",
        # Row creation, the row optimizer and eviction decide alike only with the same sparse settings.
        "sparse": repr(config.core.sparse),
    }


class ShardReplica:
    def __init__(
        self,
        server: ParameterServer,
        registry: Registry,
        config: ServerRunConfig,
        name: str,
        metrics: ReplicationMetrics,
        ledger: AuditLog | None,
        on_primary: Callable[[], None],
        on_restart: Callable[[str], None],
    ) -> None:
        """``on_primary``: starts what only a primary runs (the checkpointer); ``on_restart(why)``:
        the process must restart itself (called on a background thread)."""
        self.server = server
        self.registry = registry
        self.config = config
        self.replication: ReplicationConfig = config.replication
        self.shard = config.core.shard_index
        self.name = name
        self.metrics = metrics
        self.ledger = ledger
        self.compatibility = compatibility(server, config)
        secret_file = config.transport.job_secret_file
        self.secret = JobSecret.from_file(secret_file) if secret_file else None
        """The job's: a standby proves it to attach, a primary checks it."""
        self._on_primary = on_primary
        self._on_restart = on_restart
        self.primary: Primary | None = None
        self.standby: Standby | None = None
        self.failovers = 0
        self._lock = threading.Lock()
        metrics.asynchronous.set(1 if self.replication.replication == "async" else 0)
        metrics.max_lag.set(self.replication.allowed_lag)
        metrics.watch_lag(lambda: self.lag()[0], lambda: self.lag()[1], self.unreplicated)

    def serve(self, record: ViewRecord) -> None:
        """Serves the shard as its primary under ``record`` (bootstrapped, taken over, or promoted to)."""
        primary = Primary(
            self.server, self.registry, self.shard, self.name, record, self.replication, self.metrics, self.compatibility,
            self.ledger, on_step_down=self._stepped_down, secret=self.secret,
        )
        with self._lock:
            self.primary = primary
        primary.start()
        self._on_primary()

    def follow(self, primary: str) -> None:
        """Copies ``primary``'s state and follows its log (raises CatchUpFailed)."""
        standby = Standby(
            self.server, self.registry, self.shard, self.name, self.replication, self.metrics, self.compatibility, self.ledger,
            on_promoted=self._promoted, on_detached=self._on_restart, rpc_timeout_s=self.config.transport.rpc_timeout_s,
            secret=self.secret,
        )
        self.standby = standby
        standby.catch_up(primary)

    def stop_following(self) -> None:
        """This process is shutting down: a standby neither promotes nor restarts any more."""
        if self.standby is not None:
            self.standby.stop()

    def stop(self) -> None:
        """Stops replicating (a graceful stop: a standby following this primary takes over)."""
        self.stop_following()
        if self.primary is not None:
            self.primary.stop()

    def state(self) -> ReplicaState | None:
        """What ``ctl status`` shows; None before this process has a role."""
        primary, standby = self.primary, self.standby
        if primary is not None:
            view = primary.record.view
            role = "stepping down" if self.server.deposed else "primary"
        elif standby is not None:
            view = View(standby.epoch, standby.primary, self.name if standby.in_view else None)
            role = "standby" if standby.in_view else "catching up"
        else:
            return None
        lag_updates, lag_seconds = self.lag()
        return ReplicaState(
            role, view.epoch, view.primary, view.standby, lag_updates, lag_seconds, self.failovers, self.replication.replicas,
            self.replication.replication, self.replication.allowed_lag, self.unreplicated(),
        )

    def lag(self) -> tuple[float, float]:
        primary, standby = self.primary, self.standby
        if primary is not None:
            return primary.lag()
        if standby is not None:
            return standby.lag()
        return 0.0, 0.0

    def unreplicated(self) -> float:
        """On a primary: entries applied here that its standby lacks (``ReplicationLog.unreplicated``)."""
        return float(self.server.log.unreplicated) if self.primary is not None else 0.0

    def _promoted(self, record: ViewRecord, took: float) -> None:
        del took
        self.failovers += 1
        self.serve(record)
        self._tell_workers(record.view)

    def _stepped_down(self, why: str) -> None:
        self.metrics.role.set(ROLE_STEPPING_DOWN)
        self._on_restart(f"stepped down: {why}")

    def _tell_workers(self, view: View) -> None:
        """Fire and forget: workers also notice by themselves (a failed call, their view poll)."""
        with self.server.lock:
            names = [r.rpc_name for r in self.server.workers.records.values() if not r.left and r.rpc_name]
        for name in names:
            try:
                transport.call_async(name, replica_endpoints.view_changed, (self.shard, view), timeout_s=2.0)
            except transport.CallFailed as e:
                logger.debug("could not tell %s about the new view: %s", name, e)
