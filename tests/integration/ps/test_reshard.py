"""Resharding a real job: ``rpcps local --shards 2`` trains and is stopped (SIGTERM) mid-training, a
resume with ``--shards 1`` is refused naming both counts and ``rpcps reshard``, the command refuses a
truncated shard and converts the directory (parameters bit for bit, onto 1 and onto 3 shards), and
the job then resumes on one server where every slot stopped."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.procs import ENTRY, REPO, Proc, ProcessGroup, child_env, try_scrape, wait_until
from ps.checkpoints.export import read_checkpoint
from ps.checkpoints.snapshot_files import list_snapshots, load_snapshot
from tests.integration.conftest import read_json, wait_for_updates

pytestmark = pytest.mark.integration

STEPS = 20


def _reshard(directory: Path, shards: int) -> subprocess.CompletedProcess[str]:
    """``rpcps reshard``: one process, no RPC."""
    return subprocess.run(
        [sys.executable, str(ENTRY), "reshard", "--checkpoint-dir", str(directory), "--shards", str(shards)],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120, check=False,
    )


def _local(procs: ProcessGroup, tmp_path: Path, name: str, shards: int, steps: int) -> Proc:
    return procs.start(
        name,
        ["local", "--workers", "2", "--shards", str(shards), "--steps", str(steps), "--checkpoint-dir", tmp_path / "ckpt",
         "--run-dir", tmp_path / name, "--summary-json", tmp_path / f"{name}.json", "--progress-s", "5"],
    )


def _targets(run_dir: Path) -> list[dict] | None:
    try:
        return json.loads((run_dir / "prometheus_targets.json").read_text())
    except (OSError, ValueError):
        return None


def _assert_same_model(a: Path, b: Path) -> None:
    before, after = read_checkpoint(a).state_dict, read_checkpoint(b).state_dict
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert torch.equal(value, after[name]), f"{name} changed in the reshard"


@pytest.mark.timeout(300)
def test_a_two_shard_job_is_refused_on_one_then_resharded_and_resumed_where_it_stopped(procs: ProcessGroup, tmp_path: Path) -> None:
    first = _local(procs, tmp_path, "first", 2, 1_000_000)
    targets = wait_until(lambda: _targets(tmp_path / "first"), timeout=30, what="local's Prometheus targets file")
    ps_port = next(t["targets"][0] for t in targets if t["labels"]["role"] == "ps").rsplit(":", 1)[1]
    wait_for_updates(int(ps_port), 2 * STEPS, timeout=90, proc=first)
    # Both slots well into training (async workers can be far apart: one CI run stopped at 63 and 9
    # steps); + 2 over the bar below for the pushes still in flight, which the stop drains anyway.
    worker_ports = [int(t["targets"][0].rsplit(":", 1)[1]) for t in targets if t["labels"]["role"] == "worker"]
    assert len(worker_ports) == 2, targets

    def both_workers_stepped() -> list[float] | None:
        assert first.alive(), first.tail()
        steps = [try_scrape(port).get("rpcps_worker_steps_total", 0.0) for port in worker_ports]
        return steps if min(steps) >= STEPS // 2 + 2 else None

    wait_until(both_workers_stepped, 90, "both workers' first steps")
    first.send(signal.SIGTERM)  # mid-training: workers drain their pushes to both shards, then the servers stop
    assert first.wait(60) == 130, first.tail()
    ckpt = tmp_path / "ckpt"

    refused = _local(procs, tmp_path, "refused", 1, STEPS)
    assert refused.wait(60) == 2, refused.tail()
    assert "holds snapshots of 2 shard(s), but this server is unsharded (--shards 1)" in refused.stderr(), refused.tail()
    assert f"rpcps reshard --checkpoint-dir {ckpt} --shards 1" in refused.stderr(), refused.tail()
    assert not (tmp_path / "refused").exists(), "refused before any process started"

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    for state in (broken / "shard-1-of-2").glob("step-*/state.pt"):
        state.write_bytes(state.read_bytes()[:100])
    result = _reshard(broken, 1)
    assert result.returncode == 2 and "no valid snapshot in" in result.stderr and "shard-1-of-2" in result.stderr, result.stderr
    assert sorted(p.name for p in broken.iterdir()) == ["shard-0-of-2", "shard-1-of-2"], "a refusal changes nothing"

    three = tmp_path / "three"
    shutil.copytree(ckpt, three)
    result = _reshard(three, 3)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in three.glob("shard-*-of-3")) == ["shard-0-of-3", "shard-1-of-3", "shard-2-of-3"]
    _assert_same_model(ckpt, three)

    result = _reshard(ckpt, 1)
    assert result.returncode == 0, result.stderr
    _assert_same_model(next(ckpt.glob("resharded-from-2-*")), ckpt)
    _, state = load_snapshot(list_snapshots(ckpt)[0])
    version, held = int(state["version"]), {int(s): int(t["floor"]) + 1 for s, t in state["workers"].items()}
    assert f"now holds 1 shard(s) at version {version}" in result.stdout, result.stdout
    assert sorted(held) == [0, 1] and min(held.values()) >= STEPS // 2, held

    steps = max(held.values()) + STEPS
    resumed = _local(procs, tmp_path, "resumed", 1, steps)
    assert resumed.wait(120) == 0, resumed.tail()
    server = read_json(tmp_path / "resumed.json")["server"]
    # Each slot resumed at the step it had reached on both shards: one update per remaining step, none redone.
    todo = sum(steps - n for n in held.values())
    assert server["updates_applied"] == todo and server["model_version"] == version + todo, (server, held, version)
    assert server["pushes_duplicate"] == 0, server
