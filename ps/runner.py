"""Runs a server process: loads the model, serves the worker API and metrics until told to stop."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ps import exposure, supervisor
from ps.audit import AuditLog
from ps.checkpointer import Checkpointer, find_resume_point, shard_checkpoint_config
from ps.config import CheckpointConfig, ServerRunConfig
from ps.control.service import start_control_server
from ps.listener_recovery import ListenerRecovery
from ps.metrics import ServerMetrics
from ps.optim import torch_kwargs
from ps.reaper import MembershipReaper
from ps.registration_auth import RegistrationGate
from ps.server import ParameterServer
from ps.service import WorkerService
from ps.store_guard import StoreGuard
from rpcps import endpoints, memory, plugins, rpc_policy, threads, transport
from rpcps.jobsecret import JobSecret
from rpcps.listen_sockets import ListenerWatch
from rpcps.metrics_http import build_info, serve_metrics
from rpcps.reexec import restart_self
from rpcps.summary import write_summary

logger = logging.getLogger(__name__)

RESTART_FROM_ENV = "RPCPS_RESTART_FROM"
LISTENER_LOST_ENV = "RPCPS_LISTENER_LOST"
"""How often earlier incarnations of this server lost their RPC listener (the counter outlives the restart)."""
JOIN_ATTEMPTS_ENV = "RPCPS_JOIN_ATTEMPTS"
_RESTART_DIR_PREFIX = "rpcps-restart-"


def run_server(config: ServerRunConfig) -> int:
    exposure.check(config, os.environ)  # refused here, in the foreground, before any supervisor starts
    if config.supervise and not supervisor.is_child():
        supervisor.become_supervisor()
    secret = JobSecret.from_file(config.transport.job_secret_file) if config.transport.job_secret_file else None
    memory.tune_malloc()  # before any thread allocates (rpcps.memory)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    metrics = ServerMetrics()
    metrics.rpc_listener_lost.inc(int(os.environ.get(LISTENER_LOST_ENV, "0")))
    metrics.intra_op_threads.set(threads.apply(threads.choose(config.process.threads)))
    metrics.crash_restarts.set(supervisor.crash_restarts())
    build_info(metrics.registry, "ps", _flat_config(config))
    http, metrics_port = serve_metrics(metrics.registry, config.process.metrics_addr, config.metrics_port)
    model = plugins.load_model(config.model)
    server = ParameterServer(model, config.core, metrics)
    largest_chunk = max(server.layout.chunk_numels) * server.wire.itemsize
    config = replace(config, transport=replace(config.transport, rpc_channels=config.transport.channels(largest_chunk)))
    rpc_policy.protect(
        on_refusal=rpc_policy.counting(metrics.rpc_refused),
        max_message_bytes=rpc_policy.message_limit(server.signature.numel, config.transport.max_message_mb),
    )
    ledger = None
    if config.audit_log:
        suffix = f".shard{config.core.shard_index}" if config.core.shard_count > 1 else ""
        ledger = AuditLog(config.audit_log + suffix)
        server.on_applied(ledger.on_applied)
    service = WorkerService(server, gate=RegistrationGate(secret, metrics))
    logger.info(
        "model %s: %d parameters in %d chunks (largest %d bytes: TensorPipe channels %s); optimizer %s %s",
        config.model, server.signature.numel, len(server.layout), largest_chunk, ",".join(config.transport.rpc_channels or ()),
        config.core.optimizer.name, torch_kwargs(config.core.optimizer),
    )
    finish_workers = threading.Event()

    def request_shutdown() -> None:
        finish_workers.set()
        stop.set()

    control = start_control_server(
        server, config.control, checkpoint=None, request_shutdown=request_shutdown, registry=metrics.registry
    )
    try:
        checkpointer = _resume(server, config, ledger, secret)
        control.attach_checkpointer(checkpointer)
        service.durability = checkpointer
        _join_group(config, secret)
    except BaseException:
        control.stop(grace_s=0)
        http.shutdown()  # type: ignore[attr-defined]
        raise
    if checkpointer is not None:
        server.on_applied(checkpointer.on_applied)
        checkpointer.start()
    if server.sparse is not None:
        server.sparse.start()
        logger.info("sparse tables %s (%s, lr %g)", sorted(server.sparse.tables), config.core.sparse.optimizer, config.core.sparse.lr)
    endpoints.publish(service)
    reaper = MembershipReaper(service, metrics, config.lease_s, owns_group=config.core.shard_index == 0)
    reaper.start()
    store_guard = StoreGuard(metrics) if config.core.shard_index == 0 else None
    if store_guard is not None:
        store_guard.start()
    listener = ListenerWatch(exclude_ports={config.listen.port, metrics_port, control.port})
    recovery = ListenerRecovery(time.monotonic(), transport.membership.ranks_handed_out)
    control.set_serving(True)
    supervisor.note_serving()
    logger.info(
        "serving on %s (send SIGTERM or Ctrl-C to stop)%s", config.listen,
        "; registrations must prove the job secret" if secret is not None else "",
    )
    restart_from: str | None = None
    try:
        progress = _Progress(server, service, config.progress_s)
        while not stop.wait(1.0):
            progress.maybe_log()
            if listener.lost():
                _on_listener_lost(server, listener, recovery)
            why = recovery.restart_due(time.monotonic())
            if why is not None:
                logger.warning("restarting this server to listen again: %s", why)
                restart_from = _snapshot_for_restart(server, checkpointer, config)
                break
            if reaper.store_host_lost:
                logger.error("shard 0 (the group's store host) is gone; snapshotting and rejoining its successor")
                restart_from = _snapshot_for_restart(server, checkpointer, config)
                break
        logger.info("stopping")
        control.set_serving(False)
        if finish_workers.is_set():
            _finish_workers(server, config.finish_timeout_s)
        server.stop()
        if checkpointer is not None and restart_from is None:
            checkpointer.stop(final=True)
        write_summary(config.process.summary_json, service.summary())
    finally:
        control.stop(grace_s=5)
        reaper.stop()
        if store_guard is not None:
            store_guard.stop()
        if server.sparse is not None:
            server.sparse.stop()
        endpoints.withdraw()
        transport.shutdown()
        http.shutdown()  # type: ignore[attr-defined]
    if restart_from is not None:
        lost = metrics.registry.get_sample_value("rpcps_server_rpc_listener_lost_total") or 0
        restart_self({RESTART_FROM_ENV: restart_from, LISTENER_LOST_ENV: str(int(lost))})
    return 0


def _finish_workers(server: ParameterServer, timeout_s: float) -> None:
    """Tells workers to stop for good and waits (bounded) until none is live."""
    server.finish()
    deadline = time.monotonic() + timeout_s
    while server.status().live_workers and time.monotonic() < deadline:
        time.sleep(0.2)
    live = server.status().live_workers
    if live:
        logger.warning("%d workers still running after %.0fs; stopping anyway", live, timeout_s)


class _Progress:
    def __init__(self, server: ParameterServer, service: WorkerService, every_s: float) -> None:
        self.server = server
        self.service = service
        self.every_s = every_s
        self.last_time = time.monotonic()
        self.last_version = server.version

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self.last_time < self.every_s:
            return
        status, loss = self.server.status(), self.service.summary()["final_loss"]
        rate = (status.version - self.last_version) / (now - self.last_time)
        self.last_time, self.last_version = now, status.version
        logger.info(
            "version %d, %.1f updates/s, %d live workers, loss %s",
            status.version, rate, status.live_workers, f"{loss:.4f}" if loss is not None else "-",
        )


def _on_listener_lost(server: ParameterServer, listener: ListenerWatch, recovery: ListenerRecovery) -> None:
    """The RPC listener was closed under us (a stray connection to TensorPipe's port).

    Running workers are unaffected, but no new worker can join until this process restarts, which
    ``ListenerRecovery`` decides (when someone wants to join, rate-limited).
    """
    server.metrics.rpc_listener_lost.inc()
    ports = listener.lost()
    listener.watched.clear()  # report once
    recovery.on_lost(time.monotonic())
    logger.error(
        "the RPC listener on port(s) %s was closed by a stray connection (a TensorPipe limitation); running workers "
        "carry on, and this server restarts from a snapshot as soon as a new process wants to join; keep the RPC "
        "ports reachable only from the training network", ports,
    )


def _snapshot_for_restart(server: ParameterServer, checkpointer: Checkpointer | None, config: ServerRunConfig) -> str:
    """Stops updates and writes the exact current state for this process to restart from.

    With --checkpoint-dir it is an ordinary snapshot there (kept like the others). Without, it goes
    to a private directory (the supervisor's, removed when it exits; else a temporary one), which
    the restarted process removes once it resumed: nothing is lost and nothing is left behind.
    """
    server.stop()
    if checkpointer is None:
        scratch = supervisor.scratch_dir()
        directory = tempfile.mkdtemp(prefix=f"{_RESTART_DIR_PREFIX}shard{config.core.shard_index}-", dir=scratch)
        checkpointer = Checkpointer(
            server, CheckpointConfig(directory=directory, every_seconds=None), _meta(server, config), server.metrics
        )
    else:
        checkpointer.stop(final=False)
    path, _ = checkpointer.checkpoint_now()
    return path


def _resume(server: ParameterServer, config: ServerRunConfig, ledger: AuditLog | None, secret: JobSecret | None) -> Checkpointer | None:
    """Restores the server from a snapshot per --resume; returns the checkpointer (None when off)."""
    sign = secret.manifest_signature if secret is not None and config.checkpoint.sign else None
    checkpoint_config = shard_checkpoint_config(config.checkpoint, config.core.shard_index, config.core.shard_count)
    restart_from = os.environ.pop(RESTART_FROM_ENV, None)
    if restart_from:  # this process restarted itself from a snapshot it just wrote
        checkpoint_config = replace(checkpoint_config, resume=restart_from)
    point = find_resume_point(checkpoint_config, server.signature, config.core.optimizer.name, server.partition_digest, sign)
    if point is not None:
        info, state = point
        server.restore_state(state)
        if restart_from and checkpoint_config.directory is None:
            _remove_restart_snapshot(Path(restart_from))
        if ledger is not None:
            ledger.resumed(info.version)
        server.metrics.resumes.inc()
        server.metrics.resumed_version.set(info.version)
        logger.info("resumed from %s at version %d", info.path, info.version)
    if checkpoint_config.directory is None:
        logger.warning(
            "checkpointing is off (no --checkpoint-dir): a server crash loses all training, and finishing "
            "workers cannot make their steps durable"
        )
        return None
    Path(checkpoint_config.directory).mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(server, checkpoint_config, _meta(server, config), server.metrics, ledger, sign)
    if point is not None:
        checkpointer.adopt(*point)
    _report_rolled_back(server, checkpointer)
    return checkpointer


def _remove_restart_snapshot(path: Path) -> None:
    """Deletes the private restart snapshot this process just resumed from (see _snapshot_for_restart)."""
    if path.parent.name.startswith(_RESTART_DIR_PREFIX):
        shutil.rmtree(path.parent, ignore_errors=True)
        logger.info("resumed; removed the restart snapshot %s", path)


def _report_rolled_back(server: ParameterServer, checkpointer: Checkpointer) -> None:
    """Says loudly when a worker slot that finished (its steps were durable) is behind after a resume.

    That happens only when the snapshot holding its last steps was lost (corrupt, deleted) and an
    older one was resumed: its worker exited long ago, so nobody recomputes those steps unless the
    slot is run again (``rpcps local`` does it by itself; docs/FAULT_TOLERANCE.md says how elsewhere).
    """
    server.metrics.slots_rolled_back.set_function(lambda: len(_rolled_back(server, checkpointer)))
    for slot, (held, steps) in sorted(_rolled_back(server, checkpointer).items()):
        logger.error(
            "worker slot %d finished %d steps, but the checkpoint this server resumed from holds only %d: the newer one "
            "was lost; run worker slot %d again (it resumes at step %d)", slot, steps, held, slot, held,
        )


def _rolled_back(server: ParameterServer, checkpointer: Checkpointer) -> dict[int, tuple[int, int]]:
    """Finished slots the server now holds fewer steps of: slot -> (steps held, steps finished)."""
    progress = {w.slot: w.next_step for w in server.status().workers}
    return {slot: (progress.get(slot, 0), steps) for slot, steps in checkpointer.finished_slots().items() if progress.get(slot, 0) < steps}


def _meta(server: ParameterServer, config: ServerRunConfig) -> dict[str, Any]:
    """What every snapshot's manifest records besides the files (checked at resume)."""
    return {
        "signature": server.signature.to_wire(),
        "model_signature": server.model_signature.to_wire(),
        "signature_digest": server.model_signature.digest(),
        "optimizer": config.core.optimizer.name,
        "shard_index": config.core.shard_index,
        "shard_count": config.core.shard_count,
        "partition_digest": server.partition_digest,
        "config": json.loads(json.dumps(asdict(config), default=str)),
    }


def _join_group(config: ServerRunConfig, secret: JobSecret | None) -> None:
    """Shard 0 hosts the group's store; other shards join it under their fixed names."""
    name = endpoints.server_name(config.core.shard_index)
    if config.core.shard_index == 0:
        transport.serve(config.listen, name, config.transport, secret)
        return
    attempts = int(os.environ.get(JOIN_ATTEMPTS_ENV, "0"))
    try:
        transport.join(config.store_address, name, config.transport, fixed_name=True)
    except transport.JoinFailed as e:
        # Usually our previous incarnation is still listed; shard 0's reaper removes it within
        # seconds. torch's agent is unusable after a failed join, so retry in a fresh process.
        if attempts >= 30:
            raise
        logger.warning("%s; retrying in a fresh process (attempt %d)", e, attempts + 1)
        time.sleep(1.0)
        restart_self({JOIN_ATTEMPTS_ENV: str(attempts + 1)})
    os.environ.pop(JOIN_ATTEMPTS_ENV, None)


def _flat_config(config: ServerRunConfig) -> dict[str, Any]:
    return {
        "listen": str(config.listen),
        "model": config.model,
        "optimizer": config.core.optimizer.name,
        "on_nonfinite": config.core.on_nonfinite,
        "transports": ",".join(config.transport.rpc_transports),
    }
