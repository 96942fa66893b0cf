"""Taking a trained sparse model away, with real processes and files: one short CTR run on three server
shards (``rpcps local``), shared by every test here; ``rpcps export`` of its checkpoint equals a restore
of the same snapshots onto one server row for row, in both formats; the export, loaded in a plain
process that imports no server code, scores the same held-out AUC as the in-process reference built
from the same snapshots (``harness/sparse_eval.py``); and ``local --eval-data`` refuses a sparse model
at start, since the sidecar evaluator cannot score one yet. ``rpcps ctl export`` of a live server
(in this process, with its real control plane) writes the same directory from the server's tables.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.procs import ENTRY, REPO, ProcessGroup, child_env
from harness.sparse_eval import model_from_snapshot
from ps.checkpoints.snapshot_files import list_snapshots, peek_manifest
from ps.checkpoints.sparse_checkpoint import read_layouts
from ps.config import ControlConfig
from ps.control.control_service import start_control_server
from ps.sparse.store import SparseConfig, SparseStore
from rpcps.examples import ctr
from rpcps.sparse.export_files import load_table, read_manifest
from rpcps.sparse.serving import load_export
from rpcps.sparse.spec import declared_tables
from tests.integration.conftest import run_ctl
from tests.unit.ps.sparse.test_sparse_checkpoints import _Trainer
from tests.unit.ps.sparse.test_sparse_server import TinyModel, _rows, _server

pytestmark = pytest.mark.integration
pytest.importorskip("safetensors")

CTR = ("--model", "rpcps.examples.ctr:dlrm_model", "--data", "rpcps.examples.ctr:ctr_data_small", "--loss", "rpcps.examples.ctr:bce_loss")
STEPS = 30
SERVE = """
import json, sys
from rpcps.sparse.serving import load_export
from rpcps.examples import ctr
model = load_export(ctr.dlrm_model(), sys.argv[1])
scores = ctr.evaluate(model, ctr.eval_batches(8, 512, at_batch=int(sys.argv[2])))
print(json.dumps({**scores, "server_modules": sorted(m for m in sys.modules if m == "ps" or m.startswith("ps."))}))
"""


def _entry(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ENTRY), *map(str, args)], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The checkpoint root of a 3-shard CTR run: snapshots every 10 updates, so fulls and deltas."""
    root = tmp_path_factory.mktemp("sparse-export")
    group = ProcessGroup(root / "logs")
    try:
        local = group.start("local", [
            "local", "--workers", "1", "--shards", "3", "--steps", str(STEPS), "--run-dir", root / "run",
            "--checkpoint-dir", root / "ckpt", "--checkpoint-every-updates", "10", "--progress-s", "5", *CTR,
        ])
        assert local.wait(240) == 0, local.tail()
    finally:
        group.reap()
    kinds = [peek_manifest(list_snapshots(root / "ckpt" / f"shard-{k}-of-3")[0])["sparse"]["kind"] for k in range(3)]
    assert "delta" in kinds, f"newest snapshots {kinds}: the export must fold a chain (full + deltas); snapshot more often"
    yield root


def _restored(root: Path) -> SparseStore:
    store = SparseStore(declared_tables(ctr.dlrm_model()), SparseConfig(), 0, 1)
    store.restore(read_layouts(root))
    return store


def _sorted(ids: torch.Tensor, *columns: torch.Tensor) -> list[torch.Tensor]:
    order = ids.argsort()
    return [ids[order], *(c[order] for c in columns)]


@pytest.mark.timeout(400)
def test_export_of_a_3_shard_run_equals_the_1_shard_restore_row_for_row(run: Path) -> None:
    for fmt, extra in [("torch", ()), ("safetensors", ("--optimizer-state", "on"))]:
        out = run / f"export-{fmt}"
        done = _entry("export", "--checkpoint", run / "ckpt", "--out", out, "--format", fmt, *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "and 26 sparse tables" in done.stdout and "of model version 30/30/30" in done.stdout, done.stdout
        manifest = read_manifest(out)
        assert manifest["file_format"] == fmt and len(manifest["source"]) == 3
        restored = _restored(run / "ckpt")
        rows = 0
        for name, table in restored.tables.items():
            records = table.capture_full()["records"]
            want = _sorted(records["ids"], records["rows"])
            got = load_table(out, manifest, name)
            mine = _sorted(got["ids"], got["weight"], *([got["state"]] if "state" in got else []))
            assert torch.equal(mine[0], want[0]), f"table {name}: other ids than the restore"
            assert torch.equal(mine[1], want[1][:, : ctr.DIM]), f"table {name}: other rows than the restore"
            if "state" in got:
                assert torch.equal(mine[2], want[1][:, ctr.DIM :]), f"table {name}: other optimizer state"
            rows += len(table)
        assert rows == sum(e["rows"] for e in manifest["tables"].values()) > 10_000


@pytest.mark.timeout(400)
def test_the_export_in_a_plain_process_scores_the_auc_of_the_in_process_reference(run: Path) -> None:
    out = run / "export-serve"
    done = _entry("export", "--checkpoint", run / "ckpt", "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    served = subprocess.run([sys.executable, "-c", SERVE, str(out), str(STEPS)], cwd=REPO, env=child_env(), capture_output=True,
                            text=True, timeout=120, check=False)
    assert served.returncode == 0, served.stderr[-3000:]
    scores = json.loads(served.stdout.strip().splitlines()[-1])
    assert scores["server_modules"] == [], "serving an export must not load the server's code"
    reference = ctr.evaluate(model_from_snapshot(run / "ckpt", ctr.dlrm_model), ctr.eval_batches(8, 512, at_batch=STEPS))
    assert scores["auc"] == pytest.approx(reference["auc"], abs=1e-6)
    assert scores["logloss"] == pytest.approx(reference["logloss"], abs=1e-6)
    assert reference["auc"] > 0.6, f"the run should have learned something: AUC {reference['auc']:.3f}"


@pytest.mark.timeout(120)
def test_local_refuses_eval_data_for_a_sparse_model_before_starting_anything(tmp_path: Path) -> None:
    done = _entry("local", "--workers", "1", "--steps", "5", "--run-dir", tmp_path / "run", *CTR,
                  "--eval-data", "rpcps.examples.ctr:eval_batches", "--eval-fn", "rpcps.examples.ctr:evaluate")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "the sidecar evaluator cannot score --model rpcps.examples.ctr:dlrm_model yet: it has 26 sparse tables" in done.stderr
    assert "rpcps export --checkpoint DIR --out EXPORT_DIR" in done.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir()), "nothing may start"


@pytest.mark.timeout(120)
def test_ctl_export_of_a_live_server_writes_its_rows_at_one_version(tmp_path: Path) -> None:
    server = _server()
    _Trainer(server).steps(3)
    handle = start_control_server(server.core, ControlConfig(addr="127.0.0.1", port=0), checkpoint=None,
                                  request_shutdown=lambda: None, registry=server.core.metrics.registry)
    try:
        refused = run_ctl(handle.address, "export", "--out", str(tmp_path / "model.pt"))
        assert refused.returncode == 2 and "this model has sparse tables: their export is a directory" in refused.stderr
        out = tmp_path / "export"
        done = run_ctl(handle.address, "export", "--out", str(out), "--optimizer-state", "on", "--json")
    finally:
        handle.stop(grace_s=0)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["model_version"] == 3 and answer["bytes"] == sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    manifest, live = read_manifest(out), _rows(server)
    for name, rows in live.items():
        got = load_table(out, manifest, name)
        exported = {int(i): torch.cat([w, s]) for i, w, s in zip(got["ids"], got["weight"], got["state"])}
        assert exported.keys() == rows.keys() and all(torch.equal(exported[i], rows[i]) for i in rows), name
    served = load_export(TinyModel(), out, device="cpu")
    for name, value in server.master_tensors().items():
        assert torch.equal(served.state_dict()[name], value), name
