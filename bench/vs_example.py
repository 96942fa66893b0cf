#!/usr/bin/env python3
"""rpcps against the PyTorch RPC parameter-server example's design and the one-process limit, side by side (not a test).

    python -m bench.vs_example                      # the 5M MLP, batch 64, 2 workers x 300 steps, ~4 min
    python -m bench.vs_example --preset tiny        # the 22k teacher-student MLP, batch 64, 2 workers x 3000 steps
    python -m bench.vs_example --sides example,local-sgd,hand   # with rpcps started by hand, without local
    python -m bench.vs_example --preset tiny --sides one,example,local-steps   # local steps (H=8; --local-steps 8,16: a side per H) at equal samples
    python -m bench.vs_example --preset charlm --workers 1 --sides one,local-sgd   # the byte-level transformer, one worker
    python -m bench.vs_example --sides example,local-adam,local-adam-args --local-args "--max-in-flight 1"   # a setting's cost

In one run, ``--repeats`` times interleaved (the best of each side kept), same model, data, loss and
number of updates:

* **one process**: bench/one_process.py, forward + backward + SGD in one plain loop on torch's
  default threads (every core): the most this machine can do, with no server and no wire.
* **example design**: bench/example_design.py with ``--workers`` workers: a locked SGD server,
  workers blocking in ``rpc_sync`` with their gradients and getting every parameter back; every
  process calls ``torch.set_num_threads(1)`` itself. Once on TensorPipe's default options (what the
  example runs with) and once over uv/basic (``--example-transports``).
* **rpcps, SGD**: ``trainer_entry.py local`` on its defaults, only the optimizer matched to the
  example's (``--optimizer sgd --lr 0.05``).
* **rpcps, defaults**: ``local`` with nothing set but the model, data and loss (Adam).
* **rpcps by hand, SGD** (``--sides`` with ``hand``): a server and the workers started as separate
  processes, the way README's "Running it on a cluster" starts them on one host (bench.common.run_by_hand):
  no ``local``, no thread flag or environment; each process finds its neighbours itself (rpcps.threads).

Nothing here sets threads, transports or any other setting for rpcps: it measures what a user
who changes nothing gets. Every side is measured the same way (bench.common.steady_rate): updates
per second between the moments it had applied 15 % and 85 % of its updates, from the server's
``rpcps_server_updates_applied_total`` (sampled every 0.5 s: a scrape costs the server CPU) for rpcps and from the time of every
update for the example and the one process. That leaves out start-up and the tail on every side.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.common import local_argv, print_table, run_by_hand, run_local, run_ranks, steady_rate
from rpcps.ports import free_port
from worker.config import DEFAULT_LOCAL_STEPS


@dataclass(frozen=True)
class Preset:
    model: str
    data: str
    loss: str
    steps: int
    """Steps per worker (the one process makes workers x steps)."""


PRESETS = {
    "5m": Preset("rpcps.tasks:mlp_5m", "bench.big_batch:mlp_5m_data_64", "mse", 300),
    "tiny": Preset("rpcps.tasks:teacher_student_model", "rpcps.tasks:teacher_student_data", "cross_entropy", 3000),
    "charlm": Preset("rpcps.examples.charlm:model", "rpcps.examples.charlm:data", "cross_entropy", 300),
}
SGD_LR = 0.05
"""The example's SGD learning rate (stable on both presets' data)."""


FINAL_LOSS: dict[str, list[float]] = {}
"""Per side that reports one, the final training loss of each run (the one process, local steps)."""


def one_process(p: Preset, workers: int) -> float:
    argv = [sys.executable, "-m", "bench.one_process", "--model", p.model, "--data", p.data, "--loss", p.loss,
            "--lr", str(SGD_LR), "--steps", str(workers * p.steps)]
    report = run_ranks(argv, 1)
    FINAL_LOSS.setdefault("one process (limit)", []).append(report["final_loss"])
    return steady_rate([(t, i + 1) for i, t in enumerate(report["update_times"])])


def example_argv(p: Preset, workers: int, transport: str) -> list[str]:
    """bench.example_design's command line for ``p`` (each rank adds ``--rank R``)."""
    return [sys.executable, "-m", "bench.example_design", "--world", str(workers + 1), "--port", str(free_port()),
            "--model", p.model, "--data", p.data, "--loss", p.loss, "--lr", str(SGD_LR), "--steps", str(p.steps),
            "--transport", transport]
def example_design(p: Preset, workers: int, transport: str) -> float:
    return steady_rate([(t, i + 1) for i, t in enumerate(run_ranks(example_argv(p, workers, transport), workers + 1)["update_times"])])


SGD_ARGS = ["--optimizer", "sgd", "--lr", str(SGD_LR)]
"""The one setting the comparison changes in rpcps: the example's optimizer."""


def rpcps(p: Preset, workers: int, root: Path, tag: str, extra: list[str]) -> float:
    run_dir = root / tag
    argv = local_argv(run_dir, model=p.model, data=p.data, loss=p.loss, workers=workers, steps=p.steps, extra=extra)
    return run_local(argv, run_dir, interval_s=0.5, scrape_workers=False).steady_updates_per_s()


def local_steps_side(h: int) -> str:
    return f"rpcps --mode local-steps --local-steps {h} (batches/s)"


def rpcps_local_steps(p: Preset, workers: int, root: Path, tag: str, side: str, h: int, more: list[str]) -> float:
    """Equal samples: steps / H rounds of H batches each. Returns batches/s (updates/s x H), the
    unit of the other sides' updates/s (one batch each); records the workers' final loss under ``side``."""
    run_dir = root / tag
    extra = ["--mode", "local-steps", "--local-steps", str(h), *more]
    argv = local_argv(run_dir, model=p.model, data=p.data, loss=p.loss, workers=workers, steps=p.steps // h, extra=extra)
    run = run_local(argv, run_dir, interval_s=0.5, scrape_workers=False)
    losses = [w["final_loss"] for w in run.summary["workers"]]
    FINAL_LOSS.setdefault(side, []).append(sum(losses) / len(losses))
    return run.steady_updates_per_s() * h


def rpcps_by_hand(p: Preset, workers: int, root: Path, tag: str, extra: list[str]) -> float:
    run = run_by_hand(root / tag, model=p.model, data=p.data, loss=p.loss, workers=workers, steps=p.steps, extra=extra)
    return run.steady_updates_per_s()


SIDES = ("one", "example", "local-sgd", "local-adam", "local-adam-unpredicted", "local-adam-args", "hand", "local-steps",
         "local-steps-args")
"""What ``--sides`` may name: the one process, the example design (each of --example-transports),
``local`` with SGD, with its defaults, with its defaults but weight prediction off (what the
default staleness remedy costs), with its defaults and ``--local-args`` (what another setting
costs), rpcps started by hand with SGD (as README's cluster section starts it, from one shell), and
``local`` in local-steps mode (H inner AdamW steps per push, equal samples), on its defaults and with
``--local-args``."""


def _h_list(text: str) -> list[int]:
    try:
        hs = [int(h) for h in text.split(",")]
    except ValueError:
        hs = []
    if not hs or min(hs) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: whole numbers >= 1, comma-separated (e.g. 8,16)")
    return hs


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vs_example", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="5m")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, help="steps per worker (default: the preset's)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--example-transports", default="default,uv", help="the example design's TensorPipe options: default, uv")
    parser.add_argument("--sides", default="one,example,local-sgd,local-adam", help=f"comma-separated, of {','.join(SIDES)}")
    parser.add_argument("--local-steps", type=_h_list, default=[DEFAULT_LOCAL_STEPS],
                        metavar="H[,H...]", help=f"H of the local-steps sides, a side per H (default: the product's, {DEFAULT_LOCAL_STEPS})")
    parser.add_argument("--local-args", default="", help="`rpcps local` flags of the local-adam-args or local-steps-args side, "
                        "e.g. '--max-in-flight 1'")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    if args.steps:
        preset = Preset(preset.model, preset.data, preset.loss, args.steps)
    wanted = args.sides.split(",")
    if not set(wanted) <= set(SIDES) or not {"example", "one"} & set(wanted):
        parser.error(f"--sides must name the example or the one process (what the others are compared with), of {','.join(SIDES)}")
    if bool({"local-adam-args", "local-steps-args"} & set(wanted)) != bool(args.local_args):
        parser.error("--sides local-adam-args or local-steps-args and --local-args go together (the side runs `local` with those flags)")
    root = Path(tempfile.mkdtemp(prefix="rpcps-bench-vs-"))
    sides: dict[str, Callable[[int], float]] = {}
    if "one" in wanted:
        sides["one process (limit)"] = lambda i: one_process(preset, args.workers)
    for t in args.example_transports.split(",") if "example" in wanted else []:
        sides[f"example design ({t})"] = lambda i, t=t: example_design(preset, args.workers, t)
    if "local-sgd" in wanted:
        sides["rpcps defaults, --optimizer sgd"] = lambda i: rpcps(preset, args.workers, root, f"sgd-{i}", SGD_ARGS)
    if "local-adam" in wanted:
        sides["rpcps defaults (Adam)"] = lambda i: rpcps(preset, args.workers, root, f"adam-{i}", [])
    if "local-adam-unpredicted" in wanted:
        sides["rpcps defaults (Adam), --predict-ahead 0"] = lambda i: rpcps(preset, args.workers, root, f"adam-np-{i}", ["--predict-ahead", "0"])
    if "local-adam-args" in wanted:
        extra = shlex.split(args.local_args)
        sides[f"rpcps defaults (Adam), {args.local_args}"] = lambda i: rpcps(preset, args.workers, root, f"adam-args-{i}", extra)
    for h in args.local_steps:
        ls_side = local_steps_side(h)
        if "local-steps" in wanted:
            sides[ls_side] = lambda i, h=h, side=ls_side: rpcps_local_steps(preset, args.workers, root, f"local-steps-{h}-{i}", side, h, [])
        if "local-steps-args" in wanted:
            name = f"{ls_side}, {args.local_args}"
            sides[name] = lambda i, h=h, name=name: rpcps_local_steps(
                preset, args.workers, root, f"local-steps-args-{h}-{i}", name, h, shlex.split(args.local_args)
            )
    if "hand" in wanted:
        sides["rpcps by hand, --optimizer sgd"] = lambda i: rpcps_by_hand(preset, args.workers, root, f"hand-{i}", SGD_ARGS)
    runs: dict[str, list[float]] = {name: [] for name in sides}
    started = time.monotonic()
    for i in range(args.repeats):
        for name, measure in sides.items():
            runs[name].append(measure(i))
        print(f"repeat {i}: " + ", ".join(f"{name} {r[-1]:.1f}" for name, r in runs.items()), flush=True)
    best = {name: max(r) for name, r in runs.items()}
    example = max((v for name, v in best.items() if name.startswith("example")), default=float("nan"))
    limit = best.get("one process (limit)", float("nan"))
    print(f"\n{preset.model} ({preset.data}, {preset.loss}), {args.workers} workers x {preset.steps} steps, "
          f"steady updates/s (15-85 %), best of {args.repeats}, {time.monotonic() - started:.0f}s")
    print_table(
        ["side", "updates/s", "vs example design", "of one-process limit"],
        [[name, f"{v:.1f}", f"{v / example:.2f}x", f"{v / limit:.2f}"] for name, v in best.items()],
    )
    if "rpcps defaults, --optimizer sgd" in best and "rpcps defaults (Adam)" in best:
        print(f"rpcps Adam / rpcps SGD: {best['rpcps defaults (Adam)'] / best['rpcps defaults, --optimizer sgd']:.2f}")
    for name, losses in FINAL_LOSS.items():
        print(f"final training loss, {name}: " + ", ".join(f"{v:.4f}" for v in losses))
    print("the example design's figure is its best transport")
    print("all runs:", json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
