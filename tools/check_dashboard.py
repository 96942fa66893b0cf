#!/usr/bin/env python3
"""Checks the PromQL in a Grafana dashboard (and optionally in Prometheus rule files).

Two checks, both of which must pass:

1. Every expression parses and type-checks as PromQL. We do not trust a home-made parser for
   that: the expressions go into a temporary rules file, one recording rule each, and
   ``promtool check rules`` parses them with Prometheus's own parser.
2. Every metric an expression selects is one rpcps defines (ps/core/metrics.py, worker/metrics.py,
   evaluator/metrics.py, cli/store.py, rpcps/metrics_http.py, read from the live registries, not from a list kept by hand) or one
   Prometheus adds to every target (``up``, ``scrape_*``), and every label matcher names a label
   that metric has or a target label. A renamed metric otherwise leaves a panel silently empty.

Grafana variables ($__rate_interval, $ps_job, ...) are replaced by sample values first; a variable
the dashboard does not define is an error.

Usage:
    .venv/bin/python tools/check_dashboard.py [DASHBOARD.json ...] [--rules RULES.yml ...] [--promtool PATH]

Exit status: 0 clean, 1 problems found (each printed with where it is), 2 cannot check (promtool or
a file missing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import Metric

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DASHBOARD = Path("deploy") / "grafana" / "rpcps-dashboard.json"

# Labels Prometheus attaches to every series of a target: job and instance always, role and child
# from prometheus.yml's static labels and from the local launcher's file_sd targets file.
TARGET_LABELS = frozenset({"__name__", "job", "instance", "role", "child"})
# Series Prometheus itself writes for every scrape.
SCRAPE_SERIES = {
    name: frozenset()
    for name in (
        "up",
        "scrape_duration_seconds",
        "scrape_samples_scraped",
        "scrape_samples_post_metric_relabeling",
        "scrape_series_added",
    )
}
# Grafana's built-in interval variables, replaced by a value of the right kind.
BUILTIN_VARIABLES = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
    "__interval_ms": "60000",
    "__range_s": "3600",
    "__range_ms": "3600000",
}
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"})
_GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_AGGREGATION_CLAUSE = re.compile(r"(by|without)\b\s*\(")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_MATCHER = re.compile(r"\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*")
_VARIABLE = re.compile(r"\$\{([a-zA-Z0-9_]+)(?::[a-zA-Z]+)?\}|\$([a-zA-Z0-9_]+)|\[\[([a-zA-Z0-9_]+)\]\]")


@dataclass(frozen=True, kw_only=True)
class Query:
    where: str
    """Where the expression lives, for error messages: file, panel id and title, refId."""
    expr: str


@dataclass(frozen=True, kw_only=True)
class Selector:
    metric: str | None
    """The metric name, or None for a selector like {job="x"} that names none."""
    labels: tuple[str, ...]
    """Label names the selector's matchers use."""


# ---- PromQL lexing: which metrics and labels an expression selects ------------------------------


def selectors(expr: str) -> list[Selector]:
    """The vector selectors of a PromQL expression (assumed to parse; promtool checks that).

    A small lexer rather than a parser: it only has to tell metric names from function names,
    keywords, grouping labels, strings, durations and numbers.
    """
    found: list[Selector] = []
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        if c in "\"'`":
            i = _skip_string(expr, i)
        elif c == "[":
            i = expr.index("]", i) + 1
        elif c == "{":
            labels, i = _matchers(expr, i)
            found.append(Selector(metric=None, labels=labels))
        elif c == "#":  # a comment runs to the end of the line
            end = expr.find("\n", i)
            i = n if end < 0 else end
        elif c.isdigit() or (c == "." and i + 1 < n and expr[i + 1].isdigit()):
            i += 1
            while i < n and (expr[i].isalnum() or expr[i] in "._"):
                i += 1
        elif _IDENT.match(c):
            word = _IDENT.match(expr, i)
            assert word is not None
            name, i = word.group(), word.end()
            after = _skip_space(expr, i)
            if name in _GROUPING:
                if after < n and expr[after] == "(":
                    i = expr.index(")", after) + 1
            elif name.lower() in _KEYWORDS or (after < n and expr[after] == "(") or _AGGREGATION_CLAUSE.match(expr, after):
                pass  # an operator keyword, a function call, or an aggregation (`sum by (x) (...)`)
            elif after < n and expr[after] == "{":
                labels, i = _matchers(expr, after)
                found.append(Selector(metric=name, labels=labels))
            else:
                found.append(Selector(metric=name, labels=()))
        else:
            i += 1
    return found


def _skip_space(expr: str, i: int) -> int:
    while i < len(expr) and expr[i].isspace():
        i += 1
    return i


def _skip_string(expr: str, i: int) -> int:
    quote = expr[i]
    i += 1
    while i < len(expr) and expr[i] != quote:
        i += 2 if expr[i] == "\\" and quote != "`" else 1
    return i + 1


def _matchers(expr: str, i: int) -> tuple[tuple[str, ...], int]:
    """Label names in the matcher block opening at expr[i] == '{'; returns them and the index after '}'."""
    labels: list[str] = []
    i += 1
    while True:
        i = _skip_space(expr, i)
        if i >= len(expr) or expr[i] == "}":
            return tuple(labels), i + 1
        if expr[i] == ",":
            i += 1
            continue
        m = _MATCHER.match(expr, i)
        if m is None:  # malformed; promtool reports it, so just stop here
            return tuple(labels), len(expr)
        labels.append(m.group(1))
        i = _skip_string(expr, m.end()) if m.end() < len(expr) and expr[m.end()] in "\"'`" else m.end()


# ---- what rpcps defines ---------------------------------------------------------------------------


def rpcps_families() -> list[Metric]:
    """Every metric family rpcps's processes expose, from the real registries (server, worker, evaluator, coordinator)."""
    sys.path.insert(0, str(REPO))  # tools/ runs from a checkout, not an installed package
    from prometheus_client import CollectorRegistry

    from cli.store import CoordinatorMetrics
    from evaluator.metrics import EvaluatorMetrics
    from ps.core.metrics import ServerMetrics
    from ps.replication.metrics import ReplicationMetrics
    from ps.sparse.table import TableStats
    from rpcps.metrics_http import build_info
    from worker.metrics import WorkerMetrics

    server = ServerMetrics(CollectorRegistry())
    # One live slot, one sparse table and one shard view so the scrape-time series show their labels.
    server.watch_workers(lambda: [(0, True, time.monotonic())])
    table = TableStats(**dict.fromkeys((f.name for f in dataclasses.fields(TableStats)), 0))
    server.watch_sparse(lambda: {"table": table})
    coordinator = CoordinatorMetrics.create(listen="")
    coordinator.watch_group(lambda: (1, {0: (1, True)}))
    ReplicationMetrics(server.registry, 2)  # a shard with a standby: a single one exports no replication series
    build_info(server.registry, "ps", {})
    worker = WorkerMetrics(CollectorRegistry())
    worker.watch_sparse()  # a worker of a model with sparse tables
    build_info(worker.registry, "worker", {})
    evaluator = EvaluatorMetrics(CollectorRegistry())
    evaluator.metric.labels("loss").set(0)  # a labelled gauge shows its labels once it has a child
    build_info(evaluator.registry, "evaluator", {})
    return [*server.registry.collect(), *worker.registry.collect(), *evaluator.registry.collect(), *coordinator.registry.collect()]


def exposed_name(family: Metric) -> str:
    """The name a person queries for a family: counters gain _total and info metrics _info."""
    return family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")


def known_series() -> dict[str, frozenset[str] | None]:
    """Sample name -> its label names (None: any label, for info metrics)."""
    series: dict[str, frozenset[str] | None] = dict(SCRAPE_SERIES)
    for family in rpcps_families():
        suffixes = {
            "counter": ("_total", "_created"),
            "histogram": ("_bucket", "_count", "_sum", "_created"),
            "summary": ("_count", "_sum", "_created", ""),
            "info": ("_info",),
        }.get(family.type, ("",))
        labels: set[str] = set()
        for sample in family.samples:
            labels.update(k for k in sample.labels if k != "le")
        for suffix in suffixes:
            extra = {"le"} if suffix == "_bucket" else set()
            series[family.name + suffix] = None if family.type == "info" else frozenset(labels | extra)
    return series


# ---- the dashboard --------------------------------------------------------------------------------


def dashboard_queries(path: Path, dashboard: dict[str, Any]) -> tuple[list[Query], list[str]]:
    """Every PromQL expression in the dashboard, with variables replaced; and structural problems."""
    problems: list[str] = []
    variables = dict(BUILTIN_VARIABLES)
    raw: list[Query] = []
    for var in dashboard.get("templating", {}).get("list", []):
        name = var.get("name", "?")
        variables[name] = str(var.get("allValue") or _current_value(var) or "x")
        if var.get("type") == "query":
            query = var.get("query")
            text = query.get("query", "") if isinstance(query, dict) else str(query or "")
            expr = _variable_query_expr(text)
            if expr:
                raw.append(Query(where=f"{path}: variable ${name}", expr=expr))
    seen_ids: set[int] = set()
    for panel in _panels(dashboard.get("panels", [])):
        pid, title = panel.get("id"), panel.get("title", "?")
        where = f"{path}: panel {pid} {title!r}"
        if pid in seen_ids:
            problems.append(f"{where}: duplicate panel id {pid}")
        seen_ids.add(pid)
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{where}: no queries")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs):
            problems.append(f"{where}: duplicate refId in {refs}")
        for t in targets:
            expr = t.get("expr")
            if not expr:
                problems.append(f"{where} refId {t.get('refId')}: no 'expr'")
                continue
            raw.append(Query(where=f"{where} refId {t.get('refId')}", expr=expr))
    queries = []
    for q in raw:
        try:
            queries.append(Query(where=q.where, expr=substitute(q.expr, variables)))
        except ValueError as e:
            problems.append(f"{q.where}: {e}")
    return queries, problems


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))  # collapsed rows keep their panels inside


def _current_value(var: dict[str, Any]) -> str | None:
    value = var.get("current", {}).get("value")
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value in (None, "$__all") else str(value)


def _variable_query_expr(text: str) -> str | None:
    """The PromQL inside a Prometheus variable query: label_values(EXPR, label) or query_result(EXPR)."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)\s*", text, re.DOTALL)
    if m:
        return m.group(1)
    m = re.fullmatch(r"\s*query_result\((.*)\)\s*", text, re.DOTALL)
    return m.group(1) if m else None


def substitute(expr: str, variables: dict[str, str]) -> str:
    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in variables:
            raise ValueError(f"uses ${name}, which the dashboard does not define; add it under templating or remove it")
        return variables[name]

    return _VARIABLE.sub(value, expr)


# ---- rule files -----------------------------------------------------------------------------------


def rule_queries(path: Path) -> list[Query]:
    try:
        import yaml
    except ImportError:
        raise SystemExit("check_dashboard: --rules needs PyYAML (pip install pyyaml)") from None
    doc = yaml.safe_load(path.read_text())
    return [
        Query(where=f"{path}: group {g['name']!r} {rule.get('alert') or rule.get('record')!r}", expr=rule["expr"])
        for g in doc.get("groups", [])
        for rule in g.get("rules", [])
    ]


# ---- the checks -----------------------------------------------------------------------------------


def parse_errors(queries: list[Query], promtool: str) -> list[str]:
    """Problems promtool finds when it parses each expression as a recording rule."""
    if not queries:
        return []
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:expr_{i}", "expr": q.expr}
                                                          for i, q in enumerate(queries)]}]}
    with tempfile.TemporaryDirectory(prefix="check-dashboard-") as tmp:
        path = Path(tmp) / "rules.yml"
        path.write_text(json.dumps(rules, indent=1))  # JSON is YAML
        result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False)
    if result.returncode == 0:
        return []
    problems = []
    for line in (result.stdout + result.stderr).splitlines():
        m = re.search(r'"dashboard:expr_(\d+)": (.*)', line)
        if m:
            q = queries[int(m.group(1))]
            problems.append(f"{q.where}: {m.group(2)}\n    expr: {q.expr}")
    return problems or [f"promtool check rules failed:\n{result.stdout}{result.stderr}"]


def reference_errors(queries: list[Query], series: dict[str, frozenset[str] | None]) -> list[str]:
    """Problems with the metrics and labels each expression selects."""
    problems = []
    for q in queries:
        for sel in selectors(q.expr):
            if sel.metric is None:
                if "__name__" not in sel.labels:
                    problems.append(f"{q.where}: selector without a metric name in {q.expr!r}")
                continue
            if sel.metric not in series:
                problems.append(
                    f"{q.where}: metric {sel.metric!r} is not defined by rpcps (ps/core/metrics.py, worker/metrics.py, "
                    f"cli/store.py, rpcps/metrics_http.py); check the name and its suffix (_total, _bucket, _seconds)"
                )
                continue
            allowed = series[sel.metric]
            if allowed is None:
                continue
            unknown = sorted(set(sel.labels) - allowed - TARGET_LABELS)
            if unknown:
                problems.append(
                    f"{q.where}: {sel.metric} has no label(s) {unknown}; it has {sorted(allowed | TARGET_LABELS - {'__name__'})}"
                )
    return problems


def check(dashboards: list[Path], rules: list[Path], promtool: str) -> tuple[list[str], int]:
    """All problems found, and how many expressions were checked."""
    problems: list[str] = []
    queries: list[Query] = []
    for path in dashboards:
        try:
            dashboard = json.loads(path.read_text())
        except ValueError as e:
            problems.append(f"{path}: not valid JSON: {e}")
            continue
        found, structural = dashboard_queries(path, dashboard)
        queries += found
        problems += structural
    for path in rules:
        queries += rule_queries(path)
    problems += parse_errors(queries, promtool)
    problems += reference_errors(queries, known_series())
    return problems, len(queries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dashboards", nargs="*", type=Path, help=f"Grafana dashboard JSON (default {DEFAULT_DASHBOARD})")
    parser.add_argument("--rules", nargs="*", type=Path, default=[], help="Prometheus rule files whose expressions to check too")
    parser.add_argument("--promtool", default="promtool", help="promtool binary (default: promtool on PATH)")
    args = parser.parse_args(argv)
    dashboards = args.dashboards or ([] if args.rules else [REPO / DEFAULT_DASHBOARD])
    promtool = shutil.which(args.promtool)
    if promtool is None:
        print(f"check_dashboard: cannot find {args.promtool!r}; install Prometheus's promtool (Debian: apt-get install prometheus) "
              "or pass --promtool PATH", file=sys.stderr)
        return 2
    missing = [p for p in [*dashboards, *args.rules] if not p.is_file()]
    if missing:
        print(f"check_dashboard: no such file: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    problems, checked = check(dashboards, args.rules, promtool)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check_dashboard: {len(problems)} problem(s) in {checked} expressions", file=sys.stderr)
        return 1
    print(f"check_dashboard: {checked} expressions OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
