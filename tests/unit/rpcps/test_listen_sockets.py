"""ListenerWatch finds this process's listening sockets once and reports the ones that stop
listening, with real sockets (Linux /proc)."""

from __future__ import annotations

import socket
import sys

import pytest

from rpcps.listen_sockets import ListenerWatch, listening_sockets

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
