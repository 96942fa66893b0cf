"""Validation of the replication settings (``ps.config.ReplicationConfig``)."""

from __future__ import annotations

import pytest

from ps.config import ReplicationConfig, ServerRunConfig
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
