#!/usr/bin/env python3
"""Server and worker memory against their budgets, and flatness over time (not a test).

    python -m bench.server_memory                      # 25M model, Adam, 2 workers, 1.5 min, ~2.5 min in all
    python -m bench.server_memory --minutes 10         # the flatness run
    python -m bench.server_memory --malloc MALLOC_ARENA_MAX=8   # glibc settings for every child (compare allocators)

One ``local`` run on the product's defaults (mlp_25m, Adam: fp32 masters + two fp32 moments), its
workers pushing and pulling for ``--minutes``, then stopped. Shard 0's and the workers' VmRSS and
VmHWM are read from /proc/<pid>/status every 0.5 s (bench.common). Printed against issue 12's budgets:

* server peak RSS <= 2 x (parameters + optimizer state) + 600 MB;
* worker peak RSS <= model + 2 x gradients + 500 MB;

and the server's RSS at each quarter of the run with its growth over the second half (MB/min). The
floor the fixed parts of the budgets are meant for is measured first, in the same run: the peak RSS
of a process that imports torch and rpcps's server and worker and starts an RPC agent (a group of one).

When each peak came: a second sampler reads every process's VmRSS every 0.1 s (bench.memory_timeline),
and the last table splits each series into start-up (up to one malloc-trim interval after the first
update) and the steady sawtooth of the trims, whose windows' lows are about the live data and whose
tops are what the trims let back in. ``--timeline FILE`` keeps the samples.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import memory_timeline
from bench.common import child_env, local_argv, print_table, run_local
from rpcps import plugins
from rpcps.ports import free_port
from rpcps.process import ProcessOptions

MB = 1024 * 1024
SERVER_FIXED_MB, WORKER_FIXED_MB = 600, 500
_FLOOR = """
import sys, torch, torch.distributed.rpc as rpc
import ps.runner, worker.runner
rpc.init_rpc("floor", rank=0, world_size=1,
             rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{sys.argv[1]}"))
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")))
rpc.shutdown()
"""


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.server_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=1.5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default="rpcps.tasks:mlp_25m")
    p.add_argument("--data", default="rpcps.tasks:mlp_25m_data")
    p.add_argument("--malloc", action="append", default=[], metavar="NAME=VALUE",
                   help="a glibc MALLOC_* variable for every child (they inherit it; rpcps.memory leaves what is set alone)")
    p.add_argument("--timeline", type=Path, metavar="FILE", help="write the 0.1 s RSS samples here (seconds, process, MB)")
    args = p.parse_args()
    for item in args.malloc:
        name, _, value = item.partition("=")
        os.environ[name] = value  # children inherit it (bench.common.child_env)
    floor_mb = int(subprocess.run([sys.executable, "-c", _FLOOR, str(free_port())], env=child_env(), check=True,
                                  capture_output=True, text=True, timeout=120).stdout.split()[0]) / 1024
    run_dir = Path(tempfile.mkdtemp(prefix="rpcps-bench-mem-")) / "run"
    sampler = memory_timeline.RssSampler(run_dir)
    sampler.start()
    try:
        run = run_local(local_argv(run_dir, model=args.model, data=args.data, workers=args.workers, steps=1_000_000), run_dir,
                        interval_s=0.5, stop_after_s=60 * args.minutes)
    finally:
        sampler.stop()
    if args.timeline is not None:
        sampler.write_tsv(args.timeline)
    numel = sum(q.numel() for q in plugins.load_model(args.model).parameters())
    params_mb, opt_mb = numel * 4 / MB, 2 * numel * 4 / MB
    server_peak, worker_peak = run.samples.server_hwm_kb / 1024, run.samples.worker_hwm_kb / 1024
    server_budget = 2 * (params_mb + opt_mb) + SERVER_FIXED_MB
    worker_budget = params_mb + 2 * params_mb + WORKER_FIXED_MB
    stop_t = 60 * args.minutes  # samples after the SIGTERM show the shutdown, not the steady state
    rss = [x for x in run.samples.server_rss_kb if x[0] <= stop_t] or run.samples.server_rss_kb
    steps = run.samples.worker_steps[-1][1] if run.samples.worker_steps else 0
    quarter = [rss[min(len(rss) - 1, int(len(rss) * f))] for f in (0.25, 0.5, 0.75, 1.0)]
    half = [x for x in rss if x[0] >= rss[-1][0] / 2]
    slope = (half[-1][1] - half[0][1]) / 1024 / ((half[-1][0] - half[0][0]) / 60) if len(half) > 1 else float("nan")
    malloc = f", {' '.join(args.malloc)}" if args.malloc else ""
    print(f"\n{args.model}: {numel / 1e6:.1f} M parameters, Adam, {args.workers} workers, {args.minutes} min, {steps:.0f} worker steps"
          f", {run.steady_updates_per_s():.1f} updates/s steady{malloc}")
    print_table(
        ["quantity", "MB"],
        [
            ["floor: import torch + rpcps, RPC agent started (peak RSS)", f"{floor_mb:.0f}"],
            ["parameters (fp32)", f"{params_mb:.0f}"],
            ["optimizer state (Adam, 2 x fp32)", f"{opt_mb:.0f}"],
            ["server budget 2 x (params + optimizer) + 600", f"{server_budget:.0f}"],
            ["**server peak RSS (VmHWM)**", f"**{server_peak:.0f}** ({'within' if server_peak <= server_budget else 'OVER'})"],
            ["worker budget model + 2 x gradients + 500", f"{worker_budget:.0f}"],
            ["**worker peak RSS (largest VmHWM)**", f"**{worker_peak:.0f}** ({'within' if worker_peak <= worker_budget else 'OVER'})"],
        ],
    )
    print("\nserver RSS over time: " + ", ".join(f"t={t:.0f}s {kb / 1024:.0f} MB" for t, kb in quarter)
          + f"; second-half growth {slope:+.1f} MB/min")
    _print_timeline(run.samples.server_updates, sampler.series, stop_t)
    return 0


def _print_timeline(updates: list[tuple[float, float]], series: dict[str, list[tuple[float, float]]], stop_t: float) -> None:
    first_update = next((t for t, n in updates if n > 0), None)
    if first_update is None:
        print("\nno update was applied: no timeline")
        return
    # The windows follow the children's trim interval (the default, or --malloc RPCPS_MALLOC_TRIM_S=S when not 0).
    window = float(os.environ.get("RPCPS_MALLOC_TRIM_S") or 0) or ProcessOptions().malloc_trim_s
    print(f"\nRSS every {memory_timeline.INTERVAL_S} s, in windows of {window:g} s from the first update (t={first_update:.1f} s):")
    print_table(memory_timeline.TABLE_COLUMNS, [
        memory_timeline.table_row(name, memory_timeline.teeth(xs, first_update, window, until_s=stop_t), first_update)
        for name, xs in sorted(series.items())
    ])


if __name__ == "__main__":
    sys.exit(main())
