#!/usr/bin/env python3
"""CPU-seconds per update of every process, rpcps on its defaults against the example design (not a test).

    python -m bench.cpu_split --preset tiny     # the 22k MLP of bench.vs_example, 2 workers x 3000 steps
    python -m bench.cpu_split --preset 5m
    python -m bench.cpu_split --preset 5m --hand   # with rpcps started by hand beside local

On a machine whose cores are shared by every process of a run, updates/s can not exceed
cores / (the sum over the processes of CPU-seconds per update): once every core is busy, only less
CPU per update makes more updates. This reads utime+stime of every process of each side
(/proc/<pid>/stat) every ``--interval-s`` and divides what each spent between the moments the run
had made 15 % and 85 % of its updates (bench.common's steady part) by the updates made in between.
Sides as in bench.vs_example: the example design on TensorPipe's defaults, and ``local`` with the
optimizer matched to the example's SGD (its ``local`` parent and store processes included).

Two more columns say why a side makes fewer updates than its CPU per update allows: the cores it
kept busy (updates/s x CPU per update; the rest of the machine idled while its processes waited on
one another), and the context switches per update of all its processes (every thread's voluntary
and involuntary switches from /proc/<pid>/task/*/status: each hand-off of a message between threads,
each wait for the GIL or a lock, each sleep).
"""

from __future__ import annotations

import argparse
import bisect
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import REPO, STEADY_FROM, STEADY_TO, child_env, local_argv, print_table, run_by_hand
from bench.profile_run import cpu_seconds
from bench.vs_example import PRESETS, SGD_ARGS, Preset, example_argv
from rpcps.scrape import try_scrape

Usage = dict[str, tuple[float, int]]
"""(CPU-seconds, context switches) by process name."""


@dataclass
class CpuSamples:
    """(time.perf_counter(), usage by process name, updates so far or None) every interval."""

    rows: list[tuple[float, Usage, float | None]] = field(default_factory=list)

    def record(self, pids: dict[str, int], updates: float | None) -> None:
        usage = {name: (c, context_switches(pid)) for name, pid in pids.items() if (c := cpu_seconds(pid)) is not None}
        self.rows.append((time.perf_counter(), usage, updates))


def context_switches(pid: int) -> int:
    """Voluntary and involuntary context switches of every live thread of ``pid`` (0 once it is gone)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            lines = status.read_text().splitlines()
        except OSError:
            continue  # the thread ended meanwhile
        total += sum(int(line.split()[1]) for line in lines if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")))
    return total


@dataclass(frozen=True)
class Split:
    updates_per_s: float
    cpu_ms_per_update: dict[str, float]
    switches_per_update: dict[str, float]
    """Context switches of every thread of each process, per update."""

    @property
    def cores_busy(self) -> float:
        return self.updates_per_s * sum(self.cpu_ms_per_update.values()) / 1000


def steady_split(rows: list[tuple[float, Usage, float]]) -> Split:
    """Per-process CPU per update between the first sample at >= 15 % of the updates and the last at <= 85 %."""
    final = rows[-1][2]
    inside = [r for r in rows if STEADY_FROM * final <= r[2] <= STEADY_TO * final]
    if len(inside) < 2:
        raise RuntimeError(f"too few samples in the steady part ({len(inside)}); lower --interval-s or add --steps")
    (t0, use0, n0), (t1, use1, n1) = inside[0], inside[-1]
    updates = n1 - n0
    both = [name for name in use1 if name in use0]
    cpu = {name: 1000 * (use1[name][0] - use0[name][0]) / updates for name in both}
    switches = {name: (use1[name][1] - use0[name][1]) / updates for name in both}
    return Split(updates / (t1 - t0), cpu, switches)


def _sample_until(done: threading.Event, samples: CpuSamples, pids: Callable[[], dict[str, int]],
                  updates: Callable[[], float | None], interval_s: float) -> None:
    while not done.wait(interval_s):
        samples.record(pids(), updates())


def example_side(p: Preset, workers: int, interval_s: float) -> Split:
    argv = example_argv(p, workers, "default")
    procs = [subprocess.Popen([*argv, "--rank", str(r)], cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for r in range(workers + 1)]
    names = {"server": procs[0].pid, **{f"worker{r - 1}": procs[r].pid for r in range(1, workers + 1)}}
    samples, done = CpuSamples(), threading.Event()
    sampler = threading.Thread(target=_sample_until, args=(done, samples, lambda: names, lambda: None, interval_s), daemon=True)
    sampler.start()
    try:
        outs = [proc.communicate(timeout=900) for proc in procs]
    finally:
        done.set()
        sampler.join()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"the example design failed: {outs[0][1].decode(errors='replace')[-2000:]}")
    times = json.loads(outs[0][0].decode().strip().splitlines()[-1])["update_times"]
    return steady_split([(t, usage, float(bisect.bisect_right(times, t))) for t, usage, _ in samples.rows if usage]
                        + [(times[-1], {}, float(len(times)))])


def rpcps_side(p: Preset, workers: int, root: Path, interval_s: float, extra: list[str]) -> Split:
    run_dir = root / f"rpcps{len(list(root.iterdir()))}"
    run_dir.mkdir(parents=True)
    argv = local_argv(run_dir, model=p.model, data=p.data, loss=p.loss, workers=workers, steps=p.steps, extra=[*SGD_ARGS, *extra])
    proc = subprocess.Popen(argv, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    info: dict[str, dict] = {}

    def pids() -> dict[str, int]:
        try:
            info.update(json.loads((run_dir / "children.json").read_text()))
        except (OSError, ValueError):
            pass  # not written yet, or being rewritten
        return {"local": proc.pid, **{name: c["pid"] for name, c in info.items() if c.get("pid")}}

    def updates() -> float | None:
        port = info.get("ps", {}).get("metrics_port")
        return try_scrape(port).get("rpcps_server_updates_applied_total") if port else None

    samples, done = CpuSamples(), threading.Event()
    sampler = threading.Thread(target=_sample_until, args=(done, samples, pids, updates, interval_s), daemon=True)
    sampler.start()
    try:
        _, err = proc.communicate(timeout=900)
    finally:
        done.set()
        sampler.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"local failed ({proc.returncode}): {err.decode(errors='replace')[-2000:]}")
    return steady_split([(t, usage, n) for t, usage, n in samples.rows if n is not None])


def hand_side(p: Preset, workers: int, root: Path, interval_s: float) -> Split:
    """rpcps started by hand (bench.common.run_by_hand: no ``local``, every process's budget its own)."""
    samples = CpuSamples()
    run_by_hand(root / f"hand{len(list(root.iterdir()))}", model=p.model, data=p.data, loss=p.loss, workers=workers,
                steps=p.steps, extra=SGD_ARGS, interval_s=interval_s, on_sample=samples.record)
    return steady_split([(t, usage, n) for t, usage, n in samples.rows if n is not None])


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_split", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, help="steps per worker (default: the preset's)")
    parser.add_argument("--interval-s", type=float, default=0.25, help="how often CPU times (and rpcps's counter) are read")
    parser.add_argument("--hand", action="store_true", help="a side of rpcps started by hand (as bench.vs_example's 'hand')")
    parser.add_argument("--also", action="append", default=[], metavar="FLAGS",
                        help="an extra rpcps side with these flags added to its defaults, e.g. '--rpc-transports shm' "
                        "(an experiment, not a default: the table names the flags); repeatable")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    if args.steps:
        preset = Preset(preset.model, preset.data, preset.loss, args.steps)
    root = Path(tempfile.mkdtemp(prefix="rpcps-bench-cpu-"))
    sides = {
        "example design (TensorPipe defaults)": example_side(preset, args.workers, args.interval_s),
        "rpcps defaults, --optimizer sgd": rpcps_side(preset, args.workers, root, args.interval_s, []),
    }
    if args.hand:
        sides["rpcps by hand, --optimizer sgd"] = hand_side(preset, args.workers, root, args.interval_s)
    for flags in args.also:
        sides[f"rpcps, --optimizer sgd {flags}"] = rpcps_side(preset, args.workers, root, args.interval_s, flags.split())
    print(f"\n{preset.model}, {args.workers} workers x {preset.steps} steps, steady part (15-85 %) of one run each")
    rows = []
    for name, split in sides.items():
        total = sum(split.cpu_ms_per_update.values())
        parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(split.cpu_ms_per_update.items()) if v >= 0.0005)
        switches = ", ".join(f"{k} {v:.1f}" for k, v in sorted(split.switches_per_update.items()) if v >= 0.05)
        rows.append([name, f"{split.updates_per_s:.1f}", parts, f"{total:.3f}", f"{split.cores_busy:.2f}", switches])
    print_table(["side", "updates/s", "CPU ms per update, by process", "sum", "cores busy", "context switches per update, by process"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
