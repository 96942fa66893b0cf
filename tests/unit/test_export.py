"""Exporting the trained model: every built-in and example model round-trips through a checkpoint (one
server, or shards) into a plain ``model.load_state_dict(torch.load(path, weights_only=True))``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from cli.main import main
from harness.inprocess import InProcessServer
from ps.checkpoints.export import ExportError, export_checkpoint, read_checkpoint
from ps.checkpoints.snapshot_files import write_snapshot
from ps.config import ServerRunConfig
from ps.core.config import ServerCoreConfig
from ps.runner import _meta
from rpcps import plugins
from rpcps.address import Address
from rpcps.model_file import load_state_dict

BUILTIN = ["rpcps.tasks:teacher_student_model", "rpcps.tasks:mlp_5m", "rpcps.tasks:mlp_25m"]
EXAMPLES = ["rpcps.examples.digits:model", "rpcps.examples.charlm:model"]


def _needs(spec: str) -> None:
    if "digits" in spec:
        pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")


def _trained(spec: str, seed: int = 5) -> nn.Module:
    """The model with every parameter and float buffer moved off its initial value, counters bumped."""
    model = plugins.load_model(spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.dtype.is_floating_point:
                t.add_(torch.rand(t.shape, generator=g))
            else:
                t.add_(7)
    return model


def _checkpoint(model: nn.Module, directory: Path, shards: int = 1, chunk_bytes: int = 1 << 20) -> Path:
    """Writes what ``shards`` servers holding ``model`` would snapshot, where they would write it."""
    for k in range(shards):
        core = ServerCoreConfig(shard_count=shards, shard_index=k, chunk_bytes=chunk_bytes)
        server = InProcessServer(model, core)
        where = directory / (f"shard-{k}-of-{shards}" if shards > 1 else "")
        where.mkdir(parents=True, exist_ok=True)
        version, state = server.capture_state()
        write_snapshot(where, version + k, state, _meta(server.core, ServerRunConfig(model="x:y", core=core, store=Address("127.0.0.1", 1))))
    return directory


def _assert_same(loaded: nn.Module, original: nn.Module) -> None:
    for (name, want), got in zip(original.state_dict().items(), loaded.state_dict().values()):
        assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize("spec", BUILTIN + EXAMPLES)
def test_every_model_round_trips_through_an_exported_checkpoint(spec: str, tmp_path: Path) -> None:
    _needs(spec)
    original = _trained(spec)
    out = tmp_path / "model.pt"
    result = export_checkpoint(_checkpoint(original, tmp_path / "ckpt"), out)
    assert result.tensors == len(original.state_dict()) and result.versions == (0,)
    fresh = plugins.load_model(spec)
    fresh.load_state_dict(torch.load(out, weights_only=True))  # strict: every key, nothing more
    _assert_same(fresh, original)


@pytest.mark.parametrize("spec", ["rpcps.examples.digits:model", "rpcps.tasks:teacher_student_model"])
def test_a_sharded_checkpoint_exports_whole(spec: str, tmp_path: Path) -> None:
    _needs(spec)
    original = _trained(spec)
    root = _checkpoint(original, tmp_path / "ckpt", shards=3, chunk_bytes=4096)
    exported = read_checkpoint(root)
    assert exported.versions == (0, 1, 2)
    fresh = plugins.load_model(spec)
    fresh.load_state_dict(exported.state_dict)
    _assert_same(fresh, original)
    with pytest.raises(ExportError, match="holds only that shard's parameters"):
        read_checkpoint(root / "shard-1-of-3")
    shutil.rmtree(root / "shard-2-of-3")
    with pytest.raises(ExportError, match=r"holds none of shard\(s\) \[2\]"):
        read_checkpoint(root)


def test_one_snapshot_directory_exports_and_a_corrupt_newest_is_skipped(tmp_path: Path) -> None:
    spec = "rpcps.tasks:teacher_student_model"
    root = _checkpoint(_trained(spec, seed=1), tmp_path / "ckpt")
    older = next(root.glob("step-*"))
    newer = older.with_name("step-000000000009")
    shutil.copytree(older, newer)
    (newer / "state.pt").write_bytes(b"garbage")
    exported = read_checkpoint(root)
    assert exported.snapshots == (older,)
    assert read_checkpoint(older).snapshots == (older,)
    with pytest.raises(ExportError, match="holds no snapshot"):
        read_checkpoint(tmp_path)


def test_safetensors_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("safetensors", reason="the safetensors format needs the safetensors package")
    from safetensors.torch import load_file

    spec = "rpcps.examples.charlm:model"
    original = _trained(spec)
    out = tmp_path / "model.safetensors"
    export_checkpoint(_checkpoint(original, tmp_path / "ckpt"), out)
    fresh = plugins.load_model(spec)
    fresh.load_state_dict(load_file(str(out)))
    _assert_same(fresh, original)
    assert load_state_dict(out).keys() == original.state_dict().keys()


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        raise SystemExit(main(argv))
    captured = capsys.readouterr()
    return int(info.value.code or 0), captured.out, captured.err


def test_the_export_role(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    original = _trained("rpcps.tasks:teacher_student_model")
    root = _checkpoint(original, tmp_path / "ckpt")
    out = tmp_path / "model.pt"
    code, stdout, _ = _run(["export", "--checkpoint", str(root), "--out", str(out)], capsys)
    assert code == 0 and "wrote 6 tensors" in stdout and out.exists()
    code, _, stderr = _run(["export", "--checkpoint", str(tmp_path / "nothing"), "--out", str(out)], capsys)
    assert code == 2 and "holds no snapshot" in stderr
    with pytest.raises(SystemExit) as info:
        main(["export", "--out", str(out)])
    assert info.value.code == 2 and "checkpoint is required" in capsys.readouterr().err


