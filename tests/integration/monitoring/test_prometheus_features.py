"""The dashboard rows and alerts of the two optional features, on live data: a real Prometheus with
the shipped config and rules scrapes ``rpcps local --replicas 2`` (coordinator, primary, standby)
and then a run of the CTR task with sparse settings. tests/integration/monitoring/test_prometheus.py covers the
rest of the dashboard on a plain run, where these rows are empty by design.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    from monitoring_support import DEPLOY, REPO, LocalRun, Prometheus, panels_in_row, scrape_config_for, wait_for
except ImportError:  # tests/ laid out as a package
    from .monitoring_support import DEPLOY, REPO, LocalRun, Prometheus, panels_in_row, scrape_config_for, wait_for

PROMETHEUS = shutil.which("prometheus")
STEPS = 20000  # far more than the tests need: each stops its run (a leaked run still ends by itself)
CTR = ["--model", "rpcps.examples.ctr:dlrm_model", "--data", "rpcps.examples.ctr:ctr_data_small", "--loss", "rpcps.examples.ctr:bce_loss"]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus binary (Debian: apt-get install prometheus)"),
]


@contextlib.contextmanager
def _monitored(tmp_path: Path, extra: list[str]) -> Iterator[tuple[LocalRun, Prometheus]]:
    pytest.importorskip("yaml", reason="needs PyYAML to read deploy/prometheus/prometheus.yml")
    assert PROMETHEUS is not None
    with LocalRun(tmp_path / "run", workers=2, steps=STEPS, extra=extra) as run:
        run.targets()  # the config points at this file; wait until the launcher wrote it
        with Prometheus(PROMETHEUS, scrape_config_for(run.targets_file), tmp_path / "prometheus") as prom:
            yield run, prom


def _row_queries(row_prefix: str) -> list:
    sys.path.insert(0, str(REPO / "tools"))  # a script in the checkout, not an installed module
    import check_dashboard as checker

    path = REPO / "deploy" / "grafana" / "rpcps-dashboard.json"
    dashboard = json.loads(path.read_text())
    queries, problems = checker.dashboard_queries(path, dashboard)
    assert problems == []
    titles = panels_in_row(dashboard, row_prefix)
    assert len(titles) >= 6, f"the dashboard's {row_prefix!r} row is gone or renamed: update this test"
    return [q for q in queries if any(t in q.where for t in titles) or (row_prefix == "Replication" and "$store_job" in q.where)]


def _every_query_returns_data(run: LocalRun, prom: Prometheus, row_prefix: str) -> None:
    queries = _row_queries(row_prefix)
    wait_for(lambda: [q.where for q in queries if not prom.query(q.expr)], lambda empty: empty == [], 90,
             f"every query of the {row_prefix!r} row to return data", run.diagnostics)


def _alerts_evaluate_cleanly_and_stay_quiet(prom: Prometheus, group: str) -> None:
    import yaml

    rules = next(g for g in yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"] if g["name"] == group)["rules"]
    evaluated = wait_for(
        lambda: {r["name"]: r for g in prom.api("rules")["groups"] if g["name"] == group for r in g["rules"]
                 if not r["lastEvaluation"].startswith("0001-")},
        lambda found: set(found) == {r["alert"] for r in rules}, 30, f"every alert of group {group} evaluated",
    )
    assert {name: r.get("lastError") for name, r in evaluated.items() if r["health"] != "ok"} == {}
    assert [a for a in prom.api("alerts")["alerts"] if a["state"] == "firing"] == []


@pytest.mark.timeout(240)
def test_replication_row_and_alerts_on_a_primary_its_standby_and_the_coordinator(tmp_path: Path) -> None:
    with _monitored(tmp_path, ["--replicas", "2"]) as (run, prom):
        wait_for(
            lambda: sorted((t["labels"]["job"], t["labels"]["child"], t["health"]) for t in prom.active_targets()
                           if t["labels"]["job"] in ("rpcps-ps", "rpcps-store")),
            lambda t: t == [("rpcps-ps", "ps", "up"), ("rpcps-ps", "ps_b", "up"), ("rpcps-store", "store", "up")],
            60, "both servers in job rpcps-ps and the coordinator in rpcps-store, all up", run.diagnostics,
        )
        wait_for(lambda: prom.query('rpcps_store_view_standby{job="rpcps-store"}'), lambda r: [v for _, v in r] == [1.0], 60,
                 "the coordinator to report shard 0's standby in sync", run.diagnostics)
        _every_query_returns_data(run, prom, "Replication")
        _alerts_evaluate_cleanly_and_stay_quiet(prom, "rpcps-replication")


@pytest.mark.timeout(240)
def test_sparse_row_and_alerts_on_the_ctr_task(tmp_path: Path) -> None:
    # Admission and a short TTL make the filtered and evicted counters move; a snapshot every second
    # feeds the checkpoint-pause histogram.
    extra = [*CTR, "--sparse-admit-count", "2", "--sparse-ttl", "50", "--sparse-evict-every-s", "0.2",
             "--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every-seconds", "1"]
    with _monitored(tmp_path, extra) as (run, prom):
        _every_query_returns_data(run, prom, "Sparse tables")
        _alerts_evaluate_cleanly_and_stay_quiet(prom, "rpcps-sparse")
