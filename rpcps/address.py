"""HOST:PORT addresses as settings take and print them, and the etcd URL a `--store`/`--ps` may be instead."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlencode


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
_TLS_PARAMETERS = ("cacert", "cert", "key")
"""The URL's query parameters, named as etcdctl's flags are."""


@dataclass(frozen=True)
class EtcdTls:
    """TLS to etcd's client port: the CA that signed the members' certificates, and this process's own
    certificate and key where etcd checks its clients' (``--client-cert-auth``). PEM files, read when
    a client is made; checked readable here, so a wrong path is refused at start, naming the file."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("an etcd URL's cert= and key= go together (this process's client certificate and its key)")
        for what, path in (("cacert", self.ca_file), ("cert", self.cert_file), ("key", self.key_file)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"the etcd URL's {what}={path} is not a readable file: give the PEM file's path on this host")

    def query(self) -> str:
        """``cacert=...&cert=...&key=...``, as parsed."""
        given = (("cacert", self.ca_file), ("cert", self.cert_file), ("key", self.key_file))
        return urlencode([(k, v) for k, v in given if v is not None], safe="/")

    def credentials(self) -> tuple[bytes, bytes | None, bytes | None]:
        """(CA, key, certificate chain) as gRPC's ``ssl_channel_credentials`` takes them."""
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path is not None else None

        return read(self.ca_file) or b"", read(self.key_file), read(self.cert_file)


@dataclass(frozen=True)
class EtcdAddress:
    """``etcd://HOST:PORT[,HOST:PORT...]/PREFIX[?cacert=FILE[&cert=FILE&key=FILE]]``: the group's store
    kept in an etcd cluster, under a prefix of its own (one per job: two jobs under one prefix would read
    each other's member lists and views); with ``cacert``, over TLS (and with ``cert``/``key``, with a
    client certificate), as a PostgreSQL URL carries ``sslrootcert``."""

    endpoints: tuple[Address, ...]
    prefix: str
    """Without leading or trailing '/'; every key of the job is ``/<prefix>/...``."""
    tls: EtcdTls | None = None

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError(f"{ETCD_SCHEME}... needs at least one HOST:PORT of an etcd member")
        if not self.prefix or self.prefix != self.prefix.strip("/"):
            raise ValueError(
                f"an etcd store needs a key prefix of its own for this job, as in {ETCD_SCHEME}127.0.0.1:2379/myjob "
                f"(got {self.prefix!r})"
            )

    def __str__(self) -> str:
        query = f"?{self.tls.query()}" if self.tls is not None else ""
        return f"{ETCD_SCHEME}{','.join(map(str, self.endpoints))}/{self.prefix}{query}"

    @classmethod
    def parse(cls, text: str) -> EtcdAddress:
        if not text.startswith(ETCD_SCHEME):
            raise ValueError(f"{text!r} is not {ETCD_SCHEME}HOST:PORT[,HOST:PORT...]/PREFIX")
        url, _, query = text.partition("?")
        hosts, sep, prefix = url[len(ETCD_SCHEME):].partition("/")
        if not sep:
            raise ValueError(f"{text!r} has no /PREFIX: give this job a key prefix of its own, as in {ETCD_SCHEME}{hosts}/myjob")
        return cls(tuple(Address.parse(h) for h in hosts.split(",") if h), prefix.strip("/"), _parse_tls(text, query))

    @property
    def is_loopback(self) -> bool:
        return all(e.is_loopback for e in self.endpoints)


def _parse_tls(text: str, query: str) -> EtcdTls | None:
    if not query:
        return None
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise ValueError(f"{text!r}: its query is not NAME=VALUE&...") from None
    given = dict(pairs)
    unknown = sorted(set(given) - set(_TLS_PARAMETERS))
    if unknown or len(given) < len(pairs):
        raise ValueError(f"{text!r}: unknown or repeated parameter {', '.join(unknown) or 'name'}; "
                         f"an etcd URL takes {', '.join(f'{p}=FILE' for p in _TLS_PARAMETERS)} once each (TLS)")
    if "cacert" not in given:
        raise ValueError(f"{text!r}: TLS needs cacert=FILE, the CA that signed the etcd members' certificates")
    return EtcdTls(given["cacert"], given.get("cert"), given.get("key"))


StoreAddress = Address | EtcdAddress
"""Where the group's store is: HOST:PORT of a `rpcps store` coordinator (or an embedded server), or an etcd cluster."""


def parse_store_address(text: str) -> StoreAddress:
    """HOST:PORT, or ``etcd://HOST:PORT[,HOST:PORT...]/PREFIX``."""
    return EtcdAddress.parse(text) if text.startswith(ETCD_SCHEME) else Address.parse(text)
