"""``rpcps store``: the group's coordinator, a process that hosts the rendezvous store and keeps the
member list true (``rpcps.transport.coordinator``), and nothing else.

Servers with standbys need it: a standby cannot take over from a primary that hosts the store every
join needs, so the store lives in a process of its own that holds no training state and does no
training work (the only reasons it dies are its host and an operator). It also serves the shards'
views on /metrics, so an alert can say which shard runs without a standby.

It keeps everything in memory: started again on the same port after a crash (by its supervisor), it
serves an empty store under a new incarnation (``INCARNATION_KEY``), and the live members write back
what it held (``rpcps.transport.rebuild``); its janitor adopts them into the new group as they do.

It is protected like every rpcps process (``rpc_policy.protect`` before it serves), demands the
job secret's proof before it drops a member (``--job-secret-file``), puts back what a stranger
changed in its store (``ps.lifecycle.store_guard``), and refuses to listen off loopback without
``--trust-network`` and a job secret (as ``rpcps ps`` does, ``ps.lifecycle.exposure``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from cli.config import StoreConfig
from ps.lifecycle.exposure import TP_IFNAME, Exposed
from ps.lifecycle.store_guard import StoreGuard
from rpcps import memory, rpc_policy, signals, threads, transport
from rpcps.jobsecret import JobSecret
from rpcps.metrics_http import build_info, serve_metrics
from rpcps.summary import run_summary, write_summary
from rpcps.transport import membership
from rpcps.transport.coordinator import Janitor
from rpcps.transport.rebuild import REBUILD_GRACE_S, SNAPSHOT_CLAIM_GRACE_S

logger = logging.getLogger(__name__)

STORE_NAME = transport.COORDINATOR_NAME
"""The coordinator's RPC name (rank 0)."""


GroupReading = tuple[int, dict[int, tuple[int, bool]]]
"""(processes in the group, {shard: (its view's epoch, whether the view names an in-sync standby)})."""


def read_group(registry: transport.Registry) -> GroupReading:
    """The group as the store holds it now; raises StoreUnavailable or RuntimeError when it cannot be read."""
    views = {}
    for shard in range(registry.shard_count() or 0):
        record = registry.view(shard)
        if record is not None:
            views[shard] = (record.view.epoch, record.view.standby is not None)
    return len(transport.membership.store_members()), views


class _GroupCollector(Collector):
    """Members and shard views, read at scrape time (from the store, through ``read_group``)."""

    def __init__(self, read: Callable[[], GroupReading]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        members = GaugeMetricFamily("rpcps_store_members", "Processes in the RPC group (servers, workers, this one).")
        epoch = GaugeMetricFamily("rpcps_store_view_epoch", "Each shard's view epoch (grows by one per failover).", labels=["shard"])
        standby = GaugeMetricFamily(
            "rpcps_store_view_standby", "1 when the shard's view names an in-sync standby, else 0.", labels=["shard"]
        )
        try:
            count, views = self._read()
        except (transport.StoreUnavailable, RuntimeError) as e:
            logger.warning("could not read the group for /metrics: %s", e)
        else:
            members.add_metric([], count)
            for shard, (view_epoch, has_standby) in sorted(views.items()):
                epoch.add_metric([str(shard)], view_epoch)
                standby.add_metric([str(shard)], int(has_standby))
        yield members
        yield epoch
        yield standby


@dataclass(frozen=True)
class CoordinatorMetrics:
    """Every series of the coordinator's /metrics (docs/METRICS.md), registered here and nowhere else."""

    registry: CollectorRegistry
    removed: Counter
    repairs: Counter
    refused: Counter
    store_refused: Counter
    thread_budget_problem: Callable[[str], None]
    """Counts a problem of the thread budget (rpcps.threads.problem_counter)."""

    @classmethod
    def create(cls, listen: str) -> CoordinatorMetrics:
        registry = CollectorRegistry()
        build_info(registry, "store", {"listen": listen})
        removed = Counter(
            "rpcps_store_members_removed", "Members found dead or hung and removed from the RPC group.", registry=registry
        )
        repairs = Counter(
            "rpcps_store_repairs",
            "Changes a stranger made to the group's store (member list, addresses, rank counter) that the coordinator put back.",
            ["what"], registry=registry,
        )
        for what in membership.REPAIR_KINDS:
            repairs.labels(what)
        return cls(
            registry=registry, removed=removed, repairs=repairs, refused=rpc_policy.refusal_counter(registry),
            store_refused=rpc_policy.store_refusal_counter(registry),
            thread_budget_problem=threads.problem_counter(registry, "store"),
        )

    def watch_group(self, read: Callable[[], GroupReading]) -> None:
        """Adds the member and view gauges, computed at scrape time by ``read``."""
        self.registry.register(_GroupCollector(read))

    def totals(self) -> dict[str, Any]:
        """The counters' values for the run summary (read from the counters themselves: the registry would
        also read the group from the store, which may be gone by then)."""
        return {
            "members_removed": sum(_counts(self.removed).values()),
            "store_repairs": _counts(self.repairs),
            "refused": _counts(self.refused),
        }


def _counts(counter: Counter) -> dict[str, int]:
    """A counter's totals by the value of its one label (a single entry keyed "" when it has none)."""
    return {
        next(iter(sample.labels.values()), ""): int(sample.value)
        for family in counter.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def store_summary(metrics: CoordinatorMetrics, wall_seconds: float) -> dict[str, Any]:
    """The coordinator's ``--summary-json``: the core keys every role writes (it trains nothing, so no
    losses and zero steps and updates), plus what it did to the group."""
    return run_summary(
        "store",
        initial_loss=None,
        final_loss=None,
        steps=0,
        updates_applied=0,
        pushes_rejected=0,
        staleness_sum=0.0,
        wall_seconds=wall_seconds,
        **metrics.totals(),
    )


def check_exposure(config: StoreConfig, environ: Mapping[str, str]) -> None:
    """Raises Exposed when the store's RPC ports leave this machine without their protection."""
    if config.listen.is_loopback and environ.get(TP_IFNAME, "") in ("", "lo"):
        return
    why = f"the store address {config.listen} is not a loopback address (or {TP_IFNAME} names another interface)"
    if not config.trust_network:
        raise Exposed(
            f"{why}: torch RPC has no authentication or encryption, so that network must admit only this job's "
            "processes; say it does with --trust-network on (docs/SECURITY.md)"
        )
    if config.transport.job_secret_file is None:
        raise Exposed(
            f"{why}: without --job-secret-file anyone who reaches it could drop members from the group; give every "
            "process of the job the same secret file (docs/SECURITY.md)"
        )


def run_store(config: StoreConfig) -> int:
    started = time.monotonic()
    memory.tune_malloc()  # before any thread allocates (rpcps.memory)
    metrics = CoordinatorMetrics.create(str(config.listen))
    # It computes little, but it shares the host's cores like every role: the others count it (light).
    threads.HostBudget("store", config.process.threads, directory=config.process.host_dir, on_problem=metrics.thread_budget_problem).start()
    check_exposure(config, os.environ)
    secret = JobSecret.from_file(config.transport.job_secret_file) if config.transport.job_secret_file else None
    stop = threading.Event()
    signals.on_signals(lambda _signum: stop.set())
    http, _ = serve_metrics(metrics.registry, config.process.metrics_addr, config.metrics_port)
    # The coordinator serves no worker API, but peers may still name it: the same allow-list applies.
    rpc_policy.protect(
        on_refusal=rpc_policy.counting(metrics.refused), max_message_bytes=rpc_policy.message_limit(0, config.transport.max_message_mb)
    )
    try:
        # A new incarnation per start: the members see the store restarted empty and write their part
        # back (rpcps.transport.rebuild); a start cannot tell itself from a restart, so every start
        # holds ranks and snapshot claims for the members that may be live.
        transport.serve(config.listen, STORE_NAME, config.transport, secret, ranks_after_s=REBUILD_GRACE_S,
                        incarnation=f"{time.time_ns()}-{os.getpid()}", hold_snapshot_claims_s=SNAPSHOT_CLAIM_GRACE_S)
    except BaseException:
        http.shutdown()
        raise
    registry = transport.group_registry()
    registry.authenticate(  # before the janitor writes a dead record
        secret, STORE_NAME, trust_unsigned=config.listen.is_loopback, on_refused=rpc_policy.counting_store_refusals(metrics.store_refused)
    )
    metrics.watch_group(lambda: read_group(registry))
    janitor = Janitor(registry, config.lease_s, on_removed=lambda _: metrics.removed.inc())
    janitor.start()
    guard = StoreGuard(metrics.repairs)  # right after serving: it remembers the store as it is now
    guard.start()
    # Long-lived like the server, workers and evaluator, so the same --malloc-trim-s applies; its heap
    # holds no tensors, so a trim walks little.
    trimmer = memory.start_trimming(config.process.malloc_trim_s)
    logger.info("coordinator serving the group's store on %s (send SIGTERM or Ctrl-C to stop)", config.listen)
    try:
        stop.wait()
        logger.info("stopping: the group can no longer take joins or fail over")
    finally:
        if trimmer is not None:
            trimmer.stop()
        guard.stop()
        janitor.stop()
        transport.shutdown()
        http.shutdown()
    write_summary(config.process.summary_json, store_summary(metrics, time.monotonic() - started))
    return 0
