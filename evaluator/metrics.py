"""The evaluator's Prometheus metrics. Every series is registered here and nowhere else."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rpcps.rpc_policy import refusal_counter, store_refusal_counter
from rpcps.threads import problem_counter

_EVAL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
FAILURE_STAGES = ("observe", "evaluate", "export")


class EvaluatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.evaluations = Counter("rpcps_evaluator_evaluations", "Held-out evaluations of a new model version.", registry=r)
        self.model_version = Gauge("rpcps_evaluator_model_version", "Model version of the latest evaluation.", registry=r)
        self.loss = Gauge("rpcps_evaluator_loss", "Held-out loss of the latest evaluation.", registry=r)
        self.metric = Gauge("rpcps_evaluator_metric", "Every score of the latest evaluation, by name.", ["name"], registry=r)
        self.best = Gauge("rpcps_evaluator_best", "Best value of --best-metric so far.", registry=r)
        self.best_version = Gauge("rpcps_evaluator_best_model_version", "Model version that scored the best value.", registry=r)
        self.best_timestamp = Gauge(
            "rpcps_evaluator_best_timestamp_seconds", "When --best-metric last improved (Unix time).", registry=r
        )
        self.seconds = Histogram(
            "rpcps_evaluator_evaluation_seconds", "Time to score one model on the held-out data.", buckets=_EVAL_BUCKETS, registry=r
        )
        self.last = Gauge("rpcps_evaluator_last_evaluation_timestamp_seconds", "When the latest evaluation finished.", registry=r)
        self.failures = Counter("rpcps_evaluator_failures", "Failed observations, evaluations and best-model exports.", ["stage"],
                                registry=r)
        for stage in FAILURE_STAGES:
            self.failures.labels(stage)
        self.rpc_refused = refusal_counter(r)
        self.store_refused = store_refusal_counter(r)
        self.thread_budget_problem = problem_counter(r, "evaluator")

    def record(self, version: int, scores: dict[str, float], seconds: float) -> None:
        self.evaluations.inc()
        self.model_version.set(version)
        self.loss.set(scores["loss"])
        for name, value in scores.items():
            self.metric.labels(name).set(value)
        self.seconds.observe(seconds)
        self.last.set(time.time())

    def record_best(self, version: int, value: float) -> None:
        self.best.set(value)
        self.best_version.set(version)
        self.best_timestamp.set(time.time())
