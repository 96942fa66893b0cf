"""Reads a Prometheus /metrics endpoint into plain numbers (``local``'s progress, tools and tests)."""

from __future__ import annotations

import http.client
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def metrics_text(port: int, host: str = "127.0.0.1", timeout: float = 2.0) -> str:
    """The exposition text of ``http://host:port/metrics``. Raises OSError when it does not answer,
    or when its answer is cut off (the process died while sending it)."""
    url = f"http://{host}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.read().decode()
    except http.client.HTTPException as e:  # IncompleteRead, BadStatusLine: not OSErrors
        raise OSError(f"{url} answered with a broken reply: {e!r}") from e


def scrape_metrics(port: int, host: str = "127.0.0.1", timeout: float = 2.0) -> dict[str, float]:
    """Reads ``http://host:port/metrics`` into {sample: value}.

    Unlabelled samples are keyed by their name (``rpcps_server_updates_applied_total``), labelled ones
    by name and sorted labels (``rpcps_server_pushes_rejected_total{reason="shape"}``).

    Raises:
        OSError: the endpoint did not answer.
    """
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text(port, host, timeout)):
        for sample in family.samples:
            key = sample.name
            if sample.labels:
                key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())) + "}"
            values[key] = sample.value
    return values


def try_scrape(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """``scrape_metrics``, or {} while the endpoint does not answer (a child still starting, or gone)."""
    try:
        return scrape_metrics(port, host)
    except OSError:
        return {}
