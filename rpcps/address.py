"""HOST:PORT addresses as settings take and print them, and the etcd URL a `--store`/`--ps` may be instead."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


def is_loopback_host(host: str) -> bool:
    """True for names and addresses that only this machine can reach (127.0.0.0/8, ::1, localhost).

    Any other name counts as reachable from the network, even one that happens to resolve to loopback.
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Address:
    """HOST:PORT of a rendezvous store (the server's --listen, a worker's --ps)."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("an address needs a host")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Address:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{text!r} is not HOST:PORT")
        try:
            number = int(port)
        except ValueError:
            raise ValueError(f"{text!r}: port {port!r} is not an integer") from None
        return cls(host.strip("[]"), number)

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)


ETCD_SCHEME = "etcd://"


@dataclass(frozen=True)
class EtcdAddress:
    """``etcd://HOST:PORT[,HOST:PORT...]/PREFIX``: the group's store kept in an etcd cluster, under a prefix
    of its own (one per job: two jobs under one prefix would read each other's member lists and views)."""

    endpoints: tuple[Address, ...]
    prefix: str
    """Without leading or trailing '/'; every key of the job is ``/<prefix>/...``."""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError(f"{ETCD_SCHEME}... needs at least one HOST:PORT of an etcd member")
        if not self.prefix or self.prefix != self.prefix.strip("/"):
            raise ValueError(
                f"an etcd store needs a key prefix of its own for this job, as in {ETCD_SCHEME}127.0.0.1:2379/myjob "
                f"(got {self.prefix!r})"
            )

    def __str__(self) -> str:
        return f"{ETCD_SCHEME}{','.join(map(str, self.endpoints))}/{self.prefix}"

    @classmethod
    def parse(cls, text: str) -> EtcdAddress:
        if not text.startswith(ETCD_SCHEME):
            raise ValueError(f"{text!r} is not {ETCD_SCHEME}HOST:PORT[,HOST:PORT...]/PREFIX")
        hosts, sep, prefix = text[len(ETCD_SCHEME):].partition("/")
        if not sep:
            raise ValueError(f"{text!r} has no /PREFIX: give this job a key prefix of its own, as in {ETCD_SCHEME}{hosts}/myjob")
        return cls(tuple(Address.parse(h) for h in hosts.split(",") if h), prefix.strip("/"))

    @property
    def is_loopback(self) -> bool:
        return all(e.is_loopback for e in self.endpoints)


StoreAddress = Address | EtcdAddress
"""Where the group's store is: HOST:PORT of a `rpcps store` coordinator (or an embedded server), or an etcd cluster."""


def parse_store_address(text: str) -> StoreAddress:
    """HOST:PORT, or ``etcd://HOST:PORT[,HOST:PORT...]/PREFIX``."""
    return EtcdAddress.parse(text) if text.startswith(ETCD_SCHEME) else Address.parse(text)
