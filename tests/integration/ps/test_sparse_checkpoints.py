"""Chained sparse checkpoints with real processes: ``rpcps local`` trains the small CTR task while its
server writes a full and then deltas of the tables; the newest snapshot's chain restores onto one
and onto three servers with bit-identical rows; a corrupt delta in that chain makes a real server
refuse to resume, naming the file and the snapshot to resume instead, and leaves every file in place.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from harness.procs import ProcessGroup
from ps.checkpoints.snapshot_files import list_snapshots, peek_manifest
from ps.checkpoints.sparse_checkpoint import SPARSE_FILE, TableChains, read_layouts, snapshot_tables
from ps.sparse.store import SparseConfig, SparseStore
from rpcps.examples import ctr
from rpcps.ports import free_port
from rpcps.sparse.spec import declared_tables
from tests.integration.ps.test_sparse_ctr import CTR, _distinct_ids

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # one ~30 s CTR training shared by both: the slow pass

STEPS = 30
Rows = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _restore_onto(servers: int, chains: TableChains) -> list[Rows]:
    """Per server of ``servers``, per table, the (ids, rows) it holds after restoring ``chains``, sorted by id."""
    out = []
    for k in range(servers):
        store = SparseStore(declared_tables(ctr.dlrm_model()), SparseConfig(), k, servers)
        store.restore(chains)
        out.append({table: _sorted([f["records"] for f in fulls]) for table, fulls in store.capture().items()})
    return out


def _sorted(records: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([r["ids"] for r in records])
    order = torch.argsort(ids)
    return ids[order], torch.cat([r["rows"] for r in records])[order]


def _newest_delta(checkpoint_dir: Path) -> Path:
    deltas = [p for p in list_snapshots(checkpoint_dir) if peek_manifest(p)["sparse"]["kind"] == "delta"]
    assert deltas, f"no delta snapshot in {sorted(p.name for p in checkpoint_dir.iterdir())}"
    return deltas[0]


def _assert_same_rows(one: Rows, three: list[Rows]) -> None:
    for table, (ids, rows) in one.items():
        assert all(server[table][0].numel() for server in three), f"table {table}: each of the three servers holds some rows"
        merged_ids, merged_rows = _sorted([{"ids": s[table][0], "rows": s[table][1]} for s in three])
        assert torch.equal(merged_ids, ids), f"table {table}: an id restored twice, lost or added on 3 servers"
        assert torch.equal(merged_rows, rows), f"table {table}: rows (optimizer state included) differ between 1 and 3 servers"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 2 workers x STEPS steps, a snapshot every 4 updates, a full every 3 deltas."""
    tmp = tmp_path_factory.mktemp("sparse-chain")
    procs = ProcessGroup(tmp / "logs")
    try:
        local = procs.start(
            "local",
            ["local", "--workers", "2", "--steps", str(STEPS), "--run-dir", tmp / "run", "--checkpoint-dir", tmp / "ckpt",
             "--checkpoint-every-updates", "4", "--sparse-full-every-deltas", "3", "--keep-checkpoints", "3",
             "--progress-s", "5", *CTR],
        )
        assert local.wait(150) == 0, local.tail()
    finally:
        procs.reap()
    return tmp / "ckpt"


@pytest.mark.timeout(200)
def test_chains_restore_onto_one_and_three_servers_bit_identically(trained: Path) -> None:
    (one,) = _restore_onto(1, read_layouts(trained))  # the newest snapshot, a full or a delta
    assert sum(ids.numel() for ids, _ in one.values()) == _distinct_ids(2, STEPS), "every id the workers pulled has its row"
    _assert_same_rows(one, _restore_onto(3, read_layouts(trained)))
    delta = _newest_delta(trained)
    chain = peek_manifest(delta)["sparse"]["chain"]
    kinds = [peek_manifest(trained / name)["sparse"]["kind"] for name in chain]
    assert kinds == ["full"] + ["delta"] * (len(chain) - 1), f"{delta.name}: chain {chain} of {kinds}"
    chains = snapshot_tables(delta)
    (one,) = _restore_onto(1, chains)
    _assert_same_rows(one, _restore_onto(3, chains))


@pytest.mark.timeout(120)
def test_a_corrupt_delta_refuses_resume_naming_the_file_and_keeps_everything(
    trained: Path, procs: ProcessGroup, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained, ckpt)
    delta = _newest_delta(ckpt)
    for newer in list_snapshots(ckpt)[: list_snapshots(ckpt).index(delta)]:
        shutil.rmtree(newer)  # the delta is the newest snapshot now: resume needs its chain
    chain = peek_manifest(delta)["sparse"]["chain"]
    link = ckpt / chain[-2]
    broken = link / SPARSE_FILE
    data = bytearray(broken.read_bytes())
    data[len(data) // 2] ^= 0xFF
    broken.write_bytes(bytes(data))
    older = [p for p in list_snapshots(ckpt) if p.name < link.name]
    before = sorted(p.name for p in ckpt.iterdir())
    ps = procs.start("ps", ["ps", "--listen", f"127.0.0.1:{free_port()}", "--metrics-port", "0", "--control-port", "0",
                            "--checkpoint-dir", ckpt, *CTR[:2]])
    code = ps.wait(90)
    log = ps.tail(40)
    assert code != 0, log
    instead = f"--resume {older[0]}" if older else "start a fresh --checkpoint-dir"
    assert str(broken) in log and "checksum" in log and instead in log, log
    assert sorted(p.name for p in ckpt.iterdir()) == before, "resume moved or removed files"
