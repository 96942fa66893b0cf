"""ListenerWatch finds this process's listening sockets once and reports the ones that stop
listening, with real sockets (Linux /proc)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from rpcps.listen_sockets import ListenerWatch, _still_listening, listening_sockets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_closed_listener_is_reported_and_the_others_and_excluded_ports_are_not() -> None:
    kept, closed, excluded = _listener(), _listener(), _listener()
    connected = socket.create_connection(kept.getsockname())  # a connected socket is no listener
    try:
        ports = {s.getsockname()[1] for s in (kept, closed, excluded)}
        assert ports <= set(listening_sockets().values())
        watch = ListenerWatch(exclude_ports={excluded.getsockname()[1]})
        assert set(watch.watched.values()) >= {kept.getsockname()[1], closed.getsockname()[1]}
        assert excluded.getsockname()[1] not in watch.watched.values()
        assert watch.lost() == []
        lost_port = closed.getsockname()[1]
        closed.close()
        assert watch.lost() == [lost_port]
    finally:
        for s in (kept, closed, excluded, connected):
            s.close()


def test_a_listener_shut_down_but_not_closed_is_reported() -> None:
    listener = _listener()
    try:
        port = listener.getsockname()[1]
        watch = ListenerWatch(exclude_ports=set())
        assert port in watch.watched.values() and port not in watch.lost()
        listener.shutdown(socket.SHUT_RDWR)  # the descriptor stays open; it no longer listens
        assert port in watch.lost()
    finally:
        listener.close()


def test_a_descriptor_reused_by_something_else_is_no_listener_and_its_copy_is_closed(tmp_path: Path) -> None:
    """Between the look at /proc/self/fd and the check, a closed listener's number may be reused (by a
    file here): it is not listening, and the copy the check made is closed again (checked every
    second, a leaked copy would pile up)."""
    with open(tmp_path / "f", "wb") as f:
        fd = f.fileno()
        before = len(os.listdir("/proc/self/fd"))
        assert not _still_listening(fd, os.fstat(fd).st_ino)  # the inode matches; it is no socket
        assert not _still_listening(fd, os.fstat(fd).st_ino + 1)  # another inode
        assert len(os.listdir("/proc/self/fd")) == before
