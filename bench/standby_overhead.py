"""What a synchronous hot standby costs: ``local --replicas 1`` against ``--replicas 2``, side by side.

    flock /tmp/rpcps-cpu.lock timeout 900 python -m bench.standby_overhead --rounds 2

Runs the two configurations interleaved (A B A B ...) on the same model and data, so a machine that
gets busier during the run hurts both alike, and prints one Markdown row per run plus the ratio of
the medians. Throughput is the workers' steady steps per second (sampled from their /metrics, start-up
excluded); in async mode one step is one update.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.common import local_argv, print_table, run_local


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="rpcps.tasks:mlp_5m")
    p.add_argument("--data", default="rpcps.tasks:mlp_5m_data")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=150, help="steps per worker per run")
    p.add_argument("--rounds", type=int, default=2, help="A/B pairs")
    p.add_argument("--run-dir", type=Path, default=None)
    args = p.parse_args()
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="rpcps-standby-bench-"))
    rates: dict[int, list[float]] = {1: [], 2: []}
    rows = []
    for n in range(args.rounds):
        for replicas in (1, 2):
            run_dir = root / f"r{replicas}-{n}"
            argv = local_argv(run_dir, model=args.model, data=args.data, workers=args.workers, steps=args.steps,
                              extra=["--replicas", str(replicas)])
            run = run_local(argv, run_dir)
            rate = run.steady_steps_per_s()
            rates[replicas].append(rate)
            rows.append([str(n), str(replicas), f"{rate:.1f}", str(run.summary.get("updates_applied"))])
            print(f"round {n}, replicas {replicas}: {rate:.1f} updates/s", flush=True)
    print_table(["round", "replicas", "updates/s (steady)", "updates applied"], rows)
    ratio = statistics.median(rates[2]) / statistics.median(rates[1])
    print(f"median with a synchronous standby / without: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
