#!/usr/bin/env python3
"""Scale-out on the 25M-parameter model: shards x workers, consistency modes, bf16 wire (not a test).

    python -m bench.scale_out                          # grid (S=1,2 x N=1,2,4) + modes table, ~4 min
    python -m bench.scale_out --tables wire            # fp32 vs bf16 for S=1,2 x N=1,2
    python -m bench.scale_out --steps 40 --tables grid,modes,wire   # longer, all three

Every configuration is one ``trainer_entry.py local`` run of ``--steps`` steps per worker (Adam on
the server). The figure is worker steps per second over the run's steady part (from the workers'
/metrics, sampled every 0.25 s; start-up left out); each step is one gradient push, i.e. one update
in async and bounded mode (sync averages one round of N pushes into one update). All runs of one
invocation are made back to back, so their ratios are the trustworthy part on a noisy machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.common import LocalRun, local_argv, print_table, run_local

MODEL, DATA = "rpcps.tasks:mlp_25m", "rpcps.tasks:mlp_25m_data"


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale_out", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="steps per worker in every run")
    p.add_argument("--tables", default="grid,modes", help="comma-separated: grid, modes, wire")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--data", default=DATA)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rpcps-bench-scale-"))
    cache: dict[tuple, LocalRun] = {}

    def measure(shards: int, workers: int, mode: str = "async", wire: str = "fp32") -> LocalRun:
        key = (shards, workers, mode, wire)
        if key not in cache:
            extra = ["--shards", str(shards), "--wire-dtype", wire, "--mode", mode]
            if mode == "bounded":
                extra += ["--max-staleness", "1"]
            run_dir = root / "-".join(map(str, key))
            cache[key] = run_local(local_argv(run_dir, model=args.model, data=args.data, workers=workers, steps=args.steps, extra=extra), run_dir)
            r = cache[key]
            print(f"S={shards} N={workers} {mode} {wire}: {r.steady_steps_per_s():.2f} steps/s steady, "
                  f"{r.summary_steps_per_s():.2f} incl. start-up, run {r.elapsed_s:.0f}s", flush=True)
        return cache[key]

    tables = args.tables.split(",")
    print(f"model {args.model}, {args.steps} steps per worker, Adam, uv/basic\n")
    if "grid" in tables:
        rows = []
        base = None
        for shards in (1, 2):
            for workers in (1, 2, 4):
                r = measure(shards, workers)
                rate = r.steady_steps_per_s()
                base = base or rate
                rows.append([str(shards), str(workers), f"{rate:.2f}", f"{rate / base:.2f}", f"{r.summary_steps_per_s():.2f}"])
        print("\nshards x workers (async, fp32):")
        print_table(["shards S", "workers N", "updates/s (steady)", "vs S=1 N=1", "updates/s incl. start-up"], rows)
    if "modes" in tables:
        rows = []
        for workers in (2,):
            a = measure(1, workers).steady_steps_per_s()
            for mode in ("async", "bounded", "sync"):
                r = measure(1, workers, mode)
                rate = r.steady_steps_per_s()
                srv = r.summary["server"]
                rows.append([mode + (" K=1" if mode == "bounded" else ""), str(workers), f"{rate:.2f}", f"{rate / a:.2f}",
                             str(srv["updates_applied"]), str(srv["pushes_stale"]), str(srv["rounds"]), f"{r.summary['final_loss']:.3g}"])
        print("\nmodes, S=1 (each worker step is one pushed gradient):")
        print_table(["mode", "workers", "gradients/s (steady)", "vs async", "updates applied", "pushes refused stale", "sync rounds", "final loss"], rows)
    if "wire" in tables:
        rows = []
        for shards in (1, 2):
            for workers in (1, 2):
                f32 = measure(shards, workers).steady_steps_per_s()
                bf16 = measure(shards, workers, wire="bf16").steady_steps_per_s()
                rows.append([str(shards), str(workers), f"{f32:.2f}", f"{bf16:.2f}", f"{bf16 / f32:.2f}" if f32 else "-"])
        print("\nwire dtype (async):")
        print_table(["shards S", "workers N", "fp32 updates/s", "bf16 updates/s", "bf16 / fp32"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
