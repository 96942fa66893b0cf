"""A real Prometheus scrapes a real ``rpcps local`` run through the shipped config and alert rules.

One run and one Prometheus serve the whole module (each costs seconds of CPU). The tests run in
file order; the last one stops the run to see the server-down alert, so keep it last.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

try:
    from monitoring_support import (
        DEPLOY,
        REPO,
        LocalRun,
        Prometheus,
        checkpoint_flags,
        panels_in_row,
        scrape_config_for,
        wait_for,
    )
except ImportError:  # tests/ laid out as a package
    from .monitoring_support import (
        DEPLOY,
        REPO,
        LocalRun,
        Prometheus,
        checkpoint_flags,
        panels_in_row,
        scrape_config_for,
        wait_for,
    )

PROMETHEUS = shutil.which("prometheus")
# Far more steps than the tests need (a worker does ~100 steps/s here): the last test stops the
# run, and a run leaked by a killed pytest still ends by itself.
STEPS = 20000

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus binary (Debian: apt-get install prometheus)"),
]


@dataclass(frozen=True, kw_only=True)
class Monitored:
    run: LocalRun
    prom: Prometheus
    checkpointing: bool


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitored]:
    pytest.importorskip("yaml", reason="needs PyYAML to read deploy/prometheus/prometheus.yml")
    assert PROMETHEUS is not None
    tmp = tmp_path_factory.mktemp("prometheus")
    run_dir = tmp / "run"
    flags = checkpoint_flags(run_dir)
    # A sidecar evaluator scores the built-in task's held-out set every second (its panels need data).
    evaluator = ["--eval-data", "rpcps.tasks:teacher_student_held_out", "--every-seconds", "1"]
    with LocalRun(run_dir, workers=2, steps=STEPS, extra=[*(flags or []), *evaluator]) as run:
        run.targets()  # the config points at this file; wait until the launcher wrote it
        with Prometheus(PROMETHEUS, scrape_config_for(run.targets_file), tmp / "prometheus") as prom:
            yield Monitored(run=run, prom=prom, checkpointing=flags is not None)


def scalar(m: Monitored, expr: str) -> float | None:
    """The value of an expression that selects at most one series; None while it selects none."""
    result = m.prom.query(expr)
    assert len(result) <= 1, f"{expr!r} selected {len(result)} series, expected at most one: {result}"
    return result[0][1] if result else None


def test_targets_are_scraped_and_routed_to_jobs_by_role(monitored: Monitored) -> None:
    def targets() -> list[tuple[str, str, str]]:
        return sorted((t["labels"]["job"], t["labels"]["child"], t["health"]) for t in monitored.prom.active_targets())

    wait_for(
        targets,
        lambda t: t == [
            ("rpcps-evaluator", "evaluator", "up"), ("rpcps-ps", "ps", "up"), ("rpcps-worker", "worker0", "up"),
            ("rpcps-worker", "worker1", "up"),
        ],
        60, "the server in job rpcps-ps, both workers in rpcps-worker, the evaluator in rpcps-evaluator, all up",
        monitored.run.diagnostics,
    )


def test_updates_applied_increase_between_queries(monitored: Monitored) -> None:
    wait_for_updates_to_grow(monitored)


def wait_for_updates_to_grow(monitored: Monitored) -> None:
    expr = 'rpcps_server_updates_applied_total{job="rpcps-ps"}'
    first = wait_for(lambda: scalar(monitored, expr), lambda v: v is not None and v > 0, 60,
                     f"{expr} > 0", monitored.run.diagnostics)
    assert first is not None
    wait_for(lambda: scalar(monitored, expr), lambda v: v is not None and v > first, 30,
             f"{expr} to grow past {first}", monitored.run.diagnostics)


def test_server_counts_two_live_workers(monitored: Monitored) -> None:
    expr = 'rpcps_server_live_workers{job="rpcps-ps"}'
    wait_for(lambda: scalar(monitored, expr), lambda v: v == 2, 60, f"{expr} == 2", monitored.run.diagnostics)


def test_worker_steps_are_scraped_from_both_workers(monitored: Monitored) -> None:
    def steps() -> dict[str, float]:
        return {labels["child"]: v for labels, v in monitored.prom.query('rpcps_worker_steps_total{job="rpcps-worker"}')}

    wait_for(steps, lambda s: set(s) == {"worker0", "worker1"} and min(s.values()) > 0, 60,
             "rpcps_worker_steps_total > 0 from worker0 and worker1", monitored.run.diagnostics)


def test_alert_rules_load_evaluate_cleanly_and_stay_quiet(monitored: Monitored) -> None:
    import yaml

    expected = {r["alert"] for g in yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"] for r in g["rules"]}

    def rules() -> dict[str, tuple[str, str]]:
        return {
            r["name"]: (r["health"], r.get("lastError", ""))
            for g in monitored.prom.api("rules")["groups"]
            for r in g["rules"]
            if not r["lastEvaluation"].startswith("0001-")  # evaluated at least once
        }

    evaluated = wait_for(rules, lambda r: set(r) == expected, 30, f"every alert in alerts.yml evaluated: {sorted(expected)}")
    assert {name: h for name, h in evaluated.items() if h[0] != "ok"} == {}
    # Evaluate once more after data has arrived (binary operators only fail on real series).
    wait_for_updates_to_grow(monitored)
    again = rules()
    assert {name: h for name, h in again.items() if h[0] != "ok"} == {}
    firing = [a for a in monitored.prom.api("alerts")["alerts"] if a["state"] == "firing"]
    assert firing == [], f"alerts firing on a healthy run: {firing}"


def test_every_dashboard_query_evaluates_on_live_data(monitored: Monitored) -> None:
    sys.path.insert(0, str(REPO / "tools"))  # a script in the checkout, not an installed module
    import check_dashboard as checker
    path = REPO / "deploy" / "grafana" / "rpcps-dashboard.json"
    dashboard = json.loads(path.read_text())
    queries, problems = checker.dashboard_queries(path, dashboard)
    assert problems == []
    # Empty by design: the checkpoint age only exists once a checkpoint was written; this dense run
    # without replicas has no coordinator (`rpcps store`), no sparse tables and no replication series.
    may_be_empty = set() if monitored.checkpointing else {"Newest checkpoint age"}
    sparse, replication = panels_in_row(dashboard, "Sparse tables"), panels_in_row(dashboard, "Replication")
    assert sparse and replication, "the dashboard's sparse or replication row is gone or renamed: update this test"
    may_be_empty |= {"(coordinator)", "variable $store_job", *sparse, *replication}

    def empty() -> list[str]:
        return [q.where for q in queries if not monitored.prom.query(q.expr) and not any(t in q.where for t in may_be_empty)]

    wait_for(empty, lambda e: e == [], 60, "every dashboard query to return data", monitored.run.diagnostics)


def test_checkpoint_timestamp_is_scraped(monitored: Monitored) -> None:
    if not monitored.checkpointing:
        pytest.skip("needs the checkpointer: `python trainer_entry.py ps --help` does not list --checkpoint-dir")
    expr = 'rpcps_checkpoint_last_success_timestamp_seconds{job="rpcps-ps"}'
    stamp = wait_for(lambda: scalar(monitored, expr), lambda v: v is not None and v > 0, 60,
                     f"{expr} > 0 (checkpoint every second)", monitored.run.diagnostics)
    assert stamp is not None
    assert monitored.run.started_at - 5 <= stamp <= time.time() + 5, f"checkpoint time {stamp} is not during this run"
    assert (scalar(monitored, 'rpcps_checkpoint_size_bytes{job="rpcps-ps"}') or 0) > 0
    assert scalar(monitored, 'rpcps_checkpoint_failures_total{job="rpcps-ps"}') == 0


def test_server_down_alert_goes_pending_when_the_run_stops(monitored: Monitored) -> None:
    """Keep last: it stops the shared run."""
    monitored.run.stop()
    assert not monitored.run.running()

    def server_down() -> list[str]:
        return [
            a["state"]
            for a in monitored.prom.api("alerts")["alerts"]
            if a["labels"]["alertname"] == "RpcpsServerDown" and a["labels"]["job"] == "rpcps-ps"
        ]

    wait_for(lambda: scalar(monitored, 'up{job="rpcps-ps"}'), lambda v: v == 0, 30, 'up{job="rpcps-ps"} == 0')
    # Normally "pending": the rule holds for 1m before it fires; "firing" only on a very slow machine.
    wait_for(server_down, lambda s: s in (["pending"], ["firing"]), 30, "RpcpsServerDown pending or firing")

