"""Finds this process's listening TCP sockets through /proc (Linux), without connecting to them.

Used to watch the RPC agent's own listener: a stray TCP connection to TensorPipe's listening port
makes TensorPipe close that listener for good (measured: shared/research/torch-rpc-facts.md), after
which no new worker can join. Probing the port would itself close it, so we only look: at the
kernel's socket table to find the listeners, at this process's own descriptors to watch them.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

_LISTEN = "0A"


def listening_sockets() -> dict[int, int]:
    """{socket inode: local port} of this process's TCP sockets in LISTEN state."""
    mine = {inode for _, inode in _socket_fds()}
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


def _socket_fds() -> list[tuple[int, int]]:
    """(descriptor, socket inode) of every socket this process has open."""
    fds: list[tuple[int, int]] = []
    fd_dir = Path("/proc/self/fd")
    try:
        entries = list(fd_dir.iterdir())
    except OSError:
        return fds
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:["):
            fds.append((int(entry.name), int(target[8:-1])))
    return fds


def _still_listening(fd: int, inode: int) -> bool:
    """Whether descriptor ``fd`` still holds socket ``inode`` in LISTEN state (a copy of it is asked,
    so another thread closing ``fd`` meanwhile cannot make this close someone else's socket)."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return False
    try:
        if os.fstat(duplicate).st_ino != inode:  # closed and its number reused meanwhile
            return False
        with socket.socket(fileno=duplicate) as copy:  # closes the copy, whatever it answers
            duplicate = -1
            return bool(copy.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False
    finally:
        if duplicate >= 0:
            os.close(duplicate)


class ListenerWatch:
    """Remembers the listeners present now (minus known ports) and reports when one disappears.

    The kernel's socket table is read once, to find them; after that each is checked through this
    process's own descriptors (``SO_ACCEPTCONN``). The table is the whole host's: reading it every
    second cost a server 12 ms of CPU a second with 1,600 sockets on the host (a test run's).
    """

    def __init__(self, exclude_ports: set[int]) -> None:
        self.watched = {inode: port for inode, port in listening_sockets().items() if port not in exclude_ports}

    def lost(self) -> list[int]:
        """Ports of watched listeners that are no longer listening."""
        if not self.watched:
            return []
        listening = {inode for fd, inode in _socket_fds() if inode in self.watched and _still_listening(fd, inode)}
        return [port for inode, port in self.watched.items() if inode not in listening]
