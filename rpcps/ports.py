"""Free TCP ports on this machine, for launchers and tests that bind several servers at once.

A port is chosen at random below the kernel's ephemeral range (``ip_local_port_range``), where it
can be taken between the choice and the child's bind only by another explicit bind, never as the
source port of an outgoing connection: with torch RPC, gRPC and scrapes opening connections all the
time, a port the kernel handed to ``bind(('', 0))`` was once taken that way before the worker that
was given it for its /metrics could bind it (CI, four test workers). Where the ephemeral range
leaves no room below it, the kernel chooses (port 0).

Processes that choose ports at the same time (the test run's four workers, each ``local`` they start)
could draw the same one: each chosen port is also claimed for ``_CLAIM_S`` seconds with a file in a
per-user directory of the host (``/tmp/rpcps-ports-UID``), which every other process's choice skips.
CI once lost a test that way: ``local`` chose its server's control port, another test's process
bound it in the 10 s before the server got to it. Where the directory cannot be written, choices go
unclaimed, as before.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections import deque
from pathlib import Path

_RECENT = 4096
"""How many handed-out ports this process remembers. The kernel may give a port that was just
released to the next bind of port 0; a launcher that picks a port per child (``local`` picks one
per server, metrics endpoint and control plane) must not hand the same one to two children that
have not bound theirs yet."""

_handed_out: deque[int] = deque(maxlen=_RECENT)
_lock = threading.Lock()
_LOWEST = 10000
"""The band's floor: below it live well-known and registered services' ports."""
_TRIES = 200
_CLAIM_S = 180.0
"""How long a chosen port stays claimed against other processes' choices: long enough for a
loaded two-core host to start the child it was chosen for (a server binds its control port after
torch RPC is up, 10 s and more under a full test run)."""
_CLAIMS = Path(f"/tmp/rpcps-ports-{os.getuid()}")


def _claim(port: int) -> bool:
    """True when no other process claimed ``port`` in the last ``_CLAIM_S`` seconds (now it is ours).

    A claim is a file created with O_EXCL; an expired one is taken over by touching it. Two processes
    taking over the same expired claim in the same instant would both win: they would have to draw the
    same random port at that instant.
    """
    path = _CLAIMS / str(port)
    try:
        _CLAIMS.mkdir(mode=0o700, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        try:
            if time.time() - path.stat().st_mtime < _CLAIM_S:
                return False
            os.utime(path)
            return True
        except OSError:
            return True  # gone between the two calls: nobody holds it
    except OSError:
        return True  # nowhere to write claims: unclaimed, as before claims existed


def _band() -> range | None:
    """Ports below the ephemeral range and above ``_LOWEST``, or None when there are too few."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(_LOWEST, low) if low - _LOWEST >= 1000 else None


def _bind_candidate(host: str, band: range | None, failures: int) -> socket.socket:
    """A socket bound to a random port of ``band`` (the kernel's choice after ``_TRIES`` failures)."""
    s = socket.socket()
    try:
        s.bind((host, random.choice(band) if band is not None and failures < _TRIES else 0))
    except OSError:
        s.close()
        raise
    return s


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago, none handed out by this process among its
    last few thousand or claimed by another process in the last ``_CLAIM_S`` seconds (all stay bound
    until every one is chosen).

    The kernel may hand a port out again once released: bind it soon.
    """
    sockets = []
    try:
        with _lock:
            chosen: list[int] = []
            band, failures = _band(), 0
            while len(chosen) < n:
                try:
                    s = _bind_candidate(host, band, failures)
                except OSError:  # taken: try another
                    failures += 1
                    continue
                sockets.append(s)  # held bound: the kernel cannot offer it again in this loop
                port = s.getsockname()[1]
                if port not in _handed_out and port not in chosen and _claim(port):
                    chosen.append(port)
            _handed_out.extend(chosen)
            return chosen
    finally:
        for s in sockets:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
