"""ps.sparse.table.SparseTable: pull/apply contracts, refusals, counters and thread safety."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from ps.sparse.row_optim import SGD, RowWiseAdagrad
from ps.sparse.table import SparseTable, TableConfig
from rpcps.sparse.row_init import RowInitConfig, initial_rows
from rpcps.sparse.spec import TableSpec


def _table(**overrides: Any) -> SparseTable:
    settings: dict[str, Any] = {"name": "t", "table_id": 1, "dim": 4, "optimizer": SGD(lr=0.5)}
    settings.update(overrides)
    return SparseTable(TableConfig(spec=TableSpec(name=settings.pop("name"), table_id=settings.pop("table_id"), dim=settings.pop("dim")), **settings))


def test_pull_creates_initialised_rows_and_returns_a_copy() -> None:
    table = _table(init=RowInitConfig(seed=3))
    ids = torch.tensor([9, -9, 9])
    out = table.pull(ids)
    assert len(table) == 2 and torch.equal(out[0], out[2])
    assert torch.equal(out[:2], initial_rows(RowInitConfig(seed=3), 1, ids[:2], 4))
    out.fill_(123.0)
    assert not bool((table.pull(ids) == 123.0).any())


def test_apply_updates_pushed_rows_with_the_optimizer_and_drops_unknown_ids() -> None:
    table = _table()
    before = table.pull(torch.tensor([1, 2]))
    grads = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    result = table.apply(torch.tensor([1, 2, 3]), grads)
    assert (result.applied, result.dropped) == (2, 1)
    assert torch.equal(table.pull(torch.tensor([1, 2])), before - 0.5 * grads[:2])
    assert len(table) == 2  # apply never creates rows


@pytest.mark.parametrize(
    ("ids", "grads", "error", "message"),
    [
        (torch.tensor([1, 1]), torch.ones(2, 4), ValueError, "must be unique"),
        (torch.tensor([1, 2]), torch.ones(2, 3), ValueError, r"grads must have shape \(2, 4\), got \(2, 3\)"),
        (torch.tensor([1, 2]), torch.ones(2, 4, dtype=torch.float64), TypeError, "grads must be float32"),
        (torch.tensor([1, 2], dtype=torch.int32), torch.ones(2, 4), TypeError, "1-D int64"),
        (torch.tensor([1, 2]), torch.tensor([[0.0] * 4, [float("nan")] * 4]), ValueError, "NaN or infinite"),
    ],
)
def test_invalid_pushes_are_refused_before_anything_changes(
    ids: torch.Tensor, grads: torch.Tensor, error: type, message: str
) -> None:
    table = _table()
    table.pull(torch.tensor([1, 2]))
    before = table.pull(torch.tensor([1, 2]))
    with pytest.raises(error, match=message):
        table.apply(ids, grads)
    assert torch.equal(table.pull(torch.tensor([1, 2])), before)
    assert table.stats().pushed_rows_total == 0


def test_counters_follow_the_traffic() -> None:
    table = _table(dim=16, optimizer=RowWiseAdagrad(lr=0.1))
    table.pull(torch.arange(1000))
    table.pull(torch.arange(500))
    table.apply(torch.arange(990, 1010), torch.ones(20, 16))
    table.capture_delta()
    s = table.stats()
    assert (s.rows, s.admitted_total, s.pulled_rows_total) == (1000, 1000, 1500)
    assert (s.pushed_rows_total, s.dropped_gradients_total, s.deltas_total) == (10, 10, 1)
    assert s.last_delta_bytes == s.delta_bytes_total == 1000 * (8 + 17 * 4 + 4 + 2)
    assert s.dirty_rows_pending == 0 and s.tombstones_pending == 0
    # 68 B of payload, 7 B of metadata, 8 B of key, 4 B per index slot (1024 + grown slots).
    assert s.bytes_per_row == pytest.approx(68 + 7 + 8 + s.index_bytes_per_row - 8, rel=1e-9)


def test_bytes_per_row_stay_within_the_budget_at_a_million_rows() -> None:
    table = _table(dim=16, optimizer=RowWiseAdagrad(lr=0.1))
    for start in range(0, 1_000_000, 100_000):
        table.pull(torch.arange(start, start + 100_000))
    s = table.stats()
    assert s.rows == 1_000_000
    assert s.index_bytes_per_row <= 8 + 4 / (0.8 / 1.5) and s.bytes_per_row <= 92


def test_concurrent_pulls_and_pushes_from_threads_lose_nothing() -> None:
    table = _table()
    ids = torch.arange(200)
    table.pull(ids)
    start = table.pull(ids)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for _ in range(50):
                table.pull(ids)
                table.apply(ids, torch.full((200, 4), float(offset)))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    # SGD with lr 0.5: every push lands exactly once; (1 + 2) * 50 * 0.5 = 75 off each element.
    torch.testing.assert_close(table.pull(ids), start - 75.0)
    assert table.stats().pushed_rows_total == 2 * 50 * 200


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"name": ""}, "table name must not be empty"),
        ({"table_id": -1}, r"table_id must be in \[0, 2\*\*31\), got -1"),
        ({"dim": 0}, r"dim must be in \[1, 65536\], got 0"),
        ({"optimizer": "sgd"}, "optimizer must be one of"),
        ({"clock": "steps"}, "clock must be 'applies' or 'seconds', got 'steps'"),
        ({"num_buckets": 0}, r"num_buckets must be in \[1, 2\*\*31\), got 0"),
        ({"initial_rows": 0}, "initial_rows must be >= 1, got 0"),
        ({"full_slice_rows": 0}, "full_slice_rows must be >= 1, got 0"),
    ],
)
def test_config_is_validated(overrides: dict[str, Any], message: str) -> None:
    settings: dict[str, Any] = {"name": "t", "table_id": 1, "dim": 4, "optimizer": SGD(lr=0.5), **overrides}
    with pytest.raises(ValueError, match=message):
        TableConfig(spec=TableSpec(name=settings.pop("name"), table_id=settings.pop("table_id"), dim=settings.pop("dim")), **settings)


def test_a_deferred_pull_reads_the_initial_row_and_leaves_creation_to_create() -> None:
    """The server's pull (``defer=True``): admitted ids read the bits creating their row would write,
    get no row until ``create``, and are handed out once, unique and sorted, however often pulled."""
    table, eager = _table(init=RowInitConfig(seed=3)), _table(init=RowInitConfig(seed=3))
    ids = torch.tensor([9, -9, 9, 4])
    assert torch.equal(table.pull(ids, defer=True), eager.pull(ids))
    assert len(table) == 0
    table.pull(torch.tensor([4, 7]), defer=True)
    admitted = table.take_admitted()
    assert admitted.tolist() == [-9, 4, 7, 9] and table.take_admitted().numel() == 0
    assert table.create(admitted) == 4 and table.create(admitted) == 0  # ids that have a row are skipped
    eager.pull(torch.tensor([7]))
    assert torch.equal(table.pull(admitted), eager.pull(admitted)) and table.stats().admitted_total == 4
