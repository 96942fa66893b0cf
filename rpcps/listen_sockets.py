"""Finds this process's listening TCP sockets through /proc (Linux), without connecting to them.

Used to watch the RPC agent's own listener: a stray TCP connection to TensorPipe's listening port
makes TensorPipe close that listener for good (measured: shared/research/torch-rpc-facts.md), after
which no new worker can join. Probing the port would itself close it, so we only look at the
kernel's socket table.
"""

from __future__ import annotations

import os
from pathlib import Path

_LISTEN = "0A"


def listening_sockets() -> dict[int, int]:
    """{socket inode: local port} of this process's TCP sockets in LISTEN state."""
    mine = _socket_inodes()
    found: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            inode = int(fields[9])
            if inode in mine:
                found[inode] = int(fields[1].rsplit(":", 1)[1], 16)
    return found


def _socket_inodes() -> set[int]:
    inodes = set()
    fd_dir = Path("/proc/self/fd")
    try:
        entries = list(fd_dir.iterdir())
    except OSError:
        return inodes
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


class ListenerWatch:
    """Remembers the listeners present now (minus known ports) and reports when one disappears."""

    def __init__(self, exclude_ports: set[int]) -> None:
        self.watched = {inode: port for inode, port in listening_sockets().items() if port not in exclude_ports}

    def lost(self) -> list[int]:
        """Ports of watched listeners that are no longer listening."""
        if not self.watched:
            return []
        now = listening_sockets()
        return [port for inode, port in self.watched.items() if inode not in now]
