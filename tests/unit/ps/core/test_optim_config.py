"""OptimizerConfig and ServerCoreConfig validation: bad settings fail early, naming what is wrong."""

from __future__ import annotations

import pytest
import torch

from ps.core.config import ServerCoreConfig
from ps.core.optim import OptimizerConfig, build_optimizer


def test_unknown_optimizer_is_named_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"optimizer 'nope' is not supported; choose one of \['adagrad', 'adam'"):
        OptimizerConfig(name="nope")


def test_unknown_optimizer_setting_is_named_with_what_is_accepted() -> None:
    with pytest.raises(ValueError, match=r"optimizer 'sgd' has no setting 'momentom'; it accepts \[.*'momentum'"):
        OptimizerConfig(name="sgd", kwargs={"lr": 0.1, "momentom": 0.9})


@pytest.mark.parametrize("key", ["params", "differentiable", "capturable"])
def test_settings_that_break_flat_chunks_are_refused(key: str) -> None:
    with pytest.raises(ValueError, match=f"has no setting '{key}'"):
        OptimizerConfig(name="adam", kwargs={key: True})


def test_unknown_schedule_and_schedule_setting_are_named() -> None:
    with pytest.raises(ValueError, match=r"lr schedule 'wavy' is not supported; choose one of \['cosine'"):
        OptimizerConfig(name="sgd", kwargs={"lr": 0.1}, schedule="wavy")
    with pytest.raises(ValueError, match="lr schedule 'step' has no setting 'step_sise'"):
        OptimizerConfig(name="sgd", kwargs={"lr": 0.1}, schedule="step", schedule_kwargs={"step_sise": 3})
    with pytest.raises(ValueError, match="schedule_kwargs given without a schedule"):
        OptimizerConfig(name="sgd", kwargs={"lr": 0.1}, schedule_kwargs={"T_max": 3})


def test_values_the_optimizer_itself_refuses_surface_as_value_errors() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"optimizer 'sgd' rejected its settings .*Invalid learning rate"):
        build_optimizer(OptimizerConfig(name="sgd", kwargs={"lr": -1.0}), params)
    with pytest.raises(ValueError, match=r"optimizer 'sgd' rejected its settings"):
        build_optimizer(OptimizerConfig(name="sgd", kwargs={"lr": 0.1, "nesterov": True}), params)
    with pytest.raises(ValueError, match=r"lr schedule 'step' rejected its settings"):
        build_optimizer(OptimizerConfig(name="sgd", kwargs={"lr": 0.1}, schedule="step"), params)


def test_valid_config_builds_the_named_optimizer_and_schedule() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt, sched = build_optimizer(
        OptimizerConfig(name="adamw", kwargs={"lr": 0.01, "weight_decay": 0.1}, schedule="cosine", schedule_kwargs={"T_max": 5}),
        params,
    )
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["weight_decay"] == 0.1
    assert isinstance(sched, torch.optim.lr_scheduler.CosineAnnealingLR)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"on_nonfinite": "ignore"}, "on_nonfinite must be 'reject' or 'skip', got 'ignore'"),
        ({"chunk_bytes": 100}, r"chunk_bytes must be >= 1024 \(--chunk-mb 0.001\), got 100"),
        ({"max_workers": 0}, r"max_workers must be in \[1, 32000\], got 0"),
        ({"mode": "bounded", "max_staleness": -1}, "max_staleness must be >= 0, got -1"),
        ({"mode": "bounded"}, "needs max_staleness"),
        ({"max_staleness": 3}, "applies to mode .bounded. only"),
        ({"mode": "lockstep"}, "mode must be one of"),
        ({"async_beta2": 1.0}, r"async_beta2 must be in \[0, 1\) \(0.999 is torch's own\), got 1.0"),
    ],
)
def test_server_core_config_names_the_bad_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerCoreConfig(**kwargs)


@pytest.mark.parametrize("mode", ["async", "bounded"])
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_async_adam_gets_the_async_beta2_unless_betas_are_named(mode: str, name: str) -> None:
    extra = {"max_staleness": 2} if mode == "bounded" else {}
    config = ServerCoreConfig(mode=mode, optimizer=OptimizerConfig(name=name, lr=0.01), async_beta2=0.9, **extra)
    opt, _ = build_optimizer(config.applied_optimizer, [torch.nn.Parameter(torch.zeros(3))])
    assert opt.defaults["betas"] == (0.9, 0.9) and opt.defaults["lr"] == 0.01
    assert "('betas', (0.9, 0.9))" in config.optimizer_settings  # what replicas compare
    named = OptimizerConfig(name=name, kwargs={"lr": 0.01, "betas": [0.8, 0.999]})
    assert ServerCoreConfig(mode=mode, optimizer=named, **extra).applied_optimizer == named


@pytest.mark.parametrize(("mode", "name"), [("sync", "adam"), ("async", "sgd"), ("async", "rmsprop")])
def test_sync_and_non_adam_optimizers_are_built_as_configured(mode: str, name: str) -> None:
    optimizer = OptimizerConfig(name=name, lr=0.01)
    assert ServerCoreConfig(mode=mode, optimizer=optimizer).applied_optimizer == optimizer
