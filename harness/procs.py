"""Starting, watching, signalling and always reaping real rpcps processes in tests.

Used by the integration tests and by fault-injection tests: start a named ``trainer_entry.py``
process, wait for a condition with a deadline, kill or stop a named process on purpose, scrape its
/metrics. Every process is started in its own session, and ``ProcessGroup.reap`` ends it and every
process it started (``local`` starts its children in sessions of their own), so a failing test never
leaves a server holding a port behind it.

A test that times out fails like any other (pytest-timeout's ``signal`` method, pyproject.toml), so
the ``procs`` fixture's teardown reaps its processes. As a last resort, when the test process itself
dies without running finalisers (SIGKILL, ``os._exit``), every process started here gets SIGTERM
from the kernel (``dies_with_us``).

Nothing here sleeps to synchronise: callers poll a predicate with ``wait_until``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

from cli.main import CPP_LOG_LEVEL, CPP_LOG_LEVEL_ENV
from rpcps.memory import HUGE_PAGES_ENV
from rpcps.ports import free_port, free_ports
from rpcps.prefork import ForkedProcess, ForkServer
from rpcps.scrape import scrape_metrics, try_scrape

__all__ = [
    "ENTRY",
    "REPO",
    "Proc",
    "ProcessGroup",
    "child_env",
    "descendants",
    "dies_with_us",
    "free_port",
    "free_ports",
    "pid_alive",
    "pid_stopped",
    "scrape_metrics",
    "try_scrape",
    "wait_until",
]

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "trainer_entry.py"
LOG_TAIL_LINES = 40

T = TypeVar("T")

_DUMP_ENDED = re.compile(r" in (<module>|_run_module_as_main)\n")
"""The last line of a faulthandler dump of every thread: the main thread comes last (CPython lists
the newest thread first) and its outermost frame is the script's or ``-m``'s. Read as soon as a
first frame showed, a dump was cut mid-way on a loaded machine (the test of this saw "File " alone)."""

# Sets PR_SET_PDEATHSIG (1), which survives exec, then execs the real command in the same process
# (so its pid is the one Popen returned). A wrapper rather than Popen(preexec_fn=...), which can
# deadlock in a multi-threaded parent. If the parent is already gone by the time prctl runs, no
# signal would ever come, so it exits instead.
_PDEATHSIG_WRAPPER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dies_with_us(argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped so that the kernel sends the process SIGTERM when the thread that starts it ends.

    The kernel watches the starting *thread*: start such processes from a thread that lives as long
    as they should (the test's main thread), never from a short-lived helper thread.
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _PDEATHSIG_WRAPPER, str(os.getpid()), *argv]


FORK_SERVER_ENV = "RPCPS_TEST_FORK_SERVER"
"""``off`` starts every process as a plain subprocess (to compare, or to rule the fork server out)."""

_fork_servers: dict[int, ForkServer] = {}


def _fork_server() -> ForkServer | None:
    """This test process's fork server for the Python scripts it starts (``rpcps.prefork``:
    ``trainer_entry.py``, the own-loop example, the hostile peers): each then starts without
    importing torch again, 1.5-3.5 CPU-s saved per process on 2 shared cores.

    Started on the main thread only, where ``dies_with_us`` ties it (and, through it, its children) to
    the test process; ``None`` elsewhere, and when ``RPCPS_TEST_FORK_SERVER=off``.
    """
    if os.environ.get(FORK_SERVER_ENV) == "off" or threading.current_thread() is not threading.main_thread():
        return None
    server = _fork_servers.get(os.getpid())  # keyed by pid: a forked test process must not share its parent's
    if server is None or server.process.poll() is not None:
        server = _fork_servers[os.getpid()] = ForkServer(
            # What every rpcps command sets before torch loads (cli.main.main), set here before the
            # server's torch does: a forked child cannot change what torch read as it loaded. Huge
            # pages as there too: on unless the environment decides.
            child_env(), REPO, pdeathsig=signal.SIGTERM,
            preload_env={CPP_LOG_LEVEL_ENV: CPP_LOG_LEVEL, HUGE_PAGES_ENV: os.environ.get(HUGE_PAGES_ENV, "1")},
        )
    return server


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Polls ``predicate`` until it returns something truthy, and returns that.

    Every ``interval`` seconds: most predicates scrape a process's /metrics (about 3 ms of CPU on
    both ends), and the default run is CPU-bound, four tests at once on 2 cores; at 0.05 s a polling
    test kept 6 % of a core busy, for no test that needs a wake-up within 0.1 s.

    Raises:
        AssertionError: naming ``what`` when ``timeout`` seconds pass first. An exception raised by
            the predicate propagates at once (a predicate that may fail transiently should catch it).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def freeze_past_promotion(primary: Proc, standby_metrics: int, seconds: float = 5.0) -> None:
    """SIGSTOP of ``primary`` until its standby (``standby_metrics``: its /metrics port) has promoted
    itself, then ``seconds`` more; then SIGCONT. The thawed primary's lease has long run out."""
    primary.freeze()
    wait_until(lambda: try_scrape(standby_metrics).get("rpcps_replica_role", -1) == 2, 10, "the standby to promote itself")
    frozen_until = time.monotonic() + seconds
    wait_until(lambda: time.monotonic() >= frozen_until, seconds + 5, f"{seconds:g} s of freeze")  # the fault's duration, not a sync
    primary.thaw()


def start_replica_pair(
    procs: ProcessGroup, common: Sequence[str], first_only: Sequence[str] = (), second_only: Sequence[str] = ()
) -> list[tuple[Proc, int]]:
    """Two servers of shard 0 with the flags ``common`` (a store and ``--replicas 2``), the second
    started once the first serves, and waited for until in sync; ``first_only`` and ``second_only``
    go to one of them (e.g. its control port). Returns [(process, metrics port)], primary first."""
    a, _, ma = procs.ps("ps_a", *common, *first_only)
    wait_until(lambda: try_scrape(ma).get("rpcps_replica_role", -1) == 2 or not a.alive(), 60, "ps_a to serve as primary")
    assert a.alive(), a.tail()
    b, _, mb = procs.ps("ps_b", *common, *second_only)
    wait_until(lambda: try_scrape(ma).get("rpcps_replica_standby_in_sync", -1) == 1 or not b.alive(), 60, "ps_b to be in sync")
    assert b.alive(), b.tail()
    return [(a, ma), (b, mb)]


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (read from /proc, children before grandchildren)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces; ppid is the 2nd field after it.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    queue = [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def _state(stat_file: Path) -> str | None:
    """The state letter of a /proc ``stat`` file (a process's or one thread's), None once it is gone."""
    try:
        return stat_file.read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


_STOPPED = ("T", "t")


def pid_stopped(pid: int) -> bool:
    """True while ``pid`` is stopped (SIGSTOP: a signal waits until it is continued)."""
    return _state(Path(f"/proc/{pid}/stat")) in _STOPPED


def every_thread_stopped(pid: int) -> bool:
    """True once every thread of ``pid`` is stopped. SIGSTOP stops each thread when it next returns
    to user space: ``os.kill`` returns before, and a thread inside a system call (a snapshot's rename
    after its fsync) finishes that call first. What a test reads after a SIGSTOP waits for this."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    return bool(tasks) and all(_state(t / "stat") in _STOPPED for t in tasks)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    state = _state(Path(f"/proc/{pid}/stat"))
    return state is not None and state != "Z"


def child_env(extra_pythonpath: Iterable[Path | str] = (), **overrides: str) -> dict[str, str]:
    """The environment of a child: this repo (and ``extra_pythonpath``) importable, one intra-op thread.

    One thread per process because the test machine has two cores shared by a server and several
    workers; oversubscribed OpenMP threads slow every process down several times. Inherited
    ``RPCPS_*`` variables are dropped so the developer's shell cannot change what a test runs. An
    inherited ``PYTHONPATH`` is kept after this repo's: dependencies installed with
    ``pip install --target`` (as on a machine whose site-packages is read-only) stay importable.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPCPS_")}
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *map(str, extra_pythonpath), *inherited])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(overrides)
    return env


@dataclass
class Proc:
    """One started process, its logs, and ways to hurt it."""

    name: str
    argv: list[str]
    popen: subprocess.Popen | ForkedProcess
    stdout_path: Path
    stderr_path: Path
    _files: list[IO[bytes]] = field(default_factory=list, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        parts = []
        for label, path in (("stdout", self.stdout_path), ("stderr", self.stderr_path)):
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
            parts.append(f"--- {self.name} {label} (last {len(text)} lines) ---\n" + "\n".join(text))
        return "\n".join(parts)

    def wait(self, timeout: float) -> int:
        """Waits for the process to exit and returns its exit code.

        Raises:
            AssertionError: with the log tail, when it is still running after ``timeout`` seconds.
        """
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} (pid {self.pid}) still running after {timeout:g}s\n{self.tail()}") from None

    def send(self, sig: int) -> None:
        """Sends ``sig`` to the process itself (not its group), if it is still running."""
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL: the process dies at once, without cleanup (a crash)."""
        self.send(signal.SIGKILL)

    def freeze(self) -> None:
        """SIGSTOP: the process hangs; its sockets stay open (a hung peer)."""
        self.send(signal.SIGSTOP)

    def thaw(self) -> None:
        self.send(signal.SIGCONT)


class ProcessGroup:
    """The processes one test started. ``reap`` ends them all; the ``procs`` fixture calls it."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, Proc] = {}

    def __getitem__(self, name: str) -> Proc:
        return self.procs[name]

    def start(
        self,
        name: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        extra_pythonpath: Iterable[Path | str] = (),
        script: Path | str | None = ENTRY,
        program: Sequence[str] | None = None,
    ) -> Proc:
        """Starts ``python script args...`` (``python args...`` when ``script`` is None) in the repo root.

        ``program`` replaces ``python script`` with any command (a shell script, ``ip netns exec ...``).
        stdout and stderr go to ``<name>.out`` and ``<name>.err`` in the log folder. The process dies
        with the test process (``dies_with_us``); ``Proc.argv`` is the command without that wrapper.
        """
        if name in self.procs and self.procs[name].alive():
            raise ValueError(f"a process named {name!r} is still running in this test")
        head = list(program) if program is not None else [sys.executable, *([str(script)] if script is not None else [])]
        argv = [*head, *map(str, args)]
        out = open(self.log_dir / f"{name}.out", "ab")  # noqa: SIM115 - closed by reap
        err = open(self.log_dir / f"{name}.err", "ab")  # noqa: SIM115 - closed by reap
        env = dict(env) if env is not None else child_env(extra_pythonpath)
        forks = _fork_server() if program is None and script is not None else None
        popen: subprocess.Popen | ForkedProcess
        if forks is not None and forks.can_run(env, REPO):
            with open(os.devnull, "rb") as devnull:
                popen = forks.spawn(script, argv[2:], env, stdin=devnull.fileno(), stdout=out.fileno(), stderr=err.fileno())
        else:
            popen = subprocess.Popen(
                dies_with_us(argv), cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
            )
        proc = Proc(name, argv, popen, Path(out.name), Path(err.name), [out, err])
        self.procs[name] = proc
        return proc

    def ps(self, name: str = "ps", *args: str, port: int | None = None, **kwargs: object) -> tuple[Proc, int, int]:
        """Starts a server on 127.0.0.1 with free ports. Returns (process, rpc port, metrics port).

        The server does not supervise itself unless ``args`` says ``--supervise on``: tests signal,
        freeze and kill the serving process by its pid, and a supervisor in between would restart it.
        """
        if port is None:
            port, metrics_port = free_ports(2)
        else:
            metrics_port = free_port()
        proc = self.start(
            name,
            [
                "ps", "--listen", f"127.0.0.1:{port}", "--metrics-port", str(metrics_port), "--metrics-addr", "127.0.0.1",
                *(() if "--control-port" in args else ("--control-port", "0", "--control-addr", "127.0.0.1")),
                *(() if "--supervise" in args else ("--supervise", "off")), *args,
            ],
            **kwargs,  # type: ignore[arg-type]
        )
        return proc, port, metrics_port

    def store(self, name: str = "store", *args: str, port: int | None = None, **kwargs: object) -> tuple[Proc, int, int]:
        """Starts a ``rpcps store`` coordinator on 127.0.0.1 with free ports (``port``: on that one, as a
        supervisor restarts it). Returns (process, store port, metrics port)."""
        if port is None:
            port, metrics_port = free_ports(2)
        else:
            metrics_port = free_port()
        proc = self.start(
            name,
            ["store", "--listen", f"127.0.0.1:{port}", "--metrics-port", str(metrics_port), "--metrics-addr", "127.0.0.1", *args],
            **kwargs,  # type: ignore[arg-type]
        )
        return proc, port, metrics_port

    def worker(self, name: str, port: int | str, index: int, num_workers: int, *args: str, **kwargs: object) -> tuple[Proc, int]:
        """Starts a worker against the server on ``port`` (a str: the ``--ps`` as it is, e.g. an
        ``etcd://`` store). Returns (process, metrics port)."""
        metrics_port = free_port()
        proc = self.start(
            name,
            [
                "worker", "--ps", port if isinstance(port, str) else f"127.0.0.1:{port}", "--worker-index", str(index), "--num-workers", str(num_workers),
                "--metrics-port", str(metrics_port), "--metrics-addr", "127.0.0.1", *args,
            ],
            **kwargs,  # type: ignore[arg-type]
        )
        return proc, metrics_port

    def tails(self) -> str:
        """Every process's log tail; those that exited with an error status of their own come last,
        nearest the assertion: a long failure report is cut from the front (CI's summary keeps its
        end), and the process that failed is what it must show."""
        return "\n".join(p.tail() for p in sorted(self.procs.values(), key=lambda p: (p.returncode or 0) > 0))

    def stacks(self, timeout_s: float = 5.0) -> str:
        """The Python stacks of every running, not stopped, process of this group started with this
        interpreter, each sent SIGUSR1 (``cli.main`` has faulthandler print every thread's stack on
        it): what each one waits for, for a test that timed out. A process without that handler (a
        helper script) dies of the signal, so only a failed test's teardown calls this, before it reaps."""
        marks: dict[str, int] = {}
        for proc in self.procs.values():
            if proc.alive() and proc.argv[:1] == [sys.executable] and not pid_stopped(proc.pid):
                marks[proc.name] = proc.stderr_path.stat().st_size
                proc.send(signal.SIGUSR1)

        def dump(name: str) -> str:
            with self.procs[name].stderr_path.open("rb") as err:
                err.seek(marks[name])
                return err.read().decode(errors="replace")

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(_DUMP_ENDED.search(dump(n)) or not self.procs[n].alive() for n in marks):
            time.sleep(0.05)
        return "\n".join(f"--- {name} (pid {self.procs[name].pid}) ---\n{dump(name)}" for name in marks)

    def reap(self, grace_s: float = 15.0) -> list[str]:
        """Ends every process (and its descendants): SIGTERM, then SIGKILL after ``grace_s``.

        Stopped processes are continued so they can act on SIGTERM. Returns the names of the
        processes that had to be killed. Never raises for a process that is already gone.
        """
        targets: dict[int, str] = {}
        for proc in self.procs.values():
            if proc.alive():
                targets[proc.pid] = proc.name
            for pid in descendants(proc.pid):
                targets.setdefault(pid, f"{proc.name}/child {pid}")
        for pid in targets:
            _signal(pid, signal.SIGTERM)
            _signal(pid, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        own = {p.pid: p for p in self.procs.values()}
        while time.monotonic() < deadline and any(_running(pid, own) for pid in targets):
            time.sleep(0.05)
        killed = [name for pid, name in targets.items() if _running(pid, own)]
        for pid in targets:
            if _running(pid, own):
                _signal(pid, signal.SIGKILL)
        for proc in self.procs.values():
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:  # unkillable (D state); say so rather than hang teardown
                killed.append(f"{proc.name} (would not die)")
            for f in proc._files:
                f.close()
        return killed


def _running(pid: int, own: Mapping[int, Proc]) -> bool:
    # Our own children must be waited for (poll) or they linger as zombies; others are reaped by init.
    if pid in own:
        return own[pid].alive()
    return pid_alive(pid)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
