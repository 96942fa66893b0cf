"""The server's settings (flags, environment and defaults are generated from these declarations)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ps.optim import OPTIMIZERS, SCHEDULES, check_kwargs
from ps.sparse.row_optim import ROW_OPTIMIZERS
from rpcps.address import Address, EtcdAddress
from rpcps.messages import Mode
from rpcps.process import ProcessOptions, model_setting
from rpcps.settings import setting
from rpcps.signature import DEFAULT_CHUNK_BYTES
from rpcps.transport.config import TransportOptions
from rpcps.wire import WIRE_DTYPES

DEFAULT_LR = 3e-3
_MIB = 1024 * 1024


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """Optimizer (one, on the server)."""

    name: str = setting("adam", flag="--optimizer", help="the server's optimizer", choices=lambda: sorted(OPTIMIZERS))
    kwargs: dict[str, Any] | None = setting(
        None,
        flag="--optimizer-args",
        help="keyword arguments of the torch.optim class as JSON, e.g. '{\"lr\":0.1,\"momentum\":0.9,\"nesterov\":true}' "
        f"(unset: {{\"lr\": {DEFAULT_LR}}})",
        metavar="JSON",
    )
    lr: float | None = setting(None, help="learning rate; overrides lr in --optimizer-args")
    schedule: str | None = setting(
        None, flag="--lr-schedule", help="learning-rate schedule stepped once per applied update", choices=lambda: sorted(SCHEDULES)
    )
    schedule_kwargs: dict[str, Any] | None = setting(
        None, flag="--lr-schedule-args", help="schedule keyword arguments as JSON, e.g. '{\"T_max\":1000}'", metavar="JSON"
    )

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.name!r} is not supported; choose one of {sorted(OPTIMIZERS)}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        check_kwargs(OPTIMIZERS[self.name], self.optimizer_kwargs, f"optimizer {self.name!r}")
        if self.schedule is not None:
            if self.schedule not in SCHEDULES:
                raise ValueError(f"lr schedule {self.schedule!r} is not supported; choose one of {sorted(SCHEDULES)}")
            check_kwargs(SCHEDULES[self.schedule], self.schedule_kwargs or {}, f"lr schedule {self.schedule!r}")
        elif self.schedule_kwargs:
            raise ValueError("schedule_kwargs given without a schedule (--lr-schedule-args needs --lr-schedule)")

    @property
    def optimizer_kwargs(self) -> dict[str, Any]:
        """What the torch.optim class is built with: the JSON arguments, with --lr on top."""
        kwargs = dict(self.kwargs) if self.kwargs is not None else {"lr": DEFAULT_LR}
        if self.lr is not None:
            kwargs["lr"] = self.lr
        return kwargs


SPARSE_OPTIMIZERS = {cls.name: cls for cls in ROW_OPTIMIZERS}  # type: ignore[attr-defined]


@dataclass(kw_only=True, frozen=True)
class SparseConfig:
    """Sparse embedding tables (the tables a model declares; docs/SPARSE.md)."""

    optimizer: str = setting(
        "rowwise_adagrad", flag="--sparse-optimizer", help="row optimizer of every sparse table, applied in place on the server",
        choices=lambda: sorted(SPARSE_OPTIMIZERS),
    )
    lr: float = setting(0.05, flag="--sparse-lr", help="learning rate of the sparse row optimizer")
    init_scale: float = setting(0.01, flag="--sparse-init-scale", help="new rows start uniform in [-scale, scale) from (seed, table, id)")
    seed: int = setting(0, flag="--sparse-seed", help="seed of the deterministic row initialisation")
    admit_count: int | None = setting(
        None, flag="--sparse-admit-count", help="admit an id once it was pulled this many times (count-min, 4 MiB per table); "
        "unset admits on first sight", metavar="N",
    )
    ttl: int | None = setting(
        None, flag="--sparse-ttl", help="evict rows not updated for this many updates of their table", metavar="UPDATES"
    )
    max_rows: int | None = setting(
        None, flag="--sparse-max-rows", help="row cap per table on each server: a sweep above it evicts the least used down to 0.9 of it",
        metavar="N",
    )
    evict_every_s: float = setting(1.0, flag="--sparse-evict-every-s", help="seconds between eviction slices (off the request path)")
    full_every_deltas: int = setting(
        8, flag="--sparse-full-every-deltas", help="snapshots hold a delta of the sparse tables (rows changed since the previous "
        "one); every this many, or once the deltas outweigh the full, a full copy taken off the request path starts a new chain",
        metavar="N",
    )

    def __post_init__(self) -> None:
        if self.optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"sparse optimizer {self.optimizer!r} is not supported; choose one of {sorted(SPARSE_OPTIMIZERS)}")
        if not self.lr > 0:
            raise ValueError(f"sparse lr must be > 0, got {self.lr}")
        if not self.init_scale > 0:
            raise ValueError(f"sparse init_scale must be > 0, got {self.init_scale}")
        if self.admit_count is not None and not 1 <= self.admit_count <= 255:
            raise ValueError(f"sparse admit_count must be in [1, 255], got {self.admit_count}")
        if self.ttl is not None and self.ttl < 1:
            raise ValueError(f"sparse ttl must be >= 1, got {self.ttl}")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"sparse max_rows must be >= 1, got {self.max_rows}")
        if not self.evict_every_s > 0:
            raise ValueError(f"sparse evict_every_s must be > 0, got {self.evict_every_s}")
        if not 1 <= self.full_every_deltas <= 1000:
            raise ValueError(f"sparse full_every_deltas must be in [1, 1000], got {self.full_every_deltas}")


@dataclass(kw_only=True, frozen=True)
class ServerCoreConfig:
    """Parameters and updates."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    mode: Mode = setting(
        Mode.ASYNC,
        help="async: apply every push; bounded: refuse pushes staler than --max-staleness (the worker recomputes them); "
        "sync: one step per round from the averaged gradients of the live workers",
    )
    max_staleness: int | None = setting(
        None, help="with --mode bounded: the largest staleness (in updates) an applied gradient may have", metavar="K"
    )
    round_timeout_s: float = setting(30.0, help="with --mode sync: close a round this long after it opened, with whoever contributed")
    min_workers: int = setting(
        1, help="with --mode sync: rounds wait (up to --round-timeout-s) for this many workers; local sets it to --workers"
    )
    wire_dtype: str = setting(
        "fp32",
        help="dtype of gradients and parameters on the wire; the server keeps fp32 masters and optimizer state",
        choices=lambda: list(WIRE_DTYPES),
    )
    on_nonfinite: str = setting(
        "reject", help="NaN/Inf gradients: reject (an error on the worker) or skip (drop and count)", choices=lambda: ["reject", "skip"]
    )
    chunk_bytes: int = setting(
        DEFAULT_CHUNK_BYTES,
        flag="--chunk-mb",
        help="largest wire chunk in MiB (parameters are packed into chunks of at most this size)",
        parse=lambda text: int(float(text) * _MIB),
        show=lambda value: f"{value / _MIB:g}",
    )
    max_workers: int = setting(256, help="worker slots 0..N-1 this server accepts")
    shard_index: int = setting(0, help="this server's shard (shard 0 hosts the group's store at --listen)")
    shard_count: int = setting(1, flag="--shards", help="number of server shards the parameters are split over")

    def __post_init__(self) -> None:
        if self.mode not in set(Mode):
            raise ValueError(f"mode must be async, bounded or sync, got {self.mode!r}")
        object.__setattr__(self, "mode", Mode(self.mode))  # a plain string from code becomes the enum
        if self.mode == Mode.BOUNDED and self.max_staleness is None:
            raise ValueError("mode 'bounded' needs max_staleness (--max-staleness K)")
        if self.mode != Mode.BOUNDED and self.max_staleness is not None:
            raise ValueError("max_staleness applies to mode 'bounded' only (--mode bounded --max-staleness K)")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype {self.wire_dtype!r} is not supported; choose one of {sorted(WIRE_DTYPES)}")
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be >= 1, got {self.min_workers}")
        if self.round_timeout_s <= 0:
            raise ValueError(f"round_timeout_s must be > 0, got {self.round_timeout_s}")
        if self.shard_count < 1 or not 0 <= self.shard_index < self.shard_count:
            raise ValueError(f"shard_index must be in [0, shards), got {self.shard_index} of {self.shard_count}")
        if self.on_nonfinite not in ("reject", "skip"):
            raise ValueError(f"on_nonfinite must be 'reject' or 'skip', got {self.on_nonfinite!r}")
        if self.chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be >= 1024 (--chunk-mb 0.001), got {self.chunk_bytes}")
        if not 1 <= self.max_workers <= 32000:
            raise ValueError(f"max_workers must be in [1, 32000], got {self.max_workers}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Checkpoints."""

    directory: str | None = setting(
        None, flag="--checkpoint-dir", help="directory for snapshots; unset disables checkpointing", metavar="DIR"
    )
    every_updates: int | None = setting(
        None, flag="--checkpoint-every-updates", help="snapshot after this many applied updates", metavar="N"
    )
    every_seconds: float | None = setting(
        60.0, flag="--checkpoint-every-seconds", help="snapshot at most this often while updates arrive", metavar="T"
    )
    keep: int = setting(3, flag="--keep-checkpoints", help="newest snapshots to keep", metavar="K")
    resume: str = setting(
        "auto", help="auto (the newest valid snapshot), never, or a snapshot directory", metavar="auto|never|PATH"
    )
    sign: bool = setting(
        False,
        flag="--sign-checkpoints",
        help="sign every snapshot manifest with the job secret (HMAC) and resume only from signed ones: someone who "
        "can write the checkpoint directory but lacks the secret cannot plant a snapshot",
    )

    def __post_init__(self) -> None:
        if self.every_updates is not None and self.every_updates < 1:
            raise ValueError(f"checkpoint every_updates must be >= 1, got {self.every_updates}")
        if self.every_seconds is not None and self.every_seconds <= 0:
            raise ValueError(f"checkpoint every_seconds must be > 0, got {self.every_seconds}")
        if self.keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep}")


@dataclass(kw_only=True, frozen=True)
class ControlConfig:
    """Control plane (gRPC: status, checkpoint, pause, resume, shutdown; docs/CONTROL.md)."""

    addr: str = setting(
        "127.0.0.1",
        flag="--control-addr",
        help="address the gRPC control plane listens on; anything but loopback needs --control-token-file",
    )
    port: int = setting(9500, flag="--control-port", help="control-plane port; 0 picks a free one (logged)")
    token_file: str | None = setting(
        None, flag="--control-token-file", help="file holding the bearer token every control call must carry (recommended)",
        metavar="PATH",
    )
    tls_cert: str | None = setting(None, help="PEM certificate; with --tls-key the control plane speaks TLS only", metavar="PATH")
    tls_key: str | None = setting(None, help="PEM private key of --tls-cert", metavar="PATH")
    threads: int = 4
    """Threads answering control calls; a slow checkpoint holds one of them."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"control port must be in [0, 65535], got {self.port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: pass both for TLS, or neither for plaintext")
        if not 1 <= self.threads <= 64:
            raise ValueError(f"control threads must be in [1, 64], got {self.threads}")
        if not self.addr:
            raise ValueError("control addr must not be empty (use 0.0.0.0 for all interfaces)")


REPLICATION_MODES = ("sync", "async")
DEFAULT_MAX_REPLICA_LAG = 16
MAX_REPLICA_LAG_LIMIT = 4096
"""Each entry the standby lacks is kept in the primary's memory (a gradient of the shard's size)."""


@dataclass(kw_only=True, frozen=True)
class ReplicationConfig:
    """Replicas (a hot standby per shard; docs/FAULT_TOLERANCE.md).

    ``sync`` (the default): a push is acknowledged only once the standby holds it, so a failover
    loses no acknowledged update. ``async``: a push is acknowledged once applied here, and the
    standby follows at most ``max_replica_lag`` updates behind (pushes wait while it is that far
    behind), so a failover loses at most that many acknowledged updates, which their workers
    recompute (docs/FAULT_TOLERANCE.md).
    """

    replicas: int = setting(
        1,
        help="server processes per shard: 2 keeps a hot standby beside each primary that takes over within a second "
        "when it dies (local starts both; elsewhere start the same server command twice, with --store)",
    )
    replica_heartbeat_s: float = setting(0.1, help="the primary sends its standby an empty append after this long without one")
    replica_lease_s: float = setting(
        1.5, help="a standby that heard nothing from its primary this long promotes itself (a crash is noticed at once)"
    )
    standby_timeout_s: float = setting(
        1.0, help="a primary whose standby has not acknowledged waiting updates for this long drops it and goes on alone"
    )
    store_lease_s: float = setting(
        10.0,
        help="a primary without a standby stops applying when it cannot read its view from the store for this long; "
        "a vanished shard is taken over only after it",
    )
    digest_every: int | None = setting(
        None, help="write a digest of the state to the audit ledger every N versions (replicas compare them)", metavar="N"
    )
    replication: str = setting(
        "sync",
        help="sync: a push is acknowledged once the standby holds it (a failover loses nothing acknowledged); async: once "
        "applied here, with the standby at most --max-replica-lag updates behind (faster; a failover loses at most that many, "
        "which the workers recompute)",
        choices=lambda: list(REPLICATION_MODES),
    )
    max_replica_lag: int | None = setting(
        None,
        help=f"with --replication async: pushes wait while the standby is this many updates behind "
        f"(default {DEFAULT_MAX_REPLICA_LAG}; at most {MAX_REPLICA_LAG_LIMIT})",
        metavar="N",
    )

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 2:
            raise ValueError(f"replicas must be 1 or 2, got {self.replicas}")
        if self.replication not in REPLICATION_MODES:
            raise ValueError(f"replication must be one of {', '.join(REPLICATION_MODES)}, got {self.replication!r}")
        if self.max_replica_lag is not None:
            if self.replication != "async":
                raise ValueError(
                    f"max_replica_lag ({self.max_replica_lag}) bounds the standby's lag in asynchronous replication only: "
                    "add --replication async, or drop --max-replica-lag (a synchronous standby never lags an acknowledged update)"
                )
            if not 1 <= self.max_replica_lag <= MAX_REPLICA_LAG_LIMIT:
                raise ValueError(f"max_replica_lag must be in [1, {MAX_REPLICA_LAG_LIMIT}] updates, got {self.max_replica_lag}")
        if not 0 < self.replica_heartbeat_s <= 1.0:
            raise ValueError(f"replica_heartbeat_s must be in (0, 1], got {self.replica_heartbeat_s}")
        if not self.replica_lease_s >= 3 * self.replica_heartbeat_s:
            raise ValueError(
                f"replica_lease_s must be at least 3 x replica_heartbeat_s ({3 * self.replica_heartbeat_s:g}), "
                f"got {self.replica_lease_s}"
            )
        if not 0 < self.standby_timeout_s < self.replica_lease_s:
            raise ValueError(
                f"standby_timeout_s must be in (0, replica_lease_s={self.replica_lease_s:g}): a primary drops a silent "
                f"standby before that standby would promote itself; got {self.standby_timeout_s}"
            )
        if not self.store_lease_s >= 2.0:
            raise ValueError(f"store_lease_s must be >= 2, got {self.store_lease_s}")
        if self.digest_every is not None and self.digest_every < 1:
            raise ValueError(f"digest_every must be >= 1, got {self.digest_every}")

    @property
    def allowed_lag(self) -> int:
        """Entries applied and acknowledged here that the standby may not hold yet: 0 when synchronous."""
        if self.replication == "sync":
            return 0
        return DEFAULT_MAX_REPLICA_LAG if self.max_replica_lag is None else self.max_replica_lag


@dataclass(kw_only=True, frozen=True)
class ServerRunConfig:
    """Server process."""

    listen: Address = setting(
        Address("127.0.0.1", 29500),
        help="HOST:PORT where this server hosts the group's rendezvous store (without --store); workers use it as --ps. "
        "Anything but loopback needs --trust-network and --job-secret-file (docs/SECURITY.md)",
        metavar="HOST:PORT",
    )
    store: Address | EtcdAddress | None = setting(
        None,
        help="HOST:PORT of the group's store to join: a `rpcps store` coordinator, or shard 0's --listen; or "
        "etcd://HOST:PORT[,HOST:PORT...]/PREFIX: the job's coordination state in an etcd cluster under a prefix of its "
        "own (docs/FAULT_TOLERANCE.md); unset: this server hosts the store itself at --listen",
        metavar="HOST:PORT",
    )
    model: str = model_setting()
    metrics_port: int = setting(9400, help="server /metrics port; 0 picks a free one (logged)")
    lease_s: float = setting(10.0, help="a worker silent this long is checked and removed if its process is gone")
    progress_s: float = setting(5.0, help="seconds between progress log lines")
    audit_log: str | None = setting(
        None, help="append a ledger of every applied update to this file (fault-injection checks)", metavar="PATH"
    )
    trust_network: bool = setting(
        False,
        help="acknowledge that the RPC ports (--listen and every process's TensorPipe port) are reachable only from an "
        "isolated training network: torch RPC has no authentication or encryption (docs/SECURITY.md)",
    )
    supervise: bool = setting(
        True,
        help="run the server under a small supervisor process that restarts it from its newest snapshot when it "
        "crashes; off when something else restarts it and must see each crash (rpcps local)",
    )
    finish_timeout_s: float = 60.0
    """On a control-plane Shutdown: how long to wait for workers to finish before stopping anyway."""
    process: ProcessOptions = field(default_factory=ProcessOptions)
    transport: TransportOptions = field(default_factory=TransportOptions)
    core: ServerCoreConfig = field(default_factory=ServerCoreConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.lease_s <= 0 or self.progress_s <= 0:
            raise ValueError("lease_s and progress_s must be > 0")
        if self.core.shard_index > 0 and self.store is None:
            raise ValueError("--shard-index > 0 needs --store HOST:PORT (a `rpcps store` coordinator or shard 0's --listen)")
        if self.checkpoint.sign and (self.transport.job_secret_file is None or self.checkpoint.directory is None):
            raise ValueError("--sign-checkpoints signs snapshots with the job secret: it needs --job-secret-file and --checkpoint-dir")

    def check_replicas(self) -> None:
        """Raises ValueError for --replicas 2 without --store. Checked when a server starts, not in
        ``__post_init__``: ``rpcps local`` fills --store in for each of its servers itself."""
        if self.replication.replicas > 1 and self.store is None:
            raise ValueError(
                "--replicas 2 needs --store HOST:PORT: a standby cannot take over from a primary that hosts the group's "
                "store; start `rpcps store --listen HOST:PORT` and give every replica --store"
            )

    @property
    def hosts_store(self) -> bool:
        """This server hosts the group's store (at --listen) instead of joining one (--store)."""
        return self.store is None

    @property
    def store_address(self) -> Address | EtcdAddress:
        """Where the group's store is: this server's own --listen, or --store."""
        return self.listen if self.store is None else self.store
