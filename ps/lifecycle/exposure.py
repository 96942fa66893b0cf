"""Which of a server's ports leave this machine, and the protection each one then needs.

Refused at start (exit 2, one line saying why) rather than warned about: a warning scrolls by, and
the defaults (everything on loopback) never need any of this.

- The torch RPC ports (the store on --listen and every process's TensorPipe port) have no
  authentication and no encryption; rpcps narrows what a peer can do (docs/SECURITY.md), but a
  stranger who reaches them can still crash a process, run builtin operators and read or change
  training traffic. Off loopback they need ``--trust-network`` (an isolated training network) and
  ``--job-secret-file`` (so no stranger can take a worker slot).
- The control plane can pause, checkpoint and stop the server: off loopback it needs a token.
- ``/metrics`` is read-only and holds no secrets: any address, once chosen explicitly (the default
  is loopback).
"""

from __future__ import annotations

from collections.abc import Mapping

from ps.config import ServerRunConfig
from rpcps.address import is_loopback_host

TP_IFNAME = "TP_SOCKET_IFNAME"


class Exposed(ValueError):
    """A port would leave this machine without the protection it needs (the message says which)."""


def rpc_exposed(config: ServerRunConfig, environ: Mapping[str, str]) -> str | None:
    """Why this server's RPC ports are reachable from the network, or None when they are not."""
    store = config.store_address
    if not store.is_loopback:
        return f"the store address {store} is not a loopback address"
    interface = environ.get(TP_IFNAME, "")
    if interface not in ("", "lo"):
        return f"{TP_IFNAME}={interface} puts TensorPipe's port on that interface"
    return None


def check(config: ServerRunConfig, environ: Mapping[str, str]) -> None:
    """Raises Exposed when a port leaves this machine without its protection."""
    why = rpc_exposed(config, environ)
    if why is not None and not config.trust_network:
        raise Exposed(
            f"{why}: torch RPC has no authentication or encryption, so that network must admit only this job's "
            "processes; say it does with --trust-network on (docs/SECURITY.md)"
        )
    if why is not None and config.transport.job_secret_file is None:
        raise Exposed(
            f"{why}: without --job-secret-file anyone who reaches it could take over a worker slot; give every "
            "process of the job the same secret file (docs/SECURITY.md)"
        )
    control = config.control
    if not is_loopback_host(control.addr) and control.token_file is None:
        raise Exposed(
            f"--control-addr {control.addr} is not a loopback address: anyone who reaches it could pause, checkpoint "
            "or shut down the server; pass --control-token-file (docs/CONTROL.md)"
        )
