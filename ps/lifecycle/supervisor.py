"""``rpcps ps`` supervising itself: a small parent restarts the serving process when it crashes.

Some crashes cannot be prevented from Python: a few bytes of garbage sent to TensorPipe's port abort
the process inside torch's C++ code, and an oversized message can exhaust memory before any rpcps
code sees it (docs/SECURITY.md). So by default ``rpcps ps`` runs as two processes: this parent,
which imports nothing but the standard library (a few MB), and the serving child, which it restarts
after a crash; the child resumes from its newest snapshot and workers rejoin by themselves.

- Exit 0 (stopped) and 2 (bad setting, refused resume) end the supervisor with that code.
- A child that never reached serving and exits 1 (port in use, unreadable file) is not restarted:
  a restart cannot fix that. One that never reached serving for another reason (a crash while
  resuming) is retried ``MAX_FAILED_STARTS`` times in a row, then the supervisor gives up with its
  code, so a crash loop reaches whoever supervises the supervisor (systemd, the kubelet).
- A child that served is always restarted (a crash after serving comes from outside: an attack, a
  memory limit), after a delay that doubles while crashes come quickly (0.5 s up to 30 s).
- SIGTERM, SIGINT and SIGHUP are passed to the child as SIGTERM (it writes its final snapshot) and
  the supervisor exits with the child's code; Ctrl-Z (SIGTSTP) stops the child with it and SIGCONT
  continues both. The child dies with the supervisor (PR_SET_PDEATHSIG), so killing the supervisor
  never leaves a server holding the ports.
- The child runs in a session of its own, as ``rpcps local`` starts every process. With the kernel's
  autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on in most distributions'
  kernels) a session is a scheduling group, and CPU time is shared between groups first: a server
  in the session of the shell that also started its workers competes thread by thread with their
  compute, and its short bursts (a push to apply, a reply to send) wait behind them. Measured on 2
  cores, 5M MLP, a server and two workers started from one shell: 33.6 against 31.9 updates/s
  (docs/BENCHMARKS.md, "Thread budget"). The terminal's signals reach the child through the
  supervisor (above), since the child is no longer in the terminal's process group.

The child learns from its environment that it is supervised (``CHILD_ENV``: a private scratch
directory the supervisor removes when it exits, where the child marks itself serving and keeps its
restart snapshots when there is no checkpoint directory) and how often it was restarted.

Run by ``ps.runner`` as ``python -P ps/lifecycle/supervisor.py -- <the child's command line>``: as a script,
so the parent never imports the ``ps`` package (nor torch).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

logger = logging.getLogger("ps.lifecycle.supervisor")

CHILD_ENV = "RPCPS_SUPERVISOR_DIR"
RESTARTS_ENV = "RPCPS_CRASH_RESTARTS"
READY_FILE = "serving"
MAX_FAILED_STARTS = 5
NO_RESTART = (0, 2)
QUICK_CRASH_S = 60.0
"""A child that crashed sooner than this after the previous crash makes the next delay longer."""


@dataclass
class RestartBackoff:
    """How long to wait before starting a crashed process again: 0.5 s, doubling while its crashes
    come quickly (each within ``QUICK_CRASH_S`` of the one before), up to 30 s; a crash after a quiet
    minute starts over at 0.5 s, as Kubernetes resets a container's back-off once it ran well. Shared
    by this supervisor and ``rpcps local``'s: with a back-off that only grew, ``local``'s coordinator,
    killed 8 times over a 10-minute chaos soak, came back after 30 s, and the primary killed with it
    waited that long to fail over."""

    streak: int = 0
    last_crash: float = float("-inf")

    def after_crash(self, now: float) -> float:
        """The delay before the restart of a process that crashed at ``now`` (monotonic seconds)."""
        self.streak = self.streak + 1 if now - self.last_crash < QUICK_CRASH_S else 0
        self.last_crash = now
        return min(0.5 * 2.0**self.streak, 30.0)


_PR_SET_PDEATHSIG = 1


# ---- the serving child's side -----------------------------------------------------------------


def is_child() -> bool:
    return bool(os.environ.get(CHILD_ENV))


def scratch_dir() -> Path | None:
    """The supervisor's private directory (removed when the supervisor exits), or None when unsupervised."""
    value = os.environ.get(CHILD_ENV)
    return Path(value) if value else None


def crash_restarts() -> int:
    return int(os.environ.get(RESTARTS_ENV, "0"))


def note_serving() -> None:
    """Tells the supervisor this process reached serving (a later crash is restarted, not a failed start)."""
    directory = scratch_dir()
    if directory is not None:
        (directory / READY_FILE).write_text(str(os.getpid()))


def become_supervisor() -> NoReturn:
    """Replaces this process with the supervisor, which runs this same command line as its child."""
    child = [sys.executable, *sys.orig_argv[1:]]
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # -P: the script's own directory (ps/, whose modules could shadow the standard library's) stays
    # off sys.path; the supervisor needs nothing but the standard library.
    os.execv(sys.executable, [sys.executable, "-P", str(Path(__file__).resolve()), "--", *child])


# ---- the supervisor ---------------------------------------------------------------------------


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel sends SIGKILL when the supervisor dies.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Supervisor:
    def __init__(self, child_argv: list[str]) -> None:
        self.child_argv = child_argv
        self.scratch = Path(tempfile.mkdtemp(prefix="rpcps-supervisor-"))
        self.child: subprocess.Popen | None = None
        self.stopping = False
        self.restarts = 0

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True
        self._signal_child(signal.SIGTERM)
        self._signal_child(signal.SIGCONT)  # a child stopped by Ctrl-Z acts on SIGTERM once continued

    def _on_stop(self, signum: int, _frame: object) -> None:
        # Job control (Ctrl-Z): the child is in a session of its own, so it stops only when told.
        self._signal_child(signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)

    def _on_continue(self, signum: int, _frame: object) -> None:
        self._signal_child(signal.SIGCONT)

    def _signal_child(self, signum: int) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def _run_child(self) -> tuple[int, bool]:
        """Runs the child once; returns (exit code, whether it reached serving)."""
        ready = self.scratch / READY_FILE
        ready.unlink(missing_ok=True)
        env = {**os.environ, CHILD_ENV: str(self.scratch), RESTARTS_ENV: str(self.restarts)}
        # The supervisor runs no threads, so a preexec_fn (prctl, nothing else) is safe here.
        # A session of its own: its own scheduling group under autogroup (module docstring).
        self.child = subprocess.Popen(
            self.child_argv, env=env, preexec_fn=_die_with_parent, start_new_session=True  # noqa: PLW1509
        )
        logger.info("started the serving process (pid %d)", self.child.pid)
        while True:
            try:
                code = self.child.wait()
                break
            except InterruptedError:
                continue
        return code, ready.exists()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.1, deadline - time.monotonic()))

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGTSTP, self._on_stop)
        signal.signal(signal.SIGCONT, self._on_continue)
        failed_starts, backoff = 0, RestartBackoff()
        try:
            while True:
                code, served = self._run_child()
                if self.stopping or code in NO_RESTART:
                    return code if code >= 0 else 128 - code
                now = time.monotonic()
                if served:
                    failed_starts = 0
                elif code == 1:
                    logger.error("the server could not start (%s); not restarting it: a restart cannot fix that", _describe(code))
                    return code
                else:
                    failed_starts += 1
                    if failed_starts >= MAX_FAILED_STARTS:
                        logger.error(
                            "the server crashed %d times in a row before serving (%s); giving up", failed_starts, _describe(code)
                        )
                        return code if code >= 0 else 128 - code
                delay = backoff.after_crash(now)
                self.restarts += 1
                logger.error(
                    "the serving process %s (%s); restarting it from its newest snapshot in %.1fs (restart %d)",
                    _describe(code), "after serving" if served else "before serving", delay, self.restarts,
                )
                self._sleep(delay)
                if self.stopping:
                    return 0
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--":
        print("usage: supervisor.py -- COMMAND...", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s [supervisor pid %(process)d] %(name)s: %(message)s", stream=sys.stderr
    )
    return Supervisor(argv[1:]).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
