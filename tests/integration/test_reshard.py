"""Resharding a real job: ``rpcps local --shards 2`` trains and stops, a resume with ``--shards 1`` is
refused naming both counts and ``rpcps reshard``, the command converts the directory (parameters bit
for bit, onto 1 and onto 3 shards), and the job then resumes on one server where it stopped."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.procs import ENTRY, REPO, ProcessGroup, child_env
from ps.export import read_checkpoint
from tests.integration.conftest import read_json

pytestmark = pytest.mark.integration

STEPS = 20


def _reshard(directory: Path, shards: int) -> subprocess.CompletedProcess[str]:
    """``rpcps reshard``: one process, no RPC."""
    return subprocess.run(
        [sys.executable, str(ENTRY), "reshard", "--checkpoint-dir", str(directory), "--shards", str(shards)],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120, check=False,
    )


def _local(procs: ProcessGroup, tmp_path: Path, name: str, shards: int, steps: int) -> tuple[int, str, Path]:
    summary = tmp_path / f"{name}.json"
    local = procs.start(
        name,
        ["local", "--workers", "2", "--shards", str(shards), "--steps", str(steps), "--checkpoint-dir", tmp_path / "ckpt",
         "--run-dir", tmp_path / name, "--summary-json", summary, "--progress-s", "5"],
    )
    code = local.wait(120)
    return code, local.tail(), summary


def _assert_same_model(a: Path, b: Path) -> None:
    before, after = read_checkpoint(a).state_dict, read_checkpoint(b).state_dict
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert torch.equal(value, after[name]), f"{name} changed in the reshard"


@pytest.mark.timeout(300)
def test_a_two_shard_job_is_refused_on_one_then_resharded_and_resumed_where_it_stopped(procs: ProcessGroup, tmp_path: Path) -> None:
    code, tail, summary = _local(procs, tmp_path, "first", 2, STEPS)
    assert code == 0, tail
    ckpt = tmp_path / "ckpt"
    assert read_json(summary)["shards"][0]["model_version"] == 2 * STEPS

    code, tail, _ = _local(procs, tmp_path, "refused", 1, 2 * STEPS)
    assert code == 2, tail
    assert "holds snapshots of 2 shard(s), but this server is unsharded (--shards 1)" in tail, tail
    assert f"rpcps reshard --checkpoint-dir {ckpt} --shards 1" in tail, tail
    assert not (tmp_path / "refused").exists(), "refused before any process started"

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    for state in (broken / "shard-1-of-2").glob("step-*/state.pt"):
        state.write_bytes(state.read_bytes()[:100])
    refused = _reshard(broken, 1)
    assert refused.returncode == 2 and "no valid snapshot in" in refused.stderr and "shard-1-of-2" in refused.stderr, refused.stderr
    assert sorted(p.name for p in broken.iterdir()) == ["shard-0-of-2", "shard-1-of-2"], "a refusal changes nothing"

    three = tmp_path / "three"
    shutil.copytree(ckpt, three)
    done = _reshard(three, 3)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in three.glob("shard-*-of-3")) == ["shard-0-of-3", "shard-1-of-3", "shard-2-of-3"]
    _assert_same_model(ckpt, three)

    done = _reshard(ckpt, 1)
    assert done.returncode == 0, done.stderr
    assert f"now holds 1 shard(s) at version {2 * STEPS}" in done.stdout, done.stdout
    aside = next(ckpt.glob("resharded-from-2-*"))
    _assert_same_model(aside, ckpt)

    code, tail, summary = _local(procs, tmp_path, "resumed", 1, 2 * STEPS)
    assert code == 0, tail
    server = read_json(summary)["server"]
    # Every slot resumed at step STEPS: one more update per worker step, none redone.
    assert server["updates_applied"] == 2 * STEPS and server["model_version"] == 4 * STEPS, server
    assert server["pushes_duplicate"] == 0, server
