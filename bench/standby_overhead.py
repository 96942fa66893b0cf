"""What a hot standby costs: ``local --replicas 1`` against ``--replicas 2`` with synchronous and with
asynchronous replication, side by side.

    flock /tmp/rpcps-cpu.lock timeout 900 python -m bench.standby_overhead --rounds 2
    # the CTR task (sparse tables), synchronous replication only:
    flock /tmp/rpcps-cpu.lock timeout 900 python -m bench.standby_overhead --rounds 2 --only none sync \
        --model rpcps.examples.ctr:dlrm_model --data rpcps.examples.ctr:ctr_data --loss rpcps.examples.ctr:bce_loss \
        --server-args "--sparse-admit-count 2 --sparse-ttl 20000"

Runs the three configurations interleaved (none, sync, async, none, sync, async ...) on the same model
and data, so a machine that gets busier during the run hurts all alike, and prints one Markdown row
per run plus the ratios of the medians to the run without a standby. Asynchronous replication runs
with the product's default lag bound (``--max-replica-lag``). Throughput is the workers' steady steps
per second (sampled from their /metrics, start-up excluded); in async mode one step is one update.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.common import local_argv, print_table, run_local

CONFIGS = {
    "none": ["--replicas", "1"],
    "sync": ["--replicas", "2"],
    "async": ["--replicas", "2", "--replication", "async"],
}
"""Label -> the flags that make it (everything else is the product's default)."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="rpcps.tasks:mlp_5m")
    p.add_argument("--data", default="rpcps.tasks:mlp_5m_data")
    p.add_argument("--loss", default="mse")
    p.add_argument("--server-args", default="", help="more flags for every run, e.g. sparse settings (one string, split on spaces)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=150, help="steps per worker per run")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the three configurations")
    p.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), help="configurations to run")
    p.add_argument("--run-dir", type=Path, default=None)
    args = p.parse_args()
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="rpcps-standby-bench-"))
    rates: dict[str, list[float]] = {label: [] for label in args.only}
    rows = []
    for n in range(args.rounds):
        for label in args.only:
            run_dir = root / f"{label}-{n}"
            argv = local_argv(run_dir, model=args.model, data=args.data, workers=args.workers, steps=args.steps,
                              extra=[*CONFIGS[label], *args.server_args.split()], loss=args.loss)
            run = run_local(argv, run_dir)
            rate = run.steady_steps_per_s()
            rates[label].append(rate)
            rows.append([str(n), label, f"{rate:.1f}", str(run.summary.get("updates_applied"))])
            print(f"round {n}, standby {label}: {rate:.1f} updates/s", flush=True)
    print_table(["round", "standby", "updates/s (steady)", "updates applied"], rows)
    if "none" in rates:
        base = statistics.median(rates["none"])
        for label in (x for x in args.only if x != "none"):
            print(f"median with a {label} standby / without: {statistics.median(rates[label]) / base:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
