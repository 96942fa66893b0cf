"""Fixtures shared by every test tier. The reusable machinery itself lives in ``tests/procs.py``."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from harness.procs import ProcessGroup


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    # Keeps each phase's report on the test item so fixtures can tell, at teardown, whether it failed.
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


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
        killed = group.reap()
        report = getattr(request.node, "rep_call", None)
        if report is None or report.failed:
            print(f"\n===== process logs ({group.log_dir}) =====\n{group.tails()}", file=sys.stderr)
        if killed:
            print(f"reaped with SIGKILL: {killed}", file=sys.stderr)
