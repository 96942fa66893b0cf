"""On a machine with CUDA: a worker on --device auto really trains on the GPU (its own metrics say so).

Skipped where there is no CUDA (CI has no GPU); bench/gpu_check.py measures throughput beside the CPU.
"""

from __future__ import annotations

import pytest
import torch

from harness.procs import ProcessGroup, try_scrape, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA on this machine: nothing to check"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "task",
    [
        ["--model", "rpcps.tasks:teacher_student_model", "--data", "rpcps.tasks:teacher_student_data"],
        ["--model", "rpcps.examples.charlm:model", "--data", "rpcps.examples.charlm:data"],
    ],
)
def test_a_worker_on_auto_trains_on_the_gpu(procs: ProcessGroup, task: list[str]) -> None:
    _, port, _ = procs.ps("ps", *task[:2])  # the server takes the model only
    worker, metrics_port = procs.worker("worker0", port, 0, 1, *task, "--steps", "100000", "--device", "auto")

    def stepping() -> dict[str, float] | None:
        assert worker.alive(), f"the worker exited with code {worker.returncode}"
        m = try_scrape(metrics_port)
        return m if m.get("rpcps_worker_steps_total", 0) >= 5 else None

    # The whole stderr, not the fixture's last lines: a device run is rare and short, and its one
    # failure so far (a bare StopIteration) came back without the frames that said where it arose.
    try:
        metrics = wait_until(stepping, 180, "the worker's first steps")
        assert metrics.get("rpcps_worker_device_memory_bytes", 0) > 0, f"the worker fell back to the CPU on a machine with CUDA: {metrics}"
        assert "on cuda" in worker.stderr()
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- {worker.name}'s whole stderr ---\n{worker.stderr()}") from None
