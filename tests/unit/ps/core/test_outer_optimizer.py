"""--mode local-steps: the server's outer SGD over pushed deltas, against a hand-computed step."""

from __future__ import annotations

import math

import pytest
import torch

from harness.inprocess import grads_like, make_server, pack
from ps.core.config import ServerCoreConfig
from ps.core.optim import OptimizerConfig
from ps.core.outer import OUTER_NAME, OuterConfig
from rpcps.messages import Mode
from worker.local_steps import RoundStart

LR, MOMENTUM = 0.7, 0.9


def _by_hand(start: dict[str, torch.Tensor], deltas: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """DiLoCo's outer step written out: b = m*b + d; w = w - lr*(d + m*b)."""
    weights = {n: w.clone() for n, w in start.items()}
    buffers = {n: torch.zeros_like(w) for n, w in start.items()}
    for delta in deltas:
        for (name, w), d in zip(weights.items(), delta):
            buffers[name] = MOMENTUM * buffers[name] + d
            w -= LR * (d + MOMENTUM * buffers[name])
    return weights


def test_each_delta_is_one_nesterov_step_once_per_round() -> None:
    server, model = make_server(mode=Mode.LOCAL_STEPS, outer=OuterConfig(lr=LR, momentum=MOMENTUM))
    start = server.master_tensors()
    deltas = [grads_like(model, seed, scale=0.01) for seed in range(3)]
    registration = server.register(0, "w0", server.signature.to_wire())
    for seq, delta in enumerate(deltas):
        reply = server.push(0, registration.incarnation, seq, server.version, pack(server.layout, delta), loss=1.0)
        assert reply.status == "applied" and reply.version == seq + 1
    # The same (slot, round) again is a duplicate: no second outer step.
    again = server.push(0, registration.incarnation, 2, server.version, pack(server.layout, deltas[2]), loss=1.0)
    assert again.status == "duplicate" and server.version == 3
    expected = _by_hand(start, deltas)
    got = server.master_tensors()
    for name, value in expected.items():
        assert torch.allclose(got[name], value, rtol=1e-5, atol=1e-6), f"{name}: {float((got[name] - value).abs().max()):.3g}"
    assert sum(float((got[n] - start[n]).abs().sum()) for n in got) > 0.1, "nothing moved: the comparison would prove nothing"
    assert server.stats.rounds == 3
    assert server.status().optimizer == OUTER_NAME
    newest = math.sqrt(sum(float(d.double().square().sum()) for d in deltas[2]))
    assert server.core.metrics.registry.get_sample_value("rpcps_server_local_steps_delta_norm") == pytest.approx(newest, rel=1e-5)


@pytest.mark.parametrize("expected_workers", [1, 4])
def test_by_default_each_delta_is_applied_at_one_over_the_expected_workers_without_momentum(expected_workers: int) -> None:
    """One worker's delta is taken whole (the server lands where the worker's inner steps did); with 4
    expected, each moves the weights a quarter of the way (the round's average, FedAvg's step)."""
    server, model = make_server(mode=Mode.LOCAL_STEPS, min_workers=expected_workers)
    start = server.master_tensors()
    deltas = [grads_like(model, seed, scale=0.01) for seed in range(2)]
    registration = server.register(0, "w0", server.signature.to_wire())
    for seq, delta in enumerate(deltas):
        server.push(0, registration.incarnation, seq, server.version, pack(server.layout, delta), loss=1.0)
    got = server.master_tensors()
    for i, (name, value) in enumerate(start.items()):
        expected = value - sum(d[i] for d in deltas) / expected_workers
        assert torch.allclose(got[name], expected, rtol=1e-5, atol=1e-6), f"{name}: {float((got[name] - expected).abs().max()):.3g}"
    assert server.config.optimizer_settings == f"lr={1 / expected_workers:g} momentum=0.0"


def test_the_momentum_survives_a_snapshot() -> None:
    old, model = make_server(mode=Mode.LOCAL_STEPS, outer=OuterConfig(lr=LR, momentum=MOMENTUM))
    registration = old.register(0, "w0", old.signature.to_wire())
    for seq in range(2):
        old.push(0, registration.incarnation, seq, old.version, pack(old.layout, grads_like(model, seq, scale=0.01)))
    new, _ = make_server(mode=Mode.LOCAL_STEPS, outer=OuterConfig(lr=LR, momentum=MOMENTUM))
    new.restore_state(old.capture_state()[1])
    assert new.digest_locked() == old.digest_locked()
    last = pack(old.layout, grads_like(model, 9, scale=0.01))
    old.push(0, registration.incarnation, 2, old.version, [c.clone() for c in last])
    again = new.register(0, "w0", new.signature.to_wire())
    new.push(0, again.incarnation, 2, new.version, last)
    assert new.version == old.version == 3
    assert new.digest_locked() == old.digest_locked()


def test_round_start_turns_the_inner_steps_into_the_pushed_delta() -> None:
    params = [torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.nn.Parameter(torch.tensor([[3.0]]))]
    start = RoundStart(params)
    start.begin()
    inner = torch.optim.SGD(params, lr=0.5)
    for _ in range(2):  # two inner steps on loss = sum(p): each moves every element by -0.5
        sum(p.sum() for p in params).backward()
        inner.step()
        inner.zero_grad()
    start.deltas_as_grads()
    assert torch.equal(params[0].grad, torch.tensor([1.0, 1.0])) and torch.equal(params[1].grad, torch.tensor([[1.0]]))


def test_bad_outer_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="outer momentum"):
        OuterConfig(momentum=1.0)
    with pytest.raises(ValueError, match="--outer-lr"):
        OuterConfig(lr=0.0)
    with pytest.raises(ValueError, match="--lr-schedule"):
        ServerCoreConfig(mode=Mode.LOCAL_STEPS, optimizer=OptimizerConfig(schedule="step", schedule_kwargs={"step_size": 2}))
