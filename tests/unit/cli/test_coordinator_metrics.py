"""cli/store.py's /metrics: the coordinator's series and the shard views it reads at scrape time."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from cli.store import CoordinatorMetrics, store_summary
from rpcps import transport


def _scrape(metrics: CoordinatorMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_each_shard_view_is_a_series_with_its_epoch_and_standby() -> None:
    metrics = CoordinatorMetrics.create(listen="127.0.0.1:29400")
    metrics.watch_group(lambda: (5, {0: (3, True), 1: (1, False)}))
    text = _scrape(metrics)
    assert "rpcps_store_members 5.0" in text
    assert 'rpcps_store_view_epoch{shard="0"} 3.0' in text and 'rpcps_store_view_epoch{shard="1"} 1.0' in text
    assert 'rpcps_store_view_standby{shard="0"} 1.0' in text and 'rpcps_store_view_standby{shard="1"} 0.0' in text
    assert 'rpcps_store_repairs_total{what="members"} 0.0' in text, "every repair kind is exported from the start"


def test_an_unreadable_store_leaves_the_gauges_empty_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    def unreadable() -> tuple[int, dict[int, tuple[int, bool]]]:
        raise transport.StoreUnavailable("the store at 127.0.0.1:29400 does not answer")

    metrics = CoordinatorMetrics.create(listen="127.0.0.1:29400")
    metrics.watch_group(unreadable)
    with caplog.at_level(logging.WARNING, logger="cli.store"):
        text = _scrape(metrics)
    assert "rpcps_store_view_standby{" not in text and "\nrpcps_store_members " not in text
    assert "could not read the group for /metrics" in caplog.text


def test_the_summary_has_the_core_keys_and_what_the_counters_say() -> None:
    metrics = CoordinatorMetrics.create(listen="127.0.0.1:29400")
    metrics.watch_group(must_not_be_read)  # the summary must not read the store: it may be gone at exit
    metrics.removed.inc(2)
    metrics.repairs.labels("address").inc()
    summary = store_summary(metrics, wall_seconds=4.0)
    assert summary["role"] == "store" and summary["wall_seconds"] == 4.0
    assert summary["steps"] == summary["updates_applied"] == 0 and summary["final_loss"] is None
    assert summary["members_removed"] == 2
    assert summary["store_repairs"] == {"members": 0, "address": 1, "rank_counter": 0}
    assert set(summary["refused"]) == set(transport.REFUSAL_KINDS) and not any(summary["refused"].values())


def must_not_be_read() -> tuple[int, dict[int, tuple[int, bool]]]:
    raise AssertionError("the summary read the group from the store")
