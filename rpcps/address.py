"""HOST:PORT addresses as settings take and print them."""

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
