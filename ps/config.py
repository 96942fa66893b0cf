"""The server process's settings: where it listens, checkpoints, control, replication, and the core's
settings (``ps.core.config``) inside them (flags, environment and defaults are generated from these
declarations). Each component's own settings live beside it: the optimizer's in ``ps.core.optim``,
the sparse tables' in ``ps.sparse.store``."""

from __future__ import annotations

from dataclasses import dataclass, field

from ps.core.config import ServerCoreConfig
from rpcps.address import Address, EtcdAddress
from rpcps.process import ProcessOptions, listen_setting, model_setting, trust_network_setting
from rpcps.settings import setting
from rpcps.transport.config import TransportOptions


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
        "a vanished shard is taken over only after it; with --store etcd://, also the etcd lease of its claim (whole seconds, "
        "rounded up), whose end lets another server take the shard over at once",
    )
    coordinator_wait_s: float = setting(
        60.0,
        help="a standby whose primary died while the group's coordinator (rpcps store) was down waits this long for it to "
        "come back and take the promotion, before it restarts to claim the shard again",
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
        if not self.coordinator_wait_s >= 0:
            raise ValueError(f"coordinator_wait_s must be >= 0, got {self.coordinator_wait_s}")
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

    listen: Address = listen_setting("where this server hosts the group's rendezvous store (without --store); workers use it as --ps")
    store: Address | EtcdAddress | None = setting(
        None,
        help="HOST:PORT of the group's store to join: a `rpcps store` coordinator, or shard 0's --listen; or "
        "etcd://HOST:PORT[,HOST:PORT...]/PREFIX: the job's coordination state in an etcd cluster under a prefix of its "
        "own (docs/FAULT_TOLERANCE.md), over TLS with ?cacert=FILE[&cert=FILE&key=FILE] (docs/SECURITY.md); unset: this "
        "server hosts the store itself at --listen",
        metavar="HOST:PORT",
    )
    model: str = model_setting()
    metrics_port: int = setting(9400, help="server /metrics port; 0 picks a free one (logged)")
    lease_s: float = setting(10.0, help="a worker silent this long is checked and removed if its process is gone")
    progress_s: float = setting(5.0, help="seconds between progress log lines")
    audit_log: str | None = setting(
        None, help="append a ledger of every applied update to this file (fault-injection checks)", metavar="PATH"
    )
    trust_network: bool = trust_network_setting("every process's")
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
