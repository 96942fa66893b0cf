#!/usr/bin/env python3
"""A third worker started by hand into a running hand-started job: every process's thread budget follows (not a test).

    python -m bench.late_worker                  # the 5M MLP, SGD, a server + 2 workers x 1200 steps, a third after 25 %
    python -m bench.late_worker --preset tiny    # the 22k MLP

A server and two workers are started as README's "Running it on a cluster" starts them on one host
(bench.common.run_by_hand: separate processes, no thread flag or environment); once the server has
applied ``--late-at`` of the first two workers' updates, a third worker is started the same way. The
script prints, side by side in this one run:

* updates/s with two workers (from 10 % of their updates to the third's start) and with three (from
  ``--settle-s`` after its start, for ``--window-s``);
* for every process, how long after the third worker announced its own budget (its first
  ``intra-op threads`` log line) that process logged a recomputed budget naming the new neighbour,
  and when its ``rpcps_*_host_processes`` gauge first read one more process than before.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from bench.common import print_table, run_by_hand
from bench.vs_example import PRESETS, SGD_ARGS

LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO .*rpcps\.threads: (intra-op threads.*)$")


def budget_lines(log: str) -> list[tuple[float, str]]:
    """(unix time, message) of every budget line in a process's log."""
    out = []
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            out.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), m.group(2)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.late_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="5m")
    parser.add_argument("--steps", type=int, default=1200, help="steps of each of the first two workers")
    parser.add_argument("--late-at", type=float, default=0.25, help="fraction of the first two workers' updates")
    parser.add_argument("--settle-s", type=float, default=8.0)
    parser.add_argument("--window-s", type=float, default=30.0)
    args = parser.parse_args()
    p = PRESETS[args.preset]
    run_dir = Path(tempfile.mkdtemp(prefix="rpcps-bench-late-"))
    run = run_by_hand(run_dir, model=p.model, data=p.data, loss=p.loss, workers=2, steps=args.steps, extra=SGD_ARGS,
                      late_worker_at=args.late_at, late_worker_steps=args.steps // 2, scrape_all=True)
    assert run.late_started_s is not None, "the third worker never started"
    total = 2 * args.steps
    start = next(t for t, v in run.server_updates if v >= 0.10 * total)
    two = run.rate_between(start, run.late_started_s)
    after = run.late_started_s + args.settle_s
    three = run.rate_between(after, after + args.window_s)
    print(f"{p.model}, SGD, hand-started: server + 2 workers x {args.steps} steps, a third worker started by hand at "
          f"{args.late_at:.0%} ({run.late_started_s:.1f}s); logs in {run_dir}")
    print_table(["workers", "window", "updates/s"], [
        ["2", f"{start:.1f}-{run.late_started_s:.1f}s", f"{two:.1f}"],
        ["3", f"{after:.1f}-{after + args.window_s:.1f}s", f"{three:.1f}"],
    ])
    print(f"3 workers / 2 workers: {three / two:.2f}\n")
    late = "worker2"
    announced = budget_lines(run.logs[late])[0][0]
    rows = []
    for name, log in sorted(run.logs.items()):
        lines = [(t, msg) for t, msg in budget_lines(log) if t >= announced]
        if name == late:
            seen = f"its own: {lines[0][1][:120]}"
            delay = "-"
        else:
            hit = next(((t, msg) for t, msg in lines if "3 other rpcps processes" in msg), None)
            delay = "never" if hit is None else f"{hit[0] - announced:.1f}s"
            seen = "-" if hit is None else hit[1][:120]
        gauge = run.host_processes.get(name, [])
        before = next((v for t, v in reversed(gauge) if t < run.late_started_s), None)
        moved = next((t for t, v in gauge if t >= run.late_started_s and before is not None and v > before), None)
        threads = sorted({int(v) for _, v in run.intra_op.get(name, [])})
        rows.append([name, delay, "-" if moved is None else f"{moved - run.late_started_s:.1f}s", f"{before} -> {before + 1 if moved else before}",
                     ",".join(map(str, threads)), seen])
    print_table(["process", "log line after the third's own", "gauge moved after its start", "host_processes", "threads seen", "line"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
