"""The supervisor of `rpcps ps`, with stand-in children (plain Python, no torch, no RPC).

The real server under its supervisor, hit by garbage bytes: tests/integration/security/test_hostile_peers.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from harness.procs import pid_alive, pid_stopped, wait_until
from ps.lifecycle import supervisor
from ps.lifecycle.supervisor import QUICK_CRASH_S, RestartBackoff, Supervisor

CHILD = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    scratch = pathlib.Path(os.environ["RPCPS_SUPERVISOR_DIR"])
    restarts = int(os.environ["RPCPS_CRASH_RESTARTS"])
    log, plan = pathlib.Path(sys.argv[1]), sys.argv[2].split(",")
    with log.open("a") as f:
        f.write(f"{restarts} {os.getpid()}\\n")
    step = plan[min(restarts, len(plan) - 1)]
    if step.startswith("serve"):
        (scratch / "serving").write_text(str(os.getpid()))
        step = step[len("serve-"):]
    if step == "abort":
        os.abort()
    if step.startswith("exit"):
        sys.exit(int(step[len("exit"):]))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(0.05)
    """
)


def run(tmp_path: Path, plan: str, monkeypatch: pytest.MonkeyPatch, stop_at_start: int | None = None) -> tuple[int, list[str]]:
    """Runs a Supervisor in this process over the stand-in child; returns (exit code, child log lines).

    ``stop_at_start``: send the supervisor SIGTERM once the child started that many times.
    """
    monkeypatch.setattr(Supervisor, "_sleep", lambda self, seconds: None)  # no backoff waits in a unit test
    log = tmp_path / "children.log"
    sup = Supervisor([sys.executable, "-c", CHILD, str(log), plan])
    if stop_at_start is not None:

        def stop() -> None:
            wait_until(lambda: log.exists() and len(log.read_text().splitlines()) >= stop_at_start, 60, "child starts")
            wait_until(lambda: (sup.scratch / supervisor.READY_FILE).exists(), 60, "the last child to serve")
            sup._on_signal(signal.SIGTERM, None)

        threading.Thread(target=stop, daemon=True).start()
    code = sup.run()
    assert not sup.scratch.exists(), "the scratch directory must go with the supervisor"
    return code, log.read_text().splitlines()


def test_a_crash_after_serving_is_restarted_and_the_child_knows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, lines = run(tmp_path, "serve-abort,serve-abort,serve", monkeypatch, stop_at_start=3)
    assert code == 0  # SIGTERM was passed on and the child stopped cleanly
    assert [line.split()[0] for line in lines] == ["0", "1", "2"]


@pytest.mark.parametrize(("plan", "expected_code", "starts"), [("exit2", 2, 1), ("exit1", 1, 1), ("exit0", 0, 1), ("serve-exit1,serve-exit0", 0, 2)])
def test_what_a_restart_cannot_fix_ends_the_supervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: str, expected_code: int, starts: int
) -> None:
    code, lines = run(tmp_path, plan, monkeypatch)
    assert (code, len(lines)) == (expected_code, starts)


def test_a_crash_loop_before_serving_gives_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, lines = run(tmp_path, "abort", monkeypatch)
    assert code == 128 + signal.SIGABRT and len(lines) == supervisor.MAX_FAILED_STARTS


def test_killing_the_supervisor_takes_its_child_along(tmp_path: Path) -> None:
    log = tmp_path / "children.log"
    script = Path(supervisor.__file__)
    proc = subprocess.Popen([sys.executable, "-P", str(script), "--", sys.executable, "-c", CHILD, str(log), "serve"])
    try:
        line = wait_until(lambda: log.exists() and log.read_text().strip(), 30, "the child to start")
        child = int(line.split()[1])
        assert pid_alive(child)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not pid_alive(child), 10, "the orphaned child to die with its supervisor")
    finally:
        proc.kill()
        proc.wait()


def _supervised_child(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """The supervisor run as ``ps.runner`` runs it, over the stand-in child; returns it and the child's pid."""
    log = tmp_path / "children.log"
    proc = subprocess.Popen([sys.executable, "-P", str(Path(supervisor.__file__)), "--", sys.executable, "-c", CHILD, str(log), "serve"])
    line = wait_until(lambda: log.exists() and log.read_text().strip(), 30, "the child to start")
    return proc, int(line.split()[1])


def test_the_child_runs_in_a_session_of_its_own_and_a_hangup_stops_it_cleanly(tmp_path: Path) -> None:
    proc, child = _supervised_child(tmp_path)
    try:
        # Its own scheduling group under autogroup; not in the terminal's process group either.
        assert os.getsid(child) == child != os.getsid(proc.pid)
        os.kill(proc.pid, signal.SIGHUP)  # the terminal closed: the child is told to stop (its final snapshot)
        assert proc.wait(30) == 0  # the stand-in child exits 0 on SIGTERM only
        assert not pid_alive(child)
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_z_stops_the_child_with_the_supervisor_fg_continues_both_and_ctrl_c_ends_a_stopped_child(tmp_path: Path) -> None:
    proc, child = _supervised_child(tmp_path)
    try:
        os.kill(proc.pid, signal.SIGTSTP)
        wait_until(lambda: pid_stopped(child) and pid_stopped(proc.pid), 10, "the child and its supervisor to stop")
        os.kill(proc.pid, signal.SIGCONT)
        wait_until(lambda: not pid_stopped(child) and not pid_stopped(proc.pid), 10, "both to continue")
        os.kill(child, signal.SIGSTOP)  # stopped on its own: Ctrl-C must still end it
        wait_until(lambda: pid_stopped(child), 10, "the child to stop")
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_the_serving_child_sees_its_supervisor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(supervisor.CHILD_ENV, raising=False)
    assert not supervisor.is_child() and supervisor.scratch_dir() is None and supervisor.crash_restarts() == 0
    supervisor.note_serving()  # unsupervised: nothing to tell
    monkeypatch.setenv(supervisor.CHILD_ENV, str(tmp_path))
    monkeypatch.setenv(supervisor.RESTARTS_ENV, "3")
    supervisor.note_serving()
    assert supervisor.is_child() and supervisor.crash_restarts() == 3
    assert (tmp_path / supervisor.READY_FILE).read_text() == str(os.getpid())


def test_the_restart_delay_doubles_while_crashes_come_quickly_and_starts_over_after_a_quiet_spell() -> None:
    backoff = RestartBackoff()
    quick = [backoff.after_crash(100.0 + i) for i in range(8)]
    assert quick == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    # A crash a quiet minute after the last one (a coordinator killed every few minutes) waits 0.5 s again.
    assert backoff.after_crash(107.0 + QUICK_CRASH_S + 1.0) == 0.5
    assert backoff.after_crash(107.0 + QUICK_CRASH_S + 2.0) == 1.0
