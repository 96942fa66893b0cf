#!/usr/bin/env python3
"""Final loss with top-k gradient sparsification (error feedback) against dense, same steps (not a test).

    python -m bench.topk_convergence                       # default task, 2 workers x 300 steps, ~2 min
    python -m bench.topk_convergence --steps 1000 --ratios 0.1,0.01,0.001

Runs the built-in task (rpcps.tasks teacher/student, cross-entropy, Adam) once dense and once per
``--topk-ratio``, same seeds and steps, and prints the server's initial and final loss (mean of
the first/last 10 pushes' losses) and each final loss relative to dense.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.common import REPO, print_table, run_local


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.topk_convergence", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ratios", default="0.1,0.01")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rpcps-bench-topk-"))
    rows, dense = [], None
    for ratio in [None, *(float(x) for x in args.ratios.split(","))]:
        run_dir = root / f"topk-{ratio}"
        argv = [sys.executable, str(REPO / "trainer_entry.py"), "local", "--workers", str(args.workers), "--steps", str(args.steps),
                "--run-dir", str(run_dir), "--summary-json", str(run_dir / "summary.json"), "--progress-s", "3600", "--log-level", "WARNING"]
        if ratio is not None:
            argv += ["--topk-ratio", str(ratio)]
        s = run_local(argv, run_dir).summary
        dense = dense if dense is not None else s["final_loss"]
        rows.append(["dense" if ratio is None else f"top-k {ratio}", f"{s['initial_loss']:.4f}", f"{s['final_loss']:.4f}",
                     f"{s['final_loss'] / dense:.2f}", str(s["updates_applied"])])
        print(f"{rows[-1][0]}: final loss {s['final_loss']:.4f}", flush=True)
    print(f"\ndefault task, {args.workers} workers x {args.steps} steps, async, Adam")
    print_table(["gradients", "initial loss", "final loss", "final / dense", "updates"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
