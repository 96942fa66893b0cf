"""The worker's settings (flags, environment and defaults are generated from these declarations)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rpcps import plugins
from rpcps.address import Address, EtcdAddress
from rpcps.process import ProcessOptions, loss_setting, model_setting
from rpcps.settings import setting
from rpcps.transport.config import TransportOptions

DEFAULT_METRICS_PORT = 9410
"""A worker's /metrics port is this plus its LOCAL_RANK, unless that is taken (then a free one)."""

DEFAULT_LOCAL_STEPS = 8
"""H when a server in --mode local-steps meets a worker without --local-steps."""

INNER_OPTIMIZERS = ("adamw", "adam", "sgd")
"""The CLI loop's inner optimizers in --mode local-steps (torch.optim's, by lowercase name)."""


def _torchrun_server(environ: Mapping[str, str]) -> str | None:
    """torchrun's MASTER_ADDR:MASTER_PORT, the server's address when --ps is not given."""
    host = environ.get("MASTER_ADDR")
    return f"{host}:{environ.get('MASTER_PORT', '29500')}" if host else None


@dataclass(kw_only=True, frozen=True)
class WorkerConfig:
    """Training."""

    worker_index: int = setting(0, help="this worker's slot (its data shard and recorded progress)", torchrun="RANK")
    num_workers: int = setting(1, help="number of worker slots sharing the data", torchrun="WORLD_SIZE")
    steps: int = setting(300, help="training steps for this slot, counted across restarts (a restarted worker resumes)")
    model: str = model_setting()
    data: str = setting(
        plugins.BUILTIN_DATA,
        help="data factory 'package.module:function(worker_index, num_workers)' -> iterable of (inputs, targets)",
        metavar="SPEC",
    )
    loss: str = loss_setting()
    device: str = setting("auto", help="auto (a GPU if present, else the CPU), cpu, cuda or cuda:N")
    pull_every: int = setting(1, help="refresh parameters every N steps")
    max_in_flight: int = setting(
        1, help="pushes on the wire before a worker waits for the oldest reply (1: each step computes on parameters its "
        "last push is in, so a lone async worker trains as one process; 2 overlaps a step with the last push, one update stale)"
    )
    heartbeat_s: float = setting(2.0, help="how often an otherwise idle worker tells the server it is alive")
    max_retries: int = setting(30, help="timeouts in a row on one call before a worker gives up on a hung server")
    max_consecutive_rejects: int = setting(10, help="rejected pushes in a row before a worker stops (exit 4)")
    topk_ratio: float | None = setting(
        None, help="send only this share of each gradient chunk (largest first), with error feedback", metavar="R"
    )
    prefetch_pull: bool = setting(
        True, help="parameters come back with the push replies (no pull call per step); off: every refresh pulls and waits"
    )
    failover_timeout_s: float = setting(
        15.0,
        help="a shard whose primary failed while its view named a standby: how long to wait for that standby to take "
        "over before restarting this worker to rejoin",
    )
    local_steps: int | None = setting(
        None, help=f"with a server in --mode local-steps: inner steps per push (default {DEFAULT_LOCAL_STEPS})", metavar="H"
    )
    inner_optimizer: str = setting(
        "adamw",
        help="with --mode local-steps: the worker's inner optimizer, on its fused kernel where the device has one "
        "(its state stays in this process)",
        choices=lambda: sorted(INNER_OPTIMIZERS),
    )
    inner_lr: float = setting(1e-3, help="with --mode local-steps: the inner optimizer's learning rate")
    overlap_rounds: bool = setting(
        True,
        help="with --mode local-steps: compute the next round while the last round's delta is on the wire, and fold "
        "its reply's parameters in between two inner steps, this worker's progress since kept on top (off: each round "
        "waits for that reply; always off with --topk-ratio)",
    )
    pause_poll_s: float = 0.5
    """How often a paused worker asks whether training resumed."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.worker_index < self.num_workers:
            raise ValueError(f"worker_index must be in [0, {self.num_workers}) for {self.num_workers} workers, got {self.worker_index}")
        if self.steps < 1:  # 0 used to succeed silently, having trained nothing
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.pull_every < 1:
            raise ValueError(f"pull_every must be >= 1, got {self.pull_every}")
        if not 1 <= self.max_in_flight <= 64:
            raise ValueError(f"max_in_flight must be in [1, 64], got {self.max_in_flight}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.topk_ratio is not None and not 0 < self.topk_ratio <= 1:
            raise ValueError(f"topk_ratio must be in (0, 1], got {self.topk_ratio}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.failover_timeout_s <= 0:
            raise ValueError(f"failover_timeout_s must be > 0, got {self.failover_timeout_s}")
        if self.local_steps is not None and self.local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {self.local_steps}")
        if self.inner_optimizer not in INNER_OPTIMIZERS:
            raise ValueError(f"inner optimizer {self.inner_optimizer!r} is not supported; choose one of {sorted(INNER_OPTIMIZERS)}")
        if not self.inner_lr > 0:
            raise ValueError(f"inner_lr must be > 0, got {self.inner_lr}")
        if self.max_consecutive_rejects < 1:
            raise ValueError(f"max_consecutive_rejects must be >= 1, got {self.max_consecutive_rejects}")


@dataclass(kw_only=True, frozen=True)
class WorkerRunConfig:
    """Worker process."""

    ps: Address | EtcdAddress | None = setting(
        None,
        help="HOST:PORT of the server (its --listen) or of the group's `rpcps store`; or etcd://HOST:PORT[,...]/PREFIX, "
        "the job's store in etcd (the servers' --store)",
        torchrun=_torchrun_server, metavar="HOST:PORT",
    )
    metrics_port: int | None = setting(
        None,
        help=f"worker /metrics port; 0 picks a free one; unset: {DEFAULT_METRICS_PORT} + LOCAL_RANK, "
        "or a free one (logged) when that is taken",
    )
    max_reconnects: int = setting(20, help="times a worker restarts itself to reach a replaced server before giving up")
    process: ProcessOptions = field(default_factory=ProcessOptions)
    transport: TransportOptions = field(default_factory=TransportOptions)
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    def __post_init__(self) -> None:
        if self.ps is None:
            raise ValueError("the server's address is required: --ps HOST:PORT (or RPCPS_PS, or torchrun's MASTER_ADDR/MASTER_PORT)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.max_reconnects < 0:
            raise ValueError(f"max_reconnects must be >= 0, got {self.max_reconnects}")
