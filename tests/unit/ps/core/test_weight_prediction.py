"""Weight prediction in the server (ps.core.prediction): pulls get the parameters moved ahead along the
last step by --predict-ahead x the mean staleness; the masters, the optimizer state and the digest never see it."""

from __future__ import annotations

import pytest
import torch

from harness.inprocess import grads_like, make_server, pack
from ps.core.optim import OptimizerConfig

ADAM = OptimizerConfig(name="adam", kwargs={"lr": 0.01})


def _pushed(factor: float, staleness: list[int], **core: object):  # type: ignore[no-untyped-def]
    """A server that applied one push per entry of ``staleness`` (that many updates old); returns it,
    its model, and the masters before and after the last step."""
    server, model = make_server(ADAM, predict_ahead=factor, **core)
    wire = server.core.wire
    incarnation = server.register(0, "worker0_r1", server.signature.to_wire()).incarnation
    before = after = None
    for seq, tau in enumerate(staleness):
        before = [m.clone() for m in server.core._masters]
        reply = server.push(0, incarnation, seq, server.version - tau, [c.to(wire) for c in pack(server.layout, grads_like(model, seq))])
        assert reply.staleness == tau
        after = [m.clone() for m in server.core._masters]
    return server, incarnation, before, after


def test_a_pull_is_moved_ahead_by_the_factor_times_the_mean_staleness() -> None:
    server, incarnation, before, after = _pushed(2.0, [0, 1, 1])
    mean = 0.0
    for tau in (0, 1, 1):  # rpcps.staleness.StalenessMean, alpha 0.1, by hand
        mean += 0.1 * (tau - mean)
    ahead = 2.0 * mean
    pulled = server.pull(0, incarnation, -1).chunks
    for got, now, prev in zip(pulled, after, before):
        assert torch.allclose(got, now + ahead * (now - prev), rtol=0, atol=1e-6)
        assert not torch.equal(got, now)
    assert server.metrics.prediction_ahead._value.get() == pytest.approx(ahead)


def test_the_masters_and_the_digest_are_those_of_a_server_that_does_not_predict() -> None:
    predicting, incarnation, _, _ = _pushed(2.0, [0, 1, 2])
    plain, _, _, _ = _pushed(0.0, [0, 1, 2])
    predicting.pull(0, incarnation, -1)
    with predicting.lock, plain.lock:
        assert predicting.digest_locked() == plain.digest_locked()
    assert plain.prediction is None


def test_no_prediction_without_staleness_in_sync_or_local_steps_mode_or_without_adam() -> None:
    """Local steps step the outer SGD over deltas whatever --optimizer says: its last step is one
    worker's delta, which a pull must not be moved along (it was, at 1 x the staleness, until 2026-12-05)."""
    server, incarnation, _, after = _pushed(2.0, [0, 0])
    assert all(torch.equal(got, now) for got, now in zip(server.pull(0, incarnation, -1).chunks, after))
    sgd, _ = make_server(OptimizerConfig(name="sgd", kwargs={"lr": 0.1}), predict_ahead=2.0)
    assert sgd.prediction is None
    sync, _ = make_server(ADAM, predict_ahead=2.0, mode="sync", round_timeout_s=30)
    assert sync.prediction is None
    local_steps, _ = make_server(ADAM, predict_ahead=2.0, mode="local-steps")
    assert local_steps.prediction is None


def test_after_a_restore_pulls_are_the_masters_until_the_next_step() -> None:
    server, incarnation, _, after = _pushed(2.0, [0, 1, 1])
    with server.lock:
        state = server.capture_replica_state_locked()  # registrations included: the worker may pull after it
    server.restore_state(state)
    assert all(torch.equal(got, now) for got, now in zip(server.pull(0, incarnation, -1).chunks, after))


def test_a_bf16_wire_gets_the_prediction_rounded_once() -> None:
    server, incarnation, before, after = _pushed(1.0, [0, 2, 2], wire_dtype="bf16")
    ahead = server.prediction.ahead(server.version)
    assert ahead > 0
    for got, now, prev in zip(server.pull(0, incarnation, -1).chunks, after, before):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, (now + ahead * (now - prev)).to(torch.bfloat16))


def test_predict_ahead_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"predict_ahead must be in \[0, 8\]"):
        make_server(ADAM, predict_ahead=-1.0)


def test_an_observer_gets_the_parameters_as_they_are_while_pulls_are_predicted() -> None:
    """The sidecar evaluator scores the model, not where it is predicted to go."""
    server, incarnation, _, after = _pushed(2.0, [0, 1, 1])
    pulled = server.pull(0, incarnation, -1).chunks
    observed = server.observe(-1).chunks
    assert all(torch.equal(got, now) for got, now in zip(observed, after))
    assert not all(torch.equal(got, now) for got, now in zip(pulled, after))
    assert not all(torch.equal(got, now) for got, now in zip(server.pull(0, incarnation, -1).chunks, after)), "the pull copy was not replaced"
