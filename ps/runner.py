"""Runs a server process: loads the model, serves the worker API and metrics until told to stop."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NoReturn

from ps.api.registration_auth import RegistrationGate
from ps.api.worker_service import WorkerService
from ps.checkpoints.audit import AuditLog
from ps.checkpoints.checkpointer import Checkpointer, ResumePoint, find_resume_point, shard_checkpoint_config
from ps.config import CheckpointConfig, ServerRunConfig
from ps.control.control_service import ControlServer, start_control_server
from ps.core.metrics import ServerMetrics
from ps.core.optim import torch_kwargs
from ps.core.server import ParameterServer
from ps.lifecycle import exposure, supervisor
from ps.lifecycle.listener_recovery import ListenerRecovery
from ps.lifecycle.reaper import MembershipReaper
from ps.lifecycle.store_guard import StoreGuard
from ps.replication.claim import Claim, claim_shard
from ps.replication.metrics import ReplicationMetrics
from ps.replication.replica import ShardReplica
from ps.replication.standby import CatchUpFailed
from rpcps import endpoints, memory, plugins, replica_endpoints, rpc_policy, signals, threads, transport
from rpcps.jobsecret import JobSecret
from rpcps.listen_sockets import ListenerWatch
from rpcps.messages import Mode
from rpcps.metrics_http import build_info, serve_metrics
from rpcps.reexec import restart_self
from rpcps.summary import write_summary
from rpcps.transport import membership
from rpcps.transport.coordinator import Janitor
from rpcps.transport.registry import Registry

logger = logging.getLogger(__name__)

RESTART_FROM_ENV = "RPCPS_RESTART_FROM"
LISTENER_LOST_ENV = "RPCPS_LISTENER_LOST"
"""How often earlier incarnations of this server lost their RPC listener (the counter outlives the restart)."""
JOIN_ATTEMPTS_ENV = "RPCPS_JOIN_ATTEMPTS"
ATTACH_ONLY_ENV = "RPCPS_ATTACH_ONLY"
"""Set by a standby that restarts after the store was lost: it may only attach to a live primary."""
_RESTART_DIR_PREFIX = "rpcps-restart-"


def run_server(config: ServerRunConfig) -> int:
    config.check_replicas()
    exposure.check(config, os.environ)  # refused here, in the foreground, before any supervisor starts
    if config.supervise and not supervisor.is_child():
        supervisor.become_supervisor()
    secret = JobSecret.from_file(config.transport.job_secret_file) if config.transport.job_secret_file else None
    memory.tune_malloc()  # before any thread allocates (rpcps.memory)
    stop = threading.Event()
    asked_to_stop = threading.Event()
    """A signal or the control plane asked this process to end: it must not restart itself."""

    def on_signal(_signum: int) -> None:
        asked_to_stop.set()
        stop.set()

    signals.on_signals(on_signal)
    metrics = ServerMetrics()
    metrics.rpc_listener_lost.inc(int(os.environ.get(LISTENER_LOST_ENV, "0")))
    budget = threads.HostBudget(
        "server", config.process.threads, directory=config.process.host_dir,
        on_change=metrics.thread_budget.show, on_problem=metrics.thread_budget.count_problem,
    )
    budget.start()
    metrics.crash_restarts.set(supervisor.crash_restarts())
    build_info(metrics.registry, "ps", _flat_config(config))
    http, metrics_port = serve_metrics(metrics.registry, config.process.metrics_addr, config.metrics_port)
    model = plugins.load_model(config.model)
    server = ParameterServer(model, config.core, metrics)
    server.thread_budget = budget
    largest_chunk = max(server.layout.chunk_numels) * server.wire.itemsize
    config = replace(config, transport=replace(config.transport, rpc_channels=config.transport.channels(largest_chunk)))
    rpc_policy.protect(
        on_refusal=rpc_policy.counting(metrics.rpc_refused),
        max_message_bytes=rpc_policy.message_limit(server.signature.numel, config.transport.max_message_mb),
        extra_calls=replica_endpoints.SERVER_ENDPOINTS,  # the other replica of this shard calls them
    )
    service = WorkerService(server, gate=RegistrationGate(secret, metrics.registrations_refused))
    logger.info(
        "model %s: %d parameters in %d chunks (largest %d bytes: TensorPipe channels %s); optimizer %s %s%s",
        config.model, server.signature.numel, len(server.layout), largest_chunk, ",".join(config.transport.rpc_channels or ()),
        config.core.optimizer_name,
        config.core.optimizer_settings if config.core.mode == Mode.LOCAL_STEPS else torch_kwargs(config.core.applied_optimizer),
        ", lr / staleness from 2 updates old" if config.core.scales_lr_by_staleness else "",
    )
    finish_workers = threading.Event()

    def request_shutdown() -> None:
        finish_workers.set()
        asked_to_stop.set()
        stop.set()

    control = start_control_server(
        server, config.control, checkpoint=None, request_shutdown=request_shutdown, registry=metrics.registry
    )
    janitor: Janitor | None = None
    store_guard: StoreGuard | None = None
    restart: list[str] = []
    """Why this process must restart itself (a replaced primary, a standby that cannot follow)."""

    def restart_now(why: str) -> None:
        restart.append(why)
        stop.set()

    rmetrics = ReplicationMetrics(metrics.registry, config.replication.replicas)
    try:
        name = _join_group(config, secret)
        ledger = _open_ledger(server, config, name)
        registry = transport.group_registry()
        registry.authenticate(  # before the janitor writes a dead record or this process a view
            secret, name, trust_unsigned=config.store_address.is_loopback,
            on_refused=rpc_policy.counting_store_refusals(metrics.store_refused),
        )
        if config.hosts_store:
            janitor = Janitor(registry, config.lease_s, on_removed=lambda gone: _member_gone(service, metrics, gone))
            janitor.start()
            store_guard = StoreGuard(metrics.store_repairs)  # right after serving: it remembers the store as it is now
            store_guard.start()
        elif (duty := transport.shared_duty("janitor", name)) is not None:
            # The store is in etcd: no coordinator, so the servers keep the member list, one at a time.
            janitor = Janitor(registry, config.lease_s, on_removed=lambda gone: _member_gone(service, metrics, gone), duty=duty)
            janitor.start()
        registry.claim_shard_count(config.core.shard_count)
        own_record = _replica_record(config, metrics_port, control.port)
        registry.put_replica(name, own_record)
        checkpoint_config, point = _find_resume(server, config, secret)
        claim = _claim(registry, config, name, point)
        if claim.attach_to is not None and checkpoint_config.directory is None and checkpoint_config.resume:
            _remove_restart_snapshot(Path(checkpoint_config.resume))  # a live primary serves: its state is the one to copy
        checkpointer = _restore(server, config, ledger, secret, checkpoint_config, point if claim.attach_to is None else None)
        control.attach_checkpointer(checkpointer)
        service.durability = checkpointer
        if server.sparse is not None:
            server.sparse.start()
            logger.info("sparse tables %s (%s, lr %g)", sorted(server.sparse.tables), config.core.sparse.optimizer, config.core.sparse.lr)
        if checkpointer is not None:
            server.on_applied(lambda event: None if event.mirrored else checkpointer.on_applied(event))
        replica = ShardReplica(
            server, registry, config, name, rmetrics, ledger,
            on_primary=checkpointer.start if checkpointer is not None else lambda: None, on_restart=restart_now,
        )
        endpoints.publish(service)
        control.attach_replica(replica.state)
        if claim.attach_to is None:
            if ledger is not None:
                ledger.view(claim.record.view)
            replica.serve(claim.record)
        else:
            replica.follow(claim.attach_to)
    except CatchUpFailed as e:
        logger.warning("%s; restarting to claim the shard again", e)
        restart.append(str(e))
    except BaseException:
        if janitor is not None:
            janitor.stop()
        if store_guard is not None:
            store_guard.stop()
        control.stop(grace_s=0)
        http.shutdown()
        raise
    if restart:
        _leave_and_restart(control, janitor, store_guard, http, _snapshot_if_stepped_down(server, replica, checkpointer, config, ledger))
    store_host = transport.store_host()
    reaper = MembershipReaper(
        service, config.lease_s, store_host=store_host, secret=secret, failures=metrics.reaper_ping_failures
    )
    reaper.start()
    # A restarted coordinator serves an empty store: this server writes its records back too (the
    # view: its keeper; its membership: the transport).
    if (rebuild := transport.store_rebuild()) is not None:
        rebuild.on_restart(lambda: registry.claim_shard_count(config.core.shard_count))
        # held_state: a server starting from a snapshot waits for this one to put the view back (ps.replication.claim).
        rebuild.on_restart(lambda: registry.put_replica(name, {**own_record, "held_state": True}))
    trimmer = memory.start_trimming(config.process.malloc_trim_s)  # after start-up, which leaves the most behind
    listener = ListenerWatch(exclude_ports={config.listen.port, metrics_port, control.port})
    recovery = ListenerRecovery(time.monotonic(), transport.membership.ranks_handed_out)
    control.set_serving(True)
    supervisor.note_serving()
    logger.info(  # rpcps local reads this line (cli/progress.py SERVING_LINE): keep its start
        "serving on %s as %s (send SIGTERM or Ctrl-C to stop)%s",
        config.listen if config.hosts_store else f"the group of {config.store_address}", name,
        "; registrations must prove the job secret" if secret is not None else "",
    )
    restart_from: str | None = None
    store_lost = False
    try:
        progress = _Progress(server, service, config.progress_s)
        while not stop.wait(1.0):
            progress.maybe_log()
            if listener.lost():
                _on_listener_lost(server, listener, recovery)
            why = recovery.restart_due(time.monotonic())
            if why is not None:
                logger.warning("restarting this server to listen again: %s", why)
                restart_from = _snapshot_for_restart(server, checkpointer, config, ledger)
                break
            if reaper.store_host_lost and not store_lost:
                store_lost = True
                if store_host == transport.COORDINATOR_NAME:
                    # It holds no training state and comes back (supervised) on the same port: serve on.
                    logger.warning("the group's coordinator %s is gone; serving on (joins and failovers wait for it to come back)",
                                   store_host)
                    continue
                restart_from = _on_store_lost(server, replica, checkpointer, config, ledger)
                if restart_from is not None:
                    break
        if asked_to_stop.is_set():
            replica.stop_following()  # a standby that is told to end must not promote or restart on the way out
            restart.clear()
        if restart:
            logger.warning("restarting this server process: %s", restart[0])
            restart_from = _snapshot_if_stepped_down(server, replica, checkpointer, config, ledger) or restart_from
        else:
            logger.info("stopping")
            control.set_serving(False)
            if finish_workers.is_set():
                _finish_workers(server, config.finish_timeout_s)
            server.stop()
            if checkpointer is not None and restart_from is None and replica.primary is not None and not server.deposed:
                checkpointer.stop(final=True)
            replica.stop()
            write_summary(config.process.summary_json, service.summary())
    finally:
        control.stop(grace_s=5)
        reaper.stop()
        if trimmer is not None:
            trimmer.stop()
        if janitor is not None:
            janitor.stop()
        if store_guard is not None:
            store_guard.stop()
        if server.sparse is not None:
            server.sparse.stop()
        endpoints.withdraw()
        transport.shutdown()
        http.shutdown()
    if restart_from is not None:
        lost = metrics.registry.get_sample_value("rpcps_server_rpc_listener_lost_total") or 0
        restart_self({RESTART_FROM_ENV: restart_from, LISTENER_LOST_ENV: str(int(lost))})
    if restart:
        restart_self({})
    return 0


def _leave_and_restart(
    control: ControlServer, janitor: Janitor | None, store_guard: StoreGuard | None, http: object, restart_from: str | None = None
) -> NoReturn:
    """Restarts a process that could not take its place in the shard (it claims it again, afresh;
    from ``restart_from``, a primary's exact state, when it stepped down at once)."""
    if janitor is not None:
        janitor.stop()
    if store_guard is not None:
        store_guard.stop()
    control.stop(grace_s=0)
    endpoints.withdraw()
    transport.shutdown()
    http.shutdown()  # type: ignore[attr-defined]
    time.sleep(0.5)  # whatever it could not attach to may be changing hands right now
    restart_self({RESTART_FROM_ENV: restart_from} if restart_from is not None else {})


def _on_store_lost(
    server: ParameterServer, replica: ShardReplica, checkpointer: Checkpointer | None, config: ServerRunConfig,
    ledger: AuditLog | None,
) -> str | None:
    """The group's store host is gone: no join or view change can happen in this group any more.

    A primary stops and writes its exact state, then restarts from it into the store's successor.
    A standby keeps following until its primary stops; its promotion then fails (no store), and it
    restarts to *attach only*: it must never start the shard from a snapshot older than the one its
    primary is writing. Returns the snapshot to restart from (None for a standby).
    """
    if replica.primary is None:
        logger.error("the group's store host is gone; rejoining its successor as a standby once this shard's primary stops")
        os.environ[ATTACH_ONLY_ENV] = "1"
        return None
    logger.error("the group's store host is gone; snapshotting and rejoining its successor")
    path = _snapshot_for_restart(server, checkpointer, config, ledger)
    replica.stop()
    return path


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


def _snapshot_if_stepped_down(
    server: ParameterServer, replica: ShardReplica, checkpointer: Checkpointer | None, config: ServerRunConfig,
    ledger: AuditLog | None,
) -> str | None:
    """A primary that stepped down with no standby in its view (whatever deposed it: a newer view, a
    failed compare-and-set) holds updates no other process has: it writes its exact state and
    restarts from it, so nothing since the newest snapshot is lost. Should a live primary serve the
    shard by then, the restarted process attaches to it instead (and removes a private snapshot).
    Returns the snapshot's path, or None when there is nothing to keep (a standby, or a view with a
    standby, which holds every committed update)."""
    primary = replica.primary
    if primary is None or not server.deposed or primary.record.view.standby is not None:
        return None
    path = _snapshot_for_restart(server, checkpointer, config, ledger, stepping_down=True)
    logger.warning("stepped down with no standby: wrote the exact state (version %d) to %s to restart from", server.version, path)
    return path


def _snapshot_for_restart(
    server: ParameterServer, checkpointer: Checkpointer | None, config: ServerRunConfig, ledger: AuditLog | None,
    stepping_down: bool = False,
) -> str:
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
            server, CheckpointConfig(directory=directory, every_seconds=None), _meta(server, config), server.metrics, ledger
        )
    else:
        checkpointer.stop(final=False)
    path, _ = checkpointer.checkpoint_now(stepping_down=stepping_down)
    return path


def _find_resume(
    server: ParameterServer, config: ServerRunConfig, secret: JobSecret | None
) -> tuple[CheckpointConfig, ResumePoint | None]:
    """Where this shard's snapshots live, and the one to resume from per --resume (None: start fresh)."""
    checkpoint_config = shard_checkpoint_config(config.checkpoint, config.core.shard_index, config.core.shard_count)
    restart_from = os.environ.pop(RESTART_FROM_ENV, None)
    if restart_from:  # this process restarted itself from a snapshot it just wrote
        checkpoint_config = replace(checkpoint_config, resume=restart_from)
    point = find_resume_point(checkpoint_config, server.signature, config.core.optimizer_name, server.partition_digest, _signer(config, secret))
    return checkpoint_config, point


def _claim(registry: Registry, config: ServerRunConfig, name: str, point: ResumePoint | None) -> Claim:
    """Becomes the shard's primary (bootstrap or takeover), or learns which live primary serves it."""
    epoch = int(point[1].get("epoch", 0)) if point is not None else 0
    replication = config.replication
    return claim_shard(
        registry, config.core.shard_index, name, epoch + 1, lambda: set(membership.store_members()),
        absent_grace_s=replication.store_lease_s + 1.0, timeout_s=config.transport.connect_timeout_s + replication.store_lease_s,
        attach_only=os.environ.pop(ATTACH_ONLY_ENV, "") == "1", from_snapshot=point is not None,
    )


def _restore(
    server: ParameterServer, config: ServerRunConfig, ledger: AuditLog | None, secret: JobSecret | None,
    checkpoint_config: CheckpointConfig,
    point: ResumePoint | None,
) -> Checkpointer | None:
    """Restores the server from ``point``; returns the checkpointer (None when checkpointing is off)."""
    if point is not None:
        info, state = point
        server.restore_state(state)
        if checkpoint_config.directory is None and checkpoint_config.resume:
            _remove_restart_snapshot(Path(checkpoint_config.resume))
        if ledger is not None:
            ledger.resumed(info.version)
        server.metrics.resumes.inc()
        server.metrics.resumed_version.set(info.version)
        logger.info("resumed from %s at version %d", info.path, info.version)  # read by rpcps local (cli/progress.py)
    if checkpoint_config.directory is None:
        # rpcps local says this once on its console and starts its servers with --checkpoints-off-ok.
        logger.log(
            logging.INFO if config.process.checkpoints_off_ok else logging.WARNING,
            "checkpointing is off (no --checkpoint-dir): a server crash loses all training, and finishing "
            "workers cannot make their steps durable",
        )
        return None
    Path(checkpoint_config.directory).mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(server, checkpoint_config, _meta(server, config), server.metrics, ledger, _signer(config, secret))
    if point is not None:
        checkpointer.adopt(*point)
    _report_rolled_back(server, checkpointer)
    return checkpointer


def _signer(config: ServerRunConfig, secret: JobSecret | None) -> Any:
    """What signs and verifies snapshot manifests (--sign-checkpoints), or None."""
    return secret.manifest_signature if secret is not None and config.checkpoint.sign else None


def _remove_restart_snapshot(path: Path) -> None:
    """Deletes the private restart snapshot this process just resumed from (see _snapshot_for_restart)."""
    if path.parent.name.startswith(_RESTART_DIR_PREFIX):
        shutil.rmtree(path.parent, ignore_errors=True)
        logger.info("removed the restart snapshot %s", path)


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
        "optimizer": config.core.optimizer_name,
        "shard_index": config.core.shard_index,
        "shard_count": config.core.shard_count,
        "partition_digest": server.partition_digest,
        "config": json.loads(json.dumps(asdict(config), default=str)),
    }


def _join_group(config: ServerRunConfig, secret: JobSecret | None) -> str:
    """Hosts the group's store (no --store) or joins it, under a fresh name ``ps<K>_r<rank>``. Returns the name."""
    base = endpoints.server_name(config.core.shard_index)
    if config.hosts_store:
        name = f"{base}_r0"  # the store's host is rank 0
        transport.serve(config.listen, name, config.transport, secret)
        return name
    attempts = int(os.environ.get(JOIN_ATTEMPTS_ENV, "0"))
    try:
        name = transport.join(config.store_address, base, config.transport)
    except transport.JoinFailed as e:
        # Usually a member that just died is still listed; the group janitor removes it within
        # seconds. torch's agent is unusable after a failed join, so retry in a fresh process.
        if attempts >= 30:
            raise
        logger.warning("%s; retrying in a fresh process (attempt %d)", e, attempts + 1)
        time.sleep(1.0)
        restart_self({JOIN_ATTEMPTS_ENV: str(attempts + 1)})
    os.environ.pop(JOIN_ATTEMPTS_ENV, None)
    return name


def _member_gone(service: WorkerService, metrics: ServerMetrics, name: str) -> None:
    """The embedded janitor removed ``name`` from the group: a worker's slot is dead from now on."""
    service.member_gone(name)
    metrics.workers_reaped.inc()


def _open_ledger(server: ParameterServer, config: ServerRunConfig, name: str) -> AuditLog | None:
    """The --audit-log ledger (one file per shard, shared by its replicas), listening to every apply."""
    if not config.audit_log:
        return None
    suffix = f".shard{config.core.shard_index}" if config.core.shard_count > 1 else ""
    ledger = AuditLog(config.audit_log + suffix, name)
    server.on_applied(ledger.on_applied)
    every = config.replication.digest_every
    if every is not None:
        server.on_applied(lambda event: ledger.digest(event.version, server.digest_locked()) if event.version % every == 0 else None)
    return ledger


def _replica_record(config: ServerRunConfig, metrics_port: int, control_port: int) -> dict[str, Any]:
    """What this process tells the group about itself (``ctl`` and the fault harness read it)."""
    return {
        "shard": config.core.shard_index, "pid": os.getpid(), "host": socket.gethostname(),
        "control": f"{config.control.addr}:{control_port}", "metrics": f"{config.process.metrics_addr}:{metrics_port}",
        "max_lag": config.replication.allowed_lag,  # workers keep that many acknowledged batches to recompute (worker.acked)
    }


def _flat_config(config: ServerRunConfig) -> dict[str, Any]:
    return {
        "listen": str(config.listen),
        "model": config.model,
        "optimizer": config.core.optimizer_name,
        "on_nonfinite": config.core.on_nonfinite,
        "transports": ",".join(config.transport.rpc_transports),
    }
