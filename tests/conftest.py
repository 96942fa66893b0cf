"""Fixtures and hooks shared by every test tier. The reusable machinery itself lives in ``harness/``."""

from __future__ import annotations

import fcntl
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest

from harness.procs import ProcessGroup
from tests.must_run import MustRunList

_MUST_RUN = pytest.StashKey[MustRunList]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--must-run", metavar="FILE", default=None,
        help="node ids that must not skip (tests/must_run.txt in CI): a skip of one of them fails the run",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--must-run")
    if path is None:
        return
    try:
        config.stash[_MUST_RUN] = MustRunList.read(Path(path))
    except OSError as e:
        raise pytest.UsageError(f"--must-run {path}: {e.strerror}") from None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # tryfirst: sees every collected test before -m/-k deselect some (a deselected test is not skipped).
    must_run = config.stash.get(_MUST_RUN, None)
    if must_run is None:
        return
    stale = must_run.stale((item.nodeid for item in items), config.rootpath)
    if stale:
        raise pytest.UsageError(f"{must_run.source} lists tests that do not exist (renamed or removed?): {stale}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    report = yield
    must_run = item.config.stash.get(_MUST_RUN, None)
    if report.skipped and not hasattr(report, "wasxfail") and must_run is not None and must_run.covers(item.nodeid):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} must run here ({must_run.source} lists it) but skipped: {reason}"
    # Kept on the item so fixtures can tell, at teardown, whether a phase failed.
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Puts back the process environment a test changed: an in-process call of the CLI sets
    TORCH_CPP_LOG_LEVEL (``cli.main``), and the fork server's tests then failed on whichever xdist
    worker ran one earlier (the fork server refuses a child whose environment its preloaded
    libraries read)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


_TIMED_OUT = re.compile(r"timed out after|still running after|Timeout >")
"""How a timed-out wait fails: ``wait_until``, ``Proc.wait``, pytest-timeout."""


@pytest.fixture
def procs(tmp_path, request: pytest.FixtureRequest) -> Iterator[ProcessGroup]:
    """Processes started by this test; all of them (and their children) are ended at teardown.

    When the test failed, the tail of every process's stdout and stderr is printed, so the report
    shows what the server and workers were saying.
    """
    group = ProcessGroup(tmp_path / "logs")
    try:
        yield group
    finally:
        report = getattr(request.node, "rep_call", None)
        failed = report is None or report.failed
        # A test that timed out waiting (on a process, a condition, or pytest-timeout's limit) shows
        # what every process still running waited for: a hang leaves no log line of its own.
        # Their logs are read first: the stacks go to the same files, and would fill the tails.
        hung = failed and report is not None and _TIMED_OUT.search(str(report.longrepr)) is not None
        tails = group.tails() if hung else ""
        stacks = group.stacks() if hung else ""
        killed = group.reap()
        if failed:
            print(f"\n===== process logs ({group.log_dir}) =====\n{tails or group.tails()}", file=sys.stderr)
        if stacks:
            print(f"\n===== Python stacks of the processes still running when it timed out =====\n{stacks}", file=sys.stderr)
        if killed:
            print(f"reaped with SIGKILL: {killed}", file=sys.stderr)


@pytest.fixture
def wall_clock_bound() -> Callable[[float, float], float]:
    """The bound a ``timed`` test asserts: ``alone_s``, the product's promise, where it has the host
    to itself (no other xdist worker runs beside it: CI's serial pass, any ``-n 0`` or ``-n 1`` run);
    ``shared_s`` in the default run, where three other tests' processes share the 2 cores. The shared bound is looser
    but still fails a hang or a missed wake-up (those cost an RPC timeout, 30 s). Run alone, these
    tests held the other workers idle while they waited their turn: 95 s of a 528 s run."""
    shared = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1

    def bound(alone_s: float, shared_s: float) -> float:
        chosen = shared_s if shared else alone_s
        print(f"wall-clock bound {chosen} s ({'beside other tests' if shared else 'alone'})")
        return chosen

    return bound


_ALONE_WAIT_S = 1800.0
"""How long a test waits for its turn: the running tests end within their own timeouts (at most a
soak's), so a longer wait means a worker is stuck outside any test's timeout."""


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Under pytest-xdist (pyproject's addopts start four workers), a test marked ``slow`` runs while
    no other test runs; the others run side by side. The default run selects none (CI runs them in
    one process, ``-m "slow or timed" -n 0``): this holds for a run that selects them with workers,
    e.g. ``pytest -m slow``.

    Those tests assert wall-clock bounds (a recovery within 1 s) or compare throughput, measured with
    the machine to themselves; a second test's processes on the same cores would make them fail for a
    reason that is not theirs. Every test holds a shared lock on one file of this run, a ``slow`` test
    an exclusive one, from before its first fixture starts a process until its last one ended. (A
    ``timed`` test runs beside the others and asserts its looser bound: ``wall_clock_bound``.)

    A hook wrapped around the whole protocol, outermost (tryfirst), not a fixture: the wait for a turn
    is then outside pytest-timeout's timer, which starts inside. As a fixture it counted against the
    test's own timeout, and a 30 s unit test queued behind a test run alone that waited for a 100 s
    test on the other worker timed out in its setup (CI, stop 36).
    """
    basetemp = item.config.option.basetemp
    if "PYTEST_XDIST_WORKER" not in os.environ or basetemp is None:
        yield
        return
    alone = item.get_closest_marker("slow") is not None
    # Each worker's basetemp is <run's base>/popen-gwN: the parent is this run's, shared by all workers.
    # A plain flock lets the other workers' back-to-back shared holds starve an exclusive waiter (it
    # timed out so on 3 workers), so a gate comes first: a slow test holds it while it waits for
    # the running tests to end, and no test starts meanwhile.
    base = Path(basetemp).parent
    mode = fcntl.LOCK_EX if alone else fcntl.LOCK_SH
    deadline = time.monotonic() + _ALONE_WAIT_S
    with open(base / "alone.gate", "a") as gate, open(base / "alone.lock", "a") as lock:
        _flock_by(gate, mode, deadline, item.nodeid)
        _flock_by(lock, mode, deadline, item.nodeid)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


def _flock_by(file: IO[str], mode: int, deadline: float, nodeid: str) -> None:
    """Take ``flock(file, mode)``, polling, or fail the run by ``deadline`` (no timer covers this wait)."""
    while True:
        try:
            fcntl.flock(file, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{nodeid} waited {_ALONE_WAIT_S:.0f} s for its turn on {file.name}: a test on another xdist "
                    "worker holds it past any timeout; see that worker's output"
                ) from None
            time.sleep(0.05)
