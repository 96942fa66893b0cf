"""Hand-started processes on one host share its cores and follow each other (rpcps.threads): no thread
flag, no thread environment; a late worker and a killed one change every budget at runtime; a cgroup
CPU quota of one core gives a budget of one."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.cgroups import CgroupUnavailable, cpu_quota_cgroup, enter_argv
from harness.procs import ENTRY, Proc, ProcessGroup, child_env, try_scrape, wait_until
from rpcps.cpu_limits import usable_cores

FOLLOW_S = 10.0
"""A budget is recomputed every second; this leaves room for a loaded test machine."""


def host_env(tmp_path: Path) -> dict[str, str]:
    """A child's environment without any thread setting, with a registry of this test's own."""
    env = child_env(RPCPS_HOST_DIR=str(tmp_path / "host"))
    env.pop("OMP_NUM_THREADS", None)
    return env


def gauges(port: int, role: str) -> tuple[int, int, int] | None:
    """(intra-op threads, host processes, usable cores) from a process's /metrics, once it answers."""
    values = try_scrape(port)
    keys = [f"rpcps_{role}_{name}" for name in ("intra_op_threads", "host_processes", "usable_cores")]
    return tuple(int(values[k]) for k in keys) if all(k in values for k in keys) else None  # type: ignore[return-value]


def sharing(proc: Proc, others: int) -> bool:
    return f"shared with {others} other rpcps process" in proc.stderr()


@pytest.mark.timeout(180)
def test_hand_started_processes_share_the_host_and_follow_a_late_worker_and_a_killed_one(procs: ProcessGroup, tmp_path: Path) -> None:
    env = host_env(tmp_path)
    _ps, port, ps_metrics = procs.ps("ps", env=env)
    workers = {}
    for i in range(2):
        workers[f"w{i}"] = procs.worker(f"w{i}", port, i, 3, "--steps", "1000000", env=env)
    ports = {"ps": (ps_metrics, "server"), **{n: (m, "worker") for n, (_, m) in workers.items()}}

    def all_read(n: int) -> dict[str, tuple[int, int, int]]:
        seen = {name: gauges(p, role) for name, (p, role) in ports.items()}
        return seen if all(g is not None and g[1] == n for g in seen.values()) else {}  # type: ignore[return-value]

    three = wait_until(lambda: all_read(3), 60, "three processes to count each other")
    cores = usable_cores().cores
    assert all(g[2] == cores for g in three.values()), three
    assert sum(three[w][0] for w in workers) <= max(cores, len(workers)), three  # the workers never ask for more than the cores
    assert all(sharing(procs[name], 2) for name in ports), procs.tails()

    late, late_metrics = procs.worker("w2", port, 2, 3, "--steps", "1000000", env=env)
    wait_until(lambda: gauges(late_metrics, "worker"), 60, "the late worker to serve /metrics")
    ports["w2"] = (late_metrics, "worker")
    four = wait_until(lambda: all_read(4), FOLLOW_S, "every process to count the late worker")
    assert sum(four[w][0] for w in ("w0", "w1", "w2")) <= max(cores, 3), four
    assert all(sharing(procs[name], 3) for name in ("ps", "w0", "w1")), procs.tails()
    assert all(re.search(r"intra-op threads (stay \d+|\d+ -> \d+) \(.*shared with 3 other", procs[n].stderr()) for n in ("ps", "w0", "w1"))

    late.kill()  # SIGKILL: no goodbye; its lock goes with it
    del ports["w2"]
    wait_until(lambda: all_read(3), FOLLOW_S, "every process to drop the killed worker")
    assert os.listdir(tmp_path / "host") and len(os.listdir(tmp_path / "host")) == 3


@pytest.fixture
def one_core_cgroup() -> Iterator[Path]:
    try:
        with cpu_quota_cgroup(1.0) as group:
            yield group  # the procs fixture reaps the processes in it first (fixtures tear down in reverse order)
    except CgroupUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.timeout(120)
def test_a_cpu_quota_of_one_core_gives_a_budget_of_one(one_core_cgroup: Path, procs: ProcessGroup, tmp_path: Path) -> None:
    ps, _, metrics = procs.ps("ps", env=host_env(tmp_path), program=enter_argv(one_core_cgroup, [sys.executable, str(ENTRY)]))
    threads, _, usable = wait_until(lambda: gauges(metrics, "server"), 60, "the server's /metrics")
    assert (threads, usable) == (1, 1), ps.tail()
    assert re.search(r"intra-op threads: 1 \(1 usable cores \(affinity \d+, cgroup CPU quota 1 cores\)", ps.stderr()), ps.tail()
    assert str(ps.pid) in (one_core_cgroup / "cgroup.procs").read_text().split()
