"""Keep your own training loop: the worker role as a Python API (docs/API.md).

    from worker.api import connect

    with connect(model, data) as training:          # joins the servers, registers the model
        for step in training:                       # positioned at the resumed step; may replay
            loss = model(**step.batch)["loss"]
            loss.backward()
            step.push(loss)                         # asynchronous, within the window
    # leaving the block drained the window and waited until every step is durable

``Training`` owns the step sequence because a step may have to be computed again: a push refused as
too stale ('bounded', 'sync') or an acknowledgement lost with a failed primary comes back as a
**replay** (same index, same batch, fresh parameters). Parameters are refreshed only between steps.
Settings come from the same declarations as the CLI's (``worker.config``), with the same precedence,
keyword arguments standing in for the defaults: flag > ``RPCPS_*`` > torchrun's ``RANK``/
``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` > keyword > default.

A lost server is handled as the CLI worker handles it: the process restarts itself in place
(``os.execv``, same command line: **the whole script runs again**) and resumes where the servers
are. Failures end the process with the CLI worker's exit codes (``SystemExit``). ``rpcps worker``
is one user of this module (``worker.runner``), so every fault test of the CLI exercises it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, Self

import torch

from rpcps import memory, replica_endpoints, rpc_policy, signals, threads, transport
from rpcps.errors import (
    NotPrimary,
    RegistrationRefused,
    ServerStarting,
    ServerStopping,
    SignatureMismatch,
    UnknownWorker,
    WorkerRemoved,
)
from rpcps.jobsecret import JobSecret
from rpcps.logsafe import MESSAGE_LIMIT, peer_text
from rpcps.metrics_http import build_info, serve_metrics
from rpcps.options import add_settings, resolve
from rpcps.periodic import WaitNotice
from rpcps.reexec import rejoin_or_give_up
from rpcps.settings import build, declared
from rpcps.summary import write_summary
from rpcps.transport.registry import require_secret_off_loopback
from worker.client import ServerClient
from worker.config import DEFAULT_METRICS_PORT, WorkerRunConfig
from worker.device import pick_device
from worker.metrics import WorkerMetrics
from worker.step import Step, StepEnded
from worker.trainer import NotDurable, ServerBehind, TooManyRejects, Trainer, WorkerStats

REJOIN_ON = (
    transport.PeerUnreachable, transport.PeerTimeout, ServerStopping, ServerBehind, WorkerRemoved, NotPrimary, ServerStarting,
)
"""Errors after which a worker restarts in place and rejoins, as for a lost server. WorkerRemoved:
the server dropped this slot's registration (silent past its lease). NotPrimary with no successor
named: a server restarting from its snapshot answered before it claimed its shard again (CI saw a
worker exit 1 on it after a server re-executed itself, test_stray_connections_to_every_port...).
ServerStarting: the server withdrew its API (a primary fenced by its etcd claim, stepping down to
restart) past the failover timeout (CI saw a worker exit 1 on it, test_etcd.py's lone primary)."""

logger = logging.getLogger(__name__)

__all__ = ["Step", "StepEnded", "StepOptimizer", "Training", "connect", "worker_config"]

RECONNECTS_ENV = "RPCPS_RECONNECTS"
STATS_ENV = "RPCPS_WORKER_STATS"
"""The slot's statistics so far, handed to the next incarnation when the worker restarts itself."""

EXIT_OK = 0
EXIT_BAD_GRADIENTS = 4
EXIT_REFUSED = 5
EXIT_NOT_DURABLE = 6

Data = Iterable[Any] | Callable[[int, int], Iterable[Any]]
"""A step's data: an iterable (a DataLoader), or a factory ``(worker_index, num_workers) -> iterable``."""


def worker_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None, **settings: Any
) -> tuple[WorkerRunConfig, list[str]]:
    """The worker's settings from the command line, the environment and ``settings``, as the CLI has them.

    ``argv`` (default ``sys.argv[1:]``) may hold the script's own flags beside rpcps's: those are
    returned, untouched, for the script's parser. ``settings`` are keyword values by flag name
    (``ps="host:port"``, ``steps=200``, ``max_in_flight=2``): they replace the defaults, so a flag,
    an ``RPCPS_*`` variable or torchrun's variables still win over them.

    Raises:
        ValueError: an unknown setting or a bad value (naming the setting).
    """
    environ = os.environ if environ is None else environ
    found = declared(WorkerRunConfig)
    by_dest = {d.dest: d for d in found}
    unknown = sorted(set(settings) - set(by_dest))
    if unknown:
        raise ValueError(f"unknown worker setting(s) {unknown}; these exist: {sorted(by_dest)}")
    parser = argparse.ArgumentParser(prog=os.path.basename(sys.argv[0]) or "worker", add_help=False, allow_abbrev=False)
    add_settings(parser, found)
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    values = resolve(args, found, parser, environ)
    for dest, value in settings.items():
        d = by_dest[dest]
        if getattr(args, d.dest, None) is None and d.env not in environ and d.torchrun_value(environ) is None:
            values[d.path] = value
    return build(WorkerRunConfig, values), rest


def connect(
    model: torch.nn.Module,
    data: Data,
    *,
    accumulate: int = 1,
    argv: Sequence[str] | None = None,
    **settings: Any,
) -> Training:
    """A ``Training`` of ``model`` on ``data``, configured as ``worker_config`` says (enter it to join).

    Args:
        model: the model every server was started with (same parameters, names and shapes); it is
            moved to ``--device``. Parameters with ``requires_grad=False`` never reach the server.
        data: this slot's data, or a factory ``(worker_index, num_workers) -> iterable``. Step ``s``
            must get the same batch every time it is computed (restarts, replays): a ``seek(n)``
            method positions it at item ``n``; otherwise the first ``n`` items are read and discarded.
        accumulate: micro-batches per step (``step.batch`` is then a list of that many); one push per step.
        argv: where rpcps's flags are (default ``sys.argv[1:]``; other flags are left alone).
        settings: worker settings by flag name, standing in for their defaults (``steps=200``).
    """
    config, _ = worker_config(argv, **settings)
    return Training(model, data, config, accumulate=accumulate)


class Training:
    """One worker slot's training: a context manager over the servers, an iterable of ``Step``s.

    Entering joins the group and registers the model with every shard (a lost server restarts the
    process in place, as the CLI worker does). Iterating hands out the slot's steps from where the
    servers resumed it; each must end with ``step.push(loss)`` or ``step.skip()``. Leaving the block
    drains the window and, when every step was computed, waits until a committed snapshot holds
    them all (``durable`` in the summary), then leaves.
    """

    def __init__(
        self, model: torch.nn.Module, data: Data, config: WorkerRunConfig, *, accumulate: int = 1, data_name: str = "the training data"
    ) -> None:
        """``data_name`` names the data in errors (the CLI: ``--data 'spec'``)."""
        if accumulate < 1:
            raise ValueError(f"accumulate must be >= 1, got {accumulate}")
        self.config = config
        self.model = model
        self.accumulate = accumulate
        self.summary: dict[str, Any] | None = None
        """The run summary, once the block is left (what ``--summary-json`` gets)."""
        self._data = data
        self._data_name = data_name
        self._trainer: Trainer | None = None
        self._steps: Generator[Step, None, None] | None = None
        self._optimizer: StepOptimizer | None = None
        self._stopping = False
        self._reconnects = int(os.environ.get(RECONNECTS_ENV, "0"))
        self._stats = WorkerStats.from_carry(os.environ.get(STATS_ENV))
        self._metrics = WorkerMetrics()
        self._http: Any = None
        self._trimmer: memory.Trimmer | None = None
        self._name: str | None = None
        self._store_host = ""
        self._secret: JobSecret | None = None

    # ---- what the loop reads ---------------------------------------------------------------------

    @property
    def slot(self) -> int:
        return self.config.worker.worker_index

    @property
    def num_workers(self) -> int:
        return self.config.worker.num_workers

    @property
    def steps(self) -> int:
        """The slot's total steps (``--steps``), counted across restarts."""
        return self.config.worker.steps

    @property
    def local_steps(self) -> int | None:
        """In --mode local-steps, H: each step's ``micro_batches`` are H inner steps' batches, and its push
        sends the parameters' change since the step began (take the inner optimizer's steps yourself);
        None in the gradient modes. Known once entered."""
        return self.trainer.local_steps

    @property
    def device(self) -> torch.device:
        """Where the model computes (``--device``): move each batch here."""
        return self.trainer.device

    @property
    def start_step(self) -> int:
        """The first step this process computes (the servers' record of the slot's progress)."""
        return self.trainer.step if self._steps is None else self._first_step

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise RuntimeError("enter the Training first: `with connect(model, data) as training:`")
        return self._trainer

    @property
    def current(self) -> Step | None:
        """The step handed out and not ended yet."""
        return self._trainer.current if self._trainer is not None else None

    @property
    def optimizer(self) -> StepOptimizer:
        """A ``torch.optim.Optimizer`` facade for code that calls ``step()`` / ``zero_grad()`` itself."""
        if self._trainer is not None and self._trainer.local_steps is not None:
            # Its step() pushes; a round needs H real inner steps first (docs/API.md, local steps).
            raise RuntimeError("in --mode local-steps your own inner optimizer steps: end each round with step.push()")
        if self._optimizer is None:
            self._optimizer = StepOptimizer(self)
        return self._optimizer

    def stop(self) -> None:
        """Ends the step sequence after the steps in flight (as SIGTERM does)."""
        self._stopping = True
        if self._trainer is not None:
            self._trainer.stop()

    def __iter__(self) -> Iterator[Step]:
        trainer = self.trainer
        if self._steps is not None:
            raise RuntimeError("a Training's steps are iterated once")
        data = self._data(self.slot, self.num_workers) if callable(self._data) else self._data
        accumulate = self.accumulate
        if trainer.local_steps is not None:
            if accumulate > 1:
                raise ValueError("accumulate applies to gradient modes; in --mode local-steps a step's micro_batches are its "
                                 "--local-steps H inner steps' batches: leave accumulate at 1")
            accumulate = trainer.local_steps
        self._first_step = trainer.step
        self._steps = trainer.steps(data, accumulate, source=self._data_name)
        return self._steps

    # ---- joining and leaving ---------------------------------------------------------------------

    def __enter__(self) -> Self:
        try:
            self._join()
        except BaseException as e:
            self._fail(e)
            raise
        return self

    def _join(self) -> None:
        config = self.config
        memory.tune_malloc()  # before any thread allocates (rpcps.memory)
        metrics = self._metrics
        metrics.reconnects.set(self._reconnects)
        gpu = pick_device(config.worker.device).type == "cuda"
        threads.HostBudget(
            "worker", config.process.threads, gpu=gpu, directory=config.process.host_dir,
            on_change=metrics.thread_budget.show, on_problem=metrics.thread_budget.count_problem,
        ).start()
        build_info(metrics.registry, "worker", {"ps": str(config.ps), "slot": str(config.worker.worker_index)})
        self._http = _serve_metrics(metrics, config)
        # Until the trainer exists the worker may sit inside torch's C++ connect/join for a long time,
        # where a Python handler would not run: the default action ends it at once, with nothing to save.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        options = config.transport
        self._secret = JobSecret.from_file(options.job_secret_file) if options.job_secret_file else None
        assert config.ps is not None  # WorkerRunConfig requires it
        require_secret_off_loopback(config.ps.is_loopback, self._secret, config.ps)
        # The size limit follows the model's size, known once it is registered (see below).
        rpc_policy.protect(on_refusal=rpc_policy.counting(metrics.rpc_refused), extra_calls=replica_endpoints.WORKER_ENDPOINTS)
        try:
            with WaitNotice(f"the parameter server at {config.ps}", config.transport.connect_timeout_s):
                self._name = transport.join(config.ps, f"worker{config.worker.worker_index}", config.transport)
        except transport.JoinFailed as e:
            # The server answered but the group join failed half-way (e.g. a member that just left
            # was still listed). torch's agent is unusable after that, so retry in a fresh process.
            raise transport.PeerUnreachable(str(e)) from e
        # Views are verified before this worker follows one (a stranger's points it at the stranger).
        transport.group_registry().authenticate(
            self._secret, self._name, trust_unsigned=config.ps.is_loopback,
            on_refused=rpc_policy.counting_store_refusals(metrics.store_refused),
        )
        self._store_host = transport.store_host()
        secret = self._secret
        first = ServerClient(options.rpc_timeout_s, shard=0, wait_s=options.connect_timeout_s, secret=secret)
        clients = [first] + [
            ServerClient(options.rpc_timeout_s, shard=k, wait_s=options.connect_timeout_s, secret=secret)
            for k in range(1, first.shard_count())
        ]
        trainer = Trainer(config.worker, clients, self._name, metrics, self._stats, model=self.model)
        self._trainer = trainer
        replica_endpoints.publish_listener(trainer)  # a shard's new primary announces itself here
        transport.set_max_message_bytes(rpc_policy.message_limit(trainer.signature.numel, options.max_message_mb))
        signals.on_signals(lambda _signum: self.stop())  # finish in-flight pushes, leave, write the summary
        if self._stopping:
            trainer.stop()
        self._trimmer = memory.start_trimming(config.process.malloc_trim_s)  # after start-up, which leaves the most behind

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> Literal[False]:
        if self._steps is not None:
            self._steps.close()  # a loop left early: the sequence stops (its heartbeat too)
        if exc is None:
            try:
                self._complete()
            except BaseException as e:  # noqa: BLE001 - classified below, like a failure in the loop
                exc = e
            else:
                self._close()
                return False
        self._fail(exc)
        return False  # not one of ours: the caller's exception goes on

    def _complete(self) -> None:
        """After the last step: durable, left, summary written."""
        trainer = self.trainer
        summary = trainer.summary()
        summary["reconnects"] = self._reconnects
        # Done means durable: a worker reports success only once a committed snapshot holds every
        # one of its steps, so a server crash after it exits cannot roll them back.
        summary["durable"] = trainer.finish(checkpoints_off_ok=self.config.process.checkpoints_off_ok) if trainer.completed else False
        for link in trainer.shards:
            try:
                link.client.leave(self.slot, link.registration.incarnation)
            except Exception as e:  # noqa: BLE001 - leaving is a courtesy; the reaper covers us
                logger.debug("leave failed: %s", e)
        write_summary(self.config.process.summary_json, summary)
        self.summary = summary
        logger.info("done: %d steps, final loss %s", summary["steps"], summary["final_loss"])

    def _fail(self, error: BaseException) -> None:
        """Handles ``error`` as the CLI worker does: a lost server restarts the process in place (does
        not return), a refusal or bad gradients end it with their exit code (``SystemExit``).
        Returns (after cleaning up) for anything else, which the caller raises again."""
        code: int | None = None
        try:
            if isinstance(error, REJOIN_ON):
                if self._stopping:
                    logger.info("stopped by signal while the server went away (%s)", str(error) or type(error).__name__)
                    code = EXIT_OK
                else:
                    carry = {RECONNECTS_ENV: str(self._reconnects + 1), STATS_ENV: self._stats.to_carry()}
                    code = rejoin_or_give_up("worker", error, self._reconnects, self.config.max_reconnects, _Quiet(self._http), carry)
            elif isinstance(error, (SignatureMismatch, UnknownWorker, RegistrationRefused)):
                logger.error("%s", peer_text(str(error), MESSAGE_LIMIT))  # the server's words
                code = EXIT_REFUSED
            elif isinstance(error, TooManyRejects):
                logger.error("%s", peer_text(str(error), MESSAGE_LIMIT))  # quotes the server's last refusal
                code = EXIT_BAD_GRADIENTS
            elif isinstance(error, NotDurable):
                logger.error("%s; this slot's last steps would not survive a server crash (exit %d)", error, EXIT_NOT_DURABLE)
                code = EXIT_NOT_DURABLE
        finally:
            self._close()
        if code is not None:
            raise SystemExit(code) from error

    def _close(self) -> None:
        if self._trimmer is not None:
            self._trimmer.stop()
            self._trimmer = None
        if self._store_host and self._name is not None:  # the join named it before the store's host was kept
            transport.leave(self._name, self._store_host, self._secret)  # bounded: fails fast (or in 5 s) when the store's host is gone
            self._store_host = ""
        transport.shutdown()


class StepOptimizer(torch.optim.Optimizer):
    """The optimizer your code steps, when it must call one (a GradScaler, a framework's loop).

    ``step()`` pushes the current step's gradients (the real optimizer runs on the servers; a local
    one must never step: the parameters are replaced by the servers' between steps) and returns the
    step's index, so ``scaler.step(optimizer)`` returns None exactly when the scaler skipped it: end
    such a step with ``step.skip()``. ``zero_grad()`` clears the current step's gradients and keeps
    them bound to the wire buffers (``set_to_none`` is accepted and changes nothing here).
    """

    def __init__(self, training: Training) -> None:
        params = [p for p in training.model.parameters() if p.requires_grad]
        super().__init__(params, {"lr": 0.0})
        self._training = training

    def _open_step(self) -> Step:
        step = self._training.current
        if step is None:
            raise StepEnded("no step is open: call the optimizer inside `for step in training:`, once per step")
        return step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> int:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        current = self._open_step()
        current.push(loss)
        return current.index

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none
        current = self._training.current
        if current is not None:
            current.zero_grad()


class _Quiet:
    """The metrics server as ``rejoin_or_give_up`` shuts it down (None when it never started)."""

    def __init__(self, http: Any) -> None:
        self._http = http

    def shutdown(self) -> None:
        if self._http is not None:
            self._http.shutdown()


def _serve_metrics(metrics: WorkerMetrics, config: WorkerRunConfig) -> object:
    """/metrics on --metrics-port; unset, on 9410 + LOCAL_RANK, or a free port when that one is taken
    (several workers started by hand on one host without LOCAL_RANK)."""
    addr = config.process.metrics_addr
    if config.metrics_port is not None:
        return serve_metrics(metrics.registry, addr, config.metrics_port)[0]
    preferred = DEFAULT_METRICS_PORT + int(os.environ.get("LOCAL_RANK", "0"))
    try:
        return serve_metrics(metrics.registry, addr, preferred)[0]
    except OSError:
        http, port = serve_metrics(metrics.registry, addr, 0)
        logger.warning("metrics port %d is taken (another worker on this host?); serving /metrics on port %d instead", preferred, port)
        return http
