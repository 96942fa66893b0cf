"""The core's settings: the optimizer, the sparse tables, the consistency mode, the wire and the slots."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ps.core.optim import ADAM_OPTIMIZERS, OptimizerConfig
from ps.core.outer import OUTER_NAME, OuterConfig
from ps.sparse.store import SparseConfig
from rpcps.messages import Mode
from rpcps.settings import setting
from rpcps.signature import DEFAULT_CHUNK_BYTES
from rpcps.wire import WIRE_DTYPES

_MIB = 1024 * 1024
DEFAULT_PREDICT_AHEAD = 1.0
MAX_PREDICT_AHEAD = 8.0
ADAM_DEFAULT_BETA1 = 0.9
DEFAULT_ASYNC_BETA2 = 0.99
"""Adam's beta2 under async and bounded: torch's 0.999 averages squared gradients over ~1,000
updates, 0.99 over ~100, so the step a stale gradient takes is scaled by what gradients are now.
0.95 helped the transformer more and cost the digits CNN up to 3 accuracy points
(docs/EXAMPLES.md, "Staleness remedies")."""


@dataclass(kw_only=True, frozen=True)
class ServerCoreConfig:
    """Parameters and updates."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    mode: Mode = setting(
        Mode.ASYNC,
        help="async: apply every push; bounded: refuse pushes staler than --max-staleness (the worker recomputes them); "
        "sync: one step per round from the averaged gradients of the live workers; "
        "local-steps: workers take --local-steps H steps and push parameter deltas, applied by the outer SGD "
        "(--outer-lr, --outer-momentum) instead of --optimizer",
    )
    max_staleness: int | None = setting(
        None, help="with --mode bounded: the largest staleness (in updates) an applied gradient may have", metavar="K"
    )
    round_timeout_s: float = setting(30.0, help="with --mode sync: close a round this long after it opened, with whoever contributed")
    min_workers: int = setting(
        1,
        help="the workers the job expects: with --mode sync, rounds wait (up to --round-timeout-s) for this many; "
        "with --mode local-steps, the default --outer-lr is 1 / this; local sets it to --workers",
    )
    predict_ahead: float = setting(
        DEFAULT_PREDICT_AHEAD,
        help="async and bounded with adam/adamw: pulls get the parameters moved ahead along the last update by this many "
        "times the recent mean staleness, where the push will land (weight prediction; 0: off; docs/EXAMPLES.md)",
        metavar="FACTOR",
    )
    async_beta2: float = setting(
        DEFAULT_ASYNC_BETA2,
        help="async and bounded with adam/adamw, unless --optimizer-args sets betas: Adam's beta2 (torch's own is 0.999); "
        "a shorter memory of squared gradients makes stale gradients cost less (docs/EXAMPLES.md)",
        metavar="B",
    )
    staleness_lr: bool = setting(
        True,
        help="async and bounded: a gradient k >= 2 updates old steps with the learning rate / k (Zhang et al. 2016); "
        "fresh and one-update-old gradients keep the full rate (docs/EXAMPLES.md)",
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
            raise ValueError(f"mode must be one of {[m.value for m in Mode]}, got {self.mode!r}")
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
        if not 0 <= self.predict_ahead <= MAX_PREDICT_AHEAD:
            raise ValueError(f"predict_ahead must be in [0, {MAX_PREDICT_AHEAD:g}] (0 turns weight prediction off), got {self.predict_ahead}")
        if not 0 <= self.async_beta2 < 1:
            raise ValueError(f"async_beta2 must be in [0, 1) (0.999 is torch's own), got {self.async_beta2}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.mode == Mode.LOCAL_STEPS and self.optimizer.schedule is not None:
            raise ValueError("--lr-schedule steps the --optimizer of the gradient modes; --mode local-steps steps the outer optimizer (--outer-lr)")

    @property
    def optimizer_name(self) -> str:
        """The optimizer the server steps: the outer one in local-steps mode, else --optimizer."""
        return OUTER_NAME if self.mode == Mode.LOCAL_STEPS else self.optimizer.name

    @property
    def applied_optimizer(self) -> OptimizerConfig:
        """--optimizer as the server builds it: under async and bounded, Adam's beta2 is --async-beta2
        unless --optimizer-args names the betas (beta1 stays torch's default)."""
        named = self.optimizer.optimizer_kwargs
        if self.mode not in (Mode.ASYNC, Mode.BOUNDED) or self.optimizer.name not in ADAM_OPTIMIZERS or "betas" in named:
            return self.optimizer
        return replace(self.optimizer, kwargs={**named, "betas": (ADAM_DEFAULT_BETA1, self.async_beta2)})

    @property
    def scales_lr_by_staleness(self) -> bool:
        """Each applied gradient's learning rate is scaled by ``rpcps.staleness.lr_inverse`` of its staleness."""
        return self.staleness_lr and self.mode in (Mode.ASYNC, Mode.BOUNDED)

    @property
    def optimizer_settings(self) -> str:
        """What the optimizer is built with, for logs and the replicas' comparison."""
        if self.mode == Mode.LOCAL_STEPS:
            return f"lr={self.outer.lr_for(self.min_workers):g} momentum={self.outer.momentum}"
        return str(sorted(self.applied_optimizer.optimizer_kwargs.items()))
