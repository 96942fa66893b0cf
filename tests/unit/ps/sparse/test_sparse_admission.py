"""ps.sparse.admission: count-min and coin admission, alone and inside a SparseTable."""

from __future__ import annotations

import pytest
import torch

from ps.sparse.admission import CountAdmissionConfig, CountMinFilter, ProbabilityAdmissionConfig, build_admission
from ps.sparse.row_optim import SGD
from ps.sparse.table import SparseTable, TableConfig
from rpcps.sparse.spec import TableSpec


def _table(admission: CountAdmissionConfig | ProbabilityAdmissionConfig) -> SparseTable:
    return SparseTable(TableConfig(spec=TableSpec(name="t", table_id=1, dim=4), optimizer=SGD(lr=1.0), admission=admission))


def test_an_id_gets_a_row_on_its_threshold_th_pull_and_reads_zeros_until_then() -> None:
    table = _table(CountAdmissionConfig(threshold=3, width=1 << 16))
    ids = torch.tensor([10, -20])
    for _ in range(2):
        assert torch.equal(table.pull(ids), torch.zeros(2, 4))
        assert table.apply(ids, torch.ones(2, 4)).dropped == 2
    third = table.pull(ids)
    assert len(table) == 2 and not torch.equal(third, torch.zeros(2, 4))
    result = table.apply(ids, torch.ones(2, 4))
    assert (result.applied, result.dropped) == (2, 0)
    assert torch.equal(table.pull(ids), third - 1.0)  # SGD, lr 1: only the post-admission gradient counts
    s = table.stats()
    assert (s.admitted_total, s.filtered_total, s.dropped_gradients_total) == (2, 4, 4)


def test_a_repeated_id_in_one_pull_counts_once_and_gets_one_row() -> None:
    table = _table(CountAdmissionConfig(threshold=2, width=1 << 16))
    table.pull(torch.tensor([5, 5, 5]))
    assert len(table) == 0
    out = table.pull(torch.tensor([5, 5]))
    assert len(table) == 1 and torch.equal(out[0], out[1])


def test_sketch_memory_is_fixed_and_counters_saturate_without_wrapping() -> None:
    cfg = CountAdmissionConfig(threshold=255, width=64, depth=2)
    sketch = CountMinFilter(cfg, table_id=0)
    assert sketch.nbytes() == 128
    ids = torch.arange(1000)
    for now in range(300):
        sketch.admit(ids, now)
    assert sketch.nbytes() == 128
    assert int(sketch.estimate(ids).min()) == 255
    assert bool(sketch.admit(ids, 300).all())


def test_estimates_never_undercount() -> None:
    sketch = CountMinFilter(CountAdmissionConfig(threshold=10, width=256, depth=3), table_id=0)
    ids = torch.arange(5000)
    sketch.admit(ids, 0)
    sketch.admit(ids[:100], 1)
    assert bool((sketch.estimate(ids[:100]) >= 2).all()) and bool((sketch.estimate(ids) >= 1).all())


def test_halving_ages_the_counts_on_schedule() -> None:
    sketch = CountMinFilter(CountAdmissionConfig(threshold=9, width=1 << 12, halve_every=10), table_id=0)
    ids = torch.tensor([1, 2, 3])
    for _ in range(8):
        sketch.admit(ids, 0)
    sketch.age(9)
    assert sketch.estimate(ids).tolist() == [8, 8, 8]
    sketch.age(10)
    assert sketch.estimate(ids).tolist() == [4, 4, 4]
    sketch.age(15)
    assert sketch.estimate(ids).tolist() == [4, 4, 4]


def test_merged_sketches_add_and_saturate() -> None:
    cfg = CountAdmissionConfig(threshold=5, width=1 << 12)
    a, b = CountMinFilter(cfg, 0), CountMinFilter(cfg, 0)
    ids = torch.tensor([7])
    for _ in range(200):
        a.admit(ids, 0)
        b.admit(ids, 0)
    a.merge_state(b.state_dict())
    assert a.estimate(ids).tolist() == [255]
    other = CountMinFilter(CountAdmissionConfig(threshold=5, width=1 << 10), 0)
    with pytest.raises(ValueError, match="width or depth changed"):
        other.merge_state(b.state_dict())


def test_coin_admission_is_deterministic_per_id_and_window() -> None:
    coin = build_admission(ProbabilityAdmissionConfig(probability=0.25, seed=4), table_id=2)
    ids = torch.arange(100_000)
    first = coin.admit(ids, now=0)
    assert torch.equal(first, coin.admit(ids, now=10**6))  # no reroll: same answer forever
    assert abs(float(first.float().mean()) - 0.25) < 0.01
    other_table = build_admission(ProbabilityAdmissionConfig(probability=0.25, seed=4), table_id=3)
    assert not torch.equal(first, other_table.admit(ids, now=0))


def test_coin_rerolls_per_window_and_a_retry_in_a_window_decides_the_same() -> None:
    coin = build_admission(ProbabilityAdmissionConfig(probability=0.5, reroll_every=100), table_id=0)
    ids = torch.arange(10_000)
    assert torch.equal(coin.admit(ids, now=100), coin.admit(ids, now=199))
    assert not torch.equal(coin.admit(ids, now=100), coin.admit(ids, now=200))
    always = build_admission(ProbabilityAdmissionConfig(probability=1.0), table_id=0)
    assert bool(always.admit(ids, now=0).all())


def test_a_refused_coin_id_reads_zeros_and_drops_its_gradient() -> None:
    table = _table(ProbabilityAdmissionConfig(probability=0.5))
    ids = torch.arange(1000)
    out = table.pull(ids)
    admitted = (out != 0).any(dim=1)
    assert 400 < int(admitted.sum()) < 600 and len(table) == int(admitted.sum())
    result = table.apply(ids, torch.ones(1000, 4))
    assert result.dropped == 1000 - len(table)
    assert torch.equal((table.pull(ids) != 0).any(dim=1), admitted)  # the retry decides the same way


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: CountAdmissionConfig(threshold=0), r"threshold must be in \[1, 255\], got 0"),
        (lambda: CountAdmissionConfig(threshold=256), r"threshold must be in \[1, 255\]"),
        (lambda: CountAdmissionConfig(threshold=2, width=8), r"width must be in \[64, 2\*\*31\), got 8"),
        (lambda: CountAdmissionConfig(threshold=2, depth=0), r"depth must be in \[1, 16\], got 0"),
        (lambda: CountAdmissionConfig(threshold=2, halve_every=0), "halve_every must be >= 1 or None, got 0"),
        (lambda: ProbabilityAdmissionConfig(probability=0.0), r"probability must be in \[2\*\*-24, 1\], got 0.0"),
        (lambda: ProbabilityAdmissionConfig(probability=1.5), r"probability must be in \[2\*\*-24, 1\]"),
        (lambda: ProbabilityAdmissionConfig(probability=0.5, reroll_every=0), "reroll_every must be >= 1 or None"),
    ],
)
def test_configs_are_validated(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]
