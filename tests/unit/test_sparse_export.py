"""Exporting sparse tables and serving them without a server, on real files in tmp_path (no processes):
a chain's streamed rows equal its restore row for row (deltas, tombstones, other servers' buckets,
memory-mapped files); the export directory round-trips in both formats and in several parts; it is
written whole or not at all; and a model loaded from it answers like the server, unseen ids included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from harness.sparse_eval import StoreRows
from ps.checkpoints.sparse_export import TableSource, chain_slices, export_files
from ps.sparse.store import SparseConfig, SparseStore
from ps.sparse.table import SparseTable
from rpcps.sparse.export_files import ExportFormatError, load_table, read_manifest, write_export
from rpcps.sparse.serving import load_export, load_rows
from rpcps.sparse.sharding import BucketManifest
from rpcps.sparse.spec import TableSpec
from tests.unit.test_sparse_checkpoint import ALL, Chain, Workload, _config, _live, _restore, _train_chain
from tests.unit.test_sparse_server import TABLES, TinyModel

pytest.importorskip("safetensors")


def _streamed(chain: Chain, keep: list[tuple[int, int]], mapped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, rows) chain_slices gives, sorted by id, in slices of 97 full records."""
    parts = list(chain_slices(chain, keep, slice_rows=97, mapped=mapped))
    ids, rows = torch.cat([i for i, _ in parts]), torch.cat([r for _, r in parts])
    order = ids.argsort()
    return ids[order], rows[order]


@pytest.fixture(scope="module")
def chain() -> tuple[SparseTable, Chain]:
    table = SparseTable(_config(admission=None))
    chain = _train_chain(table, Workload(seed=11), deltas=3)
    assert sum(d["tombstones"].numel() for d in chain[1]) > 0, "the workload must evict"
    return table, chain


@pytest.mark.parametrize("servers", [1, 3])
def test_streamed_rows_equal_the_restore_of_the_chain_row_for_row(chain: tuple[SparseTable, Chain], servers: int) -> None:
    table, links = chain
    restored = _restore(table.config, [links], servers)
    manifest = BucketManifest.even(servers, table.config.num_buckets)
    for server, target in enumerate(restored):
        ids, rows = _streamed(links, manifest.ranges_of(server))
        expected = _live(target)
        assert torch.equal(ids, expected.ids) and torch.equal(rows, expected.rows)
    assert sum(len(t) for t in restored) == len(table)


def test_a_memory_mapped_chain_streams_the_same_rows_and_stays_readable(chain: tuple[SparseTable, Chain], tmp_path: Path) -> None:
    _, links = chain
    torch.save(links, tmp_path / "chain.pt")
    mapped = torch.load(tmp_path / "chain.pt", weights_only=True, mmap=True)
    in_memory = _streamed(links, ALL)
    for _ in range(2):  # dropped pages come back from the file when read again
        ids, rows = _streamed(mapped, ALL, mapped=True)
        assert torch.equal(ids, in_memory[0]) and torch.equal(rows, in_memory[1])


def _store(**sparse: Any) -> SparseStore:
    """A server's tables after a few pulls and pushes (rows created on first pull unless admission)."""
    store = SparseStore(TABLES, SparseConfig(**sparse), 0, 1)
    gen = torch.Generator().manual_seed(3)
    for step in range(6):
        for table in store.tables.values():
            ids = torch.unique(torch.randint(0, 400, (150,), generator=gen) * 7919 + step)
            table.pull(ids)
            table.apply(ids, torch.randn(ids.numel(), table.config.dim, generator=gen))
    return store


def _export(store: SparseStore, out: Path, fmt: str = "torch", part_rows: int = 100, with_state: bool = False) -> None:
    tables = {}
    for name, table in store.tables.items():
        full = table.capture_full()
        tables[name] = [TableSource(full["meta"], chain_slices((full, []), ALL))]
    dense = TinyModel().state_dict()
    write_export(export_files(dense, tables, fmt, {"model_versions": [6]}, part_rows, with_state), out)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_the_export_round_trips_every_row_in_parts_with_optimizer_state_on_request(tmp_path: Path, fmt: str) -> None:
    store = _store(optimizer="rowwise_adagrad")
    _export(store, tmp_path / "out", fmt, part_rows=100, with_state=True)
    manifest = read_manifest(tmp_path / "out")
    for name, table in store.tables.items():
        entry = manifest["tables"][name]
        assert entry["rows"] == len(table) and len(entry["parts"]) == -(-len(table) // 100)
        assert entry["unseen"] == "init" and entry["optimizer"]["name"] == "rowwise_adagrad" and entry["state_width"] == 1
        got = load_table(tmp_path / "out", manifest, name)
        live = _live(table)
        order = got["ids"].argsort()
        assert torch.equal(got["ids"][order], live.ids)
        assert torch.equal(got["weight"][order], live.rows[:, : table.config.dim])
        assert torch.equal(got["state"][order], live.rows[:, table.config.dim :])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "no temporary directory is left"


def _features(ids: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    return {name: (t.reshape(-1, 2), None) for name, t in ids.items()}


@pytest.mark.parametrize(("sparse", "unseen"), [({}, "init"), ({"admit_count": 3}, "zeros")])
def test_a_loaded_export_answers_like_the_server_unseen_ids_included(tmp_path: Path, sparse: dict[str, Any], unseen: str) -> None:
    store = _store(**sparse)
    _export(store, tmp_path / "out")
    assert {e["unseen"] for e in read_manifest(tmp_path / "out")["tables"].values()} == {unseen}
    served = load_export(TinyModel(), tmp_path / "out", device="cpu")
    reference = TinyModel().eval()
    reference.embeddings.attach(StoreRows(store))
    gen = torch.Generator().manual_seed(4)
    # Half of the ids were trained, half never seen by the server (which creates or refuses them now).
    batch = {name: torch.randint(0, 800, (64,), generator=gen) * 7919 for name in ("user", "item")}
    with torch.no_grad():
        expected = reference(_features(batch))
        assert torch.equal(served(_features(batch)), expected)
        assert torch.equal(served(_features(batch)), expected), "a lookup changes nothing"
    rows = load_rows(tmp_path / "out", TABLES)
    never = torch.tensor([-5, 10**15], dtype=torch.int64)
    server_rows = SparseStore(TABLES, SparseConfig(**sparse), 0, 1).tables["user"].pull(never)
    assert torch.equal(rows.pull({"user": never})["user"], server_rows)
    assert bool(server_rows.any()) == (unseen == "init")


def test_a_model_of_other_tables_or_a_corrupt_part_is_refused_naming_what_to_do(tmp_path: Path) -> None:
    _export(_store(), tmp_path / "out")
    other = (TableSpec(name="user", table_id=0, dim=8), TableSpec(name="item", table_id=1, dim=3))
    with pytest.raises(ExportFormatError, match="table 'user' has id 0 and dim 4, the model declares id 0 and dim 8"):
        load_rows(tmp_path / "out", other)
    with pytest.raises(ExportFormatError, match=r"holds sparse tables \['item', 'user'\], the model declares \['user'\]"):
        load_rows(tmp_path / "out", other[:1])
    part = tmp_path / "out" / read_manifest(tmp_path / "out")["tables"]["item"]["parts"][0]["file"]
    part.write_bytes(part.read_bytes()[:-1] + b"x")
    with pytest.raises(ExportFormatError, match="fails its SHA-256 checksum .* export again"):
        load_rows(tmp_path / "out", TABLES)
    with pytest.raises(ExportFormatError, match="is not an rpcps export .* run `rpcps export"):
        load_rows(tmp_path, TABLES)


def test_an_export_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _export(_store(), out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def failing() -> Any:
        yield "model.pt", b"partial"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_export(failing(), out)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(ExportFormatError, match="ends with its export.json"):
        write_export(iter([("model.pt", b"x")]), out)
    _export(_store(optimizer="sgd"), out)  # replaces the previous export
    assert {e["optimizer"]["name"] for e in read_manifest(out)["tables"].values()} == {"sgd"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    for path, message in [(tmp_path / "other", "holds something other than an export"), (tmp_path / "m.pt", "names a file")]:
        with pytest.raises(ExportFormatError, match=message):
            _export(_store(), path)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"

