#!/usr/bin/env python3
"""How much of a worker's step is spent blocked on the network, prefetch on vs off (not a test).

    python -m bench.comm_fraction                  # ~3 min
    python -m bench.comm_fraction --workers 2 --heavy-steps 30 --light-steps 40

Two workloads, each with ``--prefetch-pull on`` and ``off``, run back to back (A/B per workload):

* **compute-heavy**: mlp_5m (21 MB of gradient) on batches of 2048 (bench.big_batch), ~1 s of
  forward/backward per step on one core;
* **communication-heavy**: mlp_25m (101 MB) on batches of 32, milliseconds of compute per step.

The fraction is the workers' rpcps_worker_communication_blocked_seconds_total over (that +
rpcps_worker_compute_seconds_total), read from their /metrics at the end of the run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.common import local_argv, print_table, run_local

WORKLOADS = {
    "compute-heavy (mlp_5m, batch 2048)": ("rpcps.tasks:mlp_5m", "bench.big_batch:mlp_5m_data_2048", "heavy_steps"),
    "communication-heavy (mlp_25m, batch 32)": ("rpcps.tasks:mlp_25m", "rpcps.tasks:mlp_25m_data", "light_steps"),
}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.comm_fraction", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--heavy-steps", type=int, default=20)
    p.add_argument("--light-steps", type=int, default=25)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rpcps-bench-comm-"))
    rows = []
    for label, (model, data, steps_attr) in WORKLOADS.items():
        for prefetch in ("on", "off"):
            run_dir = root / f"{model.split(':')[1]}-{prefetch}"
            argv = local_argv(run_dir, model=model, data=data, workers=args.workers, steps=getattr(args, steps_attr),
                              extra=["--prefetch-pull", prefetch])
            r = run_local(argv, run_dir)
            m = list(r.samples.worker_last.values())
            comp = sum(x.get("rpcps_worker_compute_seconds_total", 0.0) for x in m)
            comm = sum(x.get("rpcps_worker_communication_blocked_seconds_total", 0.0) for x in m)
            steps = sum(x.get("rpcps_worker_steps_total", 0.0) for x in m)
            rows.append([label, prefetch, f"{r.communication_fraction():.3f}", f"{1000 * comp / steps:.0f}", f"{1000 * comm / steps:.0f}",
                         f"{r.steady_steps_per_s():.2f}"])
            print(f"{label} prefetch {prefetch}: fraction {r.communication_fraction():.3f}", flush=True)
    print(f"\n{args.workers} worker(s), async, Adam, uv/basic, pull every step")
    print_table(["workload", "prefetch", "communication fraction", "compute ms/step", "blocked ms/step", "steps/s (steady)"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
