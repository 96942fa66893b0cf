"""``rpcps store``: the group's coordinator, a process that hosts the rendezvous store and keeps the
member list true (``rpcps.transport.coordinator``), and nothing else.

Servers with standbys need it: a standby cannot take over from a primary that hosts the store every
join needs, so the store lives in a process of its own that holds no training state and does no
training work (the only reasons it dies are its host and an operator). It also serves the shards'
views on /metrics, so an alert can say which shard runs without a standby.

It is protected like every rpcps process (``rpc_policy.protect`` before it serves), demands the
job secret's proof before it drops a member (``--job-secret-file``), puts back what a stranger
changed in its store (``ps.store_guard``), and refuses to listen off loopback without
``--trust-network`` and a job secret (as ``rpcps ps`` does, ``ps.exposure``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from cli.config import StoreConfig
from ps.exposure import TP_IFNAME, Exposed
from ps.store_guard import StoreGuard
from rpcps import rpc_policy, transport
from rpcps.jobsecret import JobSecret
from rpcps.metrics_http import build_info, serve_metrics
from rpcps.transport import membership
from rpcps.transport.coordinator import Janitor

logger = logging.getLogger(__name__)

STORE_NAME = "store"
"""The coordinator's RPC name (rank 0)."""


class _GroupCollector(Collector):
    """Members and shard views, read from the store at scrape time."""

    def __init__(self, registry: transport.Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[GaugeMetricFamily]:
        members = GaugeMetricFamily("rpcps_store_members", "Processes in the RPC group (servers, workers, this one).")
        epoch = GaugeMetricFamily("rpcps_store_view_epoch", "Each shard's view epoch (grows by one per failover).", labels=["shard"])
        standby = GaugeMetricFamily(
            "rpcps_store_view_standby", "1 when the shard's view names an in-sync standby, else 0.", labels=["shard"]
        )
        try:
            members.add_metric([], len(transport.membership.store_members()))
            for shard in range(self._registry.shard_count() or 0):
                record = self._registry.view(shard)
                if record is not None:
                    epoch.add_metric([str(shard)], record.view.epoch)
                    standby.add_metric([str(shard)], 0 if record.view.standby is None else 1)
        except (transport.StoreUnavailable, RuntimeError) as e:
            logger.warning("could not read the group for /metrics: %s", e)
        yield members
        yield epoch
        yield standby


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
    check_exposure(config, os.environ)
    secret = JobSecret.from_file(config.transport.job_secret_file) if config.transport.job_secret_file else None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    metrics = CollectorRegistry()
    build_info(metrics, "store", {"listen": str(config.listen)})
    removed = Counter("rpcps_store_members_removed", "Members found dead or hung and removed from the RPC group.", registry=metrics)
    repairs = Counter(
        "rpcps_store_repairs",
        "Changes a stranger made to the group's store (member list, addresses, rank counter) that the coordinator put back.",
        ["what"], registry=metrics,
    )
    for what in membership.REPAIR_KINDS:
        repairs.labels(what)
    refused = rpc_policy.refusal_counter(metrics)
    http, _ = serve_metrics(metrics, config.process.metrics_addr, config.metrics_port)
    # The coordinator serves no worker API, but peers may still name it: the same allow-list applies.
    rpc_policy.protect(on_refusal=rpc_policy.counting(refused), max_message_bytes=rpc_policy.message_limit(0, config.transport.max_message_mb))
    try:
        transport.serve(config.listen, STORE_NAME, config.transport, secret)
    except BaseException:
        http.shutdown()  # type: ignore[attr-defined]
        raise
    registry = transport.group_registry()
    metrics.register(_GroupCollector(registry))
    janitor = Janitor(registry, config.lease_s, on_removed=lambda _: removed.inc())
    janitor.start()
    guard = StoreGuard(repairs)  # right after serving: it remembers the store as it is now
    guard.start()
    logger.info("coordinator serving the group's store on %s (send SIGTERM or Ctrl-C to stop)", config.listen)
    try:
        stop.wait()
        logger.info("stopping: the group can no longer take joins or fail over")
    finally:
        guard.stop()
        janitor.stop()
        transport.shutdown()
        http.shutdown()  # type: ignore[attr-defined]
    return 0
