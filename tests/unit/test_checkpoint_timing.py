"""Snapshots are captured on time, by the update that makes them due, whoever holds the lock."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import torch

from harness.inprocess import make_server, pack
from harness.ledger import check_ledger
from ps.checkpoints.audit import AuditLog
from ps.checkpoints.checkpointer import Checkpointer
from ps.config import CheckpointConfig
from ps.core.optim import OptimizerConfig

SGD = OptimizerConfig(name="sgd", kwargs={"lr": 0.01})


def test_captures_happen_every_n_updates_at_the_update_that_makes_them_due(tmp_path: Path) -> None:
    server, _ = make_server(SGD)
    ledger = AuditLog(str(tmp_path / "audit.log"), "ps0_r0")
    server.core.on_applied(ledger.on_applied)
    checkpointer = Checkpointer(
        server.core, CheckpointConfig(directory=str(tmp_path / "ck"), every_updates=5, every_seconds=None), {},
        server.core.metrics, ledger,
    )
    (tmp_path / "ck").mkdir()
    server.core.on_applied(checkpointer.on_applied)
    checkpointer.start()
    incarnation = server.register(0, "w", server.signature.to_wire()).incarnation
    grads = pack(server.layout, [torch.zeros(p.shape) for p in server.master_tensors().values()])
    # Several threads push at once, the way RPC threads do; the writer thread never needs the lock
    # to take its copy, so it cannot fall behind them.
    def push(first: int) -> None:
        for seq in range(first, 60, 3):
            server.push(0, incarnation, seq, server.version, grads)

    threads = [threading.Thread(target=push, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    checkpointer.stop(final=True)
    ledger.close()
    captures = [int(line.split()[1]) for line in (tmp_path / "audit.log").read_text().splitlines() if line.startswith("capture")]
    assert captures[0] == 5
    # Slack: each of the 3 pushing threads may apply one update between a commit and the next copy.
    report = check_ledger(tmp_path / "audit.log", every_updates=5, slack=3)
    assert report.problems == [] and report.final_version == 60
    # Each capture is N after the previous one, or the first update after a write that ran long.
    for earlier, later in itertools.pairwise(captures):
        assert later - earlier <= max(5, max(report.write_updates, default=0)) + 3, captures
