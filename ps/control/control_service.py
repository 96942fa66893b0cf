"""Serves the Control API and the standard gRPC Health service for one parameter server.

What lives here: the servicer that turns Control calls into calls on the server (``Steerable``), the
checkpoint hook and the shutdown callback; the gRPC server around it (port, TLS, token); health
states. What must not: checkpoint writing (``CheckpointHook``), the shutdown sequence itself (the
runner, through ``request_shutdown``), anything on the training data path.

Health: overall ("") and ``rpcps.control.v1.Control`` start NOT_SERVING, turn SERVING when the runner
calls ``set_serving(True)`` (model loaded, resume done), and go back to NOT_SERVING for good once a
shutdown is requested or the server stops.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from ps.checkpoints.sparse_export import export_files, live_tables
from ps.config import ControlConfig
from ps.control import control_pb2, control_pb2_grpc
from ps.control.auth import TokenInterceptor, read_token, warn_if_readable_by_others
from ps.control.hooks import CheckpointHook, ReplicaState
from ps.core.server import CONTROL_APPLY_TIMEOUT_S
from rpcps.errors import NotPrimary
from rpcps.logsafe import MESSAGE_LIMIT, peer_text
from rpcps.model_file import to_bytes
from rpcps.sparse.export_files import DEFAULT_PART_ROWS, SUFFIX, PartFile

if TYPE_CHECKING:
    import torch

    from ps.core.server import ServerStatus
    from ps.sparse.store import SparseStore
    from ps.sparse.table import ClosedFull

logger = logging.getLogger(__name__)

CONTROL_SERVICE: str = control_pb2.DESCRIPTOR.services_by_name["Control"].full_name
METHODS = tuple(m.name for m in control_pb2.DESCRIPTOR.services_by_name["Control"].methods)
EXPORT_PIECE_BYTES = 1 << 20
_NOT_APPLIED = (
    "the {action} is in the server's log but was not applied within {took:g}s: its standby has not acknowledged it "
    "(it applies once the standby does, or once the standby is dropped); ask for the status, and retry if it did not change"
)
"""Under gRPC's default 4 MiB message limit, so no client needs to raise it."""


class Steerable(Protocol):
    """What the control plane sees of the server (``ps.core.server.ParameterServer``)."""

    version: int

    @property
    def paused(self) -> bool: ...

    def pause(self) -> bool: ...

    def resume(self) -> bool: ...

    def status(self) -> ServerStatus: ...

    def model_state(self) -> tuple[int, dict[str, torch.Tensor]]: ...

    def model_export(self) -> tuple[int, dict[str, torch.Tensor], dict[str, list[ClosedFull]]]: ...

    @property
    def sparse(self) -> SparseStore | None: ...


class ControlMetrics:
    """Counts control calls by method and outcome, so refusals and failures show on /metrics."""

    CODES = tuple(c.name for c in grpc.StatusCode)

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "rpcps_control_requests", "Control-plane calls by method and gRPC status code.", ["method", "code"], registry=registry
        )
        self.checkpoint_unreadable = Counter(
            "rpcps_control_checkpoint_unreadable", "Status calls that could not read the newest snapshot.", registry=registry
        )

    @classmethod
    def of(cls, registry: CollectorRegistry) -> ControlMetrics:
        """The control series of ``registry``, registered on first use (a restarted control plane
        keeps counting where it left off instead of failing on duplicate series)."""
        with _METRICS_LOCK:
            metrics = _METRICS.get(registry)
            if metrics is None:
                metrics = _METRICS[registry] = cls(registry)
            return metrics

    def count(self, method: str, code: grpc.StatusCode) -> None:
        # Method names come from the wire on refused calls; anything unknown is folded into one
        # label value so a scanner cannot create unbounded series.
        self.requests.labels(method if method in METHODS else "unknown", code.name).inc()


_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, ControlMetrics] = weakref.WeakKeyDictionary()
_METRICS_LOCK = threading.Lock()


class _Refused(Exception):
    """A control call that cannot be honoured, with the status code and message the client sees."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_Handler = TypeVar("_Handler", bound=Callable[..., Any])


def _control_call(method: _Handler) -> _Handler:
    """Counts each call, maps _Refused to its status code and anything unexpected to INTERNAL."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: ControlServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            reply = method(self, request, context)
        except _Refused as e:
            logger.warning("control %s refused (%s): %s", name, e.code.name, peer_text(e.message, MESSAGE_LIMIT))  # may quote the request
            self.metrics.count(name, e.code)
            context.abort(e.code, e.message)
        except NotPrimary as e:  # a standby (or a replaced primary) changes nothing on its own
            logger.warning("control %s refused: %s", name, e)
            self.metrics.count(name, grpc.StatusCode.FAILED_PRECONDITION)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{e}; send {name} to the shard's primary (ctl status names it)")
        except Exception as e:  # the client gets a clean line; the traceback stays in the server log
            logger.exception("control %s failed", name)
            self.metrics.count(name, grpc.StatusCode.INTERNAL)
            context.abort(grpc.StatusCode.INTERNAL, f"{name} failed on the server: {type(e).__name__}: {e} (see the server log)")
        self.metrics.count(name, grpc.StatusCode.OK)
        return reply

    return wrapper  # type: ignore[return-value]


class ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(
        self,
        server: Steerable,
        checkpoint: CheckpointHook | None,
        request_shutdown: Callable[[], None],
        metrics: ControlMetrics,
        health_servicer: health.HealthServicer,
    ) -> None:
        self.server = server
        self.checkpoint = checkpoint
        self.replica: Callable[[], ReplicaState | None] | None = None
        """This process's replica status (``ps.replication.replica.ShardReplica.status``), once attached."""
        self.metrics = metrics
        self.health = health_servicer
        self._request_shutdown = request_shutdown
        # Guards pause/resume/shutdown and health together, so a late set_serving(True) cannot
        # undo the NOT_SERVING a concurrent Shutdown just set.
        self._lock = threading.Lock()
        # One control-plane checkpoint at a time: a second request waits for the first instead of
        # racing it for the same directory.
        self._checkpoint_lock = threading.Lock()
        self.shutdown_requested = False
        self.set_serving(False)

    def set_serving(self, serving: bool) -> bool:
        """Sets overall and Control health; returns False (and changes nothing) when asked to serve
        after a shutdown was requested."""
        with self._lock:
            if serving and self.shutdown_requested:
                return False
            _set_health(self.health, serving)
            return True

    @_control_call
    def GetStatus(self, request: control_pb2.GetStatusRequest, context: grpc.ServicerContext) -> control_pb2.GetStatusResponse:
        status = self.server.status()  # one consistent view, taken under the server's lock
        workers = [
            control_pb2.WorkerStatus(
                slot=w.slot, last_push_age_seconds=None if w.last_push_age_s is None else max(0.0, w.last_push_age_s)
            )
            for w in status.workers
            if w.live
        ]
        reply = control_pb2.GetStatusResponse(
            shard_index=status.shard_index,
            shard_count=status.shard_count,
            model_version=status.version,
            mode=str(status.mode),
            optimizer=status.optimizer,
            paused=status.paused,
            uptime_seconds=max(0.0, status.uptime_s),
            workers=workers,
            checkpointing_enabled=self.checkpoint is not None,
            shutting_down=self.shutdown_requested,
            server_id=status.server_id,
            intra_op_threads=status.intra_op_threads,
            thread_budget=status.thread_budget,
            host_processes=status.host_processes,
        )
        if self.checkpoint is not None:
            # Status must answer even when the checkpoint directory is unreadable: that is exactly
            # when an operator needs it, so the failure is reported in a field, not as an error.
            try:
                newest = self.checkpoint.newest()
            except (OSError, RuntimeError) as e:
                logger.warning("cannot read the newest snapshot for status: %s", e)
                self.metrics.checkpoint_unreadable.inc()
                reply.checkpoint_error = str(e)
                newest = None
            if newest is not None:
                path, version, committed = newest
                reply.newest_checkpoint.CopyFrom(
                    control_pb2.CheckpointInfo(path=path, version=version, age_seconds=max(0.0, time.time() - committed))
                )
        reply.slots.extend(self._slots(status))
        replica = self.replica() if self.replica is not None else None
        if replica is not None:
            reply.replica.CopyFrom(
                control_pb2.ReplicaStatus(
                    role=replica.role, epoch=replica.epoch, primary=replica.primary, standby=replica.standby or "",
                    lag_updates=replica.lag_updates, lag_seconds=replica.lag_seconds, failovers=replica.failovers,
                    configured=replica.configured, replication=replica.replication, max_lag=replica.max_lag,
                    unreplicated=replica.unreplicated,
                )
            )
        return reply

    def _slots(self, status: ServerStatus) -> list[control_pb2.SlotProgress]:
        """Every slot the server or its checkpoints know of: progress, durable progress, finished steps."""
        durable = self.checkpoint.durable_progress if self.checkpoint is not None else None
        finished = self.checkpoint.finished_slots() if self.checkpoint is not None else {}
        views = {w.slot: w for w in status.workers}
        slots = []
        for slot in sorted(set(views) | set(finished)):
            view = views.get(slot)
            progress = control_pb2.SlotProgress(
                slot=slot,
                next_step=view.next_step if view is not None else 0,
                finished_steps=finished.get(slot, 0),
                live=view is not None and view.live,
            )
            if durable is not None:
                progress.durable_next_step = durable.get(slot, 0)
            slots.append(progress)
        return slots

    @_control_call
    def Checkpoint(self, request: control_pb2.CheckpointRequest, context: grpc.ServicerContext) -> control_pb2.CheckpointResponse:
        if self.checkpoint is None:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "checkpointing is not configured on this server; restart it with --checkpoint-dir DIR",
            )
        if self.shutdown_requested:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION, "the server is shutting down and writes its final checkpoint itself"
            )
        with self._checkpoint_lock:
            started = time.monotonic()
            try:
                path, version = self.checkpoint.checkpoint_now()
            except OSError as e:
                raise _Refused(
                    grpc.StatusCode.UNAVAILABLE,
                    f"checkpoint failed: {e}; check free space and permissions of the checkpoint directory, then retry",
                ) from e
            except RuntimeError as e:
                raise _Refused(grpc.StatusCode.INTERNAL, f"checkpoint failed: {e}") from e
        logger.info("checkpoint on request: %s (version %d, %.2f s)", path, version, time.monotonic() - started)
        return control_pb2.CheckpointResponse(path=path, version=version)

    @_control_call
    def Pause(self, request: control_pb2.PauseRequest, context: grpc.ServicerContext) -> control_pb2.PauseResponse:
        with self._lock:
            if self.shutdown_requested:
                raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "the server is shutting down; pausing would stall it")
            changed = not self.server.paused
            if not self.server.pause():
                raise _Refused(grpc.StatusCode.UNAVAILABLE, _NOT_APPLIED.format(action="pause", took=CONTROL_APPLY_TIMEOUT_S))
        if changed:
            logger.info("paused on request at version %d: pushes are held until resume", self.server.version)
        return control_pb2.PauseResponse(changed=changed, model_version=self.server.version)

    @_control_call
    def Resume(self, request: control_pb2.ResumeRequest, context: grpc.ServicerContext) -> control_pb2.ResumeResponse:
        with self._lock:
            changed = self.server.paused
            if not self.server.resume():
                raise _Refused(grpc.StatusCode.UNAVAILABLE, _NOT_APPLIED.format(action="resume", took=CONTROL_APPLY_TIMEOUT_S))
        if changed:
            logger.info("resumed on request at version %d", self.server.version)
        return control_pb2.ResumeResponse(changed=changed, model_version=self.server.version)

    @_control_call
    def Shutdown(self, request: control_pb2.ShutdownRequest, context: grpc.ServicerContext) -> control_pb2.ShutdownResponse:
        with self._lock:
            if self.shutdown_requested:
                return control_pb2.ShutdownResponse(changed=False)
            self.shutdown_requested = True
            _set_health(self.health, False)
        logger.info("shutdown requested over the control plane; health is NOT_SERVING")
        self._request_shutdown()
        return control_pb2.ShutdownResponse(changed=True)


    @_control_call
    def ExportModel(self, request: control_pb2.ExportModelRequest, context: grpc.ServicerContext) -> Iterator[control_pb2.ExportModelChunk]:
        status = self.server.status()
        if status.shard_count > 1:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this server is shard {status.shard_index} of {status.shard_count} and holds only part of the model; "
                "`rpcps ctl checkpoint` every shard, then `rpcps export --checkpoint ROOT` exports it whole",
            )
        fmt = request.format or "torch"
        if self.server.sparse is not None:
            return self._export_directory(fmt, request)
        version, state = self.server.model_state()
        try:
            # Serialised before the first piece is sent, so a failure is a clean status, not half a file.
            data = to_bytes(state, fmt)
        except ValueError as e:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        logger.info("exporting the model of version %d (%d bytes, %s) on request", version, len(data), fmt)
        pieces = [data[i : i + EXPORT_PIECE_BYTES] for i in range(0, len(data), EXPORT_PIECE_BYTES)] or [b""]
        first = control_pb2.ExportModelChunk(data=pieces[0], model_version=version, total_bytes=len(data))
        return iter([first, *(control_pb2.ExportModelChunk(data=piece) for piece in pieces[1:])])

    def _export_directory(self, fmt: str, request: control_pb2.ExportModelRequest) -> Iterator[control_pb2.ExportModelChunk]:
        """A model with sparse tables: the export directory's files, one after another, built while
        they are sent (one part file in memory at a time, beside the tables' closed capture)."""
        if fmt not in SUFFIX:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"format must be torch or safetensors, got {fmt!r}")
        if request.part_rows < 0:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"part_rows must be >= 0, got {request.part_rows}")
        version, state, closed = self.server.model_export()
        logger.info("exporting the model of version %d with %d sparse tables (%s) on request", version, len(closed), fmt)
        files = export_files(state, live_tables(closed), fmt, {"model_versions": [version], "source": ["live server"]},
                             request.part_rows or DEFAULT_PART_ROWS, request.optimizer_state)
        return _file_pieces(version, files)


def _file_pieces(version: int, files: Iterator[tuple[str, bytes | PartFile]]) -> Iterator[control_pb2.ExportModelChunk]:
    first = True
    for path, content in files:
        data = content.data() if isinstance(content, PartFile) else content
        for i in range(0, max(len(data), 1), EXPORT_PIECE_BYTES):
            head: dict[str, Any] = {"path": path, "total_bytes": len(data), **({"model_version": version} if first else {})} if i == 0 else {}
            yield control_pb2.ExportModelChunk(data=data[i : i + EXPORT_PIECE_BYTES], **head)
            first = False


class ControlServer:
    """Handle on a running control plane, returned by ``start_control_server``."""

    def __init__(self, grpc_server: grpc.Server, servicer: ControlServicer, host: str, port: int) -> None:
        self._grpc_server = grpc_server
        self._servicer = servicer
        self._lock = threading.Lock()
        self._stopped = False
        self.host = host
        self.port = port
        """The bound port (the chosen one when the config asked for 0)."""

    @property
    def address(self) -> str:
        return f"{_bracket(self.host)}:{self.port}"

    @property
    def shutdown_requested(self) -> bool:
        return self._servicer.shutdown_requested

    def attach_checkpointer(self, checkpoint: CheckpointHook | None) -> None:
        """Connects the checkpointer once resume is done (the control plane starts before it)."""
        self._servicer.checkpoint = checkpoint

    def attach_replica(self, status: Callable[[], ReplicaState | None]) -> None:
        """Connects the process's replica status (known once it has claimed its shard)."""
        self._servicer.replica = status

    def set_serving(self, serving: bool) -> None:
        """SERVING once the model is loaded and any resume is done; NOT_SERVING when shutting down.

        Once a shutdown was requested or the server stopped, health stays NOT_SERVING.
        """
        if self._servicer.set_serving(serving):
            logger.info("control plane health: %s", "SERVING" if serving else "NOT_SERVING")
        else:
            logger.info("control plane health stays NOT_SERVING: shutting down")

    def stop(self, grace_s: float = 5.0) -> None:
        """Stops serving; calls in flight get ``grace_s`` seconds to finish. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        # Permanently NOT_SERVING: later set() calls are ignored by the health servicer.
        self._servicer.health.enter_graceful_shutdown()
        self._grpc_server.stop(grace_s).wait(grace_s + 5.0)
        logger.info("control plane on %s stopped", self.address)


def start_control_server(
    server: Steerable,
    config: ControlConfig,
    *,
    checkpoint: CheckpointHook | None,
    request_shutdown: Callable[[], None],
    registry: CollectorRegistry,
) -> ControlServer:
    """Starts the control plane and Health service in background threads; health is NOT_SERVING.

    Args:
        server: the parameter server to report on and pause/resume.
        config: where to listen and how to secure it.
        checkpoint: the checkpointer, or None when the server runs without --checkpoint-dir.
        request_shutdown: starts the graceful shutdown (finish workers, final checkpoint, exit);
            must return quickly, it runs on a control thread.
        registry: where the control-call counter is registered (the server's registry).

    Raises:
        OSError: the port cannot be bound, or a token/TLS file cannot be read.
        ValueError: the token file is empty or malformed.
    """
    token = read_token(config.token_file) if config.token_file else None
    if config.token_file:
        warn_if_readable_by_others(config.token_file)
    credentials = _server_credentials(config)
    metrics = ControlMetrics.of(registry)

    interceptors = []
    if token is not None:
        interceptors.append(
            TokenInterceptor(
                token,
                f"/{CONTROL_SERVICE}/",
                on_refused=lambda method: metrics.count(method.rsplit("/", 1)[-1], grpc.StatusCode.UNAUTHENTICATED),
            )
        )
    grpc_server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="control"),
        interceptors=interceptors,
        # Without this, gRPC sets SO_REUSEPORT and a second server on the same port starts "fine"
        # and steals half the calls; we want a clear bind error instead.
        options=[("grpc.so_reuseport", 0)],
    )
    health_servicer = health.HealthServicer()  # starts SERVING; the servicer sets NOT_SERVING at once
    servicer = ControlServicer(server, checkpoint, request_shutdown, metrics, health_servicer)
    control_pb2_grpc.add_ControlServicer_to_server(servicer, grpc_server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)

    target = f"{_bracket(config.addr)}:{config.port}"
    try:
        port = (
            grpc_server.add_secure_port(target, credentials) if credentials else grpc_server.add_insecure_port(target)
        )
    except RuntimeError as e:  # newer grpcio raises; older ones return 0 (below)
        raise OSError(f"cannot serve the control plane on {target}: {e}; choose another --control-port (0 picks a free one)") from e
    if port == 0:
        raise OSError(f"cannot serve the control plane on {target}; choose another --control-port (0 picks a free one)")
    grpc_server.start()
    handle = ControlServer(grpc_server, servicer, config.addr, port)
    logger.info(
        "control plane on %s (%s, %s)", handle.address, "TLS" if credentials else "plaintext",
        "token required" if token else "no token",
    )
    if token is None and config.addr not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "control plane on %s needs no token: anyone who can reach it can pause or stop training; "
            "pass --control-token-file", handle.address,
        )
    return handle


def _set_health(servicer: health.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in (health.OVERALL_HEALTH, CONTROL_SERVICE):
        servicer.set(service, status)


def _server_credentials(config: ControlConfig) -> grpc.ServerCredentials | None:
    if config.tls_cert is None or config.tls_key is None:
        return None
    return grpc.ssl_server_credentials([(_read_pem(config.tls_key, "--tls-key"), _read_pem(config.tls_cert, "--tls-cert"))])


def _read_pem(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise OSError(f"cannot read {flag} {path}: {e.strerror or e}") from e
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag} {path} is not a PEM file (no '-----BEGIN' line)")
    return data


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
