"""Full snapshots, chained deltas, compaction and resharded restores of sparse tables.

The workload pulls Zipf-distributed 64-bit ids, pushes gradients for them, and runs admission and
eviction the whole time, so chains carry new rows, updated rows and tombstones. The reference is the
live table's own rows (ids, rows with optimizer state, last_seen, count) read after the last capture;
every restore must reproduce it bit for bit, onto 1 server and onto 3.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from ps.checkpoints.snapshot_files import list_snapshots, load_snapshot, write_snapshot
from ps.sparse.admission import CountAdmissionConfig
from ps.sparse.checkpoint import InvalidPayload, RowRecords, compact, payload_nbytes
from ps.sparse.eviction import EvictionConfig
from ps.sparse.row_optim import LazyAdam, RowWiseAdagrad
from ps.sparse.table import SparseTable, TableConfig
from rpcps.sparse.hashing import derive_key, keyed_hash
from rpcps.sparse.sharding import BucketManifest, bucket_of, in_ranges
from rpcps.sparse.spec import TableSpec

Chain = tuple[dict[str, Any], list[dict[str, Any]]]
ALL = [(0, 4096)]


def _config(**overrides: Any) -> TableConfig:
    settings: dict[str, Any] = {
        "name": "emb",
        "table_id": 7,
        "dim": 8,
        "optimizer": LazyAdam(lr=0.01),
        "admission": CountAdmissionConfig(threshold=2, width=1 << 12),
        "eviction": EvictionConfig(ttl=12, slice_rows=700),
        "full_slice_rows": 300,
    }
    settings.update(overrides)
    return TableConfig(spec=TableSpec(name=settings.pop("name"), table_id=settings.pop("table_id"), dim=settings.pop("dim")), **settings)


class Workload:
    """Deterministic Zipf(1.1) batches over 20 000 ids scattered across the int64 range."""

    def __init__(self, seed: int, batch: int = 400) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        weights = 1.0 / torch.arange(1, 20_001, dtype=torch.float64) ** 1.1
        self._probs = weights / weights.sum()
        self._batch = batch

    def ids(self) -> torch.Tensor:
        ranks = torch.multinomial(self._probs, self._batch, replacement=True, generator=self._gen)
        return keyed_hash(ranks, derive_key(99))  # any 64-bit value, negative ones included

    def step(self, tables: list[SparseTable], manifest: BucketManifest | None = None) -> None:
        """One training step: pull, push summed gradients, one eviction slice, on each table."""
        ids = self.ids()
        owner = torch.zeros_like(ids) if manifest is None else manifest.server_of(ids, tables[0].config.table_id)
        for server, table in enumerate(tables):
            mine = ids[owner == server]
            table.pull(mine)
            unique = torch.unique(mine)
            table.apply(unique, torch.randn(unique.numel(), table.config.dim, generator=self._gen))
            table.evict_step()


def _live(*tables: SparseTable) -> RowRecords:
    """Every live row of the tables, sorted by id, read straight from their slabs."""
    parts = [t._records(t._slab.live_rows(0, t._slab.high_water)) for t in tables]
    records = RowRecords.concat(parts, tables[0].config.width)
    return records.select(torch.argsort(records.ids))


def _assert_same(a: RowRecords, b: RowRecords) -> None:
    assert torch.equal(a.ids, b.ids)
    assert torch.equal(a.rows, b.rows)  # bit for bit: no NaN can occur here
    assert torch.equal(a.last_seen, b.last_seen) and torch.equal(a.count, b.count)


def _restore(config: TableConfig, chains: list[Chain], servers: int) -> list[SparseTable]:
    manifest = BucketManifest.even(servers, config.num_buckets)
    tables = [SparseTable(config) for _ in range(servers)]
    for server, table in enumerate(tables):
        table.restore(chains, manifest.ranges_of(server))
        mine = bucket_of(_live(table).ids, config.table_id, config.num_buckets)
        assert bool(in_ranges(mine, manifest.ranges_of(server)).all())
    return tables


def _train_chain(table: SparseTable, work: Workload, deltas: int = 4) -> Chain:
    for _ in range(25):
        work.step([table])
    full = table.capture_full()
    chain: list[dict[str, Any]] = []
    for _ in range(deltas):
        for _ in range(10):
            work.step([table])
        chain.append(table.capture_delta())
    return full, chain


@pytest.mark.parametrize("servers", [1, 3])
def test_full_plus_deltas_restore_bit_identically_onto_1_and_3_servers(servers: int) -> None:
    table = SparseTable(_config())
    chain = _train_chain(table, Workload(seed=1))
    assert sum(d["tombstones"].numel() for d in chain[1]) > 0, "the workload must evict"
    assert table.stats().filtered_total > 0, "the workload must refuse some ids"
    _assert_same(_live(*_restore(table.config, [chain], servers)), _live(table))


def test_two_servers_restore_onto_three_and_onto_one() -> None:
    config = _config(optimizer=RowWiseAdagrad(lr=0.05))
    manifest = BucketManifest.even(2, config.num_buckets)
    old = [SparseTable(config) for _ in range(2)]
    work = Workload(seed=2)
    for _ in range(20):
        work.step(old, manifest)
    fulls = [t.capture_full(*manifest.ranges_of(s)[0]) for s, t in enumerate(old)]
    deltas: list[list[dict[str, Any]]] = [[], []]
    for _ in range(3):
        for _ in range(8):
            work.step(old, manifest)
        for s, t in enumerate(old):
            deltas[s].append(t.capture_delta())
    chains = list(zip(fulls, deltas, strict=True))
    for servers in (3, 1):
        _assert_same(_live(*_restore(config, chains, servers)), _live(*old))


def _save(directory: Path, chain: Chain) -> None:
    """Writes a chain with the existing commit-marker + SHA-256 protocol, one snapshot per payload."""
    full, deltas = chain
    directory.mkdir()
    write_snapshot(directory, 0, full, {"sparse": "full"})
    for delta in deltas:
        write_snapshot(directory, int(delta["meta"]["seq"]) + 1, delta, {"sparse": "delta"})


def _load(directory: Path) -> Chain:
    payloads = [load_snapshot(path)[1] for path in reversed(list_snapshots(directory))]  # weights_only=True
    return payloads[0], payloads[1:]


def test_payloads_survive_torch_save_and_weights_only_load(tmp_path: Path) -> None:
    table = SparseTable(_config())
    chain = _train_chain(table, Workload(seed=3), deltas=2)
    _save(tmp_path / "chain", chain)
    _assert_same(_live(*_restore(table.config, [_load(tmp_path / "chain")], 2)), _live(table))


def test_compaction_equals_the_chain_and_continues_it() -> None:
    table = SparseTable(_config())
    work = Workload(seed=4)
    full, deltas = _train_chain(table, work, deltas=3)
    full_ids = full["records"]["ids"].clone()
    compacted = compact(full, deltas)
    assert compacted["meta"]["next_delta_seq"] == deltas[-1]["meta"]["seq"] + 1
    _assert_same(_live(*_restore(table.config, [(compacted, [])], 1)), _live(table))
    for _ in range(10):
        work.step([table])
    later = table.capture_delta()
    _assert_same(_live(*_restore(table.config, [(compacted, [later])], 3)), _live(table))
    assert torch.equal(full["records"]["ids"], full_ids) and full["meta"]["next_delta_seq"] == 0  # inputs kept


def test_a_full_taken_in_slices_while_training_runs_is_exact_at_its_close() -> None:
    table = SparseTable(_config(full_slice_rows=50))
    work = Workload(seed=5)
    old_full, old_deltas = _train_chain(table, work, deltas=1)
    capture = table.begin_full()
    steps = 0
    while not capture.step():
        # Between slices: training, eviction, and now and then a delta of the old chain.
        work.step([table])
        steps += 1
        if steps % 4 == 0:
            old_deltas.append(table.capture_delta())
    assert steps > 8, "the capture must span many slices"
    work.step([table])  # after the last slice: only the closing step can see this one
    new_full = capture.finish()
    _assert_same(_live(*_restore(table.config, [(new_full, [])], 1)), _live(table))
    for _ in range(6):
        work.step([table])
    delta = table.capture_delta()
    # The next delta continues both the new full and the old chain.
    assert new_full["meta"]["next_delta_seq"] == delta["meta"]["seq"]
    _assert_same(_live(*_restore(table.config, [(new_full, [delta])], 3)), _live(table))
    _assert_same(_live(*_restore(table.config, [(old_full, [*old_deltas, delta])], 1)), _live(table))


def test_a_delta_holds_exactly_the_changed_rows_and_the_tombstones() -> None:
    config = _config(dim=16, optimizer=RowWiseAdagrad(lr=0.1), admission=None, eviction=EvictionConfig(ttl=4))
    table = SparseTable(config)
    table.pull(torch.arange(20_000))
    table.capture_delta()
    table.apply(torch.arange(0, 12_000, 2), torch.ones(6000, 16))
    table.pull(torch.arange(20_000, 21_000))  # 1000 new rows, created at clock 1
    for _ in range(4):
        table.apply(torch.arange(0, 100), torch.ones(100, 16))
    while not table.evict_step().sweep_done:
        pass
    delta = table.capture_delta()
    touched = torch.cat([torch.arange(0, 100), torch.arange(100, 12_000, 2), torch.arange(20_000, 21_000)])
    assert sorted(delta["records"]["ids"].tolist()) == touched.tolist()
    # TTL 4 at clock 5: rows last updated at clock 0 (created, never pushed) are gone.
    assert delta["tombstones"].numel() == 20_000 - 6050
    row_bytes = 8 + config.width * 4  # id + embedding + optimizer state
    limit = 1.1 * touched.numel() * row_bytes + 8 * delta["tombstones"].numel()
    assert payload_nbytes(delta) <= limit
    written = io.BytesIO()
    torch.save(delta, written)
    assert written.tell() <= limit
    assert table.stats().last_delta_bytes == payload_nbytes(delta)


def test_the_admission_sketch_travels_with_the_full() -> None:
    table = SparseTable(_config(eviction=None))
    table.pull(torch.tensor([5, 6]))  # seen once: not admitted at threshold 2
    full = table.capture_full()
    restored = SparseTable(table.config)
    restored.restore([(full, [])], ALL)
    restored.pull(torch.tensor([5]))
    assert len(restored) == 1


def test_seconds_clocks_are_rebased_onto_the_earliest_epoch() -> None:
    config = _config(clock="seconds", admission=None, eviction=None)
    early = SparseTable(config, time_fn=lambda: 1000.0)
    late = SparseTable(config, time_fn=lambda: 1100.0)
    early.pull(torch.tensor([1]))
    late.pull(torch.tensor([2]))
    restored = SparseTable(config, time_fn=lambda: 5000.0)
    restored.restore([(early.capture_full(), []), (late.capture_full(), [])], ALL)
    assert _live(restored).last_seen.tolist() == [0, 100]


def _chain(seed: int) -> tuple[SparseTable, Chain]:
    table = SparseTable(_config())
    return table, _train_chain(table, Workload(seed=seed), deltas=2)


def test_broken_chains_and_foreign_payloads_are_refused_and_leave_the_table_empty() -> None:
    table, (full, deltas) = _chain(6)
    fresh = SparseTable(table.config)
    cases = [
        ([(full, deltas[1:])], "delta chain breaks: expected seq 0, got 1"),
        ([(full, [deltas[1], deltas[0]])], "delta chain breaks"),
        ([(deltas[0], [])], "expected a full payload, got a 'delta' one"),
        ([({"meta": {"format": "other"}}, [])], "not an rpcps-sparse-v1 payload"),
        ([(full, deltas), (full, deltas)], "two chains hold the same id"),
        ([(full, [{**deltas[0], "tombstones": [1, 2]}])], "has no 1-D int64 tombstones"),
    ]
    for chains, message in cases:
        with pytest.raises(InvalidPayload, match=message):
            fresh.restore(chains, ALL)  # type: ignore[arg-type]
        assert len(fresh) == 0
    for config, message in [
        (_config(table_id=8), "checkpoint has table_id=7, table 'emb' has 8"),
        (_config(dim=4), "checkpoint has dim=8"),
        (_config(optimizer=LazyAdam(lr=0.5), clock="seconds"), "checkpoint clock is 'applies'"),
    ]:
        with pytest.raises(InvalidPayload, match=message):
            SparseTable(config).restore([(full, deltas)], ALL)
    with pytest.raises(RuntimeError, match="must be empty to restore"):
        table.restore([(full, deltas)], ALL)


def test_a_restore_may_change_hyperparameters_but_not_the_state_layout() -> None:
    _, chain = _chain(7)
    SparseTable(_config(optimizer=LazyAdam(lr=0.5))).restore([chain], ALL)
    adagrad = _config(optimizer=RowWiseAdagrad(lr=0.1))
    with pytest.raises(InvalidPayload, match="checkpoint has width=25, table 'emb' has 9"):
        SparseTable(adagrad).restore([chain], ALL)


def test_an_aborted_full_stops_collecting_and_cannot_finish() -> None:
    table = SparseTable(_config())
    table.pull(torch.arange(10))
    capture = table.begin_full(0, 100)
    capture.abort()
    capture.abort()  # twice is harmless
    assert table._fulls == []  # deltas and evictions are no longer reported to it
    with pytest.raises(RuntimeError, match="aborted or has finished"):
        capture.finish()
    with pytest.raises(ValueError, match=r"bucket range \[5, 5\) is not within \[0, 4096\)"):
        table.begin_full(5, 5)


def test_dropping_changes_while_another_full_is_open_keeps_that_full_exact() -> None:
    """``drop_changes`` (a checkpointer preparing its own full) hands the rows it forgets to every
    open capture (an export or a standby's state transfer), whose closing step would have copied them."""
    table = SparseTable(_config(full_slice_rows=50))
    work = Workload(seed=7)
    _train_chain(table, work, deltas=1)
    capture = table.begin_full()
    capture.copy_slices()
    work.step([table])  # rows changed after their slice was copied
    table.drop_changes()
    full = capture.close().payload()
    _assert_same(_live(*_restore(table.config, [(full, [])], 1)), _live(table))
