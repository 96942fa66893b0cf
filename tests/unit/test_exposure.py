"""Safe defaults: a port that leaves the machine needs its protection, or the server refuses to start."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cli.main import parse
from ps.config import ControlConfig, ServerRunConfig
from ps.lifecycle.exposure import Exposed, check
from rpcps.address import Address, is_loopback_host
from rpcps.transport.config import TransportOptions

SECRET = TransportOptions(job_secret_file="/etc/rpcps/job-secret")


def test_the_defaults_listen_on_loopback_only() -> None:
    config = ServerRunConfig()
    assert config.listen.is_loopback and is_loopback_host(config.control.addr) and is_loopback_host(config.process.metrics_addr)
    check(config, {})


@pytest.mark.parametrize(
    ("config", "environ", "expected"),
    [
        (ServerRunConfig(listen=Address("0.0.0.0", 29500)), {}, "--trust-network"),
        (ServerRunConfig(listen=Address("10.0.0.1", 29500), trust_network=True), {}, "--job-secret-file"),
        (ServerRunConfig(), {"TP_SOCKET_IFNAME": "eth0"}, "TP_SOCKET_IFNAME=eth0"),
        (ServerRunConfig(control=ControlConfig(addr="0.0.0.0")), {}, "--control-token-file"),
    ],
)
def test_an_exposed_port_without_its_protection_is_refused(config: ServerRunConfig, environ: dict[str, str], expected: str) -> None:
    with pytest.raises(Exposed, match=expected) as info:
        check(config, environ)
    assert "\n" not in str(info.value), "one line that says why"


def test_with_their_protection_exposed_ports_are_fine() -> None:
    config = ServerRunConfig(
        listen=Address("0.0.0.0", 29500), trust_network=True, transport=SECRET,
        control=ControlConfig(addr="0.0.0.0", token_file="/etc/rpcps/control-token"),
    )
    check(replace(config, process=replace(config.process, metrics_addr="0.0.0.0")), {"TP_SOCKET_IFNAME": "eth0"})
    check(ServerRunConfig(), {"TP_SOCKET_IFNAME": "lo"})


def test_a_shard_is_exposed_when_its_store_is() -> None:
    shard = ServerRunConfig(store=Address("10.0.0.1", 29500), core=replace(ServerRunConfig().core, shard_index=1, shard_count=2))
    with pytest.raises(Exposed, match="store address 10.0.0.1:29500"):
        check(shard, {})


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.1", "::", "ps-0", "localhost.example.com"])
def test_other_hosts(host: str) -> None:
    assert not is_loopback_host(host)


def test_flags_reach_the_check() -> None:
    _, config = parse(["ps", "--listen", "0.0.0.0:29500", "--trust-network", "on", "--job-secret-file", "/s", "--supervise", "off"])
    assert config.trust_network and config.transport.job_secret_file == "/s" and not config.supervise
    check(config, {})
