"""Free TCP ports on this machine, for launchers and tests that bind several servers at once."""

from __future__ import annotations

import socket
import threading
from collections import deque

_RECENT = 4096
"""How many handed-out ports this process remembers. The kernel may give a port that was just
released to the next bind of port 0; a launcher that picks a port per child (``local`` picks one
per server, metrics endpoint and control plane) must not hand the same one to two children that
have not bound theirs yet."""

_handed_out: deque[int] = deque(maxlen=_RECENT)
_lock = threading.Lock()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago, none handed out by this process among its
    last few thousand (all stay bound until every one is chosen).

    The kernel may hand a port out again once released: bind it soon.
    """
    sockets = []
    try:
        with _lock:
            chosen: list[int] = []
            while len(chosen) < n:
                s = socket.socket()
                s.bind((host, 0))
                sockets.append(s)  # held bound: the kernel cannot offer it again in this loop
                port = s.getsockname()[1]
                if port not in _handed_out:
                    chosen.append(port)
            _handed_out.extend(chosen)
            return chosen
    finally:
        for s in sockets:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
