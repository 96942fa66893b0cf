"""``--store``/``--ps etcd://HOST:PORT[,HOST:PORT...]/PREFIX``: parsed, validated with a clear error,
printed back as given (``local``'s child command lines round-trip), and HOST:PORT still a plain address."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import parse
from ps.config import ServerRunConfig
from rpcps.address import Address, EtcdAddress, EtcdTls, parse_store_address
from rpcps.etcd.client import prefix_end
from rpcps.settings import declared, to_argv
from worker.config import WorkerRunConfig


def test_an_etcd_url_names_every_member_and_the_jobs_prefix() -> None:
    address = parse_store_address("etcd://10.0.0.1:2379,10.0.0.2:2379,[::1]:2379/jobs/mnist/")
    assert address == EtcdAddress((Address("10.0.0.1", 2379), Address("10.0.0.2", 2379), Address("::1", 2379)), "jobs/mnist")
    assert str(address) == "etcd://10.0.0.1:2379,10.0.0.2:2379,[::1]:2379/jobs/mnist"
    assert not address.is_loopback
    assert parse_store_address("etcd://127.0.0.1:1,localhost:2/j").is_loopback
    assert parse_store_address("127.0.0.1:29500") == Address("127.0.0.1", 29500)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("etcd://127.0.0.1:2379", "no /PREFIX"),
        ("etcd://127.0.0.1:2379/", "key prefix of its own"),
        ("etcd:///job", "at least one HOST:PORT"),
        ("etcd://127.0.0.1/job", "is not HOST:PORT"),
    ],
)
def test_a_bad_etcd_url_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_store_address(text)


def test_every_role_that_takes_a_store_takes_an_etcd_url_and_gives_it_back_on_its_command_line() -> None:
    url = "etcd://127.0.0.1:2379,127.0.0.1:2380/job1"
    _, server = parse(["ps", "--store", url, "--replicas", "2"])
    _, worker = parse(["worker", "--ps", url])
    _, evaluator = parse(["evaluate", "--ps", url, "--eval-data", "x:y"])
    assert server.store == worker.ps == evaluator.ps == parse_store_address(url)
    assert not server.hosts_store and server.store_address == parse_store_address(url)
    argv = to_argv(worker, declared(WorkerRunConfig))
    assert url in argv and parse(["worker", *argv])[1] == worker
    assert parse(["ps", *to_argv(server, declared(ServerRunConfig))])[1] == server


def test_an_etcd_url_with_a_ca_file_is_tls_with_or_without_a_client_certificate(tmp_path: Path) -> None:
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tmp_path / name).write_text("PEM")
    ca, cert, key = (str(tmp_path / n) for n in ("ca.pem", "cert.pem", "key.pem"))
    server_only = parse_store_address(f"etcd://127.0.0.1:2379/job?cacert={ca}")
    assert server_only.tls == EtcdTls(ca) and server_only.prefix == "job"
    both = parse_store_address(f"etcd://127.0.0.1:2379/job?cacert={ca}&cert={cert}&key={key}")
    assert both.tls == EtcdTls(ca, cert, key)
    assert parse_store_address(str(both)) == both, "printed back as parsed: local hands it to its children"
    assert both.tls.credentials() == (b"PEM", b"PEM", b"PEM")
    _, worker = parse(["worker", "--ps", str(both)])
    assert worker.ps == both and str(both) in to_argv(worker, declared(WorkerRunConfig))


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("cacert={ca}&cert={ca}", "cert= and key= go together"),
        ("cert={ca}&key={ca}", "TLS needs cacert=FILE"),
        ("cacert={ca}&sslmode=on", "unknown or repeated parameter sslmode"),
        ("cacert={ca}&cacert={ca}", "unknown or repeated parameter"),
        ("cacert", "is not NAME=VALUE"),
        ("cacert=/no/such/ca.pem", "cacert=/no/such/ca.pem is not a readable file"),
    ],
)
def test_a_bad_tls_query_says_what_is_wrong(tmp_path: Path, query: str, says: str) -> None:
    (tmp_path / "ca.pem").write_text("PEM")
    with pytest.raises(ValueError, match=says):
        parse_store_address("etcd://127.0.0.1:2379/job?" + query.format(ca=tmp_path / "ca.pem"))


def test_a_bad_url_on_the_command_line_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["worker", "--ps", "etcd://127.0.0.1:2379"])
    assert "--ps" in capsys.readouterr().err


def test_a_prefix_range_ends_after_the_last_key_that_starts_with_it() -> None:
    assert prefix_end(b"/job/") == b"/job0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"
