"""ps.sparse.index.IdIndex: batched open addressing over any int64 ids, checked against a dict model."""

from __future__ import annotations

import random

import pytest
import torch

from ps.sparse.index import IdIndex, IndexConfig
from rpcps.sparse.sharding import bucket_of

_EXTREMES = torch.tensor([0, -1, 1, 2**63 - 1, -(2**63), 12345, -12345], dtype=torch.int64)


def _rows(n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def test_extreme_and_negative_ids_round_trip() -> None:
    index = IdIndex()
    index.insert(_EXTREMES, _rows(7, 100))
    assert index.lookup(_EXTREMES).tolist() == list(range(100, 107))
    assert index.ids_of(_rows(7, 100)).tolist() == _EXTREMES.tolist()
    assert index.lookup(torch.tensor([2, -2, 2**62])).tolist() == [-1, -1, -1]
    assert len(index) == 7


def test_lookup_allows_duplicates_and_empty_batches() -> None:
    index = IdIndex()
    index.insert(torch.tensor([5, 6]), _rows(2))
    assert index.lookup(torch.tensor([6, 6, 5, 7, 6])).tolist() == [1, 1, 0, -1, 1]
    assert index.lookup(torch.empty(0, dtype=torch.int64)).numel() == 0


@pytest.mark.parametrize(
    ("ids", "rows", "error", "message"),
    [
        (torch.tensor([1, 1]), _rows(2), ValueError, "must be unique"),
        (torch.tensor([1, 2]), torch.tensor([0, -1]), ValueError, r"rows must be in \[0, 2\*\*31\)"),
        (torch.tensor([1, 2]), _rows(3), ValueError, "same shape"),
        (torch.tensor([1, 2], dtype=torch.int32), _rows(2), TypeError, "1-D int64"),
    ],
)
def test_bad_inserts_are_refused(ids: torch.Tensor, rows: torch.Tensor, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        IdIndex().insert(ids, rows)


def test_inserting_a_present_id_is_refused_and_changes_nothing() -> None:
    index = IdIndex()
    index.insert(torch.tensor([10, 20]), _rows(2))
    with pytest.raises(ValueError, match=r"1 ids are already in the index, e.g. 20"):
        index.insert(torch.tensor([30, 20]), _rows(2, 2))
    assert len(index) == 2 and index.lookup(torch.tensor([30])).tolist() == [-1]


def test_remove_returns_former_rows_and_leaves_tombstones() -> None:
    index = IdIndex()
    index.insert(torch.tensor([1, 2, 3]), _rows(3, 10))
    assert index.remove(torch.tensor([2, 99])).tolist() == [11, -1]
    assert index.lookup(torch.tensor([1, 2, 3])).tolist() == [10, -1, 12]
    assert len(index) == 2 and index.tombstones == 1
    with pytest.raises(ValueError, match="remove must be unique"):
        index.remove(torch.tensor([1, 1]))


def test_growth_keeps_every_id_and_the_load_below_the_limit() -> None:
    cfg = IndexConfig(initial_slots=16, max_load=0.8, growth=1.5)
    index = IdIndex(cfg)
    gen = torch.Generator().manual_seed(0)
    ids = torch.unique(torch.randint(-(2**62), 2**62, (300_000,), generator=gen))
    for start in range(0, ids.numel(), 7_000):
        chunk = ids[start : start + 7_000]
        index.insert(chunk, _rows(chunk.numel(), start))
        assert len(index) / index.capacity <= cfg.max_load
    assert torch.equal(index.lookup(ids), _rows(ids.numel()))
    # Grown in 1.5x steps, the load stays above max_load / growth, so the index is 8 + 4/load bytes a row.
    assert len(index) / index.capacity > cfg.max_load / cfg.growth / 1.01
    assert index.nbytes() / len(index) < 8 + 4 / (cfg.max_load / cfg.growth) + 0.1


def test_churn_matches_a_dict_model_and_tombstones_do_not_grow_the_table() -> None:
    index = IdIndex(IndexConfig(initial_slots=4096))
    model: dict[int, int] = {}
    rng = random.Random(3)
    free_rows = list(range(2000))
    next_id = removed_total = 0
    for _ in range(300):
        # Keep ~1000 live ids while inserting and removing in batches: tombstones pile up and force
        # same-size rehashes, never growth.
        add = [next_id + i for i in range(rng.randint(0, 60))]
        next_id += len(add)
        if len(model) + len(add) > 1500:
            add = []
        rows = [free_rows.pop() for _ in add]
        index.insert(torch.tensor(add, dtype=torch.int64), torch.tensor(rows, dtype=torch.int64))
        model.update(zip(add, rows, strict=True))
        gone = rng.sample(sorted(model), min(len(model), rng.randint(0, 60)))
        removed = index.remove(torch.tensor(gone, dtype=torch.int64)).tolist()
        assert removed == [model.pop(g) for g in gone]
        free_rows.extend(removed)
        removed_total += len(removed)
        probe = list(model) + [next_id + 5, -7]
        assert index.lookup(torch.tensor(probe, dtype=torch.int64)).tolist() == [model.get(p, -1) for p in probe]
    assert removed_total > 4096 > index.tombstones  # more removals than slots: rehashes cleared them
    assert index.capacity == 4096


def test_ids_of_one_bucket_still_spread_over_the_index() -> None:
    # A server owning a few buckets indexes only their ids; if the slot hash were correlated with the
    # bucket hash, those ids would share slot bits and probe sequences would be long.
    ids = torch.arange(2_000_000)
    mine = ids[bucket_of(ids, table_id=0, num_buckets=64) == 5]
    index = IdIndex()
    index.insert(mine, _rows(mine.numel()))
    lengths = index.probe_lengths(mine).double()
    load = len(index) / index.capacity
    # Linear probing's expected successful search length is (1 + 1 / (1 - load)) / 2.
    assert float(lengths.mean()) < 1.2 * (1 + 1 / (1 - load)) / 2
    assert index.probe_lengths(torch.tensor([-5])).tolist() == [-1]


def test_long_probe_sequences_resolve_in_the_widened_rounds() -> None:
    # At load 0.95 linear probing builds runs of hundreds of slots, so lookups reach the rounds of
    # 64 and 256 slots (and wrap around the end of the slots); each must still find its own row, and
    # an absent id must stop at the first EMPTY slot, not at a later one that a wide window also sees.
    index = IdIndex(IndexConfig(initial_slots=8192, max_load=0.95))
    ids = torch.randint(-(2**63), 2**63 - 1, (7700,), generator=torch.Generator().manual_seed(3)).unique()
    index.insert(ids, _rows(ids.numel()))
    assert index.capacity == 8192
    assert int(index.probe_lengths(ids).max()) > 16 + 64
    assert torch.equal(index.lookup(ids.flip(0)), _rows(ids.numel()).flip(0))
    absent = torch.randint(-(2**63), 2**63 - 1, (5000,), generator=torch.Generator().manual_seed(4))
    absent = absent[~torch.isin(absent, ids)]
    assert bool((index.lookup(absent) == -1).all())
    removed = ids[::3]
    index.remove(removed)
    assert bool((index.lookup(removed) == -1).all())
    kept = torch.ones(ids.numel(), dtype=torch.bool)
    kept[::3] = False
    assert torch.equal(index.lookup(ids[kept]), _rows(ids.numel())[kept])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"initial_slots": 4}, r"initial_slots must be in \[8, 2\*\*31\), got 4"),
        ({"max_load": 0.99}, r"max_load must be in \(0, 0.95\], got 0.99"),
        ({"max_load": 0.0}, r"max_load must be in \(0, 0.95\]"),
        ({"growth": 1.0}, r"growth must be in \[1.1, 4\], got 1.0"),
    ],
)
def test_config_is_validated(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        IndexConfig(**kwargs)  # type: ignore[arg-type]
