"""The server's Prometheus metrics. Every series is registered here and nowhere else."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ps.core.push_checks import RejectReason
from rpcps.rpc_policy import refusal_counter, store_refusal_counter
from rpcps.threads import BudgetGauges
from rpcps.transport.membership import REPAIR_KINDS

if TYPE_CHECKING:
    from ps.core.update_log import UpdateApplied
    from ps.sparse.table import TableStats

PING_FAILURES = ("unreachable", "unknown", "timeout", "error")
"""How a ping failed (a metric label; ``ps.lifecycle.reaper`` sorts them): the process is gone, this
agent does not know the name, no answer in time, anything else."""
REMOVALS = ("left", "dead", "gone")
"""Why a worker's registration ended (a metric label): it said it left, the reaper found it dead or
hung past its lease, the group's janitor dropped its process."""
REGISTRATION_REFUSALS = ("no_proof", "unknown_challenge", "bad_proof")
"""Why a registration was refused (a metric label; ``ps.api.registration_auth`` refuses them)."""

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class ServerStats:
    """The counts the run summary reports; kept by ``ServerMetrics`` beside the Prometheus series."""

    pushes_received: int = 0
    updates_applied: int = 0
    pushes_rejected: int = 0
    pushes_skipped: int = 0
    pushes_duplicate: int = 0
    pushes_stale: int = 0
    rounds: int = 0
    staleness_sum: int = 0
    max_staleness: int = 0


class ServerMetrics:
    """Every server series, and one ``count_*`` method per event that updates both the series and
    the summary's plain counts (thread-safe: counts only change under the GIL in these methods)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.stats = ServerStats()
        self._stats_lock = threading.Lock()
        r = self.registry = registry or CollectorRegistry()
        self.updates = Counter("rpcps_server_updates_applied", "Optimizer updates applied.", registry=r)
        self.pushes = Counter("rpcps_server_pushes_received", "Gradient pushes received.", registry=r)
        self.rejected = Counter(
            "rpcps_server_pushes_rejected", "Pushes refused, parameters untouched.", ["reason"], registry=r
        )
        for reason in RejectReason:
            self.rejected.labels(reason.value)
        self.duplicates = Counter(
            "rpcps_server_pushes_duplicate", "Retried pushes recognised and not applied twice.", registry=r
        )
        self.skipped = Counter("rpcps_server_pushes_skipped", "Non-finite pushes dropped (--on-nonfinite skip), and steps a worker skipped.", registry=r)
        self.pulls = Counter("rpcps_server_pulls_served", "Parameter pulls answered.", ["result"], registry=r)
        # The children, looked up once: every push of a small model answers with a pull.
        self.pulls_full, self.pulls_unchanged = self.pulls.labels("full"), self.pulls.labels("unchanged")
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
        self.prediction_ahead = Gauge(
            "rpcps_server_prediction_ahead_updates",
            "Updates ahead the newest pulled parameters were moved by weight prediction (--predict-ahead; 0: served as they are).",
            registry=r,
        )
        self.lr_scale = Gauge(
            "rpcps_server_lr_scale",
            "Factor the newest applied update scaled the learning rate by for its staleness (--staleness-lr; 1: the full rate).",
            registry=r,
        )
        self.lr_scale.set(1)
        self.delta_norm = Gauge(
            "rpcps_server_local_steps_delta_norm", "L2 norm of the newest parameter delta received (--mode local-steps; this shard's part).",
            registry=r,
        )
        self.version = Gauge("rpcps_server_model_version", "Updates applied to the model since it was created.", registry=r)
        self.in_flight = Gauge("rpcps_server_pushes_in_flight", "Pushes being validated or applied now.", registry=r)
        self.thread_budget = BudgetGauges(r, "server")
        self.paused = Gauge("rpcps_server_paused", "1 while the server holds updates (paused by the control plane).", registry=r)
        self.registrations = Counter("rpcps_server_worker_registrations", "Worker registrations (joins and rejoins).", registry=r)
        self.workers_reaped = Counter(
            "rpcps_server_workers_reaped", "Worker processes found dead and removed from the RPC group.", registry=r
        )
        self.workers_removed = _labelled_counter(
            r, "rpcps_server_workers_removed", "Worker registrations this server ended (as primary), by why; replicated to its standby.",
            "why", REMOVALS,
        )
        self.reaper_ping_failures = _labelled_counter(
            r, "rpcps_server_reaper_ping_failures", "Liveness pings of registered workers and the store's host that failed, by kind.",
            "kind", PING_FAILURES,
        )
        self.rpc_listener_lost = Counter(
            "rpcps_server_rpc_listener_lost", "Times the RPC listener was closed by a stray connection.", registry=r
        )
        self.rpc_refused = refusal_counter(r)
        self.store_refused = store_refusal_counter(r)
        self.registrations_refused = _labelled_counter(
            r, "rpcps_server_registrations_refused", "Worker registrations and model observations (the evaluator) refused for lack of a valid job-secret proof, by reason.",
            "reason", REGISTRATION_REFUSALS,
        )
        self.store_repairs = _labelled_counter(
            r, "rpcps_server_store_repairs",
            "Changes a stranger made to the group's store (member list, addresses, rank counter, this shard's view) that the "
            "server put back.",
            "what", (*REPAIR_KINDS, "view"),
        )
        self.crash_restarts = Gauge(
            "rpcps_server_crash_restarts",
            "Times this server's supervisor restarted its serving process after a crash (0 without --supervise).",
            registry=r,
        )
        self.resumes = Counter("rpcps_server_resumes", "Times this server resumed from a checkpoint.", registry=r)
        self.resumed_version = Gauge("rpcps_server_resumed_from_version", "Model version of the snapshot resumed from (-1: none).", registry=r)
        self.resumed_version.set(-1)
        self.slots_rolled_back = Gauge(
            "rpcps_server_slots_rolled_back",
            "Worker slots that finished but whose steps the server no longer holds all of (their checkpoint was lost).",
            registry=r,
        )
        self.checkpoint_seconds = Histogram(
            "rpcps_checkpoint_duration_seconds", "Time to write one snapshot.", buckets=_LATENCY_BUCKETS + (30.0, 60.0), registry=r
        )
        self.checkpoint_bytes = Gauge("rpcps_checkpoint_size_bytes", "Size of the newest snapshot.", registry=r)
        self.checkpoint_failures = Counter("rpcps_checkpoint_failures", "Checkpoint writes that failed.", registry=r)
        self.checkpoint_last_success = Gauge(
            "rpcps_checkpoint_last_success_timestamp_seconds", "When the newest snapshot was committed (0: never).", registry=r
        )
        self.checkpoint_version = Gauge("rpcps_checkpoint_last_version", "Model version in the newest snapshot.", registry=r)
        self.checkpoint_write_updates = Gauge(
            "rpcps_checkpoint_write_updates",
            "Updates applied while the newest snapshot was written (a crash just before a commit loses them too).",
            registry=r,
        )
        self.checkpoint_behind = Counter(
            "rpcps_checkpoint_behind",
            "Checkpoint writes during which more updates were applied than --checkpoint-every-updates.",
            registry=r,
        )

    def count_received(self) -> None:
        with self._stats_lock:
            self.stats.pushes_received += 1
        self.pushes.inc()

    def count_rejected(self, reason: RejectReason) -> None:
        with self._stats_lock:
            self.stats.pushes_rejected += 1
        self.rejected.labels(reason.value).inc()

    def count_duplicate(self) -> None:
        with self._stats_lock:
            self.stats.pushes_duplicate += 1
        self.duplicates.inc()

    def count_skipped(self) -> None:
        with self._stats_lock:
            self.stats.pushes_skipped += 1
        self.skipped.inc()

    def count_stale(self) -> None:
        with self._stats_lock:
            self.stats.pushes_stale += 1
        self.rejected.labels(RejectReason.STALE.value).inc()

    def count_round(self) -> None:
        with self._stats_lock:
            self.stats.rounds += 1

    def count_applied(self, event: UpdateApplied) -> None:
        """An ``on_applied`` listener: one update and the staleness of what it applied."""
        with self._stats_lock:
            s = self.stats
            s.updates_applied += 1
            for _, _, staleness in event.applied:
                s.staleness_sum += staleness
                s.max_staleness = max(s.max_staleness, staleness)
        self.updates.inc()
        self.version.set(event.version)
        self.step_seconds.observe(event.step_seconds)
        self.grad_bytes.inc(event.grad_bytes)
        for _, _, staleness in event.applied:
            self.staleness.observe(staleness)

    def watch_sparse(self, stats: Callable[[], dict[str, TableStats]]) -> None:
        """Registers the sparse tables' series: their snapshots' and, read at scrape time, every table's
        counters (``ps.sparse.store.SparseStore.stats``). Only a server with sparse tables calls it, so a
        dense job's /metrics has no ``rpcps_sparse_*`` family."""
        r = self.registry
        self.sparse_capture_seconds = Histogram(
            "rpcps_sparse_checkpoint_pause_seconds",
            "Time a snapshot held the server's lock to copy the sparse tables (updates wait that long): the touched rows "
            "of a delta, or the close of a full prepared off the request path.",
            buckets=_LATENCY_BUCKETS + (30.0, 60.0),
            registry=r,
        )
        self.sparse_full_snapshots = Counter(
            "rpcps_sparse_full_snapshots",
            "Snapshots holding a full copy of the sparse tables, by how it was copied: sliced (off the request path) or "
            "locked (under the server's lock: the first snapshot, or the one after a lost delta).",
            ["capture"],
            registry=r,
        )
        for capture in ("sliced", "locked"):
            self.sparse_full_snapshots.labels(capture)
        self.sparse_chain_deltas = Gauge(
            "rpcps_sparse_checkpoint_chain_deltas",
            "Deltas on top of the full in the newest snapshot's sparse chain (a restore reads them all).",
            registry=r,
        )
        r.register(_SparseCollector(stats))

    def watch_workers(self, snapshot: Callable[[], Iterable[tuple[int, bool, float | None]]]) -> None:
        """Adds live-worker gauges computed at scrape time from (slot, live, seconds since its last push)."""
        self.registry.register(_WorkerCollector(snapshot))


def _labelled_counter(registry: CollectorRegistry, name: str, doc: str, label: str, values: Iterable[str]) -> Counter:
    """A counter with one label whose series all exist from the start (at 0, so rate() sees the first event)."""
    counter = Counter(name, doc, [label], registry=registry)
    for value in values:
        counter.labels(value)
    return counter


class _WorkerCollector(Collector):
    def __init__(self, snapshot: Callable[[], Iterable[tuple[int, bool, float | None]]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[GaugeMetricFamily]:
        live = GaugeMetricFamily("rpcps_server_live_workers", "Workers registered and not known dead or departed.")
        age = GaugeMetricFamily(
            "rpcps_server_worker_last_push_age_seconds", "Seconds since each live worker slot's last push.", labels=["slot"]
        )
        count = 0
        for slot, is_live, last_push_age in self._snapshot():
            if not is_live:
                continue
            count += 1
            if last_push_age is not None:
                age.add_metric([str(slot)], last_push_age)
        live.add_metric([], count)
        yield live
        yield age


_SPARSE_GAUGES = (
    ("rows", "rows", "Live rows of each sparse table on this server."),
    ("resident_bytes", "resident_bytes", "Bytes of each sparse table: index, rows with optimizer state, metadata, admission filter."),
    ("index_bytes", "index_bytes", "Bytes of each sparse table's id -> row index."),
)
_SPARSE_COUNTERS = (
    ("admitted_total", "admitted_ids", "Ids given a row by admission."),
    ("filtered_total", "filtered_ids", "Pulled ids refused by admission (they read zeros)."),
    ("dropped_gradients_total", "dropped_gradients", "Gradients of ids without a row (not admitted, or evicted since their pull), dropped."),
    ("evicted_total", "evicted_rows", "Rows evicted (TTL or row cap; a standby counts its primary's decisions as it applies them)."),
    ("pulled_rows_total", "pulled_rows", "Rows sent to workers by pulls."),
    ("pushed_rows_total", "pushed_rows", "Rows updated by pushes."),
    ("push_lookups_reused_total", "push_lookups_reused", "Pushes that took their rows from a remembered pull of the same ids (only ids that pull left without a row are looked up again)."),
    ("push_lookups_fallback_total", "push_lookups_fallback", "Pushes that looked all their ids up in the index: no remembered pull of exactly those ids."),
    ("delta_bytes_total", "delta_bytes", "Bytes of the checkpoint deltas captured (touched rows with their state, and tombstones)."),
)


class _SparseCollector(Collector):
    """Per-table series (label ``table``: the model's table names, a fixed set) read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, TableStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        for field, name, doc in _SPARSE_GAUGES:
            gauge = GaugeMetricFamily(f"rpcps_sparse_{name}", doc, labels=["table"])
            for table, s in stats.items():
                gauge.add_metric([table], getattr(s, field))
            yield gauge
        for field, name, doc in _SPARSE_COUNTERS:
            counter = CounterMetricFamily(f"rpcps_sparse_{name}", doc, labels=["table"])
            for table, s in stats.items():
                counter.add_metric([table], getattr(s, field))
            yield counter
