"""How fast ``rpcps local`` starts, and comes back after kill -9 of its server, with and without
``--prefork`` (its children started from one process that imported torch once) (not a test).

Both sides run in one invocation, alternating, on the product's defaults otherwise (nothing pins
threads): ``local`` with two workers of the built-in task and a checkpoint directory. Measured from
outside, through the run directory's ``children.json`` and the server's /metrics:

- *first update*: from starting ``local`` to the server's first applied update;
- *back*: from kill -9 of the server to the first update its restarted incarnation applies
  (local's restart backoff, 0.5 s for a first restart, is in both sides' figure).

Usage: ``python -m bench.local_restart [--rounds 3] [--kills 2]``. Prints one line per run and the
medians with the ratio off/on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import REPO, child_env
from rpcps.scrape import try_scrape

ENTRY = REPO / "trainer_entry.py"
UPDATES = "rpcps_server_updates_applied_total"


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while (value := predicate()) is None or value is False:
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.01)
    return value


def _server(run_dir: Path) -> tuple[int, int] | None:
    """(pid, metrics port) of the server, from local's children.json."""
    try:
        children = json.loads((run_dir / "children.json").read_text())
    except (OSError, ValueError):
        return None
    entry = next((c for name, c in children.items() if name.startswith("ps")), None)
    return (entry["pid"], entry["metrics_port"]) if entry and entry.get("pid") else None


def _updates(port: int) -> float:
    return try_scrape(port).get(UPDATES, 0)


def _kill_the_server(run_dir: Path) -> float:
    """kill -9 of the server once it has applied 50 updates; seconds until its next incarnation applies one."""
    pid, port = _server(run_dir)
    _wait(lambda: _updates(port) >= 50, 120, "50 updates")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    _wait(lambda: (s := _server(run_dir)) is not None and s[0] != pid, 60, "local to restart the server")
    # A resumed server may count from its snapshot: its first update is the first increase.
    serving = _wait(lambda: try_scrape(port).get(UPDATES), 120, "the restarted server")
    _wait(lambda: _updates(port) > serving, 120, "the restarted server's first update")
    return time.monotonic() - killed


def one_run(prefork: str, kills: int, scratch: Path) -> tuple[float, list[float]]:
    run_dir, checkpoints = scratch / f"run-{prefork}", scratch / f"ckpt-{prefork}"
    argv = [sys.executable, str(ENTRY), "local", "--workers", "2", "--steps", "1000000", "--run-dir", str(run_dir),
            "--checkpoint-dir", str(checkpoints), "--max-restarts", str(kills + 1), "--prefork", prefork]
    started = time.monotonic()
    local = subprocess.Popen(argv, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        _, port = _wait(lambda: _server(run_dir), 120, "local's children.json")
        _wait(lambda: _updates(port) >= 1, 120, "the first update")
        first = time.monotonic() - started
        backs = [_kill_the_server(run_dir) for _ in range(kills)]
        return first, backs
    finally:
        local.send_signal(signal.SIGTERM)
        try:
            local.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(local.pid, signal.SIGKILL)
            local.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("--kills", type=int, default=2, help="kill -9 of the server per run")
    args = parser.parse_args()
    firsts: dict[str, list[float]] = {"on": [], "off": []}
    backs: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for prefork in ("on", "off") if r % 2 == 0 else ("off", "on"):
            with tempfile.TemporaryDirectory(prefix="rpcps-bench-restart-") as scratch:
                first, back = one_run(prefork, args.kills, Path(scratch))
            firsts[prefork].append(first)
            backs[prefork].extend(back)
            print(f"prefork {prefork}: first update {first:.2f} s; back after kill -9: {', '.join(f'{b:.2f}' for b in back)} s", flush=True)
    for what, figures in (("first update", firsts), ("back after kill -9", backs)):
        on, off = statistics.median(figures["on"]), statistics.median(figures["off"])
        print(f"{what}: median prefork on {on:.2f} s, off {off:.2f} s: off/on {off / on:.2f}x")


if __name__ == "__main__":
    main()
