"""Every role chooses its intra-op threads the same way, and ``local`` divides the cores between its children."""

from __future__ import annotations

import os

import pytest

from cli.local import Supervisor
from cli.main import parse
from rpcps import threads
from rpcps.threads import GPU_WORKER_THREADS, choose, split_cores


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "RPCPS_THREADS"):
        monkeypatch.delenv(key, raising=False)


def test_the_flag_beats_omp_num_threads() -> None:
    assert choose(3, environ={"OMP_NUM_THREADS": "1"}, cores=8) == threads.ThreadBudget(3, "--threads")


def test_omp_num_threads_beats_the_core_count() -> None:
    assert choose(None, environ={"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}, cores=8).intra_op == 1


@pytest.mark.parametrize(("environ", "cores", "expected"), [({}, 8, 8), ({"LOCAL_WORLD_SIZE": "4"}, 8, 2), ({"LOCAL_WORLD_SIZE": "4"}, 2, 1)])
def test_without_a_setting_each_local_process_takes_its_share_of_the_cores(environ: dict[str, str], cores: int, expected: int) -> None:
    assert choose(None, environ=environ, cores=cores).intra_op == expected


def test_a_gpu_worker_keeps_few_cpu_threads() -> None:
    assert choose(None, gpu=True, environ={}, cores=64).intra_op == GPU_WORKER_THREADS
    assert choose(None, gpu=True, environ={}, cores=1).intra_op == 1
    assert choose(6, gpu=True, environ={}, cores=64).intra_op == 6  # asked for: honoured


@pytest.mark.parametrize("bad", ["", "0", "-2", "two"])
def test_a_meaningless_omp_num_threads_is_ignored(bad: str) -> None:
    assert choose(None, environ={"OMP_NUM_THREADS": bad}, cores=4).intra_op == 4


@pytest.mark.parametrize(
    ("cores", "servers", "workers", "gpu", "expected"),
    [
        (2, 1, 2, False, (1, 1)),  # three processes on two cores: never more threads than cores, at least one each
        (16, 1, 2, False, (5, 5)),
        (16, 2, 4, False, (2, 3)),  # the cores an equal split leaves go to the workers
        (16, 1, 4, True, (8, 2)),  # GPU workers feed their devices; the server is the bottleneck
        (1, 1, 1, False, (1, 1)),
    ],
)
def test_split_cores(cores: int, servers: int, workers: int, gpu: bool, expected: tuple[int, int]) -> None:
    assert split_cores(cores, servers, workers, gpu_workers=gpu) == expected


def test_the_setting_is_validated_like_every_other() -> None:
    with pytest.raises(SystemExit):
        parse(["ps", "--threads", "0"])
    assert parse(["ps", "--threads", "3"])[1].process.threads == 3


def _child_threads(supervisor: Supervisor) -> dict[str, str | None]:
    def flag(argv: list[str]) -> str | None:
        return argv[argv.index("--threads") + 1] if "--threads" in argv else None

    return {c.name: flag(c.argv) for c in supervisor.children}


def test_local_gives_each_child_its_share_of_the_cores(tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    config = parse(["local", "--workers", "2", "--device", "cpu", "--run-dir", str(tmp_path)])[1]
    assert _child_threads(Supervisor(config)) == {"ps": "1", "worker0": "1", "worker1": "1"}


def test_local_passes_an_explicit_thread_count_to_every_child(tmp_path: os.PathLike[str]) -> None:
    config = parse(["local", "--workers", "2", "--threads", "3", "--run-dir", str(tmp_path)])[1]
    assert set(_child_threads(Supervisor(config)).values()) == {"3"}


def test_local_leaves_omp_num_threads_to_the_children(tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the children inherit it and honour it themselves
    config = parse(["local", "--workers", "2", "--run-dir", str(tmp_path)])[1]
    assert set(_child_threads(Supervisor(config)).values()) == {None}
