#!/usr/bin/env python3
"""Where the CPU goes in a training run: py-spy of the server and one worker, CPU-seconds per update (not a test).

    python -m bench.profile_run                                    # mlp_5m, 2 workers
    python -m bench.profile_run --model mlp_25m --steps 40 --seconds 8
    python -m bench.profile_run --model tiny --steps 3000 --optimizer sgd   # bench.vs_example's tiny preset
    python -m bench.profile_run --replicas 2                       # a primary and its synchronous standby
    python -m bench.profile_run --model tiny --steps 400 --also "--mode local-steps --local-steps 8"

Runs ``local`` (bench.common.run_local) and, once its processes are up, records ``--seconds`` of
py-spy samples (``pip install py-spy``; active threads only, native frames off) of shard 0 (both of its
replicas with ``--replicas 2``) and of worker0, then prints each one's hottest functions by own time. Also reads utime+stime of every
child from /proc/<pid>/stat just before the run ends and prints CPU-seconds per update: on a
machine with C cores, updates/s can not exceed C / (sum of CPU-seconds per update).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import local_argv, run_local
from bench.vs_example import PRESETS, SGD_LR

_PY_SPY = str(Path(sys.executable).parent / "py-spy") if (Path(sys.executable).parent / "py-spy").exists() else "py-spy"
"""The py-spy installed beside this interpreter (a virtualenv's bin is often not on PATH), else PATH's."""


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def top_frames(raw: Path, n: int) -> list[tuple[str, float]]:
    """Own-time share of the leaf frame of each collapsed stack py-spy wrote."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            counts[stack.split(";")[-1]] += int(count)
    total = sum(counts.values()) or 1
    return [(frame, c / total) for frame, c in counts.most_common(n)]


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_run", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp_5m", choices=["mlp_5m", "mlp_25m", "tiny"],
                   help="tiny: bench.vs_example's 22k MLP preset (its data and loss)")
    p.add_argument("--optimizer", help="--optimizer for local (sgd: with the example's lr); default: local's")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--seconds", type=float, default=8.0, help="py-spy recording length")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--gil", action="store_true", help="sample only the thread holding the GIL (py-spy --gil): where "
                   "Python time goes, without threads py-spy wrongly counts as active (seen under gVisor)")
    p.add_argument("--delay", type=float, default=4.0, help="seconds after the processes are up before recording")
    p.add_argument("--replicas", type=int, default=1, choices=[1, 2])
    p.add_argument("--replication", default="sync", choices=["sync", "async"], help="with --replicas 2")
    p.add_argument("--also", default="", metavar="FLAGS",
                   help="more `rpcps local` flags, e.g. '--mode local-steps --local-steps 8' (--steps counts rounds then)")
    args = p.parse_args()
    profiled = ["ps", "ps_b", "worker0"] if args.replicas == 2 else ["ps", "worker0"]
    extra = ["--replicas", str(args.replicas)] + (["--replication", args.replication] if args.replicas == 2 else [])
    root = Path(tempfile.mkdtemp(prefix="rpcps-bench-prof-"))
    run_dir = root / "run"
    cpu: dict[str, float] = {}
    done = threading.Event()

    def profile() -> None:
        children = run_dir / "children.json"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not done.is_set():
            try:
                info = json.loads(children.read_text())
                if all(info.get(k, {}).get("pid") for k in profiled):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        else:
            return
        time.sleep(args.delay)  # past start-up and registration
        spies = [subprocess.Popen([_PY_SPY, "record", "--pid", str(info[k]["pid"]), "--duration", str(int(args.seconds)),
                                   "--rate", "200", "--format", "raw", "--nonblocking", *(["--gil"] if args.gil else []),
                                   "-o", str(root / f"{k}.txt")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for k in profiled]
        for s in spies:
            s.wait()
        while not done.is_set():  # keep the newest CPU totals until the processes exit
            for name, child in info.items():
                value = cpu_seconds(child["pid"]) if child.get("pid") else None
                if value is not None:
                    cpu[name] = value
            time.sleep(0.2)

    t = threading.Thread(target=profile, daemon=True)
    t.start()
    if args.model == "tiny":
        preset = PRESETS["tiny"]
        model, data, loss = preset.model, preset.data, preset.loss
    else:
        model = f"rpcps.tasks:{args.model}"
        data, loss = f"{model}_data", "mse"
    if args.optimizer:
        extra += ["--optimizer", args.optimizer, *(["--lr", str(SGD_LR)] if args.optimizer == "sgd" else [])]
    extra += shlex.split(args.also)
    argv = local_argv(run_dir, model=model, data=data, loss=loss, workers=args.workers, steps=args.steps, extra=extra)
    r = run_local(argv, run_dir)
    done.set()
    t.join()
    updates = r.summary["updates_applied"]
    print(f"{args.model}, {args.workers} workers x {args.steps} steps: {r.steady_steps_per_s():.2f} updates/s steady, "
          f"communication fraction {r.communication_fraction():.3f}")
    per_update = {k: 1000 * v / updates for k, v in sorted(cpu.items())}
    print("CPU ms per update (whole run incl. start-up): " + ", ".join(f"{k} {v:.1f}" for k, v in per_update.items())
          + f"; sum {sum(per_update.values()):.1f} -> at most {2000 / sum(per_update.values()):.1f} updates/s on 2 cores")
    for k in profiled:
        raw = root / f"{k}.txt"
        if raw.exists():
            print(f"\n{k}: hottest functions by own time (py-spy, active threads)")
            for frame, share in top_frames(raw, args.top):
                print(f"  {100 * share:5.1f}%  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
