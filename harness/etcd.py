"""A real etcd cluster for tests: N members (Debian's ``etcd-server``) on loopback with free ports,
or one member per test host (a network namespace, its address and etcd's own ports 2379/2380); data
directories under the test's tmp folder, started and reaped as processes of the test's ``ProcessGroup``.

Elections are tuned for loopback (50 ms heartbeats, 500 ms election timeout) so a killed leader is
replaced in about a second, as a production cluster on a LAN would be configured to.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.procs import Proc, ProcessGroup, wait_until
from rpcps.ports import free_ports

HEARTBEAT_MS = 50
ELECTION_MS = 500
CLIENT_PORT, PEER_PORT = 2379, 2380
"""etcd's own ports, for members on hosts of their own."""


def available() -> str | None:
    """Why no cluster can be started here (None when it can): etcd and etcdctl must be installed."""
    missing = [tool for tool in ("etcd", "etcdctl") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not installed (tools/setup.sh --test installs etcd-server and etcd-client)" if missing else None


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    proc: Proc | None = None
    address: str = "127.0.0.1"
    prefix: list[str] = field(default_factory=list)
    """The command line its programs run under (e.g. ``ip netns exec NS``: its host)."""

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.client_port}"


class EtcdCluster:
    """Starts the members and waits until the cluster has a leader that answers.

    ``hosts``: one member per (address, command prefix) pair, e.g. a test network's host and its
    ``ip netns exec NS``; without it, ``size`` members on loopback.
    """

    def __init__(
        self, procs: ProcessGroup, data: Path, size: int = 3, hosts: Sequence[tuple[str, list[str]]] = (),
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        """``tls``: (certificate, key) for every member's client port, the certificate its own CA (a
        self-signed one for 127.0.0.1); members then also require clients to present a certificate
        that CA signed (``--client-cert-auth``)."""
        self.tls = tls
        if hosts:
            self.members = [Member(f"etcd{i}", CLIENT_PORT, PEER_PORT, address=a, prefix=p) for i, (a, p) in enumerate(hosts)]
        else:
            ports = free_ports(2 * size)
            self.members = [Member(f"etcd{i}", ports[2 * i], ports[2 * i + 1]) for i in range(size)]
        self._procs = procs
        self._data = data
        initial = ",".join(f"{m.name}=http://{m.address}:{m.peer_port}" for m in self.members)
        for member in self.members:
            member.proc = procs.start(member.name, self._argv(member, initial), script=None, program=[*member.prefix, "etcd"])
        wait_until(self.leader, 30, "the etcd cluster to elect a leader", interval=0.1)

    def _argv(self, member: Member, initial: str) -> list[str]:
        scheme = "https" if self.tls else "http"
        tls = [] if self.tls is None else [
            "--cert-file", str(self.tls[0]), "--key-file", str(self.tls[1]), "--trusted-ca-file", str(self.tls[0]), "--client-cert-auth",
        ]
        return [
            *tls, "--name", member.name, "--data-dir", str(self._data / member.name),
            "--listen-client-urls", f"{scheme}://{member.endpoint}", "--advertise-client-urls", f"{scheme}://{member.endpoint}",
            "--listen-peer-urls", f"http://{member.address}:{member.peer_port}",
            "--initial-advertise-peer-urls", f"http://{member.address}:{member.peer_port}",
            "--initial-cluster", initial, "--initial-cluster-state", "new", "--initial-cluster-token", self._data.name,
            "--heartbeat-interval", str(HEARTBEAT_MS), "--election-timeout", str(ELECTION_MS), "--log-level", "warn",
        ]

    def url(self, prefix: str, client_certificate: bool = True) -> str:
        """``etcd://`` with every member's endpoint and ``prefix``: what ``--store``/``--ps`` take; on a
        TLS cluster with its CA (and, unless told otherwise, the client certificate it requires)."""
        url = f"etcd://{','.join(m.endpoint for m in self.members)}/{prefix}"
        if self.tls is None:
            return url
        cert, key = self.tls
        return f"{url}?cacert={cert}" + (f"&cert={cert}&key={key}" if client_certificate else "")

    def _ctl_tls(self) -> list[str]:
        return [] if self.tls is None else ["--cacert", str(self.tls[0]), "--cert", str(self.tls[0]), "--key", str(self.tls[1])]

    def alive(self) -> list[Member]:
        return [m for m in self.members if m.proc is not None and m.proc.alive()]

    def leader(self) -> Member | None:
        """The member that says it leads (asked through etcdctl); None while there is none."""
        live = self.alive()
        if not live:
            return None
        result = subprocess.run(
            [*live[0].prefix, "etcdctl", "--endpoints", ",".join(m.endpoint for m in live), *self._ctl_tls(), "endpoint", "status", "-w", "json"],
            env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin:/usr/local/bin:/usr/sbin:/sbin"},
            capture_output=True, text=True, timeout=10, check=False,
        )
        try:
            statuses = json.loads(result.stdout)
        except ValueError:
            return None
        for status in statuses:
            header = status["Status"]["header"]
            if status["Status"].get("leader") == header["member_id"]:
                return next((m for m in live if m.endpoint == status["Endpoint"]), None)
        return None
