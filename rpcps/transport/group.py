"""Joining and leaving the torch RPC group: the process-level lifecycle of the transport.

The group is *dynamic* (``world_size=None``): one process is rank 0 and hosts the rendezvous store
(a ``rpcps store`` coordinator, or a single server with ``--listen``, embedded); every other
process takes a fresh rank from a counter in that store, so a restarted process never collides with
the rank of a dead one, and joins under a name of its own (``<base>_r<rank>``) that no later
process reuses: peers cache a dead member's connection per name forever.

Every member keeps one store client of its own for the group's shared facts (``registry``).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time

import torch.distributed as dist
from torch.distributed import rpc

from rpcps.address import Address
from rpcps.jobsecret import JobSecret
from rpcps.transport import membership, protection, request_filter
from rpcps.transport.config import TransportOptions
from rpcps.transport.registry import Registry

logger = logging.getLogger(__name__)

REGISTRY_TIMEOUT_S = 2.0
"""Deadline of one registry operation: a store that does not answer within it is taken as unreachable
(a view change must not hang a replica that is deciding whether to promote)."""

_registry: Registry | None = None


class TransportError(RuntimeError):
    """The transport could not start (port in use, store unreachable)."""


class JoinFailed(TransportError):
    """The store answered but joining the RPC group failed; a fresh process may succeed."""


def _backend_options(address: Address, options: TransportOptions) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=options.rpc_threads,
        rpc_timeout=options.rpc_timeout_s,
        init_method=f"tcp://{address}",
        _transports=list(options.rpc_transports),
        _channels=list(options.channels()),
    )


def _loopback_agent(address: Address) -> None:
    """Keeps TensorPipe's own port on loopback when the group's store is.

    TensorPipe listens on the interface named by TP_SOCKET_IFNAME, or else on the address the
    hostname resolves to, whatever the store's address: a job whose store is on loopback would
    otherwise still answer anyone on the network at each process's TensorPipe port.
    """
    if address.is_loopback and not os.environ.get("TP_SOCKET_IFNAME"):
        os.environ["TP_SOCKET_IFNAME"] = "lo"


def _require_protection() -> None:
    if not protection.protected():
        raise TransportError(
            "refusing to join the RPC group unprotected: call rpcps.transport.protect(...) first "
            "(without it any peer could run any Python function in this process)"
        )


def _init_filtered_rpc(name: str, rank: int, address: Address, options: TransportOptions) -> None:
    """``init_rpc`` of a dynamic group, with an agent that refuses every request but a Python call.

    Raises:
        request_filter.FilterUnavailable: the agent torch built is not the filtering one (it is shut
            down first: this process must not serve a single request unfiltered).
    """
    with request_filter.filtered_agents():
        rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=_backend_options(address, options))
    try:
        request_filter.require_filtered()
    except request_filter.FilterUnavailable:
        shutdown()
        raise


def serve(address: Address, name: str, options: TransportOptions, secret: JobSecret | None = None) -> None:
    """Hosts the rendezvous store on ``address`` and joins the group as rank 0 under ``name``.

    With ``secret``, a member asking to be dropped from the group must prove it holds it.
    """
    _require_protection()
    _loopback_agent(address)
    membership.require_leave_proofs(secret)
    try:
        _init_filtered_rpc(name, 0, address, options)
    except (RuntimeError, dist.DistError) as e:
        text = str(e)
        if "Address already in use" in text or "EADDRINUSE" in text:
            raise TransportError(
                f"port {address.port} on {address.host} is already in use; stop whatever holds it or pick another --listen port"
            ) from e
        raise TransportError(f"could not start the RPC server on {address}: {text.splitlines()[0]}") from e
    _open_registry(address)


def join(address: Address, base_name: str, options: TransportOptions) -> str:
    """Waits for the store at ``address``, takes a fresh rank and joins the group as ``<base_name>_r<rank>``.

    Returns the RPC name.
    """
    _require_protection()
    _loopback_agent(address)
    unreachable = TransportError(
        f"no parameter server answered at {address} within {options.connect_timeout_s:g}s; "
        "start it with `rpcps ps --listen HOST:PORT` or check --ps / --connect-timeout-s"
    )
    deadline = time.monotonic() + options.connect_timeout_s
    if not _wait_for_listener(address, deadline):
        raise unreachable
    try:
        store = dist.TCPStore(
            address.host, address.port, is_master=False,
            timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0)),
        )
        rank = int(store.add(membership.RANK_COUNTER_KEY, 1))
    except (RuntimeError, dist.DistError) as e:
        raise unreachable from e
    if rank > membership.MAX_RANK:
        raise TransportError(f"the server at {address} has handed out {rank} ranks; restart it to reset the counter")
    # torch parses its member list as "name-rank,": a '-' in a name breaks every later join.
    name = f"{base_name}_r{rank}"
    try:
        _init_filtered_rpc(name, rank, address, options)
    except request_filter.FilterUnavailable:
        raise
    except (RuntimeError, dist.DistError) as e:
        raise JoinFailed(f"could not join the server at {address}: {str(e).splitlines()[0]}") from e
    _open_registry(address)
    return name


def _open_registry(address: Address) -> None:
    global _registry
    try:
        client = dist.TCPStore(
            address.host, address.port, is_master=False, timeout=datetime.timedelta(seconds=REGISTRY_TIMEOUT_S)
        )
    except (RuntimeError, dist.DistError) as e:
        raise TransportError(f"joined the group at {address} but could not open a store client: {e}") from e
    _registry = Registry(client)


def group_registry() -> Registry:
    """The group's shared facts (views, replica records), through this process's own store client."""
    if _registry is None:
        raise TransportError("this process has not joined an RPC group yet")
    return _registry


def store_host() -> str:
    """The RPC name of the member that hosts the group's store (rank 0: the coordinator, or an
    embedded server): departing members ask it to drop them from the group."""
    members = membership.store_members()
    host = next((name for name, rank in members.items() if rank == 0), None)
    if host is None:
        # next() alone would end the caller with a bare StopIteration that names nothing.
        raise TransportError(
            f"the RPC group's member list names no rank-0 member (the store's host): {sorted(members.items(), key=lambda m: m[1])}; "
            "was the server or store restarted, or the store changed by another process?"
        )
    return host


def _wait_for_listener(address: Address, deadline: float) -> bool:
    """Polls with plain TCP connects until something listens on the store's port.

    c10d's store client prints a C++ stack trace to stderr for every failed connect; waiting here
    first keeps a process started before its server (or pointed at the wrong port) quiet, with one
    clear error at the deadline. This probes the store's port only: a bare connect to TensorPipe's
    own listening port can wedge that agent (shared/research/torch-rpc-facts.md).
    """
    while True:
        try:
            with socket.create_connection((address.host, address.port), timeout=max(min(deadline - time.monotonic(), 1.0), 0.1)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)


def leave(name: str, store_host: str, secret: JobSecret | None = None, timeout_s: float = 5.0) -> bool:
    """Asks the store's host (``store_host``, an RPC name) to drop member ``name`` before this process exits.

    A process that exits while still listed makes every join in the meantime fail (and then hold
    the group token for the store's timeout), until the host's reaper notices it is gone. Returns
    True when the host confirmed; False (logged at debug) when it could not be asked in time, or
    refused (a host with a job secret needs ``secret``'s proof).
    """
    proof = secret.leave_proof(name) if secret is not None else ""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answer = rpc.rpc_sync(
                store_host, membership.forget_me, args=(name, proof), timeout=max(deadline - time.monotonic(), 0.5)
            )
        except RuntimeError as e:
            logger.debug("could not leave the RPC group: %s", str(e).splitlines()[0])
            return False
        if answer == "refused":
            logger.warning("the server refused to drop %s from the RPC group: this process lacks the job's secret", name)
            return False
        if answer != "busy":
            return True
        if time.monotonic() > deadline:
            logger.debug("could not leave the RPC group: a join held the group token for %.0fs", timeout_s)
            return False
        time.sleep(0.05)  # a join holds the token for milliseconds


def shutdown() -> None:
    """Local, non-graceful shutdown: a graceful one waits forever on any dead peer."""
    try:
        rpc.shutdown(graceful=False)
    except Exception as e:  # noqa: BLE001 - shutting down must not raise over the real error
        logger.debug("rpc shutdown: %s", e)
