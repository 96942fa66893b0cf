"""rpcps.sparse.row_init: a new row's value depends on (seed, table id, id) only."""

from __future__ import annotations

import pytest
import torch

from ps.sparse.row_optim import SGD
from ps.sparse.table import SparseTable, TableConfig
from rpcps.sparse.hashing import derive_key, keyed_hash, standard_normal, stream_at, uniform01
from rpcps.sparse.row_init import _CHUNK_ROWS, _INIT_SALT, RowInitConfig, initial_rows
from rpcps.sparse.spec import TableSpec

_IDS = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 987654321987, 42], dtype=torch.int64)


def _table(init: RowInitConfig, table_id: int = 5) -> SparseTable:
    return SparseTable(TableConfig(spec=TableSpec(name="t", table_id=table_id, dim=8), optimizer=SGD(lr=0.1), init=init))


@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_same_id_gets_bit_identical_rows_whatever_the_arrival_order_and_batching(kind: str) -> None:
    init = RowInitConfig(kind=kind, scale=0.05, seed=11)  # type: ignore[arg-type]
    one, two = _table(init), _table(init)
    perm = torch.randperm(_IDS.numel(), generator=torch.Generator().manual_seed(0))
    # Table one sees the ids in one batch; table two in another order, one at a time, mixed with
    # ids table one never sees (as a different shard would).
    rows_one = one.pull(_IDS)
    for i in perm.tolist():
        two.pull(torch.tensor([i * 1000 + 7, int(_IDS[i])]))
    rows_two = two.pull(_IDS)
    assert torch.equal(rows_one, rows_two)
    assert torch.equal(rows_one, initial_rows(init, 5, _IDS, 8))


def test_rows_differ_between_seeds_tables_and_ids() -> None:
    base = initial_rows(RowInitConfig(seed=1), 3, _IDS, 8)
    assert not torch.equal(base, initial_rows(RowInitConfig(seed=2), 3, _IDS, 8))
    assert not torch.equal(base, initial_rows(RowInitConfig(seed=1), 4, _IDS, 8))
    assert torch.unique(base, dim=0).shape[0] == _IDS.numel()


def test_a_wider_row_starts_with_the_narrower_rows_values() -> None:
    # Element j of a row is output j of the id's stream, so widths share a prefix.
    cfg = RowInitConfig(seed=3)
    assert torch.equal(initial_rows(cfg, 1, _IDS, 4), initial_rows(cfg, 1, _IDS, 16)[:, :4])


def test_distributions_have_the_configured_range_and_scale() -> None:
    ids = torch.arange(20_000)
    uniform = initial_rows(RowInitConfig(kind="uniform", scale=0.5), 0, ids, 16)
    assert float(uniform.min()) >= -0.5 and float(uniform.max()) < 0.5 and abs(float(uniform.mean())) < 0.01
    normal = initial_rows(RowInitConfig(kind="normal", scale=0.1), 0, ids, 16)
    assert abs(float(normal.std()) - 0.1) < 0.002 and abs(float(normal.mean())) < 0.002
    assert torch.equal(initial_rows(RowInitConfig(kind="zeros"), 0, ids, 4), torch.zeros(20_000, 4))


@pytest.mark.parametrize("kind", ["uniform", "normal"])
@pytest.mark.parametrize("dim", [5, 16])
def test_block_hashing_gives_the_bits_of_the_stream_definition(kind: str, dim: int) -> None:
    # Element j of a row is defined as stream_at(row key, j), one column at a time (the old code);
    # initial_rows hashes blocks of rows for every j at once. Rows past one block are included.
    cfg = RowInitConfig(kind=kind, scale=0.05, seed=7)  # type: ignore[arg-type]
    ids = torch.cat([_IDS, torch.randint(-(2**63), 2**63 - 1, (_CHUNK_ROWS + 3,), generator=torch.Generator().manual_seed(1))])
    keys = keyed_hash(ids, derive_key(_INIT_SALT, cfg.seed, 9))
    to_float = uniform01 if kind == "uniform" else standard_normal
    expected = torch.stack([to_float(stream_at(keys, j)) for j in range(dim)], dim=1).mul_(cfg.scale * (2 if kind == "uniform" else 1))
    if kind == "uniform":
        expected.sub_(cfg.scale)
    assert torch.equal(initial_rows(cfg, 9, ids, dim), expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "xavier"}, "init kind must be 'uniform', 'normal' or 'zeros', got 'xavier'"),
        ({"scale": 0.0}, "init scale must be > 0, got 0.0"),
        ({"seed": 2**64}, r"init seed must be in \[-2\*\*63, 2\*\*64\)"),
    ],
)
def test_config_is_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RowInitConfig(**kwargs)  # type: ignore[arg-type]
