"""The server's Prometheus metrics. Every series is registered here and nowhere else."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
REJECT_REASONS = ("shape", "dtype", "nonfinite", "unknown_worker", "names", "stale", "stopping")


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.updates = Counter("rpcps_server_updates_applied", "Optimizer updates applied.", registry=r)
        self.pushes = Counter("rpcps_server_pushes_received", "Gradient pushes received.", registry=r)
        self.rejected = Counter(
            "rpcps_server_pushes_rejected", "Pushes refused, parameters untouched.", ["reason"], registry=r
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.duplicates = Counter(
            "rpcps_server_pushes_duplicate", "Retried pushes recognised and not applied twice.", registry=r
        )
        self.skipped = Counter("rpcps_server_pushes_skipped", "Non-finite pushes dropped (--on-nonfinite skip).", registry=r)
        self.pulls = Counter("rpcps_server_pulls_served", "Parameter pulls answered.", ["result"], registry=r)
        for result in ("full", "unchanged"):
            self.pulls.labels(result)
        self.grad_bytes = Counter("rpcps_server_gradient_received_bytes", "Gradient bytes received.", registry=r)
        self.param_bytes = Counter("rpcps_server_parameter_sent_bytes", "Parameter bytes sent.", registry=r)
        self.staleness = Histogram(
            "rpcps_server_staleness_updates", "Staleness of applied gradients (updates behind).", buckets=_STALENESS_BUCKETS, registry=r
        )
        self.push_seconds = Histogram(
            "rpcps_server_push_apply_seconds", "Time to validate and apply one push.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.pull_seconds = Histogram(
            "rpcps_server_pull_seconds", "Time to answer one pull.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.step_seconds = Histogram(
            "rpcps_server_optimizer_step_seconds", "Time of one optimizer step.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.version = Gauge("rpcps_server_model_version", "Updates applied to the model since it was created.", registry=r)
        self.in_flight = Gauge("rpcps_server_pushes_in_flight", "Pushes being validated or applied now.", registry=r)
        self.paused = Gauge("rpcps_server_paused", "1 while the server holds updates (paused by the control plane).", registry=r)
        self.registrations = Counter("rpcps_server_worker_registrations", "Worker registrations (joins and rejoins).", registry=r)
        self.workers_reaped = Counter(
            "rpcps_server_workers_reaped", "Worker processes found dead and removed from the RPC group.", registry=r
        )
        self.rpc_listener_lost = Counter(
            "rpcps_server_rpc_listener_lost", "Times the RPC listener was closed by a stray connection.", registry=r
        )
        self.resumes = Counter("rpcps_server_resumes", "Times this server resumed from a checkpoint.", registry=r)
        self.resumed_version = Gauge("rpcps_server_resumed_from_version", "Model version of the checkpoint resumed from (-1: none).", registry=r)
        self.resumed_version.set(-1)
        self.checkpoint_seconds = Histogram(
            "rpcps_checkpoint_duration_seconds", "Time to write one checkpoint.", buckets=_LATENCY_BUCKETS + (30.0, 60.0), registry=r
        )
        self.checkpoint_bytes = Gauge("rpcps_checkpoint_size_bytes", "Size of the newest checkpoint.", registry=r)
        self.checkpoint_failures = Counter("rpcps_checkpoint_failures", "Checkpoint writes that failed.", registry=r)
        self.checkpoint_last_success = Gauge(
            "rpcps_checkpoint_last_success_timestamp_seconds", "When the newest checkpoint was committed (0: never).", registry=r
        )
        self.checkpoint_version = Gauge("rpcps_checkpoint_last_version", "Model version in the newest checkpoint.", registry=r)

    def watch_workers(self, snapshot: Callable[[], Iterable[tuple[int, bool, float | None]]]) -> None:
        """Adds live-worker gauges computed at scrape time from (slot, live, last_push_monotonic)."""
        self.registry.register(_WorkerCollector(snapshot))


class _WorkerCollector(Collector):
    def __init__(self, snapshot: Callable[[], Iterable[tuple[int, bool, float | None]]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[GaugeMetricFamily]:
        now = time.monotonic()
        live = GaugeMetricFamily("rpcps_server_live_workers", "Workers registered and not known dead or departed.")
        age = GaugeMetricFamily(
            "rpcps_server_worker_last_push_age_seconds", "Seconds since each live worker slot's last push.", labels=["slot"]
        )
        count = 0
        for slot, is_live, last_push in self._snapshot():
            if not is_live:
                continue
            count += 1
            if last_push is not None:
                age.add_metric([str(slot)], now - last_push)
        live.add_metric([], count)
        yield live
        yield age
