"""Fault injection: run ``rpcps local`` and SIGKILL the server or workers at chosen points.

Used by the integration tests and by ``tools/chaos.py``. A run kills its targets when the server's
model version reaches each kill's ``at_version`` (read from the server's /metrics), lets the local
supervisor restart them, and then checks the promises of docs/FAULT_TOLERANCE.md from the server's
audit ledger and the checkpoint directory.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.ledger import LedgerReport, check_ledger, first_apply_after
from harness.snapshots import verify_all
from rpcps.scrape import try_scrape


@dataclass(frozen=True)
class Kill:
    target: str
    """'ps' or 'workerN'."""
    at_version: int
    sig: int = signal.SIGKILL


@dataclass(kw_only=True, frozen=True)
class ChaosPlan:
    workers: int = 2
    steps: int = 600
    shards: int = 1
    kills: tuple[Kill, ...] = ()
    checkpoint_every_updates: int = 100
    extra_args: tuple[str, ...] = ()
    timeout_s: float = 240.0

    @classmethod
    def random(cls, n: int, seed: int, workers: int = 2, steps: int = 600, **kw: Any) -> ChaosPlan:
        rng = random.Random(seed)
        total = workers * steps
        targets = ["ps"] + [f"worker{i}" for i in range(workers)]
        points = sorted(rng.randint(total // 10, total * 8 // 10) for _ in range(n))
        return cls(workers=workers, steps=steps, kills=tuple(Kill(rng.choice(targets), v) for v in points), **kw)


@dataclass
class ChaosResult:
    exit_code: int
    summary: dict[str, Any]
    ledger: LedgerReport
    """Shard 0's ledger (the only one when unsharded)."""
    invalid_snapshots: dict[str, str]
    shard_ledgers: list[LedgerReport] = field(default_factory=list)
    kill_times: list[tuple[Kill, float]] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)
    """Per server kill: seconds from the kill to the next applied update."""
    skipped: list[Kill] = field(default_factory=list)
    """Kills whose target was not running at that moment (a finished worker, a restart under way)."""

    def problems(self, plan: ChaosPlan) -> list[str]:
        found = []
        if self.exit_code != 0:
            found.append(f"local exited with {self.exit_code}")
        expected = plan.workers * plan.steps
        for k, ledger in enumerate(self.shard_ledgers or [self.ledger]):
            found += [f"shard {k}: {p}" for p in ledger.problems]
            if ledger.final_version != expected:
                found.append(f"shard {k}: final version {ledger.final_version}, expected {expected} (one per worker step)")
        for path, why in self.invalid_snapshots.items():
            found.append(f"invalid snapshot on disk: {path}: {why}")
        bound = plan.checkpoint_every_updates + 2 * plan.workers * 4  # interval + pushes in flight
        for lost in (n for ledger in self.shard_ledgers or [self.ledger] for n in ledger.updates_lost):
            if lost > bound:
                found.append(f"a crash lost {lost} updates, more than one interval ({plan.checkpoint_every_updates}) + in-flight")
        if len(self.kill_times) + len(self.skipped) != len(plan.kills) or (plan.kills and not self.kill_times):
            found.append(f"only {len(self.kill_times)} of {len(plan.kills)} kills happened ({len(self.skipped)} skipped)")
        return found


def run_chaos(plan: ChaosPlan, run_dir: Path, entry: str = "trainer_entry.py") -> ChaosResult:
    run_dir.mkdir(parents=True, exist_ok=True)
    ledger = run_dir / "audit.log"
    argv = [
        sys.executable, entry, "local", "--workers", str(plan.workers), "--steps", str(plan.steps), "--shards", str(plan.shards),
        "--run-dir", str(run_dir), "--checkpoint-dir", str(run_dir / "checkpoints"),
        "--checkpoint-every-updates", str(plan.checkpoint_every_updates), "--audit-log", str(ledger),
        "--max-restarts", str(len(plan.kills) + 3), "--summary-json", str(run_dir / "summary.json"),
        "--progress-s", "5", *plan.extra_args,
    ]
    with open(run_dir / "local.log", "wb") as log:
        local = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        kill_times: list[tuple[Kill, float]] = []
        skipped: list[Kill] = []
        try:
            deadline = time.monotonic() + plan.timeout_s
            pending = list(plan.kills)
            while local.poll() is None and time.monotonic() < deadline:
                if pending and _server_version(run_dir) >= pending[0].at_version:
                    kill = pending.pop(0)
                    pid = _pid(run_dir, kill.target)
                    try:
                        if pid is None:
                            raise ProcessLookupError
                        os.kill(pid, kill.sig)
                        kill_times.append((kill, time.time()))
                    except ProcessLookupError:  # the target had finished or was restarting: nothing to kill
                        skipped.append(kill)
                time.sleep(0.05)
            if local.poll() is None:
                raise TimeoutError(f"the local run did not finish within {plan.timeout_s:.0f}s; see {run_dir}")
        finally:
            if local.poll() is None:
                os.killpg(local.pid, signal.SIGTERM)
                try:
                    local.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    os.killpg(local.pid, signal.SIGKILL)
                    local.wait()
    ledgers = [check_ledger(f"{ledger}.shard{k}") for k in range(plan.shards)] if plan.shards > 1 else []
    report = ledgers[0] if ledgers else check_ledger(ledger)
    recovery = [
        t - when for kill, when in kill_times if kill.target == "ps" and (t := first_apply_after(report, when)) is not None
    ]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    roots = [run_dir / "checkpoints"] + sorted((run_dir / "checkpoints").glob("shard-*"))
    invalid = {str(p): why for root in roots for p, why in verify_all(root).items() if why is not None}
    return ChaosResult(local.returncode, summary, report, invalid, ledgers, kill_times, recovery, skipped)


def _children(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "children.json").read_text())
    except (OSError, ValueError):
        return {}


def _pid(run_dir: Path, name: str) -> int | None:
    return _children(run_dir).get(name, {}).get("pid")


def _server_version(run_dir: Path) -> float:
    port = _children(run_dir).get("ps", {}).get("metrics_port")
    if port is None:
        return -1
    return try_scrape(port).get("rpcps_server_model_version", -1)
