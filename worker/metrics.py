"""The worker's Prometheus metrics. Every series is registered here and nowhere else."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rpcps.rpc_policy import refusal_counter, store_refusal_counter
from rpcps.threads import BudgetGauges

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.steps = Counter("rpcps_worker_steps", "Training steps computed.", registry=r)
        self.samples = Counter("rpcps_worker_samples", "Training samples consumed.", registry=r)
        self.loss = Gauge("rpcps_worker_loss", "Loss of the latest batch.", registry=r)
        self.compute_seconds = Counter("rpcps_worker_compute_seconds", "Time spent computing (forward, backward, staging).", registry=r)
        self.comm_seconds = Counter(
            "rpcps_worker_communication_blocked_seconds", "Time the training loop was blocked on the network.", registry=r
        )
        self.comm_fraction = Gauge(
            "rpcps_worker_communication_fraction", "Blocked-on-network share of step time, since start.", registry=r
        )
        self.step_seconds = Histogram("rpcps_worker_step_seconds", "Wall time of one step.", buckets=_LATENCY_BUCKETS, registry=r)
        self.push_seconds = Histogram(
            "rpcps_worker_push_latency_seconds", "Time from sending a push to its reply.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.pull_seconds = Histogram(
            "rpcps_worker_pull_latency_seconds", "Time from sending a pull to its reply.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.in_flight = Gauge("rpcps_worker_pushes_in_flight", "Pushes sent and not yet answered.", registry=r)
        self.pushes = Counter("rpcps_worker_pushes", "Pushes answered, by outcome.", ["result"], registry=r)
        self.push_results = {result: self.pushes.labels(result) for result in ("applied", "duplicate", "skipped", "stale", "rejected")}
        """The children by outcome, looked up once (one is bumped every step)."""
        self.retries = Counter("rpcps_worker_retries", "Calls retried after a timeout.", registry=r)
        self.reconnects = Gauge("rpcps_worker_reconnects", "Times this worker restarted itself to reach a new server.", registry=r)
        self.failovers = Counter(
            "rpcps_worker_failovers", "Times a shard's primary failed and this worker switched to its promoted standby.", registry=r
        )
        self.failover_seconds = Gauge(
            "rpcps_worker_failover_seconds", "The newest failover: from the failed call to the new primary's reference.", registry=r
        )
        self.pushes_resent = Counter(
            "rpcps_worker_pushes_resent", "Unacknowledged pushes sent again to a shard's new primary after a failover.", registry=r
        )
        self.pushes_lost = Counter(
            "rpcps_worker_pushes_lost",
            "Acknowledged pushes a failover lost (asynchronous replication: the new primary's version is below theirs); "
            "each is recomputed and sent again.",
            registry=r,
        )
        self.steps_skipped = Counter(
            "rpcps_worker_steps_skipped", "Steps the training loop ended with skip() (recorded, nothing applied).", registry=r
        )
        self.replays = Counter(
            "rpcps_worker_replays",
            "Steps handed to the training loop again (a push refused as stale, or an acknowledged one lost in a failover).",
            registry=r,
        )
        self.model_version = Gauge("rpcps_worker_model_version", "Model version the worker computes on.", registry=r)
        self.device_memory = Gauge("rpcps_worker_device_memory_bytes", "GPU memory allocated now (0 on CPU).", registry=r)
        self.device_memory_peak = Gauge("rpcps_worker_device_memory_peak_bytes", "Peak GPU memory allocated (0 on CPU).", registry=r)
        self.thread_budget = BudgetGauges(r, "worker")
        self.last_step = Gauge("rpcps_worker_last_step_timestamp_seconds", "When the latest step finished.", registry=r)
        self.rpc_refused = refusal_counter(r)
        self.store_refused = store_refusal_counter(r)

        self.total_compute_s = 0.0
        self.total_comm_s = 0.0

    def watch_sparse(self) -> None:
        """Registers the sparse lookup series: only a worker whose model has sparse tables calls it, so a dense
        job's /metrics has no family that cannot move. Once per process (a second call changes nothing)."""
        if hasattr(self, "sparse_ids"):
            return
        self.sparse_ids = Counter(
            "rpcps_worker_sparse_ids", "Ids looked up in sparse embedding tables by training steps (all tables).",
            registry=self.registry,
        )
        self.sparse_unique_ids = Counter(
            "rpcps_worker_sparse_unique_ids",
            "Distinct ids those lookups pulled (deduplicated per table and step); unique / looked up is the unique-id ratio.",
            registry=self.registry,
        )

    def add_time(self, compute_s: float, comm_s: float) -> None:
        self.compute_seconds.inc(compute_s)
        self.comm_seconds.inc(comm_s)
        self.total_compute_s += compute_s
        self.total_comm_s += comm_s
        total = self.total_compute_s + self.total_comm_s
        if total > 0:
            self.comm_fraction.set(self.total_comm_s / total)
