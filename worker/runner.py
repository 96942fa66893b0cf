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
from dataclasses import dataclass

from rpcps import plugins, transport
from rpcps.errors import ServerStopping, SignatureMismatch, UnknownWorker
from rpcps.metrics_http import build_info, serve_metrics
from rpcps.reexec import restart_self
from rpcps.summary import write_summary
from worker.client import ServerClient, ServerTimeout, ServerUnreachable
from worker.metrics import WorkerMetrics
from worker.trainer import TooManyRejects, Trainer, WorkerConfig

logger = logging.getLogger(__name__)

RECONNECTS_ENV = "RPCPS_RECONNECTS"

EXIT_OK = 0
EXIT_SERVER_LOST = 3
EXIT_BAD_GRADIENTS = 4
EXIT_REFUSED = 5


@dataclass(kw_only=True, frozen=True)
class WorkerRunConfig:
    transport: transport.TransportConfig
    worker: WorkerConfig
    metrics_addr: str = "0.0.0.0"
    metrics_port: int = 9401
    max_reconnects: int = 20
    """Times this worker restarts itself to reach a replaced server before giving up."""
    summary_json: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.max_reconnects < 0:
            raise ValueError(f"max_reconnects must be >= 0, got {self.max_reconnects}")


def run_worker(config: WorkerRunConfig) -> int:
    reconnects = int(os.environ.get(RECONNECTS_ENV, "0"))
    metrics = WorkerMetrics()
    metrics.reconnects.set(reconnects)
    build_info(metrics.registry, "worker", {"ps": config.transport.address, "slot": str(config.worker.worker_index)})
    http, _ = serve_metrics(metrics.registry, config.metrics_addr, config.metrics_port)
    trainer: Trainer | None = None
    stopping = False

    def on_signal(*_: object) -> None:
        nonlocal stopping
        stopping = True
        if trainer is not None:
            trainer.stop()  # finish in-flight pushes, leave, write the summary

    # Until the trainer exists the worker may sit inside torch's C++ connect/join for a long time,
    # where a Python handler would not run: the default action ends it at once, with nothing to save.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    plugins.load_loss(config.worker.loss)  # fail on a bad spec before touching the network
    name: str | None = None
    try:
        try:
            name = transport.start_worker(config.transport, config.worker.worker_index)
        except transport.JoinFailed as e:
            # The server answered but the group join failed half-way (e.g. a member that just left
            # was still listed). torch's agent is unusable after that, so retry in a fresh process.
            raise ServerUnreachable(str(e)) from e
        first = ServerClient(config.transport.rpc_timeout_s, shard=0, wait_s=config.transport.connect_timeout_s)
        shard_count = first.register_probe()
        clients = [first] + [
            ServerClient(config.transport.rpc_timeout_s, shard=k, wait_s=config.transport.connect_timeout_s)
            for k in range(1, shard_count)
        ]
        trainer = Trainer(config.worker, clients, name, metrics)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        summary = trainer.run()
        summary["reconnects"] = reconnects
        for link in trainer.shards:
            try:
                link.client.leave(config.worker.worker_index, link.registration.incarnation)
            except Exception as e:  # noqa: BLE001 - leaving is a courtesy; the reaper covers us
                logger.debug("leave failed: %s", e)
        write_summary(config.summary_json, summary)
        logger.info("done: %d steps, final loss %s", summary["steps"], summary["final_loss"])
        return EXIT_OK
    except (ServerUnreachable, ServerStopping, ServerTimeout) as e:
        if stopping:
            logger.info("stopped by signal while the server went away (%s)", e)
            return EXIT_OK
        if reconnects >= config.max_reconnects:
            logger.error("lost the server (%s) and gave up after %d reconnects", e, reconnects)
            return EXIT_SERVER_LOST
        logger.warning("lost the server (%s); restarting this worker to rejoin (reconnect %d)", e, reconnects + 1)
        transport.shutdown()
        http.shutdown()  # type: ignore[attr-defined]
        restart_self({RECONNECTS_ENV: str(reconnects + 1)})
    except (SignatureMismatch, UnknownWorker) as e:
        logger.error("%s", e)
        return EXIT_REFUSED
    except TooManyRejects as e:
        logger.error("%s", e)
        return EXIT_BAD_GRADIENTS
    finally:
        if name is not None:
            transport.leave_group(name)  # bounded: fails fast (or in 5 s) when the server is gone
        transport.shutdown()
    raise AssertionError("unreachable")
