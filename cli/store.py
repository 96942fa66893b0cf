"""``rpcps store``: the group's coordinator, a process that hosts the rendezvous store and keeps the
member list true (``rpcps.transport.coordinator``), and nothing else.

Servers with standbys need it: a standby cannot take over from a primary that hosts the store every
join needs, so the store lives in a process of its own that holds no training state and does no
training work (the only reasons it dies are its host and an operator). It also serves the shards'
views on /metrics, so an alert can say which shard runs without a standby.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from cli.config import StoreConfig
from rpcps import transport
from rpcps.metrics_http import build_info, serve_metrics
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


def run_store(config: StoreConfig) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    metrics = CollectorRegistry()
    build_info(metrics, "store", {"listen": str(config.listen)})
    removed = Counter("rpcps_store_members_removed", "Members found dead or hung and removed from the RPC group.", registry=metrics)
    http, _ = serve_metrics(metrics, config.process.metrics_addr, config.metrics_port)
    try:
        transport.serve(config.listen, STORE_NAME, config.transport)
    except BaseException:
        http.shutdown()  # type: ignore[attr-defined]
        raise
    registry = transport.group_registry()
    metrics.register(_GroupCollector(registry))
    janitor = Janitor(registry, config.lease_s, on_removed=lambda _: removed.inc())
    janitor.start()
    logger.info("coordinator serving the group's store on %s (send SIGTERM or Ctrl-C to stop)", config.listen)
    try:
        stop.wait()
        logger.info("stopping: the group can no longer take joins or fail over")
    finally:
        janitor.stop()
        transport.shutdown()
        http.shutdown()  # type: ignore[attr-defined]
    return 0
