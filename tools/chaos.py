#!/usr/bin/env python3
"""Kill the server and workers of a local run at chosen or random points, then check recovery.

    python tools/chaos.py --kills 4 --seed 1               # random targets and points
    python tools/chaos.py --kill ps@300 --kill worker1@700  # chosen ones

Runs an undisturbed baseline first (unless --no-baseline) and compares final losses. Exit status 0
when every check of docs/FAULT_TOLERANCE.md holds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.faults import ChaosPlan, Kill, run_chaos


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=600, help="steps per worker")
    p.add_argument("--kills", type=int, default=3, help="random kills (ignored with --kill)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill", action="append", default=[], metavar="TARGET@VERSION", help="e.g. ps@300, worker0@500")
    p.add_argument("--checkpoint-every-updates", type=int, default=100)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--run-dir", type=Path, default=None)
    args = p.parse_args()
    common = {"workers": args.workers, "steps": args.steps, "checkpoint_every_updates": args.checkpoint_every_updates}
    if args.kill:
        kills = []
        for spec in args.kill:
            target, _, version = spec.partition("@")
            kills.append(Kill(target, int(version)))
        plan = ChaosPlan(kills=tuple(kills), **common)
    else:
        plan = ChaosPlan.random(args.kills, args.seed, **common)
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="rpcps-chaos-"))
    print(f"plan: {[f'{k.target}@{k.at_version}' for k in plan.kills]}; runs in {root}")
    baseline_loss = None
    if not args.no_baseline:
        base = run_chaos(ChaosPlan(**common), root / "baseline")
        baseline_loss = base.summary.get("final_loss")
        print(f"baseline: exit {base.exit_code}, final loss {baseline_loss}")
    result = run_chaos(plan, root / "chaos")
    problems = result.problems(plan)
    loss = result.summary.get("final_loss")
    print(f"chaos: exit {result.exit_code}, final version {result.ledger.final_version}, final loss {loss}")
    print(f"server starts {result.ledger.restarts}, updates lost per crash {result.ledger.updates_lost}")
    print("recovery (server kill -> next applied update): " + ", ".join(f"{r:.2f}s" for r in result.recovery_s))
    if baseline_loss is not None and loss is not None and abs(loss - baseline_loss) > 0.25 * baseline_loss:
        problems.append(f"final loss {loss:.4f} is not close to the undisturbed {baseline_loss:.4f}")
    for problem in problems:
        print("PROBLEM:", problem)
    print("OK" if not problems else f"{len(problems)} problems")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
