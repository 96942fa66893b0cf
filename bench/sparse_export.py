"""Export of a big sparse table from a checkpoint: throughput and peak memory (not a test).

1. Builds a checkpoint in ``--dir`` with the server's real checkpointer: one table of ``--rows`` rows
   (dim ``--dim``, the default row-wise Adagrad), a full snapshot, ``--deltas`` more snapshots after
   Zipf pushes (deltas, so the export folds a chain), all with the product's commit protocol.
2. Exports it in a fresh child process (``ps.checkpoints.export.export_checkpoint``, what ``rpcps export`` runs)
   in each ``--format`` (``--repeats`` times, interleaved), and reports: the export's own time and MB/s (bytes written / time), the
   child's peak RSS (VmHWM) against the table's bytes (ids + embeddings: what the export holds),
   and the child's RSS before the export began (interpreter and torch).
3. Optionally (``--serve``) loads the export with ``rpcps.sparse.serving.load_rows`` and looks up
   a batch: load time and lookups/s.

    python -m bench.sparse_export --dir /tmp/sparse-export-bench              # 10 M rows, dim 16

Targets (issue 31): >= 200 MB/s, peak RSS below 1.2x the table's bytes. The directory is removed at
the end; building needs about 4x the table's payload in memory (the server's slab and its copy).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import child_env, run_in_scratch
from bench.sparse_checkpoint import TABLE, OneTable, Pusher
from harness.inprocess import InProcessServer
from ps.checkpoints.checkpointer import Checkpointer
from ps.checkpoints.snapshot_files import list_snapshots, peek_manifest
from ps.config import CheckpointConfig
from ps.core.config import ServerCoreConfig
from rpcps.sparse.hashing import derive_key, keyed_hash

_CHILD = """
import json, sys, time
from ps.checkpoints.export import export_checkpoint
def hwm():
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM"))) * 1024
before = hwm()
began = time.perf_counter()
result = export_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3])
seconds = time.perf_counter() - began
print(json.dumps({"seconds": seconds, "bytes": result.size_bytes, "rows": result.tables, "hwm": hwm(), "before": before}))
"""

_SERVE = """
import json, sys, time, torch
from rpcps.sparse.serving import load_rows
from rpcps.sparse.spec import TableSpec
began = time.perf_counter()
rows = load_rows(sys.argv[1], (TableSpec(name=sys.argv[2], table_id=0, dim=int(sys.argv[3])),), "auto")
loaded = time.perf_counter() - began
table = rows.tables[sys.argv[2]]
ids = torch.cat([table.ids[torch.randint(0, len(table), (3 * 4096 * 26 // 4,))].cpu(), torch.randint(0, 2**62, (4096 * 26 // 4,))])
began, n = time.perf_counter(), 0
while time.perf_counter() - began < 3:
    rows.pull({sys.argv[2]: torch.unique(ids)}); n += 1
print(json.dumps({"load_s": loaded, "lookups_per_s": n * torch.unique(ids).numel() / (time.perf_counter() - began),
                  "device": str(table.ids.device)}))
"""


def build(directory: Path, rows: int, dim: int, deltas: int) -> int:
    """Writes the checkpoint; returns the table's row count."""
    server = InProcessServer(OneTable(dim), ServerCoreConfig())
    table = server.core.sparse.tables[TABLE]
    key = derive_key(2024)
    for lo in range(0, rows, 1 << 18):
        table.pull(keyed_hash(torch.arange(lo, min(lo + (1 << 18), rows)), key))
    meta = {"signature": server.signature.to_wire(), "optimizer": server.config.optimizer.name}
    checkpointer = Checkpointer(server.core, CheckpointConfig(directory=str(directory), every_seconds=None, keep=1 + deltas),
                                meta, server.core.metrics)
    pusher = Pusher(server, rows, 4096 * 26, 1.1, dim, key)
    checkpointer.checkpoint_now()
    for _ in range(deltas):
        pusher.steps(20)
        checkpointer.checkpoint_now()
    newest = list_snapshots(directory)[0]
    print(f"checkpoint: {len(table)} rows, newest snapshot {newest.name} ({peek_manifest(newest)['sparse']['kind']} of a chain "
          f"of {len(peek_manifest(newest)['sparse']['chain'])})", flush=True)
    return len(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, required=True, help="scratch directory on the disk to measure (created, then removed)")
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--deltas", type=int, default=2, help="delta snapshots after the full (the export folds the chain)")
    p.add_argument("--format", action="append", choices=["torch", "safetensors"], help="repeatable; default both")
    p.add_argument("--repeats", type=int, default=2, help="exports per format, interleaved (take the best: the box is shared)")
    p.add_argument("--serve", action="store_true", help="also load the export for serving and time lookups")
    args = p.parse_args()
    run_in_scratch(args.dir, lambda: run(args))


def run(args: argparse.Namespace) -> None:
    began = time.perf_counter()
    (args.dir / "ckpt").mkdir()
    rows = build(args.dir / "ckpt", args.rows, args.dim, args.deltas)
    table_bytes = rows * (8 + 4 * args.dim)
    print(f"built in {time.perf_counter() - began:.0f} s; torch {torch.__version__}; table bytes (ids + embeddings) "
          f"{table_bytes / 1e6:.0f} MB; sparse.pt of the full {_full_size(args.dir / 'ckpt') / 1e6:.0f} MB", flush=True)
    served_once: set[str] = set()
    print("| format | export s | written MB | MB/s | child RSS before MB | peak RSS MB | peak / table bytes |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    formats = args.format or ["torch", "safetensors"]
    for fmt in [f for _ in range(args.repeats) for f in formats]:  # interleaved: a disturbance hits both
        out = args.dir / f"export-{fmt}"
        child = subprocess.run([sys.executable, "-c", _CHILD, str(args.dir / "ckpt"), str(out), fmt], env=child_env(),
                               capture_output=True, text=True, check=True)
        r = json.loads(child.stdout.strip().splitlines()[-1])
        assert sum(r["rows"].values()) == rows, r["rows"]
        print(f"| {fmt} | {r['seconds']:.2f} | {r['bytes'] / 1e6:.0f} | {r['bytes'] / r['seconds'] / 1e6:.0f} | "
              f"{r['before'] / 1e6:.0f} | {r['hwm'] / 1e6:.0f} | {r['hwm'] / table_bytes:.2f} |", flush=True)
        if args.serve and out.name not in served_once:
            served_once.add(out.name)
            served = subprocess.run([sys.executable, "-c", _SERVE, str(out), TABLE, str(args.dim)], env=child_env(),
                                    capture_output=True, text=True, check=True)
            s = json.loads(served.stdout.strip().splitlines()[-1])
            print(f"  serving ({fmt}): loaded in {s['load_s']:.1f} s on {s['device']}, {s['lookups_per_s'] / 1e6:.2f} M lookups/s")
        shutil.rmtree(out)


def _full_size(directory: Path) -> int:
    snapshots = list_snapshots(directory)
    chain = peek_manifest(snapshots[0])["sparse"]["chain"]
    return (directory / chain[0] / "sparse.pt").stat().st_size


if __name__ == "__main__":
    main()
