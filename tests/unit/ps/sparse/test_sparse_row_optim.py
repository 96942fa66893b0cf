"""ps.sparse.row_optim: each row optimizer against a plain reference on a small table.

SGD, Adagrad and lazy Adam are compared, bit for bit, with torch.optim stepping each row as its own
parameter (only the rows a push touches): that is exactly the lazy per-row semantics. Row-wise
Adagrad is compared bit for bit with a dense masked implementation (untouched rows get g = 0, which
leaves both the weight and the accumulator unchanged). FTRL is compared bit for bit with a per-row
loop of the paper's Algorithm 1 and, within float32 rounding, with a float64 version.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ps.sparse.row_optim import FTRL, SGD, Adagrad, LazyAdam, RowOptimizer, RowWiseAdagrad

N, D, STEPS, TOUCHED = 48, 16, 25, 17


def _pushes(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS pushes of TOUCHED unique rows each with summed gradients."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randperm(N, generator=gen)[:TOUCHED], torch.randn(TOUCHED, D, generator=gen)) for _ in range(STEPS)
    ]


def _run_rows(opt: RowOptimizer, weights: torch.Tensor, pushes: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """What the table does: gather the pushed rows, step them, scatter them back."""
    slab = torch.cat([weights.clone(), opt.initial_state(N, D)], dim=1)
    for rows, grads in pushes:
        block = slab.index_select(0, rows)
        opt.step(block, grads)
        slab.index_copy_(0, rows, block)
    return slab


def _torch_per_row(
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    weights: torch.Tensor,
    pushes: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    params = [torch.nn.Parameter(weights[i].clone()) for i in range(N)]
    optimizers = [make([p]) for p in params]
    for rows, grads in pushes:
        for k, r in enumerate(rows.tolist()):
            params[r].grad = grads[k].clone()
            optimizers[r].step()
    return torch.stack([p.detach() for p in params])


@pytest.mark.parametrize(
    ("opt", "make"),
    [
        (SGD(lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05, foreach=False)),
        (Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1, foreach=False)),
        (
            Adagrad(lr=0.1, eps=1e-6, initial_accumulator_value=0.2),
            lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-6, initial_accumulator_value=0.2, foreach=False),
        ),
        (LazyAdam(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01, foreach=False)),
        (
            LazyAdam(lr=0.003, beta1=0.5, beta2=0.9, eps=1e-6),
            lambda p: torch.optim.Adam(p, lr=0.003, betas=(0.5, 0.9), eps=1e-6, foreach=False),
        ),
    ],
    ids=["sgd", "adagrad", "adagrad-settings", "lazy-adam", "lazy-adam-settings"],
)
def test_matches_torch_optim_stepping_each_row_alone_bit_for_bit(
    opt: RowOptimizer, make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
) -> None:
    weights = torch.randn(N, D, generator=torch.Generator().manual_seed(1))
    pushes = _pushes(2)
    got = _run_rows(opt, weights, pushes)[:, :D]
    assert torch.equal(got, _torch_per_row(make, weights, pushes))


def test_lazy_adam_counts_steps_per_row_as_int32() -> None:
    pushes = _pushes(3)
    slab = _run_rows(LazyAdam(lr=0.01), torch.zeros(N, D), pushes)
    expected = torch.zeros(N, dtype=torch.int32)
    for rows, _ in pushes:
        expected[rows] += 1
    assert torch.equal(slab[:, 3 * D].contiguous().view(torch.int32), expected)


def test_rows_not_pushed_are_never_changed() -> None:
    gen = torch.Generator().manual_seed(7)
    weights = torch.randn(N, D, generator=gen)
    rows, grads = torch.tensor([3, 7]), torch.randn(2, D, generator=gen)
    for opt in (SGD(lr=0.1), Adagrad(lr=0.1), RowWiseAdagrad(lr=0.1), LazyAdam(lr=0.1), FTRL(lr=0.1)):
        slab = _run_rows(opt, weights, [(rows, grads)])
        untouched = torch.ones(N, dtype=torch.bool)
        untouched[rows] = False
        assert torch.equal(slab[untouched, :D], weights[untouched]), opt.name
        assert torch.equal(slab[untouched, D:], opt.initial_state(N, D)[untouched]), opt.name
        assert not torch.equal(slab[rows, :D], weights[rows]), opt.name


def test_rowwise_adagrad_matches_a_dense_masked_reference_bit_for_bit() -> None:
    opt = RowWiseAdagrad(lr=0.2, eps=1e-8, initial_accumulator_value=0.1)
    weights = torch.randn(N, D, generator=torch.Generator().manual_seed(4))
    pushes = _pushes(4)
    w, acc = weights.clone(), torch.full((N, 1), 0.1)
    for rows, grads in pushes:
        dense = torch.zeros(N, D)
        dense[rows] = grads
        acc = acc + dense.square().mean(dim=1, keepdim=True)
        w = w - dense * (0.2 / (acc.sqrt() + 1e-8))
    slab = _run_rows(opt, weights, pushes)
    assert torch.equal(slab[:, :D], w) and torch.equal(slab[:, D:], acc)


def _ftrl_reference(
    opt: FTRL, weights: torch.Tensor, pushes: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
) -> torch.Tensor:
    """McMahan et al. 2013, Algorithm 1, one row at a time."""
    w = weights.to(dtype).clone()
    z = torch.zeros(N, D, dtype=dtype)
    n = torch.full((N, D), opt.initial_accumulator_value, dtype=dtype)
    for rows, grads in pushes:
        for k, r in enumerate(rows.tolist()):
            g = grads[k].to(dtype)
            sigma = ((n[r] + g * g).sqrt() - n[r].sqrt()) / opt.lr
            z[r] = z[r] + (g - sigma * w[r])
            n[r] = n[r] + g * g
            shrunk = z[r] - z[r].sign() * opt.l1
            w[r] = torch.where(z[r].abs() <= opt.l1, 0.0, -shrunk / ((n[r].sqrt() + opt.beta) / opt.lr + opt.l2))
    return w


@pytest.mark.parametrize(
    "opt",
    [FTRL(lr=0.1), FTRL(lr=0.05, beta=0.5, l1=0.3, l2=0.01, initial_accumulator_value=0.1)],
    ids=["plain", "l1-l2"],
)
def test_ftrl_matches_the_paper_algorithm(opt: FTRL) -> None:
    weights = torch.randn(N, D, generator=torch.Generator().manual_seed(5)) * 0.01
    pushes = _pushes(5)
    got = _run_rows(opt, weights, pushes)[:, :D]
    assert torch.equal(got, _ftrl_reference(opt, weights, pushes, torch.float32))
    torch.testing.assert_close(got.double(), _ftrl_reference(opt, weights, pushes, torch.float64), rtol=1e-5, atol=1e-6)


def test_ftrl_l1_makes_weights_exactly_zero() -> None:
    weights = torch.randn(N, D, generator=torch.Generator().manual_seed(6)) * 0.01
    slab = _run_rows(FTRL(lr=0.1, l1=100.0), weights, _pushes(6))
    touched = torch.unique(torch.cat([rows for rows, _ in _pushes(6)]))
    assert bool((slab[touched, :D] == 0).all())


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SGD(lr=0.0), "lr must be a finite number > 0, got 0.0"),
        (lambda: SGD(lr=float("nan")), "lr must be a finite number > 0, got nan"),
        (lambda: Adagrad(lr=0.1, eps=0.0), "eps must be a finite number > 0, got 0.0"),
        (lambda: RowWiseAdagrad(lr=0.1, initial_accumulator_value=-1.0), "initial_accumulator_value must be >= 0"),
        (lambda: LazyAdam(lr=0.1, beta1=1.0), r"beta1 must be in \[0, 1\), got 1.0"),
        (lambda: LazyAdam(lr=0.1, beta2=-0.1), r"beta2 must be in \[0, 1\), got -0.1"),
        (lambda: FTRL(lr=0.1, l1=-1.0), "l1 must be a finite number >= 0, got -1.0"),
        (lambda: FTRL(lr=0.1, beta=0.0), "beta, l2 or initial_accumulator_value must be > 0"),
    ],
)
def test_settings_are_validated(make: Callable[[], RowOptimizer], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_settings_serialise_with_their_name() -> None:
    assert LazyAdam(lr=0.5).to_dict() == {"name": "lazy_adam", "lr": 0.5, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    assert RowWiseAdagrad(lr=0.1).state_width(16) == 1 and FTRL(lr=0.1).state_width(16) == 32
