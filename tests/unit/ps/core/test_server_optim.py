"""The server's optimizer over flat chunks gives what torch.optim gives on the model's own tensors, bit for bit.

The reference is built with the same arguments as the server's optimizer (``ps.core.optim.torch_kwargs``),
so with the same kernel: the fused CPU kernels the server uses by default round differently from
torch's single-tensor loop in the last bit (Adam, AdamW, Adagrad), so comparing across kernels could
only check closeness. Same kernel, same elements: what this proves is that stepping flat chunks
instead of the model's tensors changes nothing at all.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.inprocess import grads_like, make_model, make_server, pack
from ps.core.optim import OPTIMIZERS, SCHEDULES, OptimizerConfig, torch_kwargs
from rpcps.optim_kernels import FAST_KERNELS

STEPS = 25

CASES: dict[str, OptimizerConfig] = {
    "sgd": OptimizerConfig(name="sgd", kwargs={"lr": 0.05}),
    "sgd-momentum-nesterov": OptimizerConfig(
        name="sgd", kwargs={"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}
    ),
    "adam": OptimizerConfig(name="adam", kwargs={"lr": 1e-2}),
    "adam-amsgrad": OptimizerConfig(name="adam", kwargs={"lr": 1e-2, "amsgrad": True, "betas": (0.8, 0.95)}),
    "adamw": OptimizerConfig(name="adamw", kwargs={"lr": 1e-2, "weight_decay": 0.1}),
    "adagrad": OptimizerConfig(name="adagrad", kwargs={"lr": 0.1, "lr_decay": 0.01}),
    "rmsprop": OptimizerConfig(name="rmsprop", kwargs={"lr": 1e-2, "momentum": 0.5}),
    "adam-foreach-asked-for": OptimizerConfig(name="adam", kwargs={"lr": 1e-2, "foreach": True}),
    "adam-single-tensor-asked-for": OptimizerConfig(name="adam", kwargs={"lr": 1e-2, "fused": False}),
    "sgd-step-schedule": OptimizerConfig(
        name="sgd", kwargs={"lr": 0.1, "momentum": 0.9}, schedule="step", schedule_kwargs={"step_size": 4, "gamma": 0.5}
    ),
    "adam-cosine-schedule": OptimizerConfig(
        name="adam", kwargs={"lr": 1e-2}, schedule="cosine", schedule_kwargs={"T_max": 10}
    ),
    "adamw-linear-schedule": OptimizerConfig(
        name="adamw", kwargs={"lr": 1e-2}, schedule="linear", schedule_kwargs={"start_factor": 0.1, "total_iters": 8}
    ),
}


def _reference(config: OptimizerConfig, gradients: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """torch.optim stepped on the model's own parameters with the same gradient sequence (``config``:
    what the server builds, async's Adam betas included)."""
    model = make_model()
    optimizer = OPTIMIZERS[config.name](model.parameters(), **torch_kwargs(config))
    schedule: Any = SCHEDULES[config.schedule](optimizer, **config.schedule_kwargs) if config.schedule else None
    for grads in gradients:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        optimizer.step()
        if schedule is not None:
            schedule.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("case", CASES)
def test_server_update_equals_torch_optim(case: str) -> None:
    config = CASES[case]
    server, model = make_server(config)
    assert len(server.layout) > 1, "the test model must span several chunks"
    gradients = [grads_like(model, seed) for seed in range(STEPS)]
    registration = server.register(0, "w0", server.signature.to_wire())
    for seq, grads in enumerate(gradients):
        reply = server.push(0, registration.incarnation, seq, server.version, pack(server.layout, grads), loss=1.0)
        assert reply.status == "applied" and reply.version == seq + 1
    expected = _reference(server.config.applied_optimizer, gradients)
    got = server.master_tensors()
    moved = sum(float((got[n] - p.detach()).abs().sum()) for n, p in make_model().named_parameters())
    assert moved > 0.1, "the optimizer did not move the parameters; the comparison would prove nothing"
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{case} {name}: max difference {float((got[name] - value).abs().max()):.3g}"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_server_steps_with_the_fast_kernel_unless_told_otherwise(name: str) -> None:
    server, _ = make_server(OptimizerConfig(name=name))
    group = server.optimizer.param_groups[0]
    assert {k: group[k] for k in FAST_KERNELS.get(name, {})} == FAST_KERNELS.get(name, {})
    told, _ = make_server(OptimizerConfig(name=name, kwargs={"lr": 0.01, "foreach": False}))
    assert not told.optimizer.param_groups[0].get("fused") and told.optimizer.param_groups[0]["foreach"] is False


def test_a_snapshot_from_another_kernel_does_not_switch_the_servers() -> None:
    old, model = make_server(OptimizerConfig(name="adam", kwargs={"lr": 1e-2, "fused": False}))
    registration = old.register(0, "w0", old.signature.to_wire())
    old.push(0, registration.incarnation, 0, 0, pack(old.layout, grads_like(model, 0)))
    new, _ = make_server(OptimizerConfig(name="adam", kwargs={"lr": 1e-2}))
    new.restore_state(old.capture_state()[1])
    assert new.optimizer.param_groups[0]["fused"] is True
    assert new.version == 1


def test_schedule_changes_the_learning_rate_once_per_applied_update() -> None:
    config = OptimizerConfig(name="sgd", kwargs={"lr": 1.0}, schedule="step", schedule_kwargs={"step_size": 2, "gamma": 0.5})
    server, model = make_server(config)
    registration = server.register(0, "w0", server.signature.to_wire())
    for seq in range(5):
        server.push(0, registration.incarnation, seq, server.version, pack(server.layout, grads_like(model, seq)))
    assert server.optimizer.param_groups[0]["lr"] == pytest.approx(0.25)  # halved after updates 2 and 4
