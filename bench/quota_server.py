#!/usr/bin/env python3
"""A server under a CPU quota of one core: the budget it chooses against ``--threads 1`` and 2, side by side (not a test).

    python -m bench.quota_server                 # the 5M MLP, SGD, 2 hand-started workers x 300 steps
    python -m bench.quota_server --preset tiny   # the 22k MLP

The server runs in a cgroup this script makes (harness.cgroups: root and a writable CPU hierarchy),
limited to 1 CPU; the workers run outside it, started by hand as README's "Running it on a cluster"
starts them (bench.common.run_by_hand). Interleaved, ``--repeats`` times, best kept:

* **defaults**: no thread setting: the server counts its usable cores from the quota (rpcps.cpu_limits);
* **--threads 1**: what the issue asks to be no worse than;
* **--threads 2**: the affinity's count, what the server took before it read the quota.

Prints steady updates/s (15-85 %) of each and the budget line each server logged.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

from bench.common import print_table, run_by_hand
from bench.vs_example import PRESETS, SGD_ARGS
from harness.cgroups import cpu_quota_cgroup, enter_argv

SIDES = {"defaults": [], "--threads 1": ["--threads", "1"], "--threads 2": ["--threads", "2"]}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quota_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="5m")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    p = PRESETS[args.preset]
    root = Path(tempfile.mkdtemp(prefix="rpcps-bench-quota-"))
    runs: dict[str, list[float]] = {name: [] for name in SIDES}
    budgets: dict[str, str] = {}
    started = time.monotonic()
    with cpu_quota_cgroup(1.0) as group:
        for i in range(args.repeats):
            for name, flags in SIDES.items():
                tag = f"{name.strip('-').replace(' ', '')}-{i}"
                for attempt in range(2):
                    try:
                        run = run_by_hand(root / f"{tag}-{attempt}", model=p.model, data=p.data, loss=p.loss, workers=2, steps=p.steps,
                                          extra=[*SGD_ARGS, *flags], server_wrapper=lambda argv: enter_argv(group, argv))
                        break
                    except RuntimeError as e:
                        # Seen once: a worker gave up opening its store client (2 s) while the throttled
                        # server was still starting; a fresh run, not a skipped side.
                        print(f"{name}, repeat {i}: {e}; running it again", flush=True)
                else:
                    raise RuntimeError(f"{name} failed twice; logs in {root}")
                runs[name].append(run.steady_updates_per_s())
                line = re.search(r"rpcps\.threads: (intra-op threads: .*)", run.logs["ps"])
                budgets[name] = line.group(1) if line else "?"
            print(f"repeat {i}: " + ", ".join(f"{n} {r[-1]:.1f}" for n, r in runs.items()), flush=True)
    best = {n: max(r) for n, r in runs.items()}
    print(f"\n{p.model}, SGD, server in a cgroup of 1 CPU, 2 hand-started workers x {p.steps} steps outside it, "
          f"steady updates/s (15-85 %), best of {args.repeats}, {time.monotonic() - started:.0f}s")
    print_table(["server", "updates/s", "vs --threads 1", "the server's budget line"],
                [[n, f"{v:.1f}", f"{v / best['--threads 1']:.2f}", budgets[n][:150]] for n, v in best.items()])
    print("all runs:", runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
