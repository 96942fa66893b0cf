"""Helpers shared by the integration tests (real processes on 127.0.0.1)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.procs import ENTRY, REPO, Proc, child_env, try_scrape, wait_until


def model_version(metrics_port: int) -> float:
    """The server's model version from its /metrics, or -1 while it does not answer."""
    return try_scrape(metrics_port).get("rpcps_server_model_version", -1)


def run_ctl(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``rpcps ctl ARGS --addr ADDRESS``: the real command-line client, as a subprocess."""
    return subprocess.run(
        [sys.executable, str(ENTRY), "ctl", *args, "--addr", address, "--timeout-s", "20"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60, check=False,
    )


def imported_modules(stderr: str) -> set[str]:
    """Modules a process imported, from ``python -X importtime``'s lines ("import time: us | us | name")."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:") and "|" in line}


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def wait_for_updates(metrics_port: int, at_least: int, timeout: float = 60.0, proc: Proc | None = None) -> dict[str, float]:
    """Polls a server's /metrics until it has applied ``at_least`` updates; fails early if ``proc`` died."""

    def ready() -> dict[str, float] | None:
        if proc is not None:
            assert proc.alive(), f"{proc.name} exited with {proc.returncode} while we waited for updates\n{proc.tail()}"
        metrics = try_scrape(metrics_port)
        return metrics if metrics.get("rpcps_server_updates_applied_total", 0) >= at_least else None

    return wait_until(ready, timeout, f"{at_least} updates on the server's /metrics (port {metrics_port})")


UNTRAINED_LOSS = math.log(10)
"""Cross-entropy of an untrained model on the built-in 10-class task."""


def assert_learned(summary: dict[str, Any], factor: float = 0.75) -> None:
    """The loss fell well below an untrained model's, and below what this process first saw.

    A worker that joins late starts on parameters others already trained, so its own first losses
    are low already; comparing with the untrained loss keeps the check meaningful for it too.
    """
    first, last = summary["initial_loss"], summary["final_loss"]
    assert first is not None and last is not None, summary
    assert last < first, f"loss went {first:.4f} -> {last:.4f}; expected it to fall"
    assert last < factor * UNTRAINED_LOSS, f"final loss {last:.4f}; expected below {factor} x ln(10) = {factor * UNTRAINED_LOSS:.3f}"
