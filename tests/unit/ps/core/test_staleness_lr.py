"""--staleness-lr in the server: an async or bounded gradient k >= 2 updates old steps with lr / k
(rpcps.staleness.lr_inverse), inside the one apply step; the configured rate is back before a
schedule reads it; sync, local steps and --staleness-lr off keep the full rate."""

from __future__ import annotations

import pytest
import torch

from harness.inprocess import InProcessServer, grads_like, make_server, pack
from ps.core.config import ServerCoreConfig
from ps.core.optim import OptimizerConfig

LR = 0.1
SGD = OptimizerConfig(name="sgd", kwargs={"lr": LR})


def _steps(staleness: list[int], optimizer: OptimizerConfig = SGD, **core: object) -> tuple[InProcessServer, list[float]]:
    """A server that applied one push per entry of ``staleness`` (that many updates old); returns it
    and, per push, the step it took as a multiple of ``lr * gradient`` (plain SGD: exactly the lr factor)."""
    server, model = make_server(optimizer, predict_ahead=0.0, **core)
    incarnation = server.register(0, "worker0_r1", server.signature.to_wire()).incarnation
    factors = []
    for seq, tau in enumerate(staleness):
        grads = pack(server.layout, grads_like(model, seq))
        before = [m.clone() for m in server.core._masters]
        reply = server.push(0, incarnation, seq, server.version - tau, [c.to(server.core.wire) for c in grads])
        assert reply.staleness == tau
        steps = [b - m for b, m in zip(before, server.core._masters)]
        factor = (steps[0].flatten()[0] / (LR * grads[0].flatten()[0])).item()
        for step, grad in zip(steps, grads):
            torch.testing.assert_close(step, factor * LR * grad, rtol=1e-5, atol=1e-7)
        factors.append(factor)
    return server, factors


def test_a_gradient_k_updates_old_steps_with_the_rate_over_k() -> None:
    server, factors = _steps([0, 0, 0, 3, 1, 2])
    assert factors == pytest.approx([1, 1, 1, 1 / 3, 1, 1 / 2], rel=1e-5)
    assert server.core.optimizer.param_groups[0]["lr"] == LR, "the configured rate is restored after each step"
    assert server.metrics.lr_scale._value.get() == pytest.approx(1 / 2)


def test_the_schedule_reads_the_configured_rate_not_the_scaled_one() -> None:
    halving = OptimizerConfig(name="sgd", kwargs={"lr": LR}, schedule="step", schedule_kwargs={"step_size": 1, "gamma": 0.5})
    server, _ = _steps([0, 0, 2], halving)
    assert server.core.optimizer.param_groups[0]["lr"] == pytest.approx(LR * 0.5**3)


def test_bounded_mode_scales_as_async_does() -> None:
    _, factors = _steps([0, 0, 2], mode="bounded", max_staleness=4)
    assert factors == pytest.approx([1, 1, 1 / 2], rel=1e-5)


def test_off_a_stale_gradient_keeps_the_full_rate() -> None:
    _, factors = _steps([0, 0, 0, 3], staleness_lr=False)
    assert factors == pytest.approx([1, 1, 1, 1], rel=1e-5)


def test_only_async_and_bounded_scale() -> None:
    assert ServerCoreConfig().scales_lr_by_staleness, "on by default"
    assert ServerCoreConfig(mode="bounded", max_staleness=2).scales_lr_by_staleness
    assert not ServerCoreConfig(mode="sync").scales_lr_by_staleness
    assert not ServerCoreConfig(mode="local-steps").scales_lr_by_staleness
    assert not ServerCoreConfig(staleness_lr=False).scales_lr_by_staleness
