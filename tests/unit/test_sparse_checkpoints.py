"""Chained sparse checkpoints through the real checkpointer, on real files in tmp_path (no processes):
a full then deltas, a new full every K deltas, every snapshot restores the rows (optimizer state and
metadata included) bit for bit, the purge keeps every link a kept snapshot needs, a lost delta makes
the next snapshot a full, a broken link refuses resume naming the file and what to do, and chains
restore onto a different number of servers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from harness.inprocess import InProcessServer
from ps.checkpoints import checkpointer as checkpointer_module
from ps.checkpoints.checkpointer import Checkpointer, ResumeRefused, find_resume_point
from ps.checkpoints.snapshot_files import list_snapshots, peek_manifest, write_snapshot
from ps.checkpoints.sparse_checkpoint import SPARSE_FILE, BrokenChain, read_layouts, snapshot_tables
from ps.config import CheckpointConfig
from ps.sparse.store import SparseConfig, SparseStore
from rpcps.messages import PushStatus
from tests.unit.test_sparse_server import TABLES, TinyModel, _Rows, _rows, _server, _step, _train_sharded

Rows = dict[str, dict[int, torch.Tensor]]


class _Trainer:
    """One worker slot pushing sparse and dense steps into an in-process server."""

    def __init__(self, server: InProcessServer) -> None:
        self.server = server
        self.incarnation = server.register(0, "w0", server.signature.to_wire()).incarnation
        self.model = TinyModel()
        self.model.embeddings.attach(_Rows(server, self.incarnation))
        self.seq = 0

    def steps(self, n: int) -> None:
        for _ in range(n):
            chunks, sparse = _step(self.server, self.model, self.incarnation, self.seq)
            reply = self.server.push(0, self.incarnation, self.seq, self.server.version, chunks, 1.0, sparse)
            assert reply.status == PushStatus.APPLIED
            self.seq += 1


def _checkpointer(server: InProcessServer, directory: Path, keep: int = 50, every_updates: int | None = None) -> Checkpointer:
    meta = {"signature": server.signature.to_wire(), "optimizer": server.config.optimizer.name}
    config = CheckpointConfig(directory=str(directory), every_seconds=None, every_updates=every_updates, keep=keep)
    return Checkpointer(server.core, config, meta, server.core.metrics)  # type: ignore[arg-type]


def _kind(path: Path) -> str:
    return peek_manifest(path)["sparse"]["kind"]


def _resume(path: Path, **sparse: object) -> InProcessServer:
    fresh = _server(**sparse)
    point = find_resume_point(CheckpointConfig(resume=str(path)), fresh.signature, fresh.config.optimizer.name)
    assert point is not None
    fresh.restore_state(point[1])
    return fresh


def _same(a: Rows, b: Rows) -> bool:
    return a.keys() == b.keys() and all(a[t].keys() == b[t].keys() and all(torch.equal(a[t][i], b[t][i]) for i in a[t]) for t in a)


def _evict_all(server: InProcessServer) -> int:
    evicted = 0
    for table in server.sparse.tables.values():
        while True:
            step = table.evict_step()
            evicted += step.evicted.numel()
            if step.sweep_done:
                break
    return evicted


@pytest.mark.parametrize(
    ("full_every", "kinds"),
    [
        (1, ["full", "delta", "full", "delta", "full", "delta"]),
        # These tables are tiny: each delta holds most rows, so two of them outweigh the full.
        (1000, ["full", "delta", "delta", "full", "delta", "delta"]),
    ],
    ids=["every-k-deltas", "deltas-outweigh-the-full"],
)
def test_a_full_then_deltas_every_snapshot_restores_exactly(tmp_path: Path, full_every: int, kinds: list[str]) -> None:
    server = _server(full_every_deltas=full_every, ttl=1)
    trainer, checkpointer = _Trainer(server), _checkpointer(server, tmp_path)
    expected: dict[Path, Rows] = {}
    evicted = 0
    for _ in range(6):
        trainer.steps(2)
        evicted += _evict_all(server)
        path, _ = checkpointer.checkpoint_now()
        expected[Path(path)] = _rows(server)
    assert evicted > 0, "the TTL should have evicted rows, so deltas carry tombstones"
    paths = sorted(expected)
    assert [_kind(p) for p in paths] == kinds
    for i, path in enumerate(paths):
        start = max(j for j in range(i + 1) if kinds[j] == "full")
        assert peek_manifest(path)["sparse"]["chain"] == [p.name for p in paths[start : i + 1]]
    delta = torch.load(paths[1] / SPARSE_FILE, weights_only=True)["tables"]["user"][0]
    assert 0 < delta["records"]["ids"].numel() < sum(len(t) for t in expected[paths[1]].values()), "a delta holds touched rows only"
    for path, rows in expected.items():
        assert _same(_rows(_resume(path, ttl=1)), rows), f"{path.name} restores other rows"
    text = generate_latest(server.core.metrics.registry).decode()
    assert f'rpcps_sparse_full_snapshots_total{{capture="sliced"}} {float(kinds.count("full"))}' in text, "prepared off the lock"
    assert f"rpcps_sparse_checkpoint_chain_deltas {float(kinds[::-1].index('full'))}" in text
    assert f'rpcps_sparse_delta_bytes_total{{table="user"}} {float(server.sparse.stats()["user"].delta_bytes_total)}' in text


def test_a_capture_on_the_apply_path_without_a_prepared_full_copies_it_under_the_lock(tmp_path: Path) -> None:
    server = _server()
    checkpointer = _checkpointer(server, tmp_path, every_updates=2)
    server.core.on_applied(checkpointer.on_applied)  # the writer thread is not started: nothing prepares a full
    _Trainer(server).steps(2)
    rows = _rows(server)
    path, _ = checkpointer.checkpoint_now()
    assert _kind(Path(path)) == "full" and _same(_rows(_resume(Path(path))), rows)
    assert 'rpcps_sparse_full_snapshots_total{capture="locked"} 1.0' in generate_latest(server.core.metrics.registry).decode()


def test_purge_keeps_every_link_a_kept_snapshot_needs(tmp_path: Path) -> None:
    server = _server(full_every_deltas=2)
    server.sparse.tables["user"].pull(torch.arange(1000) + 10)  # rows that training does not touch: deltas stay small
    trainer, checkpointer = _Trainer(server), _checkpointer(server, tmp_path, keep=1)
    names, kinds = [], []
    for i in range(5):
        trainer.steps(1)
        path = Path(checkpointer.checkpoint_now()[0])
        names.append(path.name)
        kinds.append(_kind(path))
        if i == 2:
            assert sorted(p.name for p in list_snapshots(tmp_path)) == names, "keep=1, but the newest delta needs its full and delta"
    assert kinds == ["full", "delta", "delta", "full", "delta"]
    assert sorted(p.name for p in list_snapshots(tmp_path)) == names[3:], "the old chain is needed by no kept snapshot"


def test_a_delta_that_does_not_reach_the_disk_makes_the_next_snapshot_a_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = _server()
    trainer, checkpointer = _Trainer(server), _checkpointer(server, tmp_path)
    trainer.steps(2)
    checkpointer.checkpoint_now()
    trainer.steps(2)
    real = checkpointer_module.write_snapshot

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointer_module, "write_snapshot", disk_full)
    with pytest.raises(OSError, match="No space"):
        checkpointer.checkpoint_now()
    monkeypatch.setattr(checkpointer_module, "write_snapshot", real)
    trainer.steps(1)
    path = Path(checkpointer.checkpoint_now()[0])
    assert _kind(path) == "full", "the failed delta's rows are in no file: only a full can follow"
    assert _same(_rows(_resume(path)), _rows(server))


def test_a_corrupt_delta_refuses_resume_naming_the_file_and_moves_nothing(tmp_path: Path) -> None:
    server = _server()
    trainer, checkpointer = _Trainer(server), _checkpointer(server, tmp_path)
    paths, expected = [], {}
    for _ in range(4):
        trainer.steps(1)
        paths.append(Path(checkpointer.checkpoint_now()[0]))
        expected[paths[-1]] = _rows(server)
    broken = paths[2] / SPARSE_FILE
    data = bytearray(broken.read_bytes())
    data[len(data) // 2] ^= 0xFF
    broken.write_bytes(bytes(data))
    fresh = _server()
    with pytest.raises(ResumeRefused) as refused:
        find_resume_point(CheckpointConfig(directory=str(tmp_path)), fresh.signature, fresh.config.optimizer.name)
    message = str(refused.value)
    assert str(broken) in message and "checksum" in message and f"--resume {paths[1]}" in message, message
    assert list_snapshots(tmp_path) == paths[::-1], "no snapshot was moved aside"
    assert _same(_rows(_resume(paths[1])), expected[paths[1]]), "the snapshot the message names resumes exactly"


@pytest.mark.parametrize(("written", "restored"), [(1, 2), (2, 1)])
def test_chains_restore_onto_another_number_of_servers_bit_identically(tmp_path: Path, written: int, restored: int) -> None:
    directories = [tmp_path] if written == 1 else [tmp_path / f"shard-{k}-of-{written}" for k in range(written)]
    checkpointers: list[Checkpointer] = []

    def snapshot_every_second_step(servers: list[InProcessServer], seq: int) -> None:
        if not checkpointers:
            for server, directory in zip(servers, directories):
                directory.mkdir(exist_ok=True)
                checkpointers.append(_checkpointer(server, directory))
        if seq % 2:
            for checkpointer in checkpointers:
                checkpointer.checkpoint_now()

    servers = _train_sharded(written, 6, snapshot_every_second_step)
    assert all(_kind(list_snapshots(d)[0]) == "delta" for d in directories)
    expected: Rows = {t.name: {} for t in TABLES}
    for server in servers:
        for table, rows in _rows(server).items():
            expected[table].update(rows)
    chains = read_layouts(tmp_path)
    got: Rows = {t.name: {} for t in TABLES}
    for k in range(restored):
        store = SparseStore(TABLES, SparseConfig(lr=0.5), k, restored)
        store.restore(chains)
        for table, fulls in store.capture().items():
            for full in fulls:
                ids, rows = full["records"]["ids"], full["records"]["rows"]
                assert not got[table].keys() & set(ids.tolist()), "an id restored onto two servers"
                got[table].update({int(i): r for i, r in zip(ids, rows)})
    assert _same(got, expected)


def test_snapshot_tables_reads_a_snapshot_from_before_chains(tmp_path: Path) -> None:
    server = _server()
    _Trainer(server).steps(2)
    version, state = server.capture_state()  # the old layout: full copies inside state.pt
    info = write_snapshot(tmp_path, version, state, {})
    store = SparseStore(TABLES, SparseConfig(lr=0.5), 0, 1)
    store.restore(snapshot_tables(info.path))
    assert sum(len(t) for t in store.tables.values()) == sum(len(r) for r in _rows(server).values())


def test_the_first_full_does_not_copy_the_rows_pulled_before_it_under_the_lock(tmp_path: Path) -> None:
    server = _server()
    table = server.sparse.tables["user"]
    table.pull(torch.arange(5000))  # dirty since no delta was ever taken
    path = Path(_checkpointer(server, tmp_path).checkpoint_now()[0])
    assert _kind(path) == "full" and sum(len(r) for r in _rows(_resume(path)).values()) == 5000
    closing = table.stats().last_delta_bytes
    assert closing < 5000 * 8, f"the closing delta copied {closing} bytes under the lock: the slices had copied those rows already"


def test_a_link_replaced_by_a_snapshot_of_another_chain_is_refused(tmp_path: Path) -> None:
    runs = []
    for run in ("a", "b"):
        server = _server()
        trainer, checkpointer = _Trainer(server), _checkpointer(server, tmp_path / run)
        (tmp_path / run).mkdir()
        for _ in range(2):
            trainer.steps(1)
            checkpointer.checkpoint_now()
        runs.append(list_snapshots(tmp_path / run)[::-1])
    (full_a, delta_a), (full_b, _) = runs
    assert full_a.name == full_b.name and _kind(delta_a) == "delta"
    shutil.rmtree(full_a)
    shutil.copytree(full_b, full_a)  # same name, verifies on its own, but not the full delta_a was taken on
    with pytest.raises(BrokenChain, match="seq|another chain"):
        snapshot_tables(delta_a)
