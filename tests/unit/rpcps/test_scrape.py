"""rpcps.scrape: a /metrics endpoint that dies mid-reply reads as "not answering", not as a crash;
the exposition parser reads what prometheus_client's reads.

A chaos run killed a server while the harness read its /metrics: the reply announced 28 kB and
ended at 0, and http.client's IncompleteRead (not an OSError) escaped try_scrape. Real sockets on
loopback, a fake endpoint that does exactly that.
"""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rpcps.scrape import parse_exposition, scrape_metrics, try_scrape

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


def _prometheus_client_reading(text: str) -> dict[str, float]:
    """What scrape_metrics returned when prometheus_client's parser read the text (the reference)."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if sample.labels:
                key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())) + "}"
            values[key] = sample.value
    return values


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def test_the_parser_reads_what_prometheus_clients_parser_reads_from_a_real_exposition() -> None:
    registry = CollectorRegistry()
    Counter("rpcps_t_pushes", "pushes", ["reason", "path"], registry=registry).labels(
        reason='a "quoted", {braced} = reason', path="C:\\dir\\file\nnext line").inc(3)
    Gauge("rpcps_t_nan", "nan", registry=registry).set(float("nan"))
    Gauge("rpcps_t_inf", "inf", ["sign"], registry=registry).labels(sign="-").set(float("-inf"))
    Histogram("rpcps_t_seconds", "latency", ["role"], registry=registry).labels(role="ps").observe(0.3)
    Info("rpcps_t_build", "build", registry=registry).info({"version": "1.2", "commit": "abc,def"})
    text = generate_latest(registry).decode()
    parsed = parse_exposition(text)
    assert _same(parsed, _prometheus_client_reading(text)), (parsed, text)
    # Label values come back unescaped, as prometheus_client's parser gives them.
    assert parsed['rpcps_t_pushes_total{path="C:\\dir\\file\nnext line",reason="a "quoted", {braced} = reason"}'] == 3.0
    assert parsed['rpcps_t_seconds_bucket{le="+Inf",role="ps"}'] == 1.0


def test_the_parser_takes_timestamps_comments_and_trailing_commas() -> None:
    text = "# HELP x y\n# TYPE x gauge\nx 1.5 1700000000000\nx_l{a=\"1\",} 2\n\ny_total{b=\"q\",a=\"p\"} +Inf\n"
    assert parse_exposition(text) == {"x": 1.5, 'x_l{a="1"}': 2.0, 'y_total{a="p",b="q"}': float("inf")}
    assert _same(parse_exposition(text), _prometheus_client_reading(text))


@pytest.mark.parametrize("line", ["x", 'x{a="1"', 'x{a=1} 2', "x{a=\"1\" b=\"2\"} 3", "x one"])
def test_a_line_that_is_not_the_format_is_refused_naming_it(line: str) -> None:
    with pytest.raises(ValueError, match="not a Prometheus sample line"):
        parse_exposition(line + "\n")
