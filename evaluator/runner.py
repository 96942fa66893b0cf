"""Runs the sidecar evaluator: joins the group, scores the newest model every --every-seconds, serves
the scores on /metrics, keeps the best model exported, and restarts itself if the server is replaced.

It holds no worker slot and changes nothing on the server (``observe`` is read-only), so it can come
and go at any time. On SIGTERM it scores the newest model once more, then exits: a run that stops its
evaluator before its servers (``rpcps local`` does) gets the final model scored. Exit codes follow
the worker's: 0 done, 3 the server stayed unreachable, 5 a different model than the server's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from typing import Any

import torch

from evaluator.config import EvaluatorConfig, EvaluatorRunConfig
from evaluator.metrics import EvaluatorMetrics
from evaluator.observer import Observer
from evaluator.scoring import Batch, Scorer, check_scorable, checked, load_batches, load_scorer
from rpcps import memory, plugins, rpc_policy, signals, threads, transport
from rpcps.errors import SignatureMismatch
from rpcps.jobsecret import JobSecret
from rpcps.logsafe import MESSAGE_LIMIT, peer_text
from rpcps.metrics_http import build_info, serve_metrics
from rpcps.model_file import save_state_dict
from rpcps.periodic import WaitNotice
from rpcps.reexec import rejoin_or_give_up
from rpcps.summary import write_summary
from worker.client import ServerClient
from worker.device import pick_device

logger = logging.getLogger(__name__)

RECONNECTS_ENV = "RPCPS_EVALUATOR_RECONNECTS"
BEST_ENV = "RPCPS_EVALUATOR_BEST"
"""The best score so far, handed to the next incarnation so a restart never overwrites a better export."""

EXIT_OK = 0
EXIT_REFUSED = 5


class BestModel:
    """The best --best-metric so far, and the file that keeps its model (--export-best)."""

    def __init__(self, config: EvaluatorConfig, metrics: EvaluatorMetrics, carried: str | None) -> None:
        self.config = config
        self.metrics = metrics
        state = json.loads(carried) if carried else {}
        self.value: float | None = state.get("value")
        self.version: int | None = state.get("version")
        if self.value is not None and self.version is not None:
            metrics.record_best(self.version, self.value)

    def offer(self, version: int, scores: dict[str, float], model: torch.nn.Module) -> None:
        value = scores.get(self.config.best_metric)
        if value is None:
            self.metrics.failures.labels("evaluate").inc()
            logger.error("the evaluation gave no %r (it gave %s); set --best-metric to one of them",
                         self.config.best_metric, sorted(scores))
            return
        if math.isnan(value) or not self._better(value):
            return
        self.value, self.version = value, version
        self.metrics.record_best(version, value)
        if self.config.export_best is None:
            return
        try:
            save_state_dict(model.state_dict(), self.config.export_best)
        except (OSError, ValueError) as e:
            self.metrics.failures.labels("export").inc()
            logger.error("could not keep the best model (version %d) in %s: %s", version, self.config.export_best, e)
            return
        logger.info("best %s so far, %.6g at version %d: written to %s", self.config.best_metric, value, version,
                    self.config.export_best)

    def _better(self, value: float) -> bool:
        if self.value is None:
            return True
        return value < self.value if self.config.best_mode == "min" else value > self.value

    def to_carry(self) -> str:
        return json.dumps({"value": self.value, "version": self.version})

    def summary(self) -> dict[str, Any]:
        return {"metric": self.config.best_metric, "value": self.value, "model_version": self.version}


class Evaluation:
    """The model, the held-out batches and the scorer: everything but the servers."""

    def __init__(self, config: EvaluatorConfig, metrics: EvaluatorMetrics, best: BestModel) -> None:
        assert config.eval_data is not None  # EvaluatorRunConfig requires it
        self.device = pick_device(config.eval_device)
        self.model = plugins.load_model(config.model).to(self.device)
        check_scorable(self.model, config.model)
        self.batches: list[Batch] = load_batches(config.eval_data)
        self.scorer: Scorer = load_scorer(config.eval_fn, config.loss)
        self.metrics = metrics
        self.best = best
        self.count = 0
        self.last: dict[str, float] | None = None

    def score(self, version: int) -> None:
        """Scores the model as it is now; a scorer that fails is logged and counted, not fatal."""
        started = time.perf_counter()
        threads.sync()  # the host's budget may have changed since the last round (rpcps.threads)
        try:
            scores = checked(self.scorer(self.model, self.batches), "the evaluation")
        except Exception as e:  # noqa: BLE001 - the user's scorer may raise anything; the next round retries
            self.metrics.failures.labels("evaluate").inc()
            logger.error("evaluating model version %d failed: %s: %s", version, type(e).__name__, e)
            return
        seconds = time.perf_counter() - started
        self.count += 1
        self.last = scores
        self.metrics.record(version, scores, seconds)
        self.best.offer(version, scores, self.model)
        logger.info("model version %d: %s (%.2fs)", version, ", ".join(f"{k} {v:.4g}" for k, v in scores.items()), seconds)


def run_evaluator(config: EvaluatorRunConfig) -> int:
    assert config.ps is not None
    memory.tune_malloc()  # before any thread allocates (rpcps.memory)
    started = time.monotonic()
    reconnects = int(os.environ.get(RECONNECTS_ENV, "0"))
    metrics = EvaluatorMetrics()
    threads.HostBudget(  # light: it scores now and then
        "evaluator", config.process.threads, directory=config.process.host_dir, on_problem=metrics.thread_budget_problem
    ).start()
    build_info(metrics.registry, "evaluator", {"ps": str(config.ps), "model": config.evaluator.model})
    http, _ = serve_metrics(metrics.registry, config.process.metrics_addr, config.metrics_port)
    best = BestModel(config.evaluator, metrics, os.environ.get(BEST_ENV))
    stop = threading.Event()
    # As in the worker: until the loop runs the process may sit in torch's C++ join, where a Python
    # handler would not run; the default action ends it at once, with nothing to save.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    evaluation = Evaluation(config.evaluator, metrics, best)  # a bad spec fails before the network
    rpc_policy.protect(on_refusal=rpc_policy.counting(metrics.rpc_refused))
    name: str | None = None
    store_host = ""
    observer: Observer | None = None
    trimmer: memory.Trimmer | None = None
    try:
        try:
            with WaitNotice(f"the parameter server at {config.ps}", config.transport.connect_timeout_s):
                name = transport.join(config.ps, "evaluator", config.transport)
        except transport.JoinFailed as e:
            raise transport.PeerUnreachable(str(e)) from e
        store_host = transport.store_host()
        options = config.transport
        secret = JobSecret.from_file(options.job_secret_file) if options.job_secret_file else None
        transport.group_registry().authenticate(
            secret, name, trust_unsigned=config.ps.is_loopback, on_refused=rpc_policy.counting_store_refusals(metrics.store_refused)
        )
        first = ServerClient(options.rpc_timeout_s, shard=0, wait_s=options.connect_timeout_s, secret=secret)
        clients = [first] + [
            ServerClient(options.rpc_timeout_s, shard=k, wait_s=options.connect_timeout_s, secret=secret)
            for k in range(1, first.shard_count())
        ]
        observer = Observer(evaluation.model, clients)
        signals.on_signals(lambda _signum: stop.set())
        trimmer = memory.start_trimming(config.process.malloc_trim_s)  # a whole model copy per pull, as in a worker
        _loop(config.evaluator, observer, evaluation, stop)
        return EXIT_OK
    except (transport.PeerUnreachable, transport.PeerTimeout) as e:
        metrics.failures.labels("observe").inc()
        if stop.is_set():
            logger.info("stopped while the server was unreachable (%s)", e)
            return EXIT_OK
        carry = {RECONNECTS_ENV: str(reconnects + 1), BEST_ENV: best.to_carry()}
        return rejoin_or_give_up("evaluator", e, reconnects, config.max_reconnects, http, carry)
    except SignatureMismatch as e:
        logger.error("%s", peer_text(str(e), MESSAGE_LIMIT))  # names the server's parameters
        return EXIT_REFUSED
    finally:
        if trimmer is not None:
            trimmer.stop()
        write_summary(config.process.summary_json, {
            "role": "evaluator",
            "evaluations": evaluation.count,
            "model_version": observer.version if observer is not None else None,
            "last": evaluation.last,
            "best": best.summary(),
            "reconnects": reconnects,
            "wall_seconds": time.monotonic() - started,
        })
        if name is not None and store_host:
            secret_file = config.transport.job_secret_file
            transport.leave(name, store_host, JobSecret.from_file(secret_file) if secret_file else None)
        transport.shutdown()
    raise AssertionError("unreachable")


def _loop(config: EvaluatorConfig, observer: Observer, evaluation: Evaluation, stop: threading.Event) -> None:
    """Scores every new model version; after ``stop`` is set, scores once more and returns."""
    while True:
        final = stop.is_set()
        if observer.refresh():
            evaluation.score(observer.version)
        if final or (config.max_evaluations and evaluation.count >= config.max_evaluations):
            return
        stop.wait(config.every_seconds)
