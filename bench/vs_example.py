#!/usr/bin/env python3
"""rpcps against the PyTorch RPC parameter-server example's design and the wire, side by side (not a test).

    python -m bench.vs_example                       # mlp_5m, 2 workers, ~3 min
    python -m bench.vs_example --model mlp_25m --workers 2 --steps 15

In one run, same model (``rpcps.tasks:<model>``, MSE, Adam on the server), same number of workers,
``--repeats`` times interleaved (best kept):

* **rpcps training**: ``trainer_entry.py local`` end to end (forward/backward, async pushes, pulls
  every step), updates/s over the steady part of the run (bench.common).
* **example design**: bench/example_design.py: a locked server, workers blocking in ``rpc_sync``
  with their gradients and getting all parameters back every step.
* **rpcps push path**: bench.push_throughput's "ours" (a real server taking pushes of precomputed
  gradients, no compute, 2 in flight per client).
* **wire**: bench.push_throughput's "raw" (a bare TensorPipe call of the same bytes, answered at once).

Printed: updates/s, gradient GB/s, and the ratios: rpcps training / example design, and rpcps push
path / wire (the share of the transport's speed the server keeps).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, child_env, local_argv, print_table, run_local
from bench.push_throughput import Setup, _measure
from rpcps.ports import free_port


def example_design(model: str, workers: int, steps: int) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, "-m", "bench.example_design", "--world", str(workers + 1), "--port", str(port),
            "--model", model, "--steps", str(steps)]
    procs = [subprocess.Popen([*argv, "--rank", str(r)], cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(workers + 1)]
    results = []
    try:
        for r, proc in enumerate(procs):
            out, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"example design rank {r} failed: {err.decode(errors='replace')[-2000:]}")
            if r > 0:
                results.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    rate = sum(x["steps"] / x["seconds"] for x in results)
    return {"updates_per_s": rate, "grad_gb_per_s": rate * results[0]["payload_bytes"] / 1e9}


def ours_training(model: str, workers: int, steps: int, root: Path, tag: str) -> dict[str, Any]:
    run_dir = root / f"ours-{tag}"
    r = run_local(local_argv(run_dir, model=f"rpcps.tasks:{model}", data=f"rpcps.tasks:{model}_data", workers=workers, steps=steps), run_dir)
    return {"updates_per_s": r.steady_steps_per_s(), "comm_fraction": r.communication_fraction()}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vs_example", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp_5m", choices=["mlp_5m", "mlp_25m"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60, help="training steps per worker (rpcps and example design)")
    p.add_argument("--seconds", type=float, default=4.0, help="timed window of the push-path and wire measurements")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rpcps-bench-vs-"))
    setup = Setup(args.model, args.workers, "uv", "basic", args.seconds, 2, 3)
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "example": [], "push": [], "wire": []}
    started = time.monotonic()
    for i in range(args.repeats):
        runs["ours"].append(ours_training(args.model, args.workers, args.steps, root, str(i)))
        runs["example"].append(example_design(args.model, args.workers, args.steps))
        runs["push"].append(_measure("ours", setup))
        runs["wire"].append(_measure("raw", setup))
        print(f"repeat {i}: ours {runs['ours'][-1]['updates_per_s']:.2f}/s, example {runs['example'][-1]['updates_per_s']:.2f}/s, "
              f"push {runs['push'][-1]['calls_per_s']:.2f}/s, wire {runs['wire'][-1]['calls_per_s']:.2f}/s", flush=True)
    best_ours = max(runs["ours"], key=lambda x: x["updates_per_s"])
    best_ex = max(runs["example"], key=lambda x: x["updates_per_s"])
    best_push = max(runs["push"], key=lambda x: x["calls_per_s"])
    best_wire = max(runs["wire"], key=lambda x: x["calls_per_s"])
    mb = best_push["payload_mb"]
    print(f"\n{args.model}, {mb:.1f} MB of fp32 gradient per push, {args.workers} workers, uv/basic, best of {args.repeats}, "
          f"{time.monotonic() - started:.0f}s")
    print_table(
        ["side", "updates/s", "gradient GB/s", "ratio"],
        [
            ["rpcps training (local, pull every step)", f"{best_ours['updates_per_s']:.2f}", f"{best_ours['updates_per_s'] * mb / 1e3:.2f}",
             f"{best_ours['updates_per_s'] / best_ex['updates_per_s']:.2f}x example design"],
            ["example design (lock + rpc_sync grads -> params)", f"{best_ex['updates_per_s']:.2f}", f"{best_ex['grad_gb_per_s']:.2f}", "1.00"],
            ["rpcps push path (no compute, no pulls)", f"{best_push['calls_per_s']:.2f}", f"{best_push['gb_per_s']:.2f}",
             f"{best_push['calls_per_s'] / best_wire['calls_per_s']:.2f} of wire"],
            ["wire: raw TensorPipe call, same bytes", f"{best_wire['calls_per_s']:.2f}", f"{best_wire['gb_per_s']:.2f}", "1.00"],
        ],
    )
    print(f"rpcps training: workers' communication fraction {best_ours['comm_fraction']:.2f}; "
          f"training gradient GB/s / wire GB/s = {best_ours['updates_per_s'] / best_wire['calls_per_s']:.2f}")
    print("all runs:", json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
