"""tools/check_dashboard.py: the PromQL lexer, variable substitution, the metric catalogue, and the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tools"))  # a script in the checkout, not an installed module
import check_dashboard as cd

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian: apt-get install prometheus)")


def refs(expr: str) -> list[tuple[str | None, tuple[str, ...]]]:
    return [(s.metric, s.labels) for s in cd.selectors(expr)]


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ('sum by (instance) (rate(a_total{job=~"x", reason!="y"}[5m]))', [("a_total", ("job", "reason"))]),
        ("histogram_quantile(0.99, sum without (pod) (rate(b_bucket[$__rate_interval])))", [("b_bucket", ())]),
        ("a - on (job, instance) group_left (slot) b", [("a", ()), ("b", ())]),
        ("time() - (c > 0) > 1800", [("c", ())]),
        ('label_replace(m, "dst", "not_a_metric", "src", "(.*)")', [("m", ())]),
        ("x offset 5m and bool y unless z", [("x", ()), ("y", ()), ("z", ())]),
        ("1e3 * m / 0x1F + Inf - NaN", [("m", ())]),
        ('count_values("v", m) or topk(5, n)', [("m", ()), ("n", ())]),
        ('{__name__="foo"}', [(None, ("__name__",))]),
        ('m{a="}{"}', [("m", ("a",))]),
        ("sum(m) by (le)", [("m", ())]),
        ("max_over_time(m[30m:1m])", [("m", ())]),
    ],
)
def test_selectors_finds_metrics_and_matcher_labels_only(expr: str, expected: list[tuple[str | None, tuple[str, ...]]]) -> None:
    assert refs(expr) == expected


def test_substitute_replaces_every_variable_syntax_and_rejects_unknown_ones() -> None:
    variables = {"__rate_interval": "5m", "ps_job": ".+", "q": "0.9"}
    assert cd.substitute('rate(a{job=~"${ps_job}"}[$__rate_interval]) * [[q]]', variables) == 'rate(a{job=~".+"}[5m]) * 0.9'
    assert cd.substitute('a{job=~"${ps_job:regex}"}', variables) == 'a{job=~".+"}'
    with pytest.raises(ValueError, match=r"\$nope.*does not define"):
        cd.substitute("a{x=\"$nope\"}", variables)


def test_known_series_come_from_the_code_with_suffixes_and_labels() -> None:
    series = cd.known_series()
    assert series["rpcps_server_updates_applied_total"] == frozenset()
    assert "rpcps_server_updates_applied" not in series  # prometheus_client exposes counters as _total
    assert series["rpcps_server_staleness_updates_bucket"] == frozenset({"le"})
    assert series["rpcps_server_pushes_rejected_total"] == frozenset({"reason"})
    assert series["rpcps_server_worker_last_push_age_seconds"] == frozenset({"slot"})
    assert series["rpcps_worker_pushes_total"] == frozenset({"result"})
    assert series["rpcps_build_info"] is None  # info labels are open-ended
    assert series["up"] == frozenset()


def test_reference_errors_name_unknown_metrics_and_labels() -> None:
    series = cd.known_series()
    queries = [
        cd.Query(where="ok", expr='sum by (reason) (rate(rpcps_server_pushes_rejected_total{job="j", reason="shape"}[5m]))'),
        cd.Query(where="typo", expr="rate(rpcps_server_updates_applied[5m])"),
        cd.Query(where="label", expr='rpcps_server_live_workers{slot="0"}'),
        cd.Query(where="bare", expr='{job="j"}'),
        cd.Query(where="info", expr='rpcps_build_info{role="ps", anything="x"}'),
    ]
    problems = cd.reference_errors(queries, series)
    assert [p.split(":")[0] for p in problems] == ["typo", "label", "bare"]
    assert "'rpcps_server_updates_applied' is not defined" in problems[0]
    assert "no label(s) ['slot']" in problems[1]


def test_dashboard_queries_walk_rows_and_variables_and_flag_structure(tmp_path: Path) -> None:
    dashboard = {
        "templating": {"list": [{"name": "ps_job", "type": "query", "allValue": ".+",
                                 "query": {"query": "label_values(rpcps_server_model_version, job)"}}]},
        "panels": [
            {"id": 1, "type": "row", "title": "r", "panels": [
                {"id": 2, "type": "timeseries", "title": "inner", "targets": [{"refId": "A", "expr": 'up{job=~"$ps_job"}'}]},
            ]},
            {"id": 2, "type": "stat", "title": "dup", "targets": [{"refId": "A", "expr": "up"}, {"refId": "A", "expr": "up"}]},
            {"id": 3, "type": "stat", "title": "empty", "targets": []},
        ],
    }
    queries, problems = cd.dashboard_queries(tmp_path / "d.json", dashboard)
    assert [q.expr for q in queries] == ["rpcps_server_model_version", 'up{job=~".+"}', "up", "up"]
    assert any("duplicate panel id 2" in p for p in problems)
    assert any("duplicate refId" in p for p in problems)
    assert any("'empty': no queries" in p for p in problems)


def run_checker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "tools" / "check_dashboard.py"), *args],
                          capture_output=True, text=True, timeout=120, check=False)


@needs_promtool
def test_shipped_dashboard_and_alerts_pass() -> None:
    result = run_checker(str(REPO / "deploy/grafana/rpcps-dashboard.json"), "--rules", str(REPO / "deploy/prometheus/alerts.yml"))
    assert result.returncode == 0, result.stderr
    assert "expressions OK" in result.stdout


@needs_promtool
def test_broken_dashboard_fails_naming_each_panel(tmp_path: Path) -> None:
    panels = [
        {"id": 1, "type": "timeseries", "title": "unclosed", "targets": [{"refId": "A", "expr": "sum(rate(up[5m])"}]},
        {"id": 2, "type": "timeseries", "title": "wrong type", "targets": [{"refId": "A", "expr": "rate(up)"}]},
        {"id": 3, "type": "timeseries", "title": "renamed", "targets": [{"refId": "A", "expr": "rpcps_server_version"}]},
        {"id": 4, "type": "timeseries", "title": "undefined var", "targets": [{"refId": "A", "expr": 'up{job="$nope"}'}]},
        {"id": 5, "type": "timeseries", "title": "fine", "targets": [{"refId": "A", "expr": "rpcps_server_model_version"}]},
    ]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps({"panels": panels}))
    result = run_checker(str(path))
    assert result.returncode == 1
    for title in ("unclosed", "wrong type", "renamed", "undefined var"):
        assert f"{title!r}" in result.stderr, result.stderr
    assert "'fine'" not in result.stderr
    assert "4 problem(s)" in result.stderr


def test_missing_promtool_is_a_clear_error() -> None:
    result = run_checker("--promtool", "/nonexistent/promtool")
    assert result.returncode == 2
    assert "cannot find '/nonexistent/promtool'" in result.stderr and "apt-get install prometheus" in result.stderr
