"""The replication series of a server process (docs/METRICS.md): its role, epoch, standby, lag, failovers."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from ps.replication.auth import REASONS as REFUSALS

ROLE_CATCHING_UP, ROLE_STANDBY, ROLE_PRIMARY, ROLE_STEPPING_DOWN = 0, 1, 2, 3


class ReplicationMetrics:
    """The series of one server process's replication.

    A shard without standbys (``replicas`` 1) keeps them in a private registry that nothing
    exports: a dense single-server job's /metrics shows no replica role, lag or failovers that
    cannot happen. Only refused replication calls stay exported there (a stranger may still try
    them), as a series per reason that appears with its first refusal.
    """

    def __init__(self, registry: CollectorRegistry, replicas: int) -> None:
        exported = replicas > 1
        r = registry if exported else CollectorRegistry()
        self.configured = Gauge("rpcps_replica_configured", "Server processes per shard this one was started for (--replicas).", registry=r)
        self.configured.set(replicas)
        self.role = Gauge(
            "rpcps_replica_role", "This process's role: 0 catching up, 1 standby in sync, 2 primary, 3 stepping down.", registry=r
        )
        self.role.set(ROLE_CATCHING_UP)
        self.epoch = Gauge("rpcps_replica_epoch", "Epoch of the shard's view this process serves under.", registry=r)
        self.standby_in_sync = Gauge(
            "rpcps_replica_standby_in_sync", "On a primary: 1 while the view names an in-sync standby (commits wait for it).", registry=r
        )
        self.lag_updates = Gauge(
            "rpcps_replication_lag_updates",
            "Primary: entries sequenced and not yet acknowledged by the standby; standby: received and not yet applied.",
            registry=r,
        )
        self.lag_seconds = Gauge(
            "rpcps_replication_lag_seconds", "Age of the oldest entry counted in rpcps_replication_lag_updates.", registry=r
        )
        self.asynchronous = Gauge(
            "rpcps_replication_async",
            "1 when this process replicates asynchronously (--replication async: a push is acknowledged before the standby "
            "holds it), 0 when synchronously.",
            registry=r,
        )
        self.max_lag = Gauge(
            "rpcps_replication_max_lag_updates",
            "Updates a primary may apply and acknowledge before its standby holds them (--max-replica-lag; 0 when synchronous).",
            registry=r,
        )
        self.unreplicated = Gauge(
            "rpcps_replication_unreplicated_updates",
            "On a primary: entries applied and acknowledged here that the standby does not hold yet (what a failover now would "
            "lose); at most rpcps_replication_max_lag_updates, always 0 when synchronous.",
            registry=r,
        )
        self.failovers = Counter("rpcps_replica_failovers", "Times this process promoted itself to primary.", registry=r)
        self.stepdowns = Counter("rpcps_replica_stepdowns", "Times this process stopped serving because a newer epoch exists.", registry=r)
        self.standby_drops = Counter(
            "rpcps_replica_standby_drops", "Standbys this primary removed from the view (failed or too slow).", registry=r
        )
        self.sent_bytes = Counter("rpcps_replication_sent_bytes", "Log entry bytes this primary sent to its standby.", registry=r)
        self.catchup_seconds = Gauge(
            "rpcps_replica_catchup_seconds", "How long the newest standby took to copy the state (attach to ready).", registry=r
        )
        self.handover_pause_seconds = Gauge(
            "rpcps_replica_handover_pause_seconds",
            "How long the newest hand-over held pushes while a caught-up standby took its place in the view.",
            registry=r,
        )
        self.failover_seconds = Gauge(
            "rpcps_replica_failover_seconds", "On a promoted primary: from noticing its primary's failure to serving.", registry=r
        )

        self.refused = Counter(
            "rpcps_replica_refused", "Replication calls refused (no valid job-secret proof or attach id), by reason.", ["reason"],
            registry=registry,
        )
        if exported:
            for reason in REFUSALS:
                self.refused.labels(reason)  # every series from the start, at 0 (rate() sees the first refusal)

    def watch_lag(self, updates: Callable[[], float], seconds: Callable[[], float], unreplicated: Callable[[], float]) -> None:
        """Computes the lag at scrape time from the current role's view of the log."""
        self.lag_updates.set_function(updates)
        self.lag_seconds.set_function(seconds)
        self.unreplicated.set_function(unreplicated)
