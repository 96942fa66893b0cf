"""The test machinery itself: polling, scraping, and reaping process trees even when they resist."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from harness.procs import (
    REPO,
    ProcessGroup,
    child_env,
    descendants,
    every_thread_stopped,
    free_ports,
    pid_alive,
    pid_stopped,
    scrape_metrics,
    wait_until,
)
from tests.pytest_run import run_pytest


def test_wait_until_returns_the_truthy_value_and_names_what_timed_out() -> None:
    calls = iter([0, None, "ready"])
    assert wait_until(lambda: next(calls), timeout=5, what="x", interval=0) == "ready"
    with pytest.raises(AssertionError, match="timed out after 0.2s waiting for the moon"):
        wait_until(lambda: False, timeout=0.2, what="the moon")


def test_free_ports_are_distinct() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5


def test_a_child_imports_this_repo_first_and_keeps_an_inherited_pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    # Dependencies installed with `pip install --target DIR` are found through PYTHONPATH only.
    monkeypatch.setenv("PYTHONPATH", "/opt/deps/a:/opt/deps/b")
    monkeypatch.setenv("RPCPS_THREADS", "7")
    env = child_env(["/extra"])
    assert env["PYTHONPATH"].split(":") == [str(REPO), "/extra", "/opt/deps/a", "/opt/deps/b"]
    assert "RPCPS_THREADS" not in env
    monkeypatch.delenv("PYTHONPATH")
    assert child_env()["PYTHONPATH"] == str(REPO)


def test_scrape_metrics_keys_labelled_and_unlabelled_samples() -> None:
    registry = CollectorRegistry()
    Counter("demo_things", "d", ["kind"], registry=registry).labels("b").inc(2)
    Gauge("demo_level", "d", registry=registry).set(1.5)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        values = scrape_metrics(server.server_address[1])
    finally:
        server.shutdown()
        thread.join(timeout=5)
    assert values['demo_things_total{kind="b"}'] == 2
    assert values["demo_level"] == 1.5


# A parent that ignores SIGTERM and starts a child in a session of its own (as `rpcps local` does).
_STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.timeout(60)
def test_tails_end_with_the_process_that_failed(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path / "logs")
    try:
        group.start("failed", ["-c", "import sys; print('why it failed', file=sys.stderr); sys.exit(1)"], script=None)
        group.start("fine", ["-c", "print('all well')"], script=None)
        running = group.start("running", ["-c", "import time; time.sleep(600)"], script=None)
        assert [group[n].wait(30) for n in ("failed", "fine")] == [1, 0]
        tails = group.tails()
        assert tails.rstrip().endswith("why it failed"), tails
        assert tails.index("--- running") < tails.index("--- failed")
        assert running.alive()
    finally:
        group.reap(grace_s=1.0)


_WAITS_IN_A_NAMED_FUNCTION = textwrap.dedent(
    """
    import faulthandler, signal, sys, threading
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # as cli.main does
    def waiting_for_the_moon():
        threading.Event().wait()
    print("ready", flush=True)
    waiting_for_the_moon()
    """
)


@pytest.mark.timeout(60)
def test_stacks_show_where_each_running_process_waits_and_skip_a_stopped_one(tmp_path: Path) -> None:
    script = tmp_path / "waits.py"
    script.write_text(_WAITS_IN_A_NAMED_FUNCTION)
    group = ProcessGroup(tmp_path / "logs")
    try:
        waiting = group.start("waiting", [], script=script)
        stopped = group.start("stopped", [], script=script)
        wait_until(lambda: waiting.stdout() and stopped.stdout(), timeout=20, what="both to start")
        stopped.freeze()
        wait_until(lambda: pid_stopped(stopped.pid), timeout=10, what="the stop to take effect")
        stacks = group.stacks()
        assert "--- waiting" in stacks and "waiting_for_the_moon" in stacks, stacks
        assert "--- stopped" not in stacks  # a stopped process would print nothing until continued
        assert waiting.alive() and stopped.alive()
    finally:
        group.reap(grace_s=1.0)


@pytest.mark.timeout(60)
def test_reap_ends_a_stubborn_tree_and_a_stopped_process(tmp_path: Path) -> None:
    script = tmp_path / "stubborn.py"
    script.write_text(_STUBBORN)
    group = ProcessGroup(tmp_path / "logs")
    parent = group.start("parent", [], script=script)
    sleeper = group.start("sleeper", ["-c", "import time; time.sleep(600)"], script=None)
    child_pid = int(wait_until(lambda: parent.stdout().strip(), timeout=20, what="the child's pid"))
    assert child_pid in descendants(parent.pid)
    sleeper.freeze()
    killed = group.reap(grace_s=1.0)
    assert "parent" in killed  # it ignored SIGTERM
    assert not parent.alive() and not sleeper.alive()
    assert sleeper.returncode == -signal.SIGTERM  # continued, then ended by SIGTERM
    wait_until(lambda: not pid_alive(child_pid), timeout=10, what="the grandchild to die")


# Run by a pytest in a subprocess: starts a sleeping child through the procs fixture, records its
# pid, then hangs until pytest-timeout ends it.
_HANGING_TEST = textwrap.dedent(
    """
    import os, time
    from pathlib import Path

    def test_hangs(procs):
        child = procs.start("sleeper", ["-c", "import time; time.sleep(600)"], script=None)
        Path(os.environ["HANG_PIDFILE"]).write_text(str(child.pid))
        time.sleep(600)
    """
)


def _run_hanging_test(tmp_path: Path, *options: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """Runs _HANGING_TEST with a 5 s timeout; returns (the run, the pid of the child it started)."""
    pidfile = tmp_path / "child.pid"
    run = run_pytest(tmp_path, _HANGING_TEST, "--timeout", "5", *options, HANG_PIDFILE=str(pidfile))
    assert pidfile.exists(), f"the hanging test never started its child\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
    return run, int(pidfile.read_text())


@pytest.mark.timeout(150)
def test_a_timed_out_test_fails_and_its_teardown_reaps_its_processes(tmp_path: Path) -> None:
    """The configured timeout method fails the test and runs its fixtures' teardown.

    Catches pyproject.toml going back to timeout_method="thread" (os._exit: no teardown, no report).
    """
    run, pid = _run_hanging_test(tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 1 and "Timeout" in output and "1 failed" in output, output[-3000:]
    assert "===== process logs" in output, "the procs fixture's teardown did not run"
    wait_until(lambda: not pid_alive(pid), timeout=10, what=f"the timed-out test's child {pid} to be gone")


@pytest.mark.timeout(150)
def test_processes_die_with_a_test_process_that_exits_without_teardown(tmp_path: Path) -> None:
    """The last resort: pytest-timeout's "thread" method os._exits pytest, skipping every finaliser;
    the kernel still ends the children (PR_SET_PDEATHSIG). Catches ProcessGroup.start losing it."""
    run, pid = _run_hanging_test(tmp_path, "-o", "timeout_method=thread")
    output = run.stdout + run.stderr
    assert "Timeout" in output and "===== process logs" not in output, output[-3000:]
    wait_until(lambda: not pid_alive(pid), timeout=10, what=f"the orphaned child {pid} to be gone")


@pytest.mark.timeout(60)
def test_every_thread_stopped_waits_for_each_thread_not_only_the_main_one() -> None:
    """A process with a second thread: stopped once both are, running again once continued."""
    code = "import threading, time; threading.Thread(target=time.sleep, args=(600,)).start(); print('up', flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert len(list(Path(f"/proc/{proc.pid}/task").iterdir())) >= 2
        assert not every_thread_stopped(proc.pid)
        proc.send_signal(signal.SIGSTOP)
        wait_until(lambda: every_thread_stopped(proc.pid), timeout=10, what="every thread stopped")
        proc.send_signal(signal.SIGCONT)
        wait_until(lambda: not every_thread_stopped(proc.pid), timeout=10, what="the threads running again")
    finally:
        proc.kill()
        proc.wait(10)
    assert not every_thread_stopped(proc.pid)  # gone: not "stopped"
