#!/usr/bin/env python3
"""Crash the server and workers of a local run at chosen or random points, then check recovery.

    python tools/chaos.py --kills 4 --seed 1                 # random crashes from one seed
    python tools/chaos.py --kills 8 --seeds 20 --seed 100   # 20 seeds in a row (100..119)
    python tools/chaos.py --kill ps@300 --kill worker1@700   # chosen ones
    python tools/chaos.py --replicas 2 --kills 10 --pace-s 0.04 --steps 1600   # failovers of a hot standby
    python tools/chaos.py --every-role 3 --pairs 3 --pace-s 0.05 --steps 3000 --no-baseline   # every role, pairs too
    python tools/chaos.py --ctr --replicas 2 --steps 300 --kill primary@80 --kill primary@180   # sparse tables: AUC too

Runs an undisturbed baseline first (unless --no-baseline) and compares final losses (with --ctr,
also the held-out AUC of each run's final snapshot). Prints each
seed's plan and outcome; exit status 0 when every check of docs/FAULT_TOLERANCE.md held for every seed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.faults import EVALUATOR_ARGS, ChaosPlan, ChaosResult, Kill, run_chaos


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=600, help="steps per worker")
    p.add_argument("--kills", type=int, default=3, help="random crashes per run (ignored with --kill)")
    p.add_argument("--seed", type=int, default=0, help="the (first) seed of the random plans")
    p.add_argument("--seeds", type=int, default=1, help="run this many seeds in a row, from --seed on")
    p.add_argument("--kill", action="append", default=[], metavar="TARGET@VERSION", help="e.g. ps@300, worker0@500")
    p.add_argument("--checkpoint-every-updates", type=int, default=100)
    p.add_argument("--replicas", type=int, default=1, help="2: a hot standby; random kills then hit the serving primary")
    p.add_argument("--pace-s", type=float, default=None, help="at most one batch per worker per this many seconds "
                   "(the paced test data), so a run lasts long enough for its kills")
    p.add_argument("--max-replica-lag", type=int, default=None, metavar="N",
                   help="with --replicas 2: asynchronous replication with this lag bound (default: synchronous)")
    p.add_argument("--model", default=None, help="a model other than the built-in task (e.g. rpcps.tasks:mlp_5m)")
    p.add_argument("--data", default=None, help="its data (e.g. rpcps.tasks:mlp_5m_data); --pace-s paces the built-in task only")
    p.add_argument("--ctr", action="store_true", help="the built-in CTR task (sparse tables, with admission and a TTL); "
                   "prints each run's held-out AUC")
    p.add_argument("--every-role", type=int, default=0, metavar="ROUNDS",
                   help="kill every role ROUNDS times in random order: each worker, the primary, the standby, the "
                   "coordinator and an evaluator (implies --replicas 2 and starts the evaluator)")
    p.add_argument("--pairs", type=int, default=0, help="with --every-role: also kill the primary and the coordinator at once, N times")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--run-dir", type=Path, default=None)
    args = p.parse_args()
    extra: tuple[str, ...] = ()
    if args.pace_s is not None:
        os.environ["RPCPS_TEST_BATCH_INTERVAL_S"] = str(args.pace_s)
        extra = ("--data", "tests.integration.paced_data:paced_data")
    if args.model is not None:
        extra = ("--model", args.model, "--loss", "mse", *(("--data", args.data) if args.data else ()))
    if args.ctr:
        extra = CTR_ARGS
    common = {"workers": args.workers, "steps": args.steps, "checkpoint_every_updates": args.checkpoint_every_updates,
              "replicas": args.replicas, "extra_args": extra, "timeout_s": max(240.0, 4.0 * args.steps * (args.pace_s or 0.0)),
              "max_replica_lag": args.max_replica_lag}
    if args.every_role:
        common["replicas"] = 2
        common["extra_args"] = (*extra, *EVALUATOR_ARGS)
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="rpcps-chaos-"))
    baseline_loss = baseline_auc = None
    if not args.no_baseline:
        base = run_chaos(ChaosPlan(**common), root / "baseline")
        baseline_loss = base.summary.get("final_loss")
        print(f"baseline: exit {base.exit_code}, final loss {baseline_loss}", flush=True)
        if args.ctr:
            baseline_auc = _ctr_auc(root / "baseline", args.steps)
            print(f"baseline: held-out AUC {baseline_auc:.4f}", flush=True)
    if args.every_role:
        plans = {seed: ChaosPlan.every_role(args.every_role, args.pairs, seed, **common) for seed in range(args.seed, args.seed + args.seeds)}
    elif args.kill:
        kills = tuple(Kill(target, int(version)) for target, _, version in (spec.partition("@") for spec in args.kill))
        plans = {args.seed: ChaosPlan(kills=kills, **common)}
    else:
        plans = {seed: ChaosPlan.random(args.kills, seed, **common) for seed in range(args.seed, args.seed + args.seeds)}
    failed = []
    for seed, plan in plans.items():
        print(f"seed {seed}: plan {[str(k) for k in plan.kills]}; runs in {root / f'seed-{seed}'}", flush=True)
        result = run_chaos(plan, root / f"seed-{seed}")
        problems = result.problems(plan)
        loss = result.summary.get("final_loss")
        if baseline_loss is not None and loss is not None and abs(loss - baseline_loss) > 0.1 * baseline_loss:
            problems.append(f"final loss {loss:.4f} is not within 10% of the undisturbed {baseline_loss:.4f}")
        _report(seed, result, problems)
        if args.ctr:
            auc = _ctr_auc(root / f"seed-{seed}", args.steps)
            versus = f" ({auc - baseline_auc:+.4f} against the baseline)" if baseline_auc is not None else ""
            print(f"seed {seed}: held-out AUC {auc:.4f}{versus}", flush=True)
        if problems:
            failed.append(seed)
    print(f"{len(plans) - len(failed)} of {len(plans)} seeds OK" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


CTR_ARGS = (
    "--model", "rpcps.examples.ctr:dlrm_model", "--data", "rpcps.examples.ctr:ctr_data_small", "--loss", "rpcps.examples.ctr:bce_loss",
    "--sparse-admit-count", "2", "--sparse-ttl", "200", "--sparse-evict-every-s", "0.5",
)


def _ctr_auc(run_dir: Path, steps: int) -> float:
    """Held-out AUC of the CTR model in the run's newest snapshot (the batches after the ones trained on)."""
    from harness.sparse_eval import model_from_snapshot
    from rpcps.examples import ctr

    model = model_from_snapshot(run_dir / "checkpoints", ctr.dlrm_model)
    return ctr.evaluate(model, ctr.eval_batches(8, 512, at_batch=steps))["auc"]


def _report(seed: int, result: ChaosResult, problems: list[str]) -> None:
    ledger = result.ledger
    print(f"seed {seed}: exit {result.exit_code}, final version {ledger.final_version}, final loss {result.summary.get('final_loss')}")
    print(f"seed {seed}: server starts {ledger.restarts}, updates lost per crash {ledger.updates_lost}, updates applied "
          f"during a snapshot write: worst {ledger.worst_write_updates}")
    recovery = result.recovery_s
    print(f"seed {seed}: recovery (server crash -> next applied update): " + ", ".join(f"{r:.3f}s" for r in recovery))
    if recovery:
        print(f"seed {seed}: recovery median {statistics.median(recovery):.3f}s, worst {max(recovery):.3f}s over {len(recovery)} crashes; "
              f"failovers (promotions) {len(ledger.promotions)}, digests compared {ledger.digests_compared}")
    if ledger.failover_losses or result.worst_unreplicated > 0:
        print(f"seed {seed}: asynchronous replication: versions lost per failover {ledger.failover_losses}, most entries the "
              f"primary was seen ahead of its standby {result.worst_unreplicated:.0f}")
    for note in result.notes:
        print(f"seed {seed}: note: {note}")
    for problem in problems:
        print(f"seed {seed}: PROBLEM: {problem}")
    print(f"seed {seed}: " + ("OK" if not problems else f"{len(problems)} problems"), flush=True)


if __name__ == "__main__":
    sys.exit(main())
