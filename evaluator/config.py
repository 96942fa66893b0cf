"""The evaluator's settings (flags, environment and defaults are generated from these declarations)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rpcps.address import Address, EtcdAddress
from rpcps.process import ProcessOptions, loss_setting, model_setting
from rpcps.settings import setting
from rpcps.transport.config import TransportOptions

DEFAULT_METRICS_PORT = 9420
BEST_MODES = ("min", "max")


@dataclass(kw_only=True, frozen=True)
class EvaluatorConfig:
    """Evaluation (the sidecar evaluator)."""

    model: str = model_setting()
    loss: str = loss_setting()
    eval_data: str | None = setting(
        None,
        help="held-out data 'package.module:function()' returning an iterable of (inputs, targets) batches, read once; "
        "with local, starts an evaluator beside the workers",
        metavar="SPEC",
    )
    eval_fn: str | None = setting(
        None,
        help="scores 'package.module:function(model, batches)' -> dict of floats holding 'loss' "
        "(unset: mean --loss, and accuracy for class logits)",
        metavar="SPEC",
    )
    every_seconds: float = setting(30.0, help="evaluate the newest model this often (an unchanged model is not scored again)")
    eval_device: str = setting("cpu", help="device the evaluator scores on: cpu, auto, cuda or cuda:N")
    export_best: str | None = setting(
        None, help="keep the best model so far in this file (a state_dict; .safetensors for that format)", metavar="PATH"
    )
    best_metric: str = setting("loss", help="the score that decides the best model")
    best_mode: str = setting("min", help="whether the best --best-metric is the lowest or the highest", choices=lambda: BEST_MODES)
    max_evaluations: int = setting(0, help="stop after this many evaluations; 0: until stopped")

    def __post_init__(self) -> None:
        if not self.every_seconds > 0:
            raise ValueError(f"every_seconds must be > 0, got {self.every_seconds}")
        if self.best_mode not in BEST_MODES:
            raise ValueError(f"best_mode must be one of {list(BEST_MODES)}, got {self.best_mode!r}")
        if self.max_evaluations < 0:
            raise ValueError(f"max_evaluations must be >= 0, got {self.max_evaluations}")
        if not self.best_metric:
            raise ValueError("best_metric must name a score the evaluation returns, e.g. loss")


@dataclass(kw_only=True, frozen=True)
class EvaluatorRunConfig:
    """Evaluator process."""

    ps: Address | EtcdAddress | None = setting(
        None, help="HOST:PORT of the server (its --listen), or etcd://HOST:PORT[,...]/PREFIX (the servers' --store)",
        metavar="HOST:PORT",
    )
    metrics_port: int = setting(DEFAULT_METRICS_PORT, help="evaluator /metrics port; 0 picks a free one (logged)")
    max_reconnects: int = setting(20, help="times the evaluator restarts itself to reach a replaced server before giving up")
    process: ProcessOptions = field(default_factory=ProcessOptions)
    transport: TransportOptions = field(default_factory=TransportOptions)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)

    def __post_init__(self) -> None:
        if self.ps is None:
            raise ValueError("the server's address is required: --ps HOST:PORT (or RPCPS_PS)")
        if self.evaluator.eval_data is None:
            raise ValueError("held-out data is required: --eval-data package.module:function")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.max_reconnects < 0:
            raise ValueError(f"max_reconnects must be >= 0, got {self.max_reconnects}")
