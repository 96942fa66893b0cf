#!/usr/bin/env python3
"""Throughput with a snapshot every second versus none, measured side by side (not a test).

    python bench/checkpoint_overhead.py [--model rpcps.tasks:mlp_5m --data rpcps.tasks:mlp_5m_data] [--rounds 2]

Runs ``rpcps local`` alternately without and with ``--checkpoint-every-seconds 1`` (A/B/A/B, so
machine noise hits both alike) and prints updates/s of each and their ratio, plus how many
snapshots were written and their mean duration (from the server's own metrics file).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(args: argparse.Namespace, workdir: Path, checkpoints: bool) -> dict:
    workdir.mkdir(parents=True)
    argv = [
        sys.executable, str(REPO / "trainer_entry.py"), "local", "--workers", str(args.workers), "--steps", str(args.steps),
        "--model", args.model, "--data", args.data, "--loss", "mse", "--optimizer", "adam",
        "--run-dir", str(workdir), "--summary-json", str(workdir / "summary.json"), "--progress-s", "60",
        "--log-level", "INFO",  # the snapshot lines below are INFO
    ]
    if checkpoints:
        argv += ["--checkpoint-dir", str(workdir / "ckpt"), "--checkpoint-every-seconds", "1", "--keep-checkpoints", "2"]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((workdir / "summary.json").read_text())
    snapshots = sorted((workdir / "ckpt").glob("step-*")) if checkpoints else []
    log = (workdir / "ps.log").read_text()
    written = log.count("written to")
    durations = [float(line.rsplit(" in ", 1)[1].rstrip("s")) for line in log.splitlines() if "written to" in line]
    return {
        "updates_per_second": summary["server"]["updates_per_second"],
        "snapshots_written": written,
        "mean_snapshot_s": sum(durations) / len(durations) if durations else 0.0,
        "snapshot_bytes": sum(f.stat().st_size for s in snapshots for f in s.iterdir()) // max(len(snapshots), 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="rpcps.tasks:mlp_5m")
    p.add_argument("--data", default="rpcps.tasks:mlp_5m_data")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rpcps-bench-ckpt-"))
    base, ckpt = [], []
    for r in range(args.rounds):
        base.append(run(args, root / f"none-{r}", checkpoints=False))
        ckpt.append(run(args, root / f"every1s-{r}", checkpoints=True))
    mean = lambda xs: sum(xs) / len(xs)
    b = mean([x["updates_per_second"] for x in base])
    c = mean([x["updates_per_second"] for x in ckpt])
    print(f"model {args.model}, {args.workers} workers x {args.steps} steps, {args.rounds} rounds A/B")
    print(f"  no checkpoints        : {b:8.2f} updates/s  (runs: {[round(x['updates_per_second'], 2) for x in base]})")
    print(f"  snapshot every 1 s    : {c:8.2f} updates/s  (runs: {[round(x['updates_per_second'], 2) for x in ckpt]})")
    print(f"  ratio (with / without): {c / b:8.3f}")
    print(f"  snapshots per run     : {[x['snapshots_written'] for x in ckpt]}, mean write "
          f"{mean([x['mean_snapshot_s'] for x in ckpt]):.3f}s, {ckpt[0]['snapshot_bytes'] / 1e6:.1f} MB each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
