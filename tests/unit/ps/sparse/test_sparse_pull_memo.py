"""ps.sparse.pull_memo: a push of a pull's ids reuses its rows, and applies exactly what a lookup would."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ps.sparse.admission import CountAdmissionConfig
from ps.sparse.eviction import EvictionConfig
from ps.sparse.pull_memo import MAX_IDS, MAX_PULLS, PullMemo
from ps.sparse.row_optim import SGD, RowWiseAdagrad
from ps.sparse.table import SparseTable, TableConfig
from rpcps.sparse.spec import TableSpec


def _table(**overrides: Any) -> SparseTable:
    settings: dict[str, Any] = {"name": "t", "table_id": 3, "dim": 4, "optimizer": SGD(lr=0.5)}
    settings.update(overrides)
    return SparseTable(TableConfig(spec=TableSpec(name=settings.pop("name"), table_id=settings.pop("table_id"), dim=settings.pop("dim")), **settings))


def _reversed_push(table: SparseTable, ids: torch.Tensor, grads: torch.Tensor) -> None:
    """The same push in another order: equal in effect (ids are unique), but no pull's ids, so the
    table looks every id up in its index as it did before the memo."""
    table.apply(ids.flip(0), grads.flip(0))


@pytest.mark.parametrize("lag", [0, 3, MAX_PULLS + 2])
def test_a_push_after_its_pull_applies_bit_identically_to_one_that_looks_its_ids_up(lag: int) -> None:
    """Two tables fed the same pulls and gradients; one's pushes match their pulls, the other's do not.
    ``lag`` pulls come between a pull and its push (two workers with pushes in flight), more than the
    memo keeps in the last case. Admission leaves some ids without a row, eviction releases rows and
    later pulls reuse them: every path of the memo is exercised."""
    settings: dict[str, Any] = {
        "dim": 8,
        "optimizer": RowWiseAdagrad(lr=0.1),
        "admission": CountAdmissionConfig(threshold=2, width=1 << 12),
        "eviction": EvictionConfig(ttl=4, slice_rows=64),
    }
    memo, lookup = _table(**settings), _table(**settings)
    gen = torch.Generator().manual_seed(lag)
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    steps = lag + 60
    for step in range(steps):
        ids = torch.unique(torch.randint(0, 400, (200,), generator=gen) ** 2 // 400)  # skewed: hot ids repeat
        grads = torch.randn(ids.numel(), 8, generator=gen)
        assert torch.equal(memo.pull(ids), lookup.pull(ids))
        pending.append((ids, grads))
        if len(pending) > lag:
            push_ids, push_grads = pending.pop(0)
            memo.apply(push_ids, push_grads)
            _reversed_push(lookup, push_ids, push_grads)
        if step % 5 == 4:
            for table in (memo, lookup):
                table.evict_step()
    a, b = memo.capture_full()["records"], lookup.capture_full()["records"]
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    s, t = memo.stats(), lookup.stats()
    assert (s.evicted_total, s.dropped_gradients_total, s.pushed_rows_total) == (t.evicted_total, t.dropped_gradients_total, t.pushed_rows_total)
    assert s.evicted_total > 0 and s.dropped_gradients_total > 0  # eviction and admission did happen
    pushes = steps - lag
    if lag < MAX_PULLS:  # a push's pull and the lag pulls after it are all remembered
        assert (s.push_lookups_reused_total, s.push_lookups_fallback_total) == (pushes, 0)
    else:
        assert (s.push_lookups_reused_total, s.push_lookups_fallback_total) == (0, pushes)
    assert (t.push_lookups_reused_total, t.push_lookups_fallback_total) == (0, pushes)


def test_a_push_after_an_eviction_that_reused_its_rows_updates_the_right_rows() -> None:
    table = _table(eviction=EvictionConfig(ttl=1))
    table.pull(torch.tensor([1, 2]))  # rows 0 and 1, created at clock 0; remembered
    for _ in range(3):
        table.apply(torch.tensor([2]), torch.zeros(1, 4))  # clock 3: id 1 is 3 applies old, id 2 none
    assert table.evict_step().evicted.tolist() == [1]  # row 0 is free
    three = table.pull(torch.tensor([3]))  # takes row 0
    one = table.pull(torch.tensor([1]))  # back, in a new row
    two = table.pull(torch.tensor([2]))
    result = table.apply(torch.tensor([1, 2]), torch.tensor([[1.0] * 4, [2.0] * 4]))  # the first pull's ids
    assert (result.applied, result.dropped) == (2, 0)
    assert torch.equal(table.pull(torch.tensor([3])), three)  # row 0's new id is untouched
    assert torch.equal(table.pull(torch.tensor([1])), one - 0.5)  # id 1 updated in its new row
    assert torch.equal(table.pull(torch.tensor([2])), two - 1.0)
    assert table.stats().push_lookups_reused_total == 1


def test_an_evicted_id_without_a_row_at_push_time_has_its_gradient_dropped() -> None:
    table = _table(eviction=EvictionConfig(ttl=1))
    table.pull(torch.tensor([1, 2]))
    for _ in range(3):
        table.apply(torch.tensor([2]), torch.zeros(1, 4))
    table.evict_step()
    table.pull(torch.tensor([3]))  # row 0 now belongs to id 3
    three = table.pull(torch.tensor([3]))
    result = table.apply(torch.tensor([1, 2]), torch.ones(2, 4))
    assert (result.applied, result.dropped) == (1, 1)
    assert torch.equal(table.pull(torch.tensor([3])), three)


def test_an_id_admitted_between_its_pull_and_its_push_gets_its_gradient() -> None:
    table = _table(admission=CountAdmissionConfig(threshold=2, width=1 << 12))
    table.pull(torch.tensor([5, 6]))  # first sight of both: no rows (remembered as such)
    admitted = table.pull(torch.tensor([6]))  # second sight of 6: admitted
    result = table.apply(torch.tensor([5, 6]), torch.ones(2, 4))
    assert (result.applied, result.dropped) == (1, 1)
    assert torch.equal(table.pull(torch.tensor([6])), admitted - 0.5)
    assert table.stats().push_lookups_reused_total == 1


def test_a_retried_push_looks_its_ids_up_and_is_applied_again() -> None:
    table = _table()
    ids = torch.tensor([7, 8, 9])
    start = table.pull(ids)
    table.apply(ids, torch.ones(3, 4))
    table.apply(ids.clone(), torch.ones(3, 4))  # deduplicating retries is the server's job, not the table's
    assert torch.equal(table.pull(ids), start - 0.5 - 0.5)  # SGD, lr 0.5: both pushes applied
    s = table.stats()
    assert (s.push_lookups_reused_total, s.push_lookups_fallback_total) == (1, 1)


def test_a_restore_forgets_the_empty_tables_pulls() -> None:
    source = _table()
    source.pull(torch.tensor([1, 2]))
    saved = source.capture_full()
    table = _table(admission=CountAdmissionConfig(threshold=3, width=1 << 12))
    table.pull(torch.tensor([1, 2]))  # not admitted: remembered without rows
    table.restore([(saved, [])], [(0, table.config.num_buckets)])
    table.apply(torch.tensor([1, 2]), torch.ones(2, 4))
    assert torch.equal(table.pull(torch.tensor([1, 2])), source.pull(torch.tensor([1, 2])) - 0.5)
    assert table.stats().push_lookups_fallback_total == 1


def test_the_memo_keeps_the_newest_pulls_within_its_bounds() -> None:
    memo = PullMemo()
    for k in range(MAX_PULLS + 3):
        memo.remember(torch.tensor([k]), torch.tensor([10 * k]))
    assert len(memo) == MAX_PULLS
    assert memo.take(torch.tensor([0])) is None and memo.take(torch.tensor([2])) is None  # the oldest went
    assert memo.take(torch.tensor([MAX_PULLS + 2])).tolist() == [10 * (MAX_PULLS + 2)]
    assert memo.take(torch.tensor([MAX_PULLS + 2])) is None  # consumed
    memo.clear()
    half = MAX_IDS // 2
    memo.remember(torch.arange(MAX_IDS + 1), torch.arange(MAX_IDS + 1))  # alone over the bound: not kept
    memo.remember(torch.arange(half), torch.arange(half))
    memo.remember(torch.arange(1, half + 1), torch.arange(half))
    memo.remember(torch.arange(2, half + 2), torch.arange(half))  # the first is dropped to fit
    assert len(memo) == 2 and memo.take(torch.arange(half)) is None
    assert memo.take(torch.arange(2, half + 2)) is not None


def test_the_memo_matches_the_ids_it_was_given_not_the_callers_tensor_later() -> None:
    memo = PullMemo()
    ids = torch.tensor([1, 2, 3])
    memo.remember(ids, torch.tensor([0, 1, 2]))
    ids[0] = 4  # the caller reuses its buffer
    assert memo.take(ids) is None
    assert memo.take(torch.tensor([1, 2, 3])).tolist() == [0, 1, 2]


def test_forgotten_rows_read_minus_one() -> None:
    memo = PullMemo()
    memo.remember(torch.tensor([1, 2, 3]), torch.tensor([5, -1, 7]))
    memo.forget(torch.tensor([7, 9]))
    assert memo.take(torch.tensor([1, 2, 3])).tolist() == [5, -1, -1]


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_every_push_matches_when_each_worker_has_its_window_of_pulls_waiting(workers: int) -> None:
    """Round robin, each worker pulling step t before its pushes of t - 1 and t - 2 land (a
    window of 2): the pull a push needs is the oldest remembered, so a FIFO memo shorter than the
    pulls waiting would match none of them."""
    memo, waiting = PullMemo(), 3 * workers
    pulls = [torch.arange(k * 10, k * 10 + 5 + k % 7) for k in range(waiting + 40)]
    matched = 0
    for k, ids in enumerate(pulls):
        memo.remember(ids, ids * 2)
        if k >= waiting - 1:
            oldest = pulls[k - (waiting - 1)]
            matched += memo.take(oldest) is not None
    assert matched == len(pulls) - (waiting - 1)


def test_the_store_applies_only_what_its_own_check_made() -> None:
    from ps.sparse.store import SparseConfig, SparseStore
    from rpcps.sparse.spec import TableSpec

    store = SparseStore((TableSpec(name="t", table_id=0, dim=4),), SparseConfig(optimizer="sgd"), 0, 1)
    store.pull({"t": torch.tensor([5, 6])}, torch.float32)
    before = store.pull({"t": torch.tensor([5, 6])}, torch.float32)["t"]
    with pytest.raises(TypeError, match="check_push"):
        store.apply({"t": (torch.tensor([5, 5]), torch.ones(2, 4))})  # type: ignore[arg-type]
    assert torch.equal(store.pull({"t": torch.tensor([5, 6])}, torch.float32)["t"], before)  # nothing applied
    assert store.apply(store.check_push({"t": (torch.tensor([5, 6]), torch.ones(2, 4))}, torch.float32), store.take_admitted()) == 2
