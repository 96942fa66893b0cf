"""Every role chooses its intra-op threads the same way: a setting pins them, else the host's cores are
shared by what each rpcps process uses (rpcps.threads); ``local`` leaves the choice to its children."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from cli.local import Supervisor
from cli.main import parse
from harness.procs import wait_until
from rpcps import threads
from rpcps.cpu_limits import UsableCores
from rpcps.host_registry import Entry, HostRegistry
from rpcps.threads import GPU_WORKER_THREADS, HostBudget, omp_num_threads, pinned, share


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "RPCPS_THREADS", "TORCHELASTIC_RUN_ID", "RPCPS_HOST_DIR"):
        monkeypatch.delenv(key, raising=False)


def entry(role: str = "worker", kind: str = "compute", use: float = 1.0, threads: int = 1) -> Entry:
    return Entry(pid=1, role=role, kind=kind, started=0.0, use=use, threads=threads)


def server(use: float = 0.05) -> Entry:
    return entry("server", "light", use)


# ---------------------------------------------------------------- what pins the threads


def test_the_flag_beats_omp_num_threads() -> None:
    assert pinned(3, {"OMP_NUM_THREADS": "1"}) == threads.ThreadBudget(3, "--threads")


def test_omp_num_threads_pins_when_set_by_someone() -> None:
    assert pinned(None, {"OMP_NUM_THREADS": "2"}) == threads.ThreadBudget(2, "OMP_NUM_THREADS")
    assert pinned(None, {}) is None


def test_torchruns_blanket_default_of_one_thread_does_not_pin() -> None:
    torchrun = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "abc", "LOCAL_WORLD_SIZE": "4"}
    assert omp_num_threads(torchrun) is None
    assert omp_num_threads({**torchrun, "OMP_NUM_THREADS": "3"}) == 3  # a user's own choice under torchrun
    assert omp_num_threads({**torchrun, "LOCAL_WORLD_SIZE": "1"}) == 1  # torchrun sets nothing for one process
    assert omp_num_threads({"OMP_NUM_THREADS": "1"}) == 1  # by hand: a choice


@pytest.mark.parametrize("bad", ["", "0", "-2", "two"])
def test_a_meaningless_omp_num_threads_is_ignored(bad: str) -> None:
    assert pinned(None, {"OMP_NUM_THREADS": bad}) is None


# ---------------------------------------------------------------- shares


def test_alone_a_worker_takes_every_core() -> None:
    assert share(8, entry(), [], None) == 8


def test_a_waiting_server_leaves_both_cores_to_one_worker() -> None:
    # local --workers 1 on 2 cores: the server's ~5 % of a core must not cost the worker a core.
    assert share(2, entry(), [server(0.05)], None) == 2
    assert share(2, server(0.05), [entry()], None) == 1


@pytest.mark.parametrize("workers", [2, 3])
def test_a_server_and_several_workers_on_two_cores_get_one_thread_each(workers: int) -> None:
    others = [server(0.4)] + [entry()] * (workers - 1)
    assert share(2, entry(), others, None) == 1
    assert share(2, server(0.4), [entry()] * workers, None) == 1


def test_a_busy_light_process_reserves_what_it_uses() -> None:
    assert share(16, entry(), [server(4.0), entry()], None) == 6  # (16 - 4) / 2
    assert share(16, server(4.0), [entry(), entry()], None) == 4  # about what it uses, within an equal split
    assert share(16, server(12.0), [entry(), entry()], None) == 5  # never more than an equal split


def test_pinned_processes_keep_their_threads_and_reserve_their_use() -> None:
    assert share(4, entry(kind="pinned", threads=3), [entry()], None) == 3
    assert share(4, entry(), [entry("worker", "pinned", use=3.0, threads=3)], None) == 1


def test_hysteresis_keeps_a_share_near_a_boundary() -> None:
    neighbour = [server(0.5)]  # exact share 1.5
    assert share(2, entry(), neighbour, 1) == 1
    assert share(2, entry(), neighbour, 2) == 2
    assert share(2, entry(), [server(0.3)], 1) == 2  # 1.7: far enough from 1
    assert share(2, entry(), [server(0.7)], 2) == 1  # 1.3: far enough from 2


def test_a_gpu_worker_is_light_and_capped() -> None:
    gpu = entry("worker", threads.kind_of("worker", gpu=True), use=3.0)
    assert share(64, gpu, [], None, cap=GPU_WORKER_THREADS) == GPU_WORKER_THREADS
    assert share(64, entry(), [gpu], None) == 61
    assert share(1, gpu, [], None, cap=GPU_WORKER_THREADS) == 1


def test_never_more_threads_than_cores_and_at_least_one() -> None:
    assert share(1, entry(), [entry()] * 5, None) == 1
    assert share(1, server(8.0), [], None) == 1


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        share(2, entry(kind="heavy"), [], None)


# ---------------------------------------------------------------- the budget of a process


def cores(n: int) -> UsableCores:
    return UsableCores(n, n, None, "no cgroup CPU quota")


def test_a_budget_counts_its_neighbours_and_says_so(tmp_path: Path) -> None:
    neighbour = HostRegistry(tmp_path, server(0.05))
    seen: list[threads.ThreadBudget] = []
    budget = HostBudget("worker", directory=tmp_path, environ={}, limits=lambda: cores(2), poll_s=3600, on_change=seen.append)
    try:
        first = budget.start()
        assert first.intra_op == 2 and first.sharing == 2 and first.usable == 2
        assert "2 usable cores" in first.reason and "shared with 1 other rpcps process on this host (1 server)" in first.reason
        assert seen == [first]
    finally:
        budget.stop()
        neighbour.close()
    assert os.listdir(tmp_path) == []


def test_a_pinned_budget_still_registers_so_others_count_it(tmp_path: Path) -> None:
    budget = HostBudget("worker", 1, directory=tmp_path, environ={}, limits=lambda: cores(4), poll_s=3600)
    try:
        assert budget.start() == threads.ThreadBudget(1, "--threads", sharing=1)
        others = HostBudget("worker", directory=tmp_path, environ={}, limits=lambda: cores(4), poll_s=3600)
        try:
            assert others.start().intra_op == 3  # the pinned worker's use (1 core) is reserved
        finally:
            others.stop()
    finally:
        budget.stop()


def test_only_processes_that_draw_on_the_same_cores_divide_them(tmp_path: Path) -> None:
    def pool(name: str) -> UsableCores:
        return UsableCores(4, 64, 4.0, "cgroup v2 cpu.max 400000/100000 at /sys/fs/cgroup", pool=name)

    mine = HostBudget("worker", directory=tmp_path, environ={}, limits=lambda: pool("cgroup 1:10"), poll_s=3600)
    # A pod with a CPU limit of its own on the same node, sharing the registry (Kubernetes hostPath).
    other_pod = HostBudget("worker", directory=tmp_path, environ={}, limits=lambda: pool("cgroup 1:20"), poll_s=3600)
    same_pod = HostBudget("worker", directory=tmp_path, environ={}, limits=lambda: pool("cgroup 1:10"), poll_s=3600)
    try:
        assert mine.start().intra_op == 4
        assert other_pod.start().intra_op == 4 and other_pod.budget.sharing == 1, "its limit is its own"
        shared = same_pod.start()
        assert shared.intra_op == 2 and shared.sharing == 2, "two compute processes under one limit"
        assert "shared with 1 other rpcps process on this host (1 worker)" in shared.reason
    finally:
        for b in (mine, other_pod, same_pod):
            b.stop()


# ---------------------------------------------------------------- what goes wrong on the way


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(1 for r in caplog.records if r.levelname == "WARNING" and text in r.getMessage())


def test_an_unreadable_cgroup_is_counted_at_every_poll_and_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []
    unreadable = UsableCores(2, 2, None, "cgroups unreadable (Permission denied)")
    budget = HostBudget("worker", directory=tmp_path, environ={}, limits=lambda: unreadable, poll_s=0.01, on_problem=seen.append)
    try:
        assert budget.start().usable == 2  # goes on with the affinity's cores
        wait_until(lambda: seen.count("cgroup_unreadable") >= 3, 10, "three polls of an unreadable cgroup")
    finally:
        budget.stop()
    assert set(seen) == {"cgroup_unreadable"}
    assert _warnings(caplog, "cgroups unreadable (Permission denied): the budget counts the affinity's cores only") == 1


def test_registry_problems_and_a_bad_setting_are_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    alone = HostBudget("worker", directory=blocked, environ={"OMP_NUM_THREADS": "two"}, limits=lambda: cores(2), poll_s=3600,
                       on_problem=seen.append)
    try:
        assert alone.start().sharing == 1
    finally:
        alone.stop()
    assert seen == ["bad_setting", "registry"]
    assert _warnings(caplog, "cannot join the host's process registry") == 1

    seen.clear()
    directory = tmp_path / "registry"
    budget = HostBudget("worker", directory=directory, environ={}, limits=lambda: cores(2), poll_s=0.01, on_problem=seen.append)
    try:
        budget.start()
        assert seen == []
        shutil.rmtree(directory)  # the registry's directory went away under a running process (a tmp cleaner)
        wait_until(lambda: seen.count("registry") >= 2, 10, "polls of a registry that cannot be listed")
    finally:
        budget.stop()
    assert _warnings(caplog, "cannot read the host's process registry") == 1


def test_the_problems_counter_has_every_problem_from_the_start() -> None:
    registry = CollectorRegistry()
    count = threads.problem_counter(registry, "worker")
    for problem in threads.PROBLEMS:
        assert registry.get_sample_value("rpcps_worker_thread_budget_problems_total", {"problem": problem}) == 0.0
    count("registry")
    assert registry.get_sample_value("rpcps_worker_thread_budget_problems_total", {"problem": "registry"}) == 1.0


def test_the_setting_is_validated_like_every_other() -> None:
    with pytest.raises(SystemExit):
        parse(["ps", "--threads", "0"])
    assert parse(["ps", "--threads", "3"])[1].process.threads == 3


def _child_threads(supervisor: Supervisor) -> dict[str, str | None]:
    def flag(argv: list[str]) -> str | None:
        return argv[argv.index("--threads") + 1] if "--threads" in argv else None

    return {c.name: flag(c.argv) for c in supervisor.children}


def test_local_leaves_the_budget_to_its_children(tmp_path: os.PathLike[str]) -> None:
    config = parse(["local", "--workers", "2", "--device", "cpu", "--run-dir", str(tmp_path)])[1]
    assert set(_child_threads(Supervisor(config)).values()) == {None}


def test_local_passes_an_explicit_thread_count_to_every_child(tmp_path: os.PathLike[str]) -> None:
    config = parse(["local", "--workers", "2", "--threads", "3", "--run-dir", str(tmp_path)])[1]
    assert set(_child_threads(Supervisor(config)).values()) == {"3"}
