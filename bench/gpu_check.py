"""Each example with its workers on the GPU, checked from the workers' own metrics, beside a CPU run.

    python -m bench.gpu_check                       # both examples, 2 workers, 200 steps each
    python -m bench.gpu_check --examples digits --steps 100

For each example and device (cuda, then cpu) it runs ``rpcps local`` and, while the workers train,
reads every worker's /metrics (ports from the run's ``children.json``): the run on cuda fails the
check unless every worker reported ``rpcps_worker_device_memory_bytes`` > 0 (a worker that silently
fell back to the CPU reports 0). Throughput is samples per second per worker, from the workers'
summaries (steps x batch size / wall seconds, start-up included). Prints a markdown table on stderr
and one JSON object on stdout; exits 1 when a check failed, 2 when there is no CUDA here.
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

import torch

from bench.common import emit_json
from rpcps.scrape import try_scrape

REPO = Path(__file__).resolve().parents[1]
BATCH = {"digits": 32, "charlm": 32}


def run(example: str, device: str, workers: int, steps: int, work: Path) -> dict[str, Any]:
    module = f"rpcps.examples.{example}"
    run_dir = work / f"{example}-{device}"
    argv = [
        sys.executable, str(REPO / "trainer_entry.py"), "local", "--workers", str(workers), "--steps", str(steps),
        "--model", f"{module}:model", "--data", f"{module}:data", "--loss", "cross_entropy", "--device", device,
        "--run-dir", str(run_dir), "--summary-json", str(run_dir / "summary.json"), "--progress-s", "30",
    ]
    local = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak: dict[str, float] = {}
    while local.poll() is None:
        try:
            children = json.loads((run_dir / "children.json").read_text())
        except (OSError, ValueError):
            children = {}
        for name, info in children.items():
            if name.startswith("worker"):
                memory = try_scrape(info["metrics_port"]).get("rpcps_worker_device_memory_bytes")
                if memory is not None:
                    peak[name] = max(peak.get(name, 0.0), memory)
        time.sleep(0.2)
    if local.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {local.returncode}; logs in {run_dir}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rates = [w["steps"] * BATCH[example] / w["wall_seconds"] for w in summary["workers"]]
    return {
        "example": example, "device": device, "workers": workers, "steps": steps,
        "samples_per_second_per_worker": sum(rates) / len(rates),
        "max_device_memory_bytes": peak,
        "gpu_used": len(peak) == workers and all(v > 0 for v in peak.values()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", default="digits,charlm")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA on this machine: nothing to check", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="rpcps-gpu-") as work:
        for example in a.examples.split(","):
            for device in ("cuda", "cpu"):
                results.append(run(example, device, a.workers, a.steps, Path(work)))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print("| example | device | samples/s per worker | most device memory in use, per worker |\n|---|---|---|---|", file=sys.stderr)
    for r in results:
        memory = ", ".join(f"{v / 2**20:.1f} MiB" for v in r["max_device_memory_bytes"].values())
        print(f"| {r['example']} | {r['device']} | {r['samples_per_second_per_worker']:.0f} | {memory} |", file=sys.stderr)
    failed = [r for r in results if r["device"] == "cuda" and not r["gpu_used"]]
    for r in failed:
        print(f"FAILED: {r['example']} workers on cuda reported no device memory: {r['max_device_memory_bytes']}", file=sys.stderr)
    emit_json({"gpu": torch.cuda.get_device_name(0), "results": results})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
