"""Snapshot files, checkpointer and resume, on real files in tmp_path (no processes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from harness.inprocess import InProcessServer
from harness.snapshots import verify_all
from ps.checkpoints import snapshot_files
from ps.checkpoints.checkpointer import Checkpointer, ResumeRefused, find_resume_point
from ps.checkpoints.snapshot_files import (
    InvalidSnapshot,
    leftover_tmp_dirs,
    list_snapshots,
    load_snapshot,
    read_manifest,
    write_snapshot,
)
from ps.config import CheckpointConfig
from ps.core.config import ServerCoreConfig
from ps.core.optim import OptimizerConfig
from rpcps.errors import NotPrimary
from rpcps.tasks import teacher_student_model


def make_server(optimizer: str = "adam") -> InProcessServer:
    return InProcessServer(teacher_student_model(), ServerCoreConfig(optimizer=OptimizerConfig(name=optimizer, kwargs={"lr": 0.01})))


def gradient(server: InProcessServer, slot: int, seq: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(slot * 100_003 + seq)
    return [torch.randn(n, generator=g) for n in server.layout.chunk_numels]


def train(server: InProcessServer, steps: int, slot: int = 0, start: int = 0, rpc_name: str = "worker0_r1") -> None:
    reg = server.register(slot, rpc_name, server.signature.to_wire())
    for seq in range(start, start + steps):
        assert server.push(slot, reg.incarnation, seq, server.version, gradient(server, slot, seq)).status == "applied"


def checkpointer(server: InProcessServer, directory: Path, **kw: object) -> Checkpointer:
    meta = {"signature": server.signature.to_wire(), "optimizer": server.config.optimizer.name}
    return Checkpointer(server.core, CheckpointConfig(directory=str(directory), every_seconds=None, **kw), meta, server.core.metrics)  # type: ignore[arg-type]


def test_snapshot_round_trip_continues_exactly(tmp_path: Path) -> None:
    a = make_server()
    train(a, 5)
    path, version = checkpointer(a, tmp_path).checkpoint_now()
    assert version == 5 and Path(path).name == "step-000000000005"

    b = make_server()
    point = find_resume_point(CheckpointConfig(directory=str(tmp_path)), b.signature, "adam")
    assert point is not None
    b.restore_state(point[1])
    assert b.version == 5
    assert b.register(0, "worker0_r2", b.signature.to_wire()).next_step == 5, "the slot's progress must survive"
    # Both continue with the same gradients: the optimizer state came back exactly.
    train(a, 3, start=5)
    train(b, 3, start=5, rpc_name="worker0_r3")
    for name, tensor in a.master_tensors().items():
        assert torch.equal(tensor, b.master_tensors()[name]), name


def corrupt(path: Path, how: str) -> None:
    state = path / "state.pt"
    if how == "truncated":
        data = state.read_bytes()
        state.write_bytes(data[: len(data) // 2])
    elif how == "bitflip":
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0x01
        state.write_bytes(bytes(data))
    elif how == "no-manifest":
        (path / "manifest.json").unlink()
    elif how == "bad-manifest":
        (path / "manifest.json").write_text("{not json")


@pytest.mark.parametrize("how", ["truncated", "bitflip", "no-manifest", "bad-manifest"])
def test_resume_auto_skips_a_broken_newest_snapshot(tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    server = make_server()
    cp = checkpointer(server, tmp_path, keep=5)
    train(server, 3)
    good, _ = cp.checkpoint_now()
    train(server, 2, start=3)
    bad, _ = cp.checkpoint_now()
    corrupt(Path(bad), how)
    with pytest.raises(InvalidSnapshot):
        read_manifest(Path(bad)) if how != "bitflip" and how != "truncated" else load_snapshot(Path(bad))

    fresh = make_server()
    point = find_resume_point(CheckpointConfig(directory=str(tmp_path)), fresh.signature, "adam")
    assert point is not None and str(point[0].path) == good and point[0].version == 3
    assert "skipping snapshot" in caplog.text and Path(bad).name in caplog.text
    # The broken one is moved aside (kept for inspection), so it never shadows later versions.
    assert not Path(bad).exists()
    assert any(p.name.startswith(".invalid-step-000000000005") for p in tmp_path.iterdir())


def test_explicit_resume_path_that_is_broken_is_refused(tmp_path: Path) -> None:
    server = make_server()
    train(server, 2)
    path, _ = checkpointer(server, tmp_path).checkpoint_now()
    corrupt(Path(path), "bitflip")
    with pytest.raises(ResumeRefused, match="checksum"):
        find_resume_point(CheckpointConfig(directory=str(tmp_path), resume=path), server.signature, "adam")


def test_resume_into_a_different_model_is_refused_naming_the_parameter(tmp_path: Path) -> None:
    server = make_server()
    train(server, 1)
    checkpointer(server, tmp_path).checkpoint_now()
    other = InProcessServer(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)), ServerCoreConfig())
    with pytest.raises(ResumeRefused, match=r"different model: parameter '0.weight' has shape \[128, 32\]"):
        find_resume_point(CheckpointConfig(directory=str(tmp_path)), other.signature, "adam")


def test_resume_into_a_different_optimizer_is_refused(tmp_path: Path) -> None:
    server = make_server("adam")
    train(server, 1)
    checkpointer(server, tmp_path).checkpoint_now()
    with pytest.raises(ResumeRefused, match="'adam' optimizer state but this server runs 'sgd'"):
        find_resume_point(CheckpointConfig(directory=str(tmp_path)), server.signature, "sgd")


def test_resume_never_refuses_a_directory_with_snapshots(tmp_path: Path) -> None:
    server = make_server()
    train(server, 1)
    checkpointer(server, tmp_path).checkpoint_now()
    with pytest.raises(ResumeRefused, match="already holds snapshots"):
        find_resume_point(CheckpointConfig(directory=str(tmp_path), resume="never"), server.signature, "adam")


def test_purge_keeps_the_newest_k_and_removes_dead_writers_leftovers(tmp_path: Path) -> None:
    server = make_server()
    cp = checkpointer(server, tmp_path, keep=2)
    leftover = tmp_path / ".tmp-step-000000000001-999999999-1"  # a writer pid that cannot exist
    leftover.mkdir()
    for i in range(4):
        train(server, 1, start=i)
        cp.checkpoint_now()
    assert [p.name for p in list_snapshots(tmp_path)] == ["step-000000000004", "step-000000000003"]
    assert not leftover.exists()
    assert all(why is None for why in verify_all(tmp_path).values())


def test_a_failed_write_leaves_earlier_snapshots_intact_and_is_counted(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    server = make_server()
    cp = checkpointer(server, directory)
    train(server, 1)
    first, _ = cp.checkpoint_now()
    train(server, 1, start=1)
    os.chmod(directory, 0o500)
    renamed = tmp_path / "gone"
    directory.rename(renamed)  # the directory vanishes (root ignores chmod, so remove it instead)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cp.checkpoint_now()
    assert server.metrics.registry.get_sample_value("rpcps_checkpoint_failures_total") == 1
    renamed.rename(directory)
    os.chmod(directory, 0o700)
    assert verify_all(directory) == {Path(first): None}
    path, version = cp.checkpoint_now()  # the next attempt works again
    assert version == 2 and Path(path).exists()


def _fail_renames_onto(name: str, monkeypatch: pytest.MonkeyPatch, times: int | None = None) -> list[str | Path]:
    """Makes ``os.rename`` onto a path named ``name`` fail with ENOSPC, the first ``times`` attempts
    (None: every one); returns the failed attempts' sources."""
    real_rename, failed = os.rename, []

    def rename(src: str | Path, dst: str | Path) -> None:
        if Path(dst).name == name and (times is None or len(failed) < times):
            failed.append(src)
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    return failed


def test_writing_a_version_again_replaces_it_whole(tmp_path: Path) -> None:
    write_snapshot(tmp_path, 7, {"x": torch.zeros(2)}, {"reason": "periodic"})
    write_snapshot(tmp_path, 7, {"x": torch.ones(2)}, {"reason": "final"})
    [path] = list_snapshots(tmp_path)
    assert read_manifest(path)["reason"] == "final"
    assert torch.equal(load_snapshot(path)[1]["x"], torch.ones(2))
    assert leftover_tmp_dirs(tmp_path) == []


def test_a_rewrite_of_a_version_that_fails_at_its_commit_keeps_the_old_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old copy was deleted in place before the new one was renamed in (CI run 34 read one
    half-deleted); a failure at that rename then lost version 7 altogether."""
    write_snapshot(tmp_path, 7, {"x": torch.zeros(2)}, {"reason": "periodic"})
    failed = _fail_renames_onto("step-000000000007", monkeypatch, times=1)
    with pytest.raises(OSError, match="No space left"):
        write_snapshot(tmp_path, 7, {"x": torch.ones(2)}, {"reason": "final"})
    assert failed, "the commit's rename was attempted"
    [path] = list_snapshots(tmp_path)
    assert read_manifest(path)["reason"] == "periodic"
    assert torch.equal(load_snapshot(path)[1]["x"], torch.zeros(2))
    assert leftover_tmp_dirs(tmp_path) == []


def test_a_rewrite_whose_directory_fsync_fails_after_the_commit_leaves_no_old_copy_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new copy is in place; the old one must not stay under a name this process's purge skips
    (its own pid): each such failure kept one more full snapshot."""
    write_snapshot(tmp_path, 7, {"x": torch.zeros(2)}, {"reason": "periodic"})
    real_fsync_dir = snapshot_files.fsync_dir

    def fsync_dir(path: Path) -> None:
        if Path(path) == tmp_path:
            raise OSError(5, "Input/output error")
        real_fsync_dir(path)

    monkeypatch.setattr(snapshot_files, "fsync_dir", fsync_dir)
    with pytest.raises(OSError, match="Input/output error"):
        write_snapshot(tmp_path, 7, {"x": torch.ones(2)}, {"reason": "final"})
    [path] = list_snapshots(tmp_path)
    assert read_manifest(path)["reason"] == "final"
    assert leftover_tmp_dirs(tmp_path) == []


def test_when_the_old_copy_cannot_be_put_back_the_commit_error_comes_through_and_the_copy_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    write_snapshot(tmp_path, 7, {"x": torch.zeros(2)}, {"reason": "periodic"})
    _fail_renames_onto("step-000000000007", monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        write_snapshot(tmp_path, 7, {"x": torch.ones(2)}, {"reason": "final"})
    [aside] = leftover_tmp_dirs(tmp_path)
    assert read_manifest(aside)["reason"] == "periodic", "the old copy is whole under its temporary name"
    assert f"could not rename the old snapshot {aside} back" in caplog.text


def test_manifest_records_config_signature_and_checksums(tmp_path: Path) -> None:
    server = make_server()
    train(server, 1)
    path, _ = checkpointer(server, tmp_path).checkpoint_now()
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    assert manifest["version"] == 1
    assert manifest["optimizer"] == "adam"
    assert manifest["signature"][0][0] == "0.weight"
    assert len(manifest["files"]["state.pt"]["sha256"]) == 64


def test_snapshot_files_load_without_executing_code(tmp_path: Path) -> None:
    """A state.pt holding a pickled callable is refused (weights_only), even with a valid manifest."""
    server = make_server()
    train(server, 1)
    path = Path(checkpointer(server, tmp_path).checkpoint_now()[0])
    torch.save({"evil": os.system}, path / "state.pt")
    manifest = json.loads((path / "manifest.json").read_text())
    from ps.checkpoints.snapshot_files import _sha256

    manifest["files"]["state.pt"] = {"size": (path / "state.pt").stat().st_size, "sha256": _sha256(path / "state.pt")}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidSnapshot, match="cannot be loaded"):
        load_snapshot(path)


def test_only_the_serving_replica_writes_snapshots(tmp_path: Path) -> None:
    """A standby (or a replaced primary) shares its shard's checkpoint directory: writing there would
    race the primary's writes, so an on-demand checkpoint is refused and nothing is written."""
    server = make_server()
    train(server, 2)
    server.core.mirroring = True
    with pytest.raises(NotPrimary):
        checkpointer(server, tmp_path).checkpoint_now()
    assert list_snapshots(tmp_path) == []


def _rewrite_manifest(path: Path, **changes: object) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(changes)
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../../etc/hostname", "/dev/zero", "..", ".hidden", "a/b", ""])
def test_manifests_name_only_plain_files(tmp_path: Path, name: str) -> None:
    """A planted manifest cannot make resume read (or hang on) a file outside the snapshot."""
    server = make_server()
    train(server, 1)
    path = Path(checkpointer(server, tmp_path).checkpoint_now()[0])
    _rewrite_manifest(path, files={name: {"size": 0, "sha256": ""}})
    with pytest.raises(InvalidSnapshot, match="not a plain file name"):
        read_manifest(path)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_snapshot_files_must_be_regular_files_opened_without_following_links(tmp_path: Path, kind: str) -> None:
    server = make_server()
    train(server, 1)
    (tmp_path / "ck").mkdir()
    path = Path(checkpointer(server, tmp_path / "ck").checkpoint_now()[0])
    state = path / "state.pt"
    real = tmp_path / "elsewhere.pt"
    os.replace(state, real)
    if kind == "symlink":
        state.symlink_to(real)  # same bytes: only the link itself is wrong
    elif kind == "fifo":
        os.mkfifo(state)  # opening it for reading would wait for a writer forever
    else:
        state.mkdir()
    with pytest.raises(InvalidSnapshot, match="regular file"):
        load_snapshot(path)
    (path / "manifest.json").unlink()
    (path / "manifest.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(InvalidSnapshot, match="manifest.json is unreadable"):
        read_manifest(path)


def test_signed_manifests_refuse_foreign_and_unsigned_snapshots(tmp_path: Path) -> None:
    from rpcps.jobsecret import JobSecret

    ours, theirs = JobSecret("a" * 64).manifest_signature, JobSecret("b" * 64).manifest_signature
    server = make_server()
    train(server, 1)
    unsigned = Path(checkpointer(server, tmp_path).checkpoint_now()[0])
    train(server, 1, start=1, rpc_name="worker0_r2")
    signed = Checkpointer(
        server.core, CheckpointConfig(directory=str(tmp_path), every_seconds=None),
        {"signature": server.signature.to_wire(), "optimizer": "adam"}, server.core.metrics, sign=ours,  # type: ignore[arg-type]
    )
    good = Path(signed.checkpoint_now()[0])
    assert read_manifest(good, ours)["hmac"]
    with pytest.raises(InvalidSnapshot, match="not signed with this job's secret"):
        read_manifest(good, theirs)
    _rewrite_manifest(good, version=99)  # altered after signing (the checksums still hold)
    with pytest.raises(InvalidSnapshot, match="not signed with this job's secret"):
        read_manifest(good, ours)
    good.rename(tmp_path / ".moved")
    # The newest snapshot is unsigned: refused with a way out, neither skipped nor moved aside.
    with pytest.raises(ResumeRefused, match=f"--resume {unsigned}"):
        find_resume_point(CheckpointConfig(directory=str(tmp_path)), server.signature, "adam", verify=ours)
    assert unsigned.exists()
    point = find_resume_point(CheckpointConfig(directory=str(tmp_path), resume=str(unsigned)), server.signature, "adam", verify=ours)
    assert point is not None and point[0].version == 1


def test_a_checkpointer_that_never_started_stops_and_still_writes_its_final_snapshot(tmp_path: Path) -> None:
    # A standby's checkpointer starts only on promotion; a standby told to restart (its coordinator
    # lost) stops it before writing the snapshot it restarts from.
    server = make_server()
    train(server, 2)
    never_started = checkpointer(server, tmp_path)
    never_started.stop(final=True)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("step-")] == ["step-000000000002"]
