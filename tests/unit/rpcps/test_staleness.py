"""Each staleness rule (rpcps.staleness) against a step computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rpcps import staleness
from rpcps.staleness import AdamView


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_lr_scale_is_one_over_one_plus_staleness() -> None:
    assert [staleness.lr_scale(tau) for tau in (0, 1, 3)] == [1.0, 0.5, 0.25]
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness.lr_scale(-1)


def test_lr_inverse_is_one_over_staleness_from_two_updates_old() -> None:
    assert [staleness.lr_inverse(tau) for tau in (0, 1, 2, 3, 4)] == [1.0, 1.0, 0.5, 1 / 3, 0.25]
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness.lr_inverse(-1)


def test_dc_asgd_first_step() -> None:
    # beta2 0.75, no moment yet: v_hat = g*g*(1 - 0.75) / (1 - 0.75) = g*g, so the term is lam*|g|*(now - stale).
    adam = AdamView(_t(0, 0), _t(0, 0), step=0, lr=0.1, beta1=0.9, beta2=0.75, eps=0.0)
    comp = staleness.dc_asgd(_t(2, -1), now=_t(1.5, 0), stale=_t(1.0, 0.5), adam=adam, lam=0.5)
    assert comp.tolist() == [0.5 * 2 * 0.5, 0.5 * 1 * -0.5]


def test_dc_asgd_folds_this_gradient_into_the_moment() -> None:
    # step 1, v = 1, beta2 = 0.5, g = 1: v' = 0.5 + 0.5 = 1, bias 1 - 0.25 -> v_hat = 4/3.
    adam = AdamView(_t(0), _t(1), step=1, lr=0.1, beta1=0.9, beta2=0.5, eps=0.0)
    comp = staleness.dc_asgd(_t(1), now=_t(3), stale=_t(1), adam=adam, lam=0.1)
    assert comp.item() == pytest.approx(0.1 * 1 / math.sqrt(4 / 3) * 2, rel=1e-12)


def test_dc_asgd_is_zero_before_adam_has_moments() -> None:
    assert staleness.dc_asgd(_t(1, 2), _t(1, 1), _t(0, 0), None, lam=1.0).tolist() == [0, 0]


def test_gap_aware_penalty() -> None:
    # moved 0.5 where steps are 0.25: penalty 3; not moved: 1.
    penalty = staleness.gap_aware(_t(9, 9), now=_t(1, 2), stale=_t(0.5, 2), step_rms=_t(0.25, 1), eps=0.0)
    assert penalty.tolist() == [3.0, 1.0]


def test_step_rms_is_bias_corrected() -> None:
    rms = staleness.StepRms(_t(0), beta=0.5)
    assert rms.rms().tolist() == [0.0]
    rms.record(_t(1), _t(3))  # step 2: mean square 0.5*4 = 2, bias 0.5 -> rms 2
    assert rms.rms().tolist() == [2.0]
    rms.record(_t(3), _t(3))  # step 0: mean square 1, bias 0.75 -> rms sqrt(4/3)
    assert rms.rms().item() == pytest.approx(math.sqrt(4 / 3), rel=1e-12)


def test_predict_moves_ahead_along_adams_step() -> None:
    # step 1, lr 0.1, m 0.1, v 0.01: m_hat = 1, sqrt(v_hat) = 0.1 / sqrt(0.001); two steps ahead.
    adam = AdamView(_t(0.1), _t(0.01), step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=0.0)
    params = _t(1.0)
    predicted = staleness.predict(params, adam, ahead=2)
    assert predicted.item() == pytest.approx(1 - 2 * 0.1 * 1 / (0.1 / math.sqrt(0.001)), rel=1e-12)
    assert params.item() == 1.0


def test_predict_one_step_ahead_is_adams_next_step_when_the_gradient_repeats_the_momentum() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    opt = torch.optim.Adam([w], lr=0.01, betas=(0.9, 0.999), eps=0.0)
    w.grad = torch.randn(5, dtype=torch.float64)
    opt.step()
    view = staleness.adam_view(opt, w)
    assert view is not None and view.step == 1
    predicted = staleness.predict(w.detach(), view, ahead=1)
    # After one step m_hat = g0 and v_hat = g0*g0; a second gradient equal to g0 leaves both bias-corrected
    # moments as they are, so Adam's second step is exactly the predicted one (up to rounding).
    w.grad = view.exp_avg / (1 - 0.9)
    opt.step()
    assert torch.allclose(predicted, w.detach(), rtol=1e-12, atol=1e-15)


def test_predict_without_moments_is_a_copy() -> None:
    params = _t(1, 2)
    out = staleness.predict(params, None, ahead=2)
    assert out.tolist() == [1, 2] and out is not params


def test_predict_into_gives_predicts_bits_and_uses_the_scratch() -> None:
    torch.manual_seed(1)
    params, m, v = torch.randn(7), torch.randn(7) * 0.01, torch.rand(7) * 1e-4
    adam = AdamView(m, v, step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    out, scratch = torch.empty(7), torch.empty(7)
    staleness.predict_into(out, params, adam, 1.5, scratch)
    assert torch.equal(out, staleness.predict(params, adam, 1.5))
    assert not torch.equal(out, params)


def test_staleness_mean_moves_a_tenth_of_the_way() -> None:
    mean = staleness.StalenessMean(alpha=0.1)
    mean.record(2)
    assert mean.value == pytest.approx(0.2)
    mean.record(2)
    assert mean.value == pytest.approx(0.2 + 0.1 * 1.8)


def test_extrapolating_the_last_adam_step_is_predicting_with_adams_moments() -> None:
    torch.manual_seed(2)
    w = torch.nn.Parameter(torch.randn(50, dtype=torch.float64))
    opt = torch.optim.Adam([w], lr=1e-2)
    for _ in range(3):
        w.grad = torch.randn(50, dtype=torch.float64)
        previous = w.detach().clone()
        opt.step()
    predicted = staleness.predict(w.detach(), staleness.adam_view(opt, w), ahead=2.5)
    out = torch.empty_like(previous)
    staleness.extrapolate_into(out, w.detach(), previous, 2.5)
    assert torch.allclose(out, predicted, rtol=0, atol=1e-12)
    assert (out - w.detach()).abs().max() > 1e-3  # it moved: the check compares something


def test_extrapolate_by_hand() -> None:
    out = torch.empty(2)
    staleness.extrapolate_into(out, now=torch.tensor([1.0, 2.0]), previous=torch.tensor([0.5, 2.0]), ahead=2.0)
    assert out.tolist() == [2.0, 2.0]
