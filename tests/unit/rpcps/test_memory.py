"""glibc malloc tuning (rpcps.memory): what the environment keeps for itself, the trim setting, the trimmer."""

from __future__ import annotations

import importlib
import inspect
import os
import threading
import time

import pytest

from cli.local import Supervisor
from cli.main import ROLES, _load, parse
from rpcps import memory
from rpcps.process import ProcessOptions


@pytest.mark.parametrize(
    ("environ", "left"),
    [
        ({}, False),
        ({"MALLOC_ARENA_MAX": "4"}, True),
        ({"MALLOC_ARENA_MAX_": "4"}, True),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, True),
        ({"GLIBC_TUNABLES": "glibc.pthread.rseq=0", "MALLOC_TOP_PAD_": "1"}, False),
    ],
)
def test_a_setting_the_environment_made_is_left_to_it(environ: dict[str, str], left: bool) -> None:
    assert memory.left_to_environment("MALLOC_ARENA_MAX", environ) is left


@pytest.mark.parametrize("seconds", [0.1, -1.0, 3601.0])
def test_the_trim_interval_is_zero_or_in_range(seconds: float) -> None:
    with pytest.raises(ValueError, match="malloc_trim_s must be 0"):
        ProcessOptions(malloc_trim_s=seconds)


def test_the_trim_interval_is_a_setting_of_every_role_and_local_passes_it_on(tmp_path: os.PathLike[str]) -> None:
    assert parse(["ps", "--malloc-trim-s", "0"])[1].process.malloc_trim_s == 0
    assert parse(["worker", "--ps", "127.0.0.1:29500", "--malloc-trim-s", "7"])[1].process.malloc_trim_s == 7
    config = parse(["local", "--workers", "2", "--malloc-trim-s", "7", "--run-dir", str(tmp_path)])[1]
    children = Supervisor(config).children
    assert {float(c.argv[c.argv.index("--malloc-trim-s") + 1]) for c in children} == {7.0}, [c.argv for c in children]


def test_a_role_that_takes_the_trim_interval_trims_and_the_one_shot_roles_refuse_it(capsys: pytest.CaptureFixture[str]) -> None:
    """Every role that accepts --malloc-trim-s starts a trimmer in its run module (the store and the
    evaluator once accepted it and did nothing); ``local`` hands it to its children (above)."""
    takers = [name for name, role in ROLES.items() if any(d.flag == "--malloc-trim-s" for d in role.settings())]
    assert "store" in takers and "local" in takers
    for name in takers:
        if name != "local":
            module = inspect.getmodule(_load(ROLES[name].run))
            source = inspect.getsource(module)
            if name == "worker":  # the CLI worker is one user of the worker API, which runs the process
                source += inspect.getsource(importlib.import_module("worker.api"))
            assert "memory.start_trimming(" in source, f"rpcps {name} takes --malloc-trim-s but never trims"
    assert parse(["store", "--malloc-trim-s", "7"])[1].process.malloc_trim_s == 7
    for role in (["export"], ["reshard"], ["ctl", "status"]):
        assert role[0] not in takers
        with pytest.raises(SystemExit) as exited:
            parse([*role, "--malloc-trim-s", "7"])
        assert exited.value.code == 2 and "unrecognized arguments: --malloc-trim-s" in capsys.readouterr().err


class _FakeLibc:
    def __init__(self) -> None:
        self.calls: list[int] = []
        self.called = threading.Event()

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(pad)
        self.called.set()
        return 1


@pytest.mark.timeout(10)
def test_the_trimmer_trims_at_once_then_every_interval_until_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _FakeLibc()
    monkeypatch.setattr(memory, "_glibc", lambda: libc)
    trimmer = memory.start_trimming(0.05)
    assert trimmer is not None and libc.calls == [0]  # start-up's leftovers go at once
    deadline = time.monotonic() + 5
    while len(libc.calls) < 3 and time.monotonic() < deadline:
        libc.called.wait(0.05)
    trimmer.stop()
    assert len(libc.calls) >= 3 and set(libc.calls) == {0} and trimmer.trims == len(libc.calls)
    assert "malloc-trim" not in {t.name for t in threading.enumerate()}  # stopped: nothing trims any more


def test_no_trimmer_when_off_or_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _FakeLibc()
    monkeypatch.setattr(memory, "_glibc", lambda: libc)
    assert memory.start_trimming(0) is None and libc.calls == []
    monkeypatch.setattr(memory, "_glibc", lambda: None)
    assert memory.start_trimming(1.0) is None


def test_the_warm_up_trims_at_every_wake_up_then_once_per_interval() -> None:
    warm_up = memory.WARMUP_INTERVALS * memory.WARMUP_SPLIT
    due = [tick for tick in range(1, warm_up + 4 * memory.WARMUP_SPLIT + 1) if memory.trim_due(tick)]
    steady = [warm_up + k * memory.WARMUP_SPLIT for k in range(1, 5)]
    assert due == list(range(1, warm_up + 1)) + steady  # the interval's own ticks after the warm-up, nothing between
    assert memory.WARMUP_SPLIT > 1 and memory.WARMUP_INTERVALS >= 1  # a warm-up that trims more often than steady state


def test_huge_pages_are_asked_for_unless_the_environment_decided() -> None:
    environ: dict[str, str] = {}
    memory.prefer_huge_pages(environ)
    assert environ == {memory.HUGE_PAGES_ENV: "1"}
    operator = {memory.HUGE_PAGES_ENV: "0"}
    memory.prefer_huge_pages(operator)
    assert operator == {memory.HUGE_PAGES_ENV: "0"}


def test_every_rpcps_command_asks_for_huge_pages_before_it_parses_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cli.main.main`` sets it before any role's code runs (torch reads it at its first allocation)."""
    import cli.main

    class Parsed(Exception):
        pass

    def parse_(argv: object) -> None:
        assert os.environ.get(memory.HUGE_PAGES_ENV) == "1"
        raise Parsed

    monkeypatch.delenv(memory.HUGE_PAGES_ENV, raising=False)
    monkeypatch.setattr(cli.main, "parse", parse_)
    with pytest.raises(Parsed):
        cli.main.main(["worker"])


@pytest.mark.parametrize(
    ("environ", "mode", "says"),
    [
        ({}, "always [madvise] never", "off (THP_MEM_ALLOC_ENABLE unset)"),
        ({"THP_MEM_ALLOC_ENABLE": "0"}, "always [madvise] never", "off (THP_MEM_ALLOC_ENABLE=0)"),
        ({"THP_MEM_ALLOC_ENABLE": "1"}, "always [madvise] never", "on for blocks of 2 MB and more (kernel mode madvise)"),
        ({"THP_MEM_ALLOC_ENABLE": "1"}, "[always] madvise never", "on for blocks of 2 MB and more (kernel mode always)"),
        ({"THP_MEM_ALLOC_ENABLE": "1"}, "always madvise [never]", "asked for, but the kernel's transparent huge pages are off (never)"),
        ({"THP_MEM_ALLOC_ENABLE": "1"}, None, "asked for, but this kernel has no transparent huge pages"),
    ],
)
def test_the_log_says_whether_huge_pages_are_on_and_why(
    tmp_path: os.PathLike[str], environ: dict[str, str], mode: str | None, says: str
) -> None:
    mode_file = os.path.join(tmp_path, "enabled")
    if mode is not None:
        with open(mode_file, "w") as f:
            f.write(mode + "\n")
    assert memory.huge_pages_state(environ, mode_file) == says
