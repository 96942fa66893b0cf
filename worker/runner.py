"""Runs a worker process: joins its server, trains, and restarts itself if the server is replaced.

Why restart instead of reconnecting in place: torch RPC caches a broken connection per peer forever,
and re-initialising the agent inside one process lands in a new store namespace and raced into hangs
in our measurements (shared/research/torch-rpc-facts.md). A fresh process (``os.execv``, same PID,
same arguments) joins the new server cleanly in about two seconds, most of it Python start-up, and
picks up its slot's progress from the server.
"""

from __future__ import annotations

import logging
import os
import signal

from rpcps import memory, plugins, replica_endpoints, rpc_policy, signals, threads, transport
from rpcps.errors import RegistrationRefused, ServerStopping, SignatureMismatch, UnknownWorker, WorkerRemoved
from rpcps.jobsecret import JobSecret
from rpcps.metrics_http import build_info, serve_metrics
from rpcps.reexec import rejoin_or_give_up
from rpcps.summary import write_summary
from worker.client import ServerClient
from worker.config import DEFAULT_METRICS_PORT, WorkerRunConfig
from worker.device import pick_device
from worker.metrics import WorkerMetrics
from worker.trainer import NotDurable, ServerBehind, TooManyRejects, Trainer, WorkerStats

logger = logging.getLogger(__name__)

RECONNECTS_ENV = "RPCPS_RECONNECTS"
STATS_ENV = "RPCPS_WORKER_STATS"
"""The slot's statistics so far, handed to the next incarnation when the worker restarts itself."""

EXIT_OK = 0
EXIT_BAD_GRADIENTS = 4
EXIT_REFUSED = 5
EXIT_NOT_DURABLE = 6


def run_worker(config: WorkerRunConfig) -> int:
    memory.tune_malloc()  # before any thread allocates (rpcps.memory)
    reconnects = int(os.environ.get(RECONNECTS_ENV, "0"))
    metrics = WorkerMetrics()
    metrics.reconnects.set(reconnects)
    gpu = pick_device(config.worker.device).type == "cuda"
    threads.HostBudget(
        "worker", config.process.threads, gpu=gpu, directory=config.process.host_dir,
        on_change=metrics.thread_budget.show,
    ).start()
    build_info(metrics.registry, "worker", {"ps": str(config.ps), "slot": str(config.worker.worker_index)})
    http = _serve_metrics(metrics, config)
    stats = WorkerStats.from_carry(os.environ.get(STATS_ENV))
    trainer: Trainer | None = None
    stopping = False

    def on_signal(_signum: int) -> None:
        nonlocal stopping
        stopping = True
        if trainer is not None:
            trainer.stop()  # finish in-flight pushes, leave, write the summary

    # Until the trainer exists the worker may sit inside torch's C++ connect/join for a long time,
    # where a Python handler would not run: the default action ends it at once, with nothing to save.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    plugins.load_loss(config.worker.loss)  # fail on a bad spec before touching the network
    options = config.transport
    secret = JobSecret.from_file(options.job_secret_file) if options.job_secret_file else None
    # The size limit follows the model, which is loaded after joining (see below).
    rpc_policy.protect(on_refusal=rpc_policy.counting(metrics.rpc_refused), extra_calls=replica_endpoints.WORKER_ENDPOINTS)
    name: str | None = None
    store_host = ""
    trimmer: memory.Trimmer | None = None
    try:
        assert config.ps is not None  # WorkerRunConfig requires it
        try:
            name = transport.join(config.ps, f"worker{config.worker.worker_index}", config.transport)
        except transport.JoinFailed as e:
            # The server answered but the group join failed half-way (e.g. a member that just left
            # was still listed). torch's agent is unusable after that, so retry in a fresh process.
            raise transport.PeerUnreachable(str(e)) from e
        store_host = transport.store_host()
        first = ServerClient(options.rpc_timeout_s, shard=0, wait_s=options.connect_timeout_s, secret=secret)
        clients = [first] + [
            ServerClient(options.rpc_timeout_s, shard=k, wait_s=options.connect_timeout_s, secret=secret)
            for k in range(1, first.shard_count())
        ]
        trainer = Trainer(config.worker, clients, name, metrics, stats)
        replica_endpoints.publish_listener(trainer)  # a shard's new primary announces itself here
        transport.set_max_message_bytes(rpc_policy.message_limit(trainer.signature.numel, options.max_message_mb))
        signals.on_signals(on_signal)
        trimmer = memory.start_trimming(config.process.malloc_trim_s)  # after start-up, which leaves the most behind
        summary = trainer.run()
        summary["reconnects"] = reconnects
        # Done means durable: a worker reports success only once a committed checkpoint holds every
        # one of its steps, so a server crash after it exits cannot roll them back.
        summary["durable"] = trainer.finish() if trainer.completed else False
        for link in trainer.shards:
            try:
                link.client.leave(config.worker.worker_index, link.registration.incarnation)
            except Exception as e:  # noqa: BLE001 - leaving is a courtesy; the reaper covers us
                logger.debug("leave failed: %s", e)
        write_summary(config.process.summary_json, summary)
        logger.info("done: %d steps, final loss %s", summary["steps"], summary["final_loss"])
        return EXIT_OK
    # WorkerRemoved: the server dropped this slot's registration (silent past its lease): rejoin as for a lost server.
    except (transport.PeerUnreachable, transport.PeerTimeout, ServerStopping, ServerBehind, WorkerRemoved) as e:
        if stopping:
            logger.info("stopped by signal while the server went away (%s)", e)
            return EXIT_OK
        carry = {RECONNECTS_ENV: str(reconnects + 1), STATS_ENV: stats.to_carry()}
        return rejoin_or_give_up("worker", e, reconnects, config.max_reconnects, http, carry)
    except (SignatureMismatch, UnknownWorker, RegistrationRefused) as e:
        logger.error("%s", e)
        return EXIT_REFUSED
    except TooManyRejects as e:
        logger.error("%s", e)
        return EXIT_BAD_GRADIENTS
    except NotDurable as e:
        logger.error("%s; this slot's last steps would not survive a server crash (exit %d)", e, EXIT_NOT_DURABLE)
        return EXIT_NOT_DURABLE
    finally:
        if trimmer is not None:
            trimmer.stop()
        if store_host:
            transport.leave(name, store_host, secret)  # bounded: fails fast (or in 5 s) when the store's host is gone
        transport.shutdown()
    raise AssertionError("unreachable")


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
