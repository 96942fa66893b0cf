#!/usr/bin/env python3
"""Server memory: peak RSS against parameters + optimizer state, and flatness over time (not a test).

    python -m bench.server_memory                      # 25M model, 2 workers, 1.5 min, ~2.5 min in all
    python -m bench.server_memory --minutes 5          # the longer flatness run
    python -m bench.server_memory --malloc-mmap-threshold 131072   # glibc: large blocks always mmapped

Two runs back to back, each sampling shard 0's VmRSS and VmHWM from /proc/<pid>/status every
0.5 s (bench.common):

1. the fixed overhead: the built-in tiny model (a few thousand parameters), 1 worker, a short run:
   the interpreter, torch, the RPC agent's threads and buffers, gRPC, Prometheus;
2. the measured run: mlp_25m with Adam (fp32 masters + two fp32 moments = 3 x 4 bytes per
   parameter), ``--workers`` workers pushing and pulling for ``--minutes``, then stopped.

Printed: peak RSS, the budget 1.5 x (params + optimizer state) + fixed overhead, and RSS at each
quarter of the run plus its growth over the second half (MB/min) for flatness.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bench.common import local_argv, print_table, run_local
from rpcps import plugins

MB = 1024 * 1024


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.server_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=1.5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default="rpcps.tasks:mlp_25m")
    p.add_argument("--data", default="rpcps.tasks:mlp_25m_data")
    p.add_argument("--malloc-mmap-threshold", type=int, help="set glibc's MALLOC_MMAP_THRESHOLD_ for every child (a fixed "
                   "threshold: freed multi-MB buffers go back to the OS instead of staying in malloc's arenas)")
    args = p.parse_args()
    if args.malloc_mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)  # children inherit it (bench.common.child_env)
    root = Path(tempfile.mkdtemp(prefix="rpcps-bench-mem-"))
    base_dir = root / "tiny"
    base = run_local(local_argv(base_dir, model="rpcps.tasks:teacher_student_model", data="rpcps.tasks:teacher_student_data",
                                workers=1, steps=200, extra=["--loss", "cross_entropy"]), base_dir, interval_s=0.5)
    fixed_mb = base.samples.server_hwm_kb / 1024
    run_dir = root / "big"
    big = run_local(local_argv(run_dir, model=args.model, data=args.data, workers=args.workers, steps=1_000_000), run_dir,
                    interval_s=0.5, stop_after_s=60 * args.minutes)
    numel = sum(q.numel() for q in plugins.load_model(args.model).parameters())
    params_mb, opt_mb = numel * 4 / MB, 2 * numel * 4 / MB
    peak_mb = big.samples.server_hwm_kb / 1024
    budget_mb = 1.5 * (params_mb + opt_mb) + fixed_mb
    stop_t = 60 * args.minutes  # samples after the SIGTERM show the shutdown, not the steady state
    rss = [x for x in big.samples.server_rss_kb if x[0] <= stop_t] or big.samples.server_rss_kb
    steps = big.samples.worker_steps[-1][1] if big.samples.worker_steps else 0
    quarter = [rss[min(len(rss) - 1, int(len(rss) * f))] for f in (0.25, 0.5, 0.75, 1.0)]
    half = [x for x in rss if x[0] >= rss[-1][0] / 2]
    slope = (half[-1][1] - half[0][1]) / 1024 / ((half[-1][0] - half[0][0]) / 60) if len(half) > 1 else float("nan")
    malloc = f", MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}" if args.malloc_mmap_threshold is not None else ""
    print(f"\n{args.model}: {numel / 1e6:.1f} M parameters, Adam, {args.workers} workers, {args.minutes} min, {steps:.0f} worker steps{malloc}")
    print_table(
        ["quantity", "MB"],
        [
            ["fixed overhead (tiny model, peak RSS)", f"{fixed_mb:.0f}"],
            ["parameters (fp32)", f"{params_mb:.0f}"],
            ["optimizer state (Adam, 2 x fp32)", f"{opt_mb:.0f}"],
            ["budget 1.5 x (params + optimizer) + fixed", f"{budget_mb:.0f}"],
            ["server peak RSS (VmHWM)", f"{peak_mb:.0f}"],
            ["(peak - fixed) / (params + optimizer)", f"{(peak_mb - fixed_mb) / (params_mb + opt_mb):.2f}x"],
        ],
    )
    print("\nRSS over time: " + ", ".join(f"t={t:.0f}s {kb / 1024:.0f} MB" for t, kb in quarter)
          + f"; second-half growth {slope:+.1f} MB/min; {'within' if peak_mb <= budget_mb else 'OVER'} budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
