"""Serves a prometheus_client registry on /metrics for either role."""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, Info, start_http_server

from rpcps import __version__

logger = logging.getLogger(__name__)


def build_info(registry: CollectorRegistry, role: str, config: dict[str, str]) -> None:
    info = Info("rpcps_build", "Version and resolved configuration of this process.", registry=registry)
    info.info({"version": __version__, "role": role, **{k: str(v)[:200] for k, v in config.items()}})
    start = Gauge("rpcps_process_start_timestamp_seconds", "When this rpcps process started.", registry=registry)
    start.set_to_current_time()


def serve_metrics(registry: CollectorRegistry, addr: str, port: int) -> tuple[WSGIServer, int]:
    """Starts the /metrics HTTP server in a daemon thread; returns (server, bound port).

    Port 0 picks a free port, which is logged so a person can find it.
    """
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        raise OSError(f"cannot serve metrics on {addr}:{port}: {e.strerror or e}; choose another --metrics-port (0 picks a free one)") from e
    bound = server.server_address[1]
    logger.info("metrics on http://%s:%d/metrics", addr, bound)
    return server, bound
