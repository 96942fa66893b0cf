"""rpcps.scrape: a /metrics endpoint that dies mid-reply reads as "not answering", not as a crash.

A chaos run killed a server while the harness read its /metrics: the reply announced 28 kB and
ended at 0, and http.client's IncompleteRead (not an OSError) escaped try_scrape. Real sockets on
loopback, a fake endpoint that does exactly that.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from rpcps.scrape import scrape_metrics, try_scrape

pytestmark = pytest.mark.timeout(30)


def _serve_once(reply: bytes) -> Iterator[int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        thread.join(timeout=10)
        listener.close()


@pytest.fixture
def cut_off_port() -> Iterator[int]:
    yield from _serve_once(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 28012\r\n\r\n")


@pytest.fixture
def whole_port() -> Iterator[int]:
    body = b"# TYPE rpcps_x_total counter\nrpcps_x_total 3.0\n"
    yield from _serve_once(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


def test_a_reply_cut_off_reads_as_not_answering(cut_off_port: int) -> None:
    assert try_scrape(cut_off_port) == {}


def test_a_reply_cut_off_raises_oserror_naming_the_endpoint(cut_off_port: int) -> None:
    with pytest.raises(OSError, match=f"127.0.0.1:{cut_off_port}/metrics answered with a broken reply"):
        scrape_metrics(cut_off_port)


def test_a_whole_reply_is_read(whole_port: int) -> None:
    assert try_scrape(whole_port) == {"rpcps_x_total": 3.0}
