"""A fork server: Python programs started from an interpreter that has already imported torch.

An rpcps process spends 1.5-2.5 CPU-seconds importing torch before it does anything, and a server
about 1 more in ``torch._dynamo`` (its first optimizer step imports it). Whoever starts many of them
on one host can start them from a ``ForkServer`` instead: one process that imported those libraries
once and forks a child for each request. ``rpcps local`` starts its children and restarts them this
way (measured: a server's start 4.6 CPU-s fresh, 0.7 forked; a worker's 2.7 and 0.4), and so does the
test harness (some 500 processes a run). The child takes the request's standard streams, working
directory, environment, session and ``sys.argv``, then runs the script as ``__main__``, as
``python SCRIPT ARGS...`` would, under that command line as its process title (``ps``, ``top`` and
``/proc/PID/cmdline`` show what it runs, not the fork server's command).

What a fork cannot give a child is its own start of the preloaded libraries: the variables they
read when they load (``OMP_*``, ``TORCH_*``, ``LD_*``, ...) are the fork server's. So a request may
differ from the server's environment only in the variables ``PER_CHILD`` lists (rpcps's own settings
and pytest's, read after the fork); ``ForkServer.can_run`` says whether it does, and the caller
starts anything else as a plain subprocess. Only third-party libraries are preloaded, never rpcps's
own modules: those read their settings (``RPCPS_*``, fail points) when imported, so each child
imports them itself under its own environment. ``random`` reseeds itself in a forked child; nothing
of rpcps draws from numpy's global generator.

The protocol is a Unix socket pair per server (only its starter uses it) and one more per child:
the request carries the child's end of that pair and its three standard streams as file
descriptors; the server answers the pid on it, then the exit code when the child ends (it waits for
its children itself, so none lingers as a zombie). The server ends when its starter closes its end.
"""

from __future__ import annotations

import json
import os
import selectors
import shlex
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["PER_CHILD", "PRELOAD", "ForkServer", "ForkedProcess"]

PRELOAD = ("numpy", "torch", "torch.distributed.rpc", "torch._dynamo", "grpc", "prometheus_client", "setproctitle")
"""What the server imports before it serves: what every rpcps role imports, ``torch._dynamo``,
which torch's optimizers import on their first step, and what titles each child."""

PER_CHILD = ("RPCPS_", "PYTEST_", "PYTHONPATH", "TMPDIR")
"""Variables (or prefixes) a child's environment may set apart from the server's: none of them is
read by a preloaded library as it loads."""

START_TIMEOUT_S = 120.0
"""How long a request waits for its pid: the server imports ``PRELOAD`` first (4-5 s on 2 busy cores)."""

_CODE = struct.Struct("!i")
_MAX_REQUEST = 1 << 20


def _differs(env: Mapping[str, str], base: Mapping[str, str]) -> list[str]:
    return sorted(k for k in set(env) ^ set(base) | {k for k in env if k in base and env[k] != base[k]}
                  if not k.startswith(PER_CHILD))


class ForkedProcess:
    """A child of the fork server, with the part of ``subprocess.Popen``'s interface that waits and signals."""

    def __init__(self, status: socket.socket, pid: int) -> None:
        self._status = status
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(block=False)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(["fork server child", str(self.pid)], timeout or 0.0)
            self._status.settimeout(left)
            self._read(block=True)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, *, block: bool) -> None:
        try:
            data = self._status.recv(_CODE.size, 0 if block else socket.MSG_DONTWAIT)
        except (BlockingIOError, TimeoutError):
            return
        if len(data) == _CODE.size:
            self.returncode = _CODE.unpack(data)[0]
        else:  # the server died before the child: its status is lost (the harness's children die with it)
            self.returncode = 255
        self._status.close()


class ForkServer:
    """Starts and talks to a fork server; ``spawn`` runs a script in a fork of it.

    Start it from a thread that lives as long as its children should: ``pdeathsig`` (the server and
    each child get that signal when their parent thread ends) follows the starting thread.
    """

    def __init__(
        self, env: Mapping[str, str], cwd: Path | str, *, preload_env: Mapping[str, str] | None = None, pdeathsig: int = 0
    ) -> None:
        """``env``: the children's environment (each may differ in ``PER_CHILD``); ``preload_env``: what
        the children's script sets for itself before it imports anything (``os.environ.setdefault``),
        so the libraries load in the server as they would in a fresh start of that script."""
        self.env = dict(env)
        self.preload_env = dict(preload_env or {})
        self.cwd = str(cwd)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._control = ours
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno()), str(pdeathsig), str(os.getpid())],
            cwd=self.cwd, env={**self.env, **self.preload_env}, stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
            start_new_session=True,
        )
        theirs.close()

    def can_run(self, env: Mapping[str, str], cwd: Path | str) -> bool:
        """Whether a child with ``env`` in ``cwd`` would start as a fresh interpreter would."""
        return self.process.poll() is None and str(cwd) == self.cwd and not self._differing(env)

    def _differing(self, env: Mapping[str, str]) -> list[str]:
        preset = [k for k, v in self.preload_env.items() if env.get(k, v) != v]
        return sorted({*_differs({k: v for k, v in env.items() if k not in self.preload_env}, self.env), *preset})

    def spawn(self, script: Path | str, args: Sequence[str], env: Mapping[str, str], *, stdin: int, stdout: int, stderr: int) -> ForkedProcess:
        """Runs ``python script args...`` in a new session, with these file descriptors as its streams.

        Raises:
            ValueError: ``env`` differs from the server's beyond ``PER_CHILD`` (check ``can_run``).
            OSError: the server is gone.
        """
        if differing := self._differing(env):
            raise ValueError(f"the fork server cannot give a child its own {', '.join(differing)}: start it as a subprocess")
        request = json.dumps({"argv": [str(script), *map(str, args)], "env": dict(env)}).encode()
        mine, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            socket.send_fds(self._control, [request], [child_end.fileno(), stdin, stdout, stderr])
        finally:
            child_end.close()
        mine.settimeout(START_TIMEOUT_S)  # the first request waits for the preloading
        try:
            pid = mine.recv(_CODE.size)
        except TimeoutError:
            pid = b""
        mine.settimeout(None)
        if len(pid) != _CODE.size:
            mine.close()
            raise OSError(f"the fork server (pid {self.process.pid}) did not start {script}: it exited with {self.process.poll()}")
        return ForkedProcess(mine, _CODE.unpack(pid)[0])

    def close(self) -> None:
        """Ends the server (its children run on); waits for it."""
        self._control.close()
        try:
            # It reads the close only once its preloading is done, which on a loaded host takes
            # as long as a first request may wait (CI saw 10 s pass and the server killed).
            self.process.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


    def kill(self) -> None:
        """Ends the server at once, preloading or not; for a starter whose children are all reaped
        (one still running gets its ``pdeathsig``)."""
        self._control.close()
        self.process.kill()
        self.process.wait()


# --- the server's side -------------------------------------------------------------------------------

def _prctl_pdeathsig(sig: int, parent: int) -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, sig)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl: no signal will ever come
        os._exit(1)


def _serve(control: socket.socket) -> tuple[dict, list[int]] | None:
    """Forks a child per request until the starter closes ``control``. Returns, in a child, its
    request and file descriptors; in the server, None once it should exit."""
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, status socket)
    while True:
        for key, _ in selector.select():
            if key.fileobj is control:
                message, fds, _flags, _addr = socket.recv_fds(control, _MAX_REQUEST, 4)
                if not message:
                    return None
                request = json.loads(message)
                try:
                    pid = os.fork()
                except OSError:  # no fork (memory, process limit): the starter sees its status socket close
                    for fd in fds:
                        os.close(fd)
                    continue
                if pid == 0:
                    selector.close()
                    control.close()
                    for pidfd, (_pid, status) in children.items():
                        os.close(pidfd)
                        status.close()
                    return request, fds
                status = socket.socket(fileno=fds[0])
                for fd in fds[1:]:
                    os.close(fd)
                status.sendall(_CODE.pack(pid))
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, status)
                selector.register(pidfd, selectors.EVENT_READ)
            else:
                pidfd = key.fd
                pid, status = children.pop(pidfd)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, wait_status = os.waitpid(pid, 0)
                try:
                    status.sendall(_CODE.pack(os.waitstatus_to_exitcode(wait_status)))
                except OSError:  # the starter no longer watches this child
                    pass
                status.close()


def _become(request: dict, fds: list[int], pdeathsig: int, server: int) -> None:
    """Turns a fresh fork into the requested program's process, up to running its script."""
    os.setsid()
    if pdeathsig:
        _prctl_pdeathsig(pdeathsig, server)
    for target, fd in zip((0, 1, 2), fds[1:], strict=True):
        os.dup2(fd, target)
        os.close(fd)
    status_fd = fds[0]
    os.close(status_fd)
    base_pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ.clear()
    os.environ.update(request["env"])
    import tempfile

    tempfile.tempdir = None  # chosen anew from this child's TMPDIR
    script, *_ = request["argv"]
    pythonpath = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [p for p in sys.path[1:] if p not in base_pythonpath]
    sys.path[:] = [str(Path(script).resolve().parent), *pythonpath, *rest]
    sys.argv[:] = request["argv"]
    # As `python SCRIPT ARGS...` would have it: what a process that restarts itself in place execs
    # (rpcps.reexec, the server's supervisor), not the fork server's own command line.
    sys.orig_argv[:] = [sys.orig_argv[0], *request["argv"]]
    import setproctitle

    setproctitle.setproctitle(shlex.join(sys.orig_argv))


def main(argv: Sequence[str]) -> None:
    control_fd, pdeathsig, parent = (int(a) for a in argv)
    if pdeathsig:
        _prctl_pdeathsig(pdeathsig, parent)
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    # setproctitle claims the argv and environment area on first use, and finds nothing to claim once
    # a child has replaced its environment (_become): claimed here, each child inherits the claim.
    sys.modules["setproctitle"].getproctitle()
    server = os.getpid()
    child = _serve(socket.socket(fileno=control_fd))
    if child is None:
        return
    request, fds = child
    _become(request, fds, pdeathsig, server)
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
