"""Validation of the replication settings (``ps.config.ReplicationConfig``)."""

from __future__ import annotations

import pytest

from cli.main import parse
from ps.config import DEFAULT_MAX_REPLICA_LAG, MAX_REPLICA_LAG_LIMIT, ReplicationConfig, ServerRunConfig
from rpcps.address import Address


def test_two_replicas_need_a_store_of_their_own() -> None:
    """A standby cannot take over from a primary that hosts the store every join needs."""
    with pytest.raises(ValueError, match="--replicas 2 needs --store"):
        ServerRunConfig(replication=ReplicationConfig(replicas=2)).check_replicas()
    ServerRunConfig(replication=ReplicationConfig(replicas=2), store=Address("127.0.0.1", 29500)).check_replicas()
    ServerRunConfig().check_replicas()  # one replica hosts the store itself, as before


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"replicas": 3}, "replicas"),
        ({"replica_heartbeat_s": 0}, "replica_heartbeat_s"),
        ({"replica_lease_s": 0.2}, "replica_lease_s"),
        ({"standby_timeout_s": 1.5}, "standby_timeout_s"),  # must be below the lease: drop before a promotion
        ({"store_lease_s": 1.0}, "store_lease_s"),
        ({"digest_every": 0}, "digest_every"),
    ],
)
def test_bad_values_name_their_field(kw: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ReplicationConfig(**kw)  # type: ignore[arg-type]


def test_replication_is_synchronous_unless_asked_and_async_lag_defaults_to_a_bound() -> None:
    assert ReplicationConfig().replication == "sync" and ReplicationConfig().allowed_lag == 0
    assert ReplicationConfig(replication="async").allowed_lag == DEFAULT_MAX_REPLICA_LAG
    assert ReplicationConfig(replication="async", max_replica_lag=3).allowed_lag == 3


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"replication": "eventually"}, "replication must be one of sync, async, got 'eventually'"),
        ({"max_replica_lag": 4}, "add --replication async"),  # a lag bound means nothing when synchronous
        ({"replication": "async", "max_replica_lag": 0}, r"max_replica_lag must be in \[1, 4096\]"),
        ({"replication": "async", "max_replica_lag": MAX_REPLICA_LAG_LIMIT + 1}, "max_replica_lag must be in"),
    ],
)
def test_bad_replication_settings_say_what_to_do(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicationConfig(**kw)  # type: ignore[arg-type]


def test_the_replication_flags_parse_for_ps_and_local() -> None:
    for command in ("ps", "local"):
        _, config = parse([command, "--replicas", "2", "--replication", "async", "--max-replica-lag", "5"])
        replication = (config.server if command == "local" else config).replication
        assert (replication.replication, replication.max_replica_lag) == ("async", 5)


def test_a_lag_bound_without_async_is_a_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(["ps", "--max-replica-lag", "5"])
    assert exited.value.code == 2
    assert "add --replication async" in capsys.readouterr().err
