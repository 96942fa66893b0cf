"""A private test network of Linux network namespaces: one "host" per namespace, joined by a bridge.

Each host gets its own namespace with a veth ``eth0`` and an address in a private test subnet; the
other end of each veth sits on a bridge inside a namespace of its own. Nothing is created in the
caller's namespace, so the test network has no route to anything outside it. ``cut`` takes a
host's cable out (the bridge-side end goes down: the host's own interface keeps its address, as
when a switch port or cable fails) and ``restore`` puts it back.

Needs root and ``ip`` from iproute2. ``close`` deletes every namespace it made (which deletes the
veths and the bridge with them); callers must end the processes running inside first.
"""

from __future__ import annotations

import ctypes
import os
import queue
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
IFNAME = "eth0"


class NetnsUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no iproute2, or not permitted)."""


@dataclass(frozen=True)
class Host:
    name: str
    """Logical name ("ps", "w0", ...)."""
    netns: str
    """Namespace name (unique per test network)."""
    address: str
    bridge_port: str
    """Name of the veth end on the bridge (inside the bridge namespace)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None when they can (creates and deletes a probe)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs `ip` from iproute2 (apt-get install iproute2)"
    probe = f"rpcps-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class TestNetwork:
    """Hosts on one bridge in subnet ``{prefix}.0/24``; address ``{prefix}.{n}`` for the n-th host."""

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, tag: str, prefix: str = "10.213.7") -> None:
        self.tag = tag
        self.prefix = prefix
        self.bridge_ns = f"rpcps-{tag}-br"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        try:
            self._add_netns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "set", "lo", "up")
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        except RuntimeError:
            self.close()  # the caller never gets an object to close
            raise

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def add_host(self, name: str) -> Host:
        n = len(self.hosts) + 1
        host = Host(name=name, netns=f"rpcps-{self.tag}-{name}", address=f"{self.prefix}.{n}", bridge_port=f"p-{name}")
        self._add_netns(host.netns)
        _ip("-n", self.bridge_ns, "link", "add", host.bridge_port, "type", "veth", "peer", "name", IFNAME, "netns", host.netns)
        _ip("-n", self.bridge_ns, "link", "set", host.bridge_port, "master", "br0", "up")
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", IFNAME)
        _ip("-n", host.netns, "link", "set", IFNAME, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        self.hosts[name] = host
        return host

    def cut(self, name: str) -> None:
        """Unplugs the host: its bridge-side veth goes down, packets to and from it are dropped."""
        _ip("-n", self.bridge_ns, "link", "set", self.hosts[name].bridge_port, "down")

    def restore(self, name: str) -> None:
        _ip("-n", self.bridge_ns, "link", "set", self.hosts[name].bridge_port, "up")

    def argv(self, name: str, command: Sequence[str]) -> list[str]:
        """``command`` run inside the host's namespace."""
        return ["ip", "netns", "exec", self.hosts[name].netns, *command]

    def call_in(self, name: str, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Runs ``fn`` on a fresh thread that has entered the host's network namespace.

        Only that thread switches namespace (a network namespace is per thread), and it ends with
        ``fn``, so the caller's sockets and threads are untouched. Lets a test scrape a /metrics
        endpoint that only exists inside a namespace.
        """
        results: queue.Queue[tuple[bool, object]] = queue.Queue()
        path = f"/run/netns/{self.hosts[name].netns}"

        def run() -> None:
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    _setns(fd)
                finally:
                    os.close(fd)
                results.put((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                results.put((False, e))

        threading.Thread(target=run, name=f"netns-{name}", daemon=True).start()
        try:
            ok, value = results.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"call inside namespace of {name} took more than {timeout:g}s") from None
        if not ok:
            raise value  # type: ignore[misc]
        return value  # type: ignore[return-value]

    def close(self) -> list[str]:
        """Deletes every namespace this network made; returns the errors (never raises).

        A process still running inside one of them (only the test's own processes can be there) is
        killed first: a namespace outlives its name while a process holds it, and so would its veth.
        """
        errors = []
        for name in self._made:
            listed = _ip("netns", "pids", name, check=False)
            for pid in listed.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    errors.append(f"killed pid {pid}, still running in {name}")
                except ProcessLookupError:
                    pass
        for name in reversed(self._made):
            result = _ip("netns", "del", name, check=False)
            if result.returncode != 0:
                errors.append(f"ip netns del {name}: {result.stderr.strip()}")
        self._made.clear()
        return errors


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")
