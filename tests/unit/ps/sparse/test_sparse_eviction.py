"""Eviction: TTL (applies and seconds), LFU with decay, the row cap, sliced sweeps and tombstones."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from ps.sparse.eviction import EvictionConfig, EvictionPlan
from ps.sparse.row_optim import SGD
from ps.sparse.table import SparseTable, TableConfig
from rpcps.sparse.row_init import RowInitConfig, initial_rows
from rpcps.sparse.spec import TableSpec


def _table(eviction: EvictionConfig, time_fn: Callable[[], float] = time.time, **kwargs: object) -> SparseTable:
    config = TableConfig(spec=TableSpec(name="t", table_id=2, dim=4), optimizer=SGD(lr=0.1), eviction=eviction, **kwargs)  # type: ignore[arg-type]
    return SparseTable(config, time_fn=time_fn)


def _sweep(table: SparseTable) -> torch.Tensor:
    """Runs evict_step until the sweep ends; returns the evicted ids, sorted."""
    evicted = []
    while True:
        step = table.evict_step()
        evicted.append(step.evicted)
        if step.sweep_done:
            return torch.sort(torch.cat(evicted)).values


def _push(table: SparseTable, ids: torch.Tensor) -> None:
    table.apply(ids, torch.ones(ids.numel(), 4))


def test_ttl_in_applies_evicts_rows_not_updated_for_longer_than_ttl() -> None:
    table = _table(EvictionConfig(ttl=3))
    table.pull(torch.arange(10))  # created at clock 0
    for _ in range(4):
        _push(table, torch.arange(5))  # clock 4; rows 0..4 last updated at 4
    assert _sweep(table).tolist() == [5, 6, 7, 8, 9]  # age 4 > 3
    assert len(table) == 5
    assert _sweep(table).tolist() == []


def test_ttl_in_seconds_uses_the_wall_clock() -> None:
    now = [1000.0]
    table = _table(EvictionConfig(ttl=60), clock="seconds", time_fn=lambda: now[0])
    table.pull(torch.arange(4))
    now[0] += 30
    _push(table, torch.tensor([0, 1]))
    now[0] += 40  # rows 2, 3 unseen for 70 s, rows 0, 1 for 40 s
    assert _sweep(table).tolist() == [2, 3]


def test_lfu_with_decay_evicts_rows_whose_decayed_count_fell_below_the_floor() -> None:
    table = _table(EvictionConfig(min_count=1.5, count_decay=0.9))
    table.pull(torch.arange(6))  # count 1 at creation, clock 0
    for _ in range(3):
        _push(table, torch.tensor([0, 1]))  # clock 3: rows 0, 1 counted 3.44
    _push(table, torch.tensor([2]))  # clock 4: row 2 counted 1 * 0.9**4 + 1 = 1.66
    assert _sweep(table).tolist() == [3, 4, 5]  # 0.9**4 = 0.66
    for _ in range(10):
        _push(table, torch.tensor([2]))  # clock 14: rows 0, 1 decayed to 3.44 * 0.9**11 = 1.08
    assert _sweep(table).tolist() == [0, 1]


def test_the_cap_evicts_the_least_used_rows_down_to_its_target() -> None:
    table = _table(EvictionConfig(max_rows=1000, cap_target=0.8, slice_rows=97))
    table.pull(torch.arange(1500))
    hot = torch.arange(0, 1500, 2)  # 750 rows updated twice; the odd ones never
    _push(table, hot)
    _push(table, hot)
    evicted = _sweep(table)
    assert evicted.numel() == 1500 - 800 and len(table) == 800
    assert bool((evicted % 2 == 1).all())  # only never-updated rows went
    assert _sweep(table).tolist() == []  # under the cap: nothing more


def test_lru_cap_evicts_the_oldest_rows() -> None:
    table = _table(EvictionConfig(max_rows=10, cap_target=1.0, cap_score="lru"))
    for i in range(20):
        table.pull(torch.tensor([i]))
        _push(table, torch.tensor([i]))  # row i last updated at clock i + 1
    assert _sweep(table).tolist() == list(range(10))


def test_a_sweep_is_sliced_and_each_step_examines_at_most_slice_rows() -> None:
    table = _table(EvictionConfig(ttl=1, slice_rows=100))
    table.pull(torch.arange(1050))
    _push(table, torch.tensor([0]))
    _push(table, torch.tensor([0]))
    steps = []
    while not (step := table.evict_step()).sweep_done:
        steps.append(step)
    steps.append(step)
    assert len(steps) == 11 and all(s.scanned <= 100 for s in steps)
    assert sum(s.evicted.numel() for s in steps) == 1049 and len(table) == 1


def test_evicted_ids_are_tombstoned_in_the_next_delta_and_come_back_with_their_initial_value() -> None:
    init = RowInitConfig(seed=9)
    table = _table(EvictionConfig(ttl=1), init=init)
    ids = torch.tensor([3, -4, 5])
    table.pull(ids)
    table.capture_delta()
    _push(table, ids[:1])
    _push(table, ids[:1])
    assert _sweep(table).tolist() == [-4, 5]
    delta = table.capture_delta()
    assert sorted(delta["tombstones"].tolist()) == [-4, 5]
    assert delta["records"]["ids"].tolist() == [3]
    assert torch.equal(table.pull(torch.tensor([5])), initial_rows(init, 2, torch.tensor([5]), 4))
    assert table.stats().evicted_total == 2


def test_without_eviction_a_step_only_does_upkeep() -> None:
    table = SparseTable(TableConfig(spec=TableSpec(name="t", table_id=0, dim=2), optimizer=SGD(lr=0.1)))
    table.pull(torch.arange(5))
    step = table.evict_step()
    assert step.sweep_done and step.evicted.numel() == 0 and len(table) == 5


def test_plan_counts_ttl_victims_toward_the_cap_quota() -> None:
    cfg = EvictionConfig(ttl=5, max_rows=10, cap_target=1.0)
    sample = (torch.zeros(20, dtype=torch.int32), torch.ones(20, dtype=torch.float16))
    plan = EvictionPlan(cfg, now=10, live=20, sample=sample)
    assert plan.quota == 10
    last_seen = torch.tensor([0] * 6 + [10] * 14, dtype=torch.int32)
    victims = plan.select(10, last_seen, torch.ones(20, dtype=torch.float16))
    assert int(victims.sum()) == 10 and bool(victims[:6].all()) and plan.quota == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttl": 0}, "ttl must be >= 1 or None, got 0"),
        ({"min_count": 0.0}, "min_count must be > 0 or None, got 0.0"),
        ({"count_decay": 0.0}, r"count_decay must be in \(0, 1\], got 0.0"),
        ({"count_decay": 1.5}, r"count_decay must be in \(0, 1\]"),
        ({"max_rows": 0}, "max_rows must be >= 1 or None, got 0"),
        ({"cap_target": 0.0}, r"cap_target must be in \(0, 1\], got 0.0"),
        ({"cap_score": "fifo"}, "cap_score must be 'lfu' or 'lru', got 'fifo'"),
        ({"slice_rows": 0}, "slice_rows must be >= 1, got 0"),
    ],
)
def test_config_is_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EvictionConfig(**kwargs)  # type: ignore[arg-type]


def test_an_eviction_decided_apart_spares_a_row_updated_after_the_decision() -> None:
    """``plan_eviction`` removes nothing; ``evict`` removes the decided rows not updated since the
    decision's clock (the server applies the decision later, from its log)."""
    table = _table(EvictionConfig(ttl=1))
    table.pull(torch.arange(6))
    for _ in range(3):
        table.apply(torch.tensor([5]), torch.ones(1, 4))
    planned = table.plan_eviction()
    assert sorted(planned.evicted.tolist()) == [0, 1, 2, 3, 4] and len(table) == 6
    table.apply(torch.tensor([2]), torch.ones(1, 4))  # pushed to after the decision: it stays
    assert sorted(table.evict(planned.evicted, planned.clock).tolist()) == [0, 1, 3, 4]
    assert len(table) == 2 and table.stats().tombstones_pending == 4
    assert table.evict(torch.tensor([1]), planned.clock, tombstones=False).numel() == 0  # no row: nothing
