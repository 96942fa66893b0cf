"""The torch.distributed.rpc transport under both roles: start-up, failure classification, shutdown.

Everything that touches torch RPC's process-group machinery lives here or in ``rpc_membership``, so
another transport can replace it later without touching the server's or the worker's logic.

The group is *dynamic* (``world_size=None``): the server is rank 0 and hosts the rendezvous store
on its ``--listen`` address; every worker process takes a fresh rank from a counter in that store, so
a restarted worker never collides with the rank of a dead one.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import rpc

logger = logging.getLogger(__name__)

SERVER_NAME = "ps0"
"""Shard 0, which also hosts the group's rendezvous store."""
_RANK_COUNTER_KEY = "rpcps/next_rank"
_MAX_RANK = 32767  # TensorPipe ranks are int16


@dataclass(kw_only=True, frozen=True)
class TransportConfig:
    host: str = "127.0.0.1"
    """Address of the server's rendezvous store (the server's --listen host)."""
    port: int = 29500
    """Port of the server's rendezvous store (the server's --listen port)."""
    rpc_timeout_s: float = 30.0
    """Default deadline of one RPC; a hung peer fails calls after this instead of blocking forever."""
    num_worker_threads: int = 32
    """Threads that run incoming RPCs in this process."""
    transports: tuple[str, ...] = ("uv",)
    """TensorPipe transports. 'uv' (TCP) by default: the 'shm' transport busy-polls a core per
    process, which on small machines costs more than its faster copies gain (docs/BENCHMARKS.md)."""
    channels: tuple[str, ...] = ("basic",)
    """TensorPipe channels for tensor payloads."""
    connect_timeout_s: float = 60.0
    """How long a worker waits for its server's store to answer before giving up."""
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("rpc_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 1 <= self.num_worker_threads <= 1024:
            raise ValueError(f"num_worker_threads must be in [1, 1024], got {self.num_worker_threads}")
        known_transports, known_channels = {"uv", "shm", "ibv"}, {"basic", "cma", "mpt_uv", "xth", "cuda_ipc", "cuda_basic", "cuda_gdr", "cuda_xth"}
        for t in self.transports:
            if t not in known_transports:
                raise ValueError(f"unknown TensorPipe transport {t!r}; choose from {sorted(known_transports)}")
        for c in self.channels:
            if c not in known_channels:
                raise ValueError(f"unknown TensorPipe channel {c!r}; choose from {sorted(known_channels)}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def server_name(shard: int) -> str:
    return f"ps{shard}"


class TransportError(RuntimeError):
    """The transport could not start (port in use, server unreachable)."""


class JoinFailed(TransportError):
    """The server's store answered but joining the RPC group failed; a fresh process may succeed."""


def _options(config: TransportConfig, device_maps: dict[str, dict] | None = None) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=config.num_worker_threads,
        rpc_timeout=config.rpc_timeout_s,
        init_method=f"tcp://{config.host}:{config.port}",
        _transports=list(config.transports),
        _channels=list(config.channels),
        device_maps=device_maps or None,
    )


def start_server(config: TransportConfig) -> None:
    """Hosts the rendezvous store on config.host:port and joins the group as rank 0."""
    try:
        rpc.init_rpc(SERVER_NAME, rank=0, world_size=None, rpc_backend_options=_options(config))
    except (RuntimeError, dist.DistError) as e:
        text = str(e)
        if "Address already in use" in text or "EADDRINUSE" in text:
            raise TransportError(
                f"port {config.port} on {config.host} is already in use; stop whatever holds it or pick another --listen port"
            ) from e
        raise TransportError(f"could not start the RPC server on {config.address}: {text.splitlines()[0]}") from e


def start_worker(config: TransportConfig, slot: int) -> str:
    """Waits for the server's store, takes a fresh rank and joins the group. Returns the RPC name."""
    return _join(config, f"worker{slot}")


def start_shard(config: TransportConfig, shard: int) -> str:
    """Joins shard 0's group as server shard ``shard`` (> 0) under its fixed name ``ps<shard>``."""
    return _join(config, server_name(shard), fixed_name=True)


def _join(config: TransportConfig, base_name: str, fixed_name: bool = False) -> str:
    unreachable = TransportError(
        f"no parameter server answered at {config.address} within {config.connect_timeout_s:g}s; "
        "start it with `rpcps ps --listen HOST:PORT` or check --ps / --connect-timeout-s"
    )
    deadline = time.monotonic() + config.connect_timeout_s
    if not _wait_for_listener(config.host, config.port, deadline):
        raise unreachable
    try:
        store = dist.TCPStore(
            config.host,
            config.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0)),
        )
        rank = int(store.add(_RANK_COUNTER_KEY, 1))
    except (RuntimeError, dist.DistError) as e:
        raise unreachable from e
    if rank > _MAX_RANK:
        raise TransportError(f"the server at {config.address} has handed out {rank} ranks; restart it to reset the counter")
    # torch parses its member list as "name-rank,": a '-' in a name breaks every later join.
    # Workers get a fresh name per process; a server shard keeps its name (workers look it up).
    name = base_name if fixed_name else f"{base_name}_r{rank}"
    try:
        rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=_options(config))
    except (RuntimeError, dist.DistError) as e:
        raise JoinFailed(f"could not join the server at {config.address}: {str(e).splitlines()[0]}") from e
    return name


def _wait_for_listener(host: str, port: int, deadline: float) -> bool:
    """Polls with plain TCP connects until something listens on the server's store port.

    c10d's store client prints a C++ stack trace to stderr for every failed connect; waiting here
    first keeps a worker started before its server (or pointed at the wrong port) quiet, with one
    clear error at the deadline. This probes the store's port only: a bare connect to TensorPipe's
    own listening port can wedge that agent (shared/research/torch-rpc-facts.md).
    """
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(), 1.0), 0.1)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)


def leave_group(name: str, timeout_s: float = 5.0) -> bool:
    """Asks the server to drop this process from the group's member list before it exits.

    A process that exits while still listed makes every join in the meantime fail (and then hold
    the group token for the store's timeout), until the server's reaper notices it is gone. Returns
    True when the server confirmed; False (logged at debug) when it could not be asked in time.
    """
    from rpcps import rpc_membership

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answer = rpc.rpc_sync(
                SERVER_NAME, rpc_membership.forget_me, args=(name,), timeout=max(deadline - time.monotonic(), 0.5)
            )
        except RuntimeError as e:
            logger.debug("could not leave the RPC group: %s", str(e).splitlines()[0])
            return False
        if answer != "busy":
            return True
        if time.monotonic() > deadline:
            logger.debug("could not leave the RPC group: a join held the group token for %.0fs", timeout_s)
            return False
        time.sleep(0.05)  # a join holds the token for milliseconds


def shutdown() -> None:
    """Local, non-graceful shutdown: a graceful one waits forever on any dead peer."""
    try:
        rpc.shutdown(graceful=False)
    except Exception as e:  # noqa: BLE001 - shutting down must not raise over the real error
        logger.debug("rpc shutdown: %s", e)


TIMEOUT = "timeout"
PEER_DEAD = "peer_dead"
OTHER = "other"

_DEAD_MARKERS = ("eof", "econnreset", "econnrefused", "connection reset", "connection refused", "broken pipe", "epipe", "pipe closed", "rpc agent is not running", "shutdown",
                 # The peer is alive but removed us from its group (we were unreachable past the lease,
                 # e.g. a cut link that healed): only a fresh process that rejoins can talk to it again.
                 # Seen by tests/integration/test_multihost.py as "... could not find destination id 2".
                 "could not find destination id")


def classify_failure(error: BaseException) -> str:
    """Tells a hung peer (timeout: retry later) from a dead one (reconnect) from everything else.

    torch RPC raises plain RuntimeErrors for all of them, so the message is all there is; the
    markers are pinned by integration tests that kill and stop real processes.
    """
    text = str(error).lower()
    if "ran for more than set timeout" in text or "rpcerr:1" in text or "timed out" in text:
        return TIMEOUT
    if any(marker in text for marker in _DEAD_MARKERS):
        return PEER_DEAD
    return OTHER
