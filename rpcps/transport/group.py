"""Joining and leaving the torch RPC group: the process-level lifecycle of the transport.

The group is *dynamic* (``world_size=None``): one process is rank 0 and hosts the rendezvous store
(a ``rpcps store`` coordinator, or a single server with ``--listen``, embedded); every other
process takes a fresh rank from a counter in that store, so a restarted process never collides with
the rank of a dead one, and joins under a name of its own (``<base>_r<rank>``) that no later
process reuses: peers cache a dead member's connection per name forever.

Every member keeps one store client of its own for the group's shared facts (``registry``).

With an etcd store (``--store etcd://...``, ``rpcps.etcd``) no process hosts the store: every
process joins, ranks start at 1, and each member is its own "store host" (it changes the member
list through its own client: ``store_host``, ``leave``).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed import rpc

from rpcps.address import Address, EtcdAddress, StoreAddress
from rpcps.etcd.client import modified_at
from rpcps.etcd.lease import HeldKey
from rpcps.etcd.store import EtcdStore, open_store, register_rendezvous, rendezvous_url
from rpcps.jobsecret import JobSecret
from rpcps.logsafe import peer_text
from rpcps.store_waits import never_wait_for
from rpcps.transport import membership, protection, request_filter
from rpcps.transport.config import TransportOptions
from rpcps.transport.membership import RANK_COUNTER_KEY
from rpcps.transport.rebuild import StoreRebuild, start_rebuild
from rpcps.transport.registry import Registry
from rpcps.transport.store_client import INCARNATION_KEY, SNAPSHOT_CLAIMS_HELD_KEY, ReconnectingStore, open_client
from rpcps.transport.store_client import register_rendezvous as register_tcp_rendezvous
from rpcps.transport.store_client import rendezvous_url as tcp_rendezvous_url

logger = logging.getLogger(__name__)

COORDINATOR_NAME = "store"
"""The RPC name (rank 0) of the ``rpcps store`` coordinator: a store host that holds no training state."""

REGISTRY_TIMEOUT_S = 2.0
"""Deadline of one registry operation: a store that does not answer within it is taken as unreachable
(a view change must not hang a replica that is deciding whether to promote)."""

_registry: Registry | None = None
_etcd: EtcdStore | None = None
"""The registry's store when the group's store is in etcd."""
_tcp_store: ReconnectingStore | None = None
"""The registry's store when a process (a coordinator, or a server with ``--listen``) hosts it."""
_rebuild: StoreRebuild | None = None
"""Writes this member's part back into a restarted coordinator's store (joined members of a TCPStore group)."""
_alive: HeldKey | None = None
"""This member's liveness key, with an etcd store."""
_agent_view: dist.Store | None = None
"""With an etcd store, the group's keys as this process's agent sees them (torch's prefix)."""

ALIVE_PREFIX = "rpcps/alive/"
ALIVE_KEY = ALIVE_PREFIX + "{}"
"""``rpcps/alive/<name>``: held by RPC member ``name`` under its own etcd lease from just before it
joins until it exits; a listed member without one is gone (``membership.prune_departed``)."""
ALIVE_TTL_S = 5
"""The liveness lease: a dead member counts as gone this long after its last renewal (renewed every
third of it). Long beside an etcd election (0.5-1 s measured), so a live member cut off from etcd
for a moment is not taken for dead and dropped from the member list new joiners call; short, since
a join right after a member's death fails on it until then."""


class TransportError(RuntimeError):
    """The transport could not start (port in use, store unreachable)."""


class JoinFailed(TransportError):
    """The store answered but joining the RPC group failed; a fresh process may succeed."""


def _init_method(address: StoreAddress, rank: int) -> str:
    """Where torch's agent rendezvouses: etcd, or the TCPStore that rank 0 hosts (``store_client.host_store``
    starts it there); every other rank's agent gets a client that reconnects (``store_client``)."""
    if isinstance(address, EtcdAddress):
        return rendezvous_url(address)
    register_tcp_rendezvous()
    return tcp_rendezvous_url(address.host, address.port)


def _backend_options(address: StoreAddress, options: TransportOptions, rank: int) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=options.rpc_threads,
        rpc_timeout=options.rpc_timeout_s,
        init_method=_init_method(address, rank),
        _transports=list(options.rpc_transports),
        _channels=list(options.channels()),
    )


def _loopback_agent(address: StoreAddress) -> None:
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


def _init_filtered_rpc(name: str, rank: int, address: StoreAddress, options: TransportOptions) -> None:
    """``init_rpc`` of a dynamic group, with an agent that refuses every request but a Python call.

    Raises:
        request_filter.FilterUnavailable: the agent torch built is not the filtering one (it is shut
            down first: this process must not serve a single request unfiltered).
    """
    with request_filter.filtered_agents():
        rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=_backend_options(address, options, rank))
    try:
        request_filter.require_filtered()
    except request_filter.FilterUnavailable:
        shutdown()
        raise


def serve(
    address: Address,
    name: str,
    options: TransportOptions,
    secret: JobSecret | None = None,
    ranks_after_s: float = 0.0,
    incarnation: str | None = None,
    hold_snapshot_claims_s: float = 0.0,
) -> None:
    """Hosts the rendezvous store on ``address`` and joins the group as rank 0 under ``name``.

    With ``secret``, a member asking to be dropped from the group must prove it holds it. Joining
    processes take ranks only ``ranks_after_s`` from now: a restarted coordinator's store counts
    ranks from 0 until the live members have raised it past theirs (``rpcps.transport.rebuild``).
    ``incarnation`` (a coordinator's, new per start) is in the store before any rank is handed out,
    so every member finds it when it joins. For ``hold_snapshot_claims_s`` from now, a server that
    finds no view for its shard does not serve it from a snapshot (``ps.replication.claim``).
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
    _open_registry(address, options.connect_timeout_s)
    store = _tcp_store
    assert store is not None  # a TCPStore address: _open_registry opened one
    if incarnation is not None:
        store.set(INCARNATION_KEY, incarnation)
    if hold_snapshot_claims_s > 0:
        store.set(SNAPSHOT_CLAIMS_HELD_KEY, "1")
        releaser = threading.Timer(hold_snapshot_claims_s, lambda: store.set(SNAPSHOT_CLAIMS_HELD_KEY, "0"))
        releaser.daemon = True
        releaser.start()
    if ranks_after_s > 0:
        opener = threading.Timer(ranks_after_s, lambda: store.set(membership.RANKS_OPEN_KEY, "1"))
        opener.daemon = True
        opener.start()
    else:
        store.set(membership.RANKS_OPEN_KEY, "1")


def join(address: StoreAddress, base_name: str, options: TransportOptions) -> str:
    """Waits for the store at ``address``, takes a fresh rank and joins the group as ``<base_name>_r<rank>``.

    Returns the RPC name.
    """
    _require_protection()
    _loopback_agent(address)
    deadline = time.monotonic() + options.connect_timeout_s
    rank_client: dist.TCPStore | None = None
    if isinstance(address, EtcdAddress):
        rank = _etcd_rank(address, deadline)
    else:
        rank, rank_client = _store_rank(address, deadline)
    if rank > membership.MAX_RANK:
        raise TransportError(f"the server at {address} has handed out {rank} ranks; restart it to reset the counter")
    # torch parses its member list as "name-rank,": a '-' in a name breaks every later join.
    name = f"{base_name}_r{rank}"
    # torch's failed join leaves the group through a wait for its own join token, which only this
    # process could release: that wait would last the store's whole timeout (rpcps.store_waits).
    never_wait_for(membership.join_token(name), "a member listed in the group did not answer this join (" + (
        f"one that died stays listed until its liveness key in etcd ends, {ALIVE_TTL_S} s after its last renewal)"
        if isinstance(address, EtcdAddress) else "one that died stays listed until the group's janitor removes it, within seconds)"
    ))
    if rank_client is None:  # in etcd, where this process announces that it is alive itself
        assert isinstance(address, EtcdAddress)
        beat_view = _announce_alive(address, name, deadline)
    else:
        beat_view = membership.agent_store(rank_client)
    try:
        with membership.beating_while_joining(beat_view, name):
            _init_filtered_rpc(name, rank, address, options)
    except request_filter.FilterUnavailable:
        raise
    except (RuntimeError, dist.DistError) as e:
        if isinstance(address, EtcdAddress):
            _withdraw(name)
        raise JoinFailed(f"could not join the server at {address}: {str(e).splitlines()[0]}") from e
    _open_registry(address, max(deadline - time.monotonic(), REGISTRY_TIMEOUT_S))
    global _rebuild
    _rebuild = start_rebuild(_tcp_store)  # a coordinator restarted empty gets this member's part back
    return name


def _store_rank(address: Address, deadline: float) -> tuple[int, dist.TCPStore]:
    """A fresh rank from the counter of the store ``address`` hosts (waiting for it until ``deadline``),
    and the client that took it (the join beats through it)."""
    unreachable = TransportError(
        f"no parameter server answered at {address} within {deadline - time.monotonic():.0f}s; "
        "start it with `rpcps ps --listen HOST:PORT` or check --ps / --connect-timeout-s"
    )
    if not _wait_for_listener(address, deadline):
        raise unreachable
    try:
        left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0))
        store = open_client(address.host, address.port, left.total_seconds(), left)
        store.wait([membership.RANKS_OPEN_KEY])  # a coordinator that just restarted: live members' ranks first
        return int(store.add(membership.RANK_COUNTER_KEY, 1)), store
    except (RuntimeError, dist.DistError) as e:
        raise unreachable from e


def _etcd_rank(address: EtcdAddress, deadline: float) -> int:
    """A fresh rank from the counter in etcd (no process hosts the store, so rank 0 is nobody's)."""
    register_rendezvous()
    store = open_store(address, REGISTRY_TIMEOUT_S)
    try:
        while True:
            try:
                return int(store.add(membership.RANK_COUNTER_KEY, 1))
            except dist.DistStoreError as e:
                if time.monotonic() >= deadline:
                    raise TransportError(
                        f"the etcd cluster {address} did not answer: {e}; start it, or check --store / --ps and --connect-timeout-s"
                    ) from e
                time.sleep(0.5)
    finally:
        store.client.close()


def _announce_alive(address: EtcdAddress, name: str, deadline: float) -> dist.Store:
    """With an etcd store, before joining: takes this member's liveness key (held until it exits),
    then drops from the member list every member whose key ended, and frees the group token if one
    of them died holding it. With no process hosting the store, nothing else does that when no other
    member is joined (a lone server restarting, a whole job started again on its old prefix).
    Returns the group's keys as the agent will see them (``membership.agent_store``)."""
    global _etcd, _alive, _agent_view
    store = _etcd = open_store(address, REGISTRY_TIMEOUT_S)
    _agent_view = view = membership.agent_store(store)
    _alive = HeldKey(store.client, store.key(ALIVE_KEY.format(name)), name, ALIVE_TTL_S, on_retaken=_relist).start()
    if not _alive.wait_taken(max(deadline - time.monotonic(), REGISTRY_TIMEOUT_S)):
        raise TransportError(f"could not take this process's liveness key in the etcd cluster {address}; is every member reachable?")
    try:
        gone = membership.prune_departed(_agent_view, name, lambda: {k.removeprefix(ALIVE_PREFIX) for k in store.keys_under(ALIVE_PREFIX)})
    except (RuntimeError, dist.DistError) as e:
        logger.warning("could not check the group's member list in etcd before joining (%s); joining as it is", e)
        return view
    if gone:
        logger.warning("dropped %d members whose processes are gone from the group's member list: %s", len(gone), [peer_text(n) for n in gone])
    return view


def _relist() -> None:
    """This member's liveness key lapsed (it was frozen, or cut off from etcd, past the TTL) and is
    back: a join meanwhile may have dropped it from the member list as gone, so it puts itself back
    (``membership.relist_self``) and later joiners call it again. Runs on the key's renewal thread."""
    if not membership.joined():
        return
    deadline = time.monotonic() + REGISTRY_TIMEOUT_S
    while True:
        try:
            membership.relist_self(membership.own_address())
            return
        except membership.TokenBusy:
            if time.monotonic() > deadline:
                logger.warning("could not put this member back in the group's member list: a join held the token for %gs", REGISTRY_TIMEOUT_S)
                return
            time.sleep(0.05)  # a join holds the token for milliseconds


def _withdraw(name: str) -> None:
    """After a failed join with an etcd store: ends this member's liveness key and frees what its
    join still holds (``membership.withdraw_failed_join``), so the next join need not wait for either."""
    global _alive
    if _alive is not None:
        _alive.stop()
        _alive = None
    try:
        if _agent_view is not None:
            membership.withdraw_failed_join(_agent_view, name)
    except (RuntimeError, dist.DistError) as e:
        logger.warning("could not free what the failed join held in etcd (%s): the next join frees it once this process's liveness key ended", e)


def _open_registry(address: StoreAddress, connect_timeout_s: float) -> None:
    global _registry, _etcd, _tcp_store
    if isinstance(address, EtcdAddress):
        _etcd = _etcd or open_store(address, REGISTRY_TIMEOUT_S)  # opened before the join (_announce_alive)
        _registry = Registry(_etcd)
        return
    # Its own client, one that reconnects: torch's never does, and a coordinator may restart (store_client).
    client = ReconnectingStore(address.host, address.port, REGISTRY_TIMEOUT_S, connect_timeout_s=connect_timeout_s)
    try:
        client.check([RANK_COUNTER_KEY])
    except (RuntimeError, dist.DistError) as e:
        raise TransportError(f"joined the group at {address} but could not open a store client: {e}") from e
    _registry = Registry(client)
    _tcp_store = client


def group_registry() -> Registry:
    """The group's shared facts (views, replica records), through this process's own store client."""
    if _registry is None:
        raise TransportError("this process has not joined an RPC group yet")
    return _registry


def store_client() -> ReconnectingStore | None:
    """This process's own client of the group's TCPStore (the registry's); None with an etcd store."""
    return _tcp_store


def store_rebuild() -> StoreRebuild | None:
    """What this member writes back after a coordinator restart (add a role's own records with
    ``on_restart``); None for the store's host and with an etcd store."""
    return _rebuild


def store_host() -> str:
    """The RPC name of the member that hosts the group's store (rank 0: the coordinator, or an
    embedded server): departing members ask it to drop them from the group. With an etcd store,
    this process's own name (it changes the member list itself)."""
    if _etcd is not None:
        return membership.my_name()
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
    said = False
    while True:
        try:
            with socket.create_connection((address.host, address.port), timeout=max(min(deadline - time.monotonic(), 1.0), 0.1)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            if not said:
                said = True
                logger.info("nothing answers at the group's store %s yet; waiting up to %.0fs (--connect-timeout-s)",
                            address, deadline - time.monotonic())
            time.sleep(0.1)


def leave(name: str, store_host: str, secret: JobSecret | None = None, timeout_s: float = 5.0) -> bool:
    """Asks the store's host (``store_host``, an RPC name) to drop member ``name`` before this process exits.

    A process that exits while still listed makes every join in the meantime fail (and then hold
    the group token for the store's timeout), until the host's reaper notices it is gone. Returns
    True when the host confirmed; False (logged at debug) when it could not be asked in time, or
    refused (a host with a job secret needs ``secret``'s proof).
    """
    deadline = time.monotonic() + timeout_s
    if store_host == membership.my_name():
        return _forget_here(name, deadline)
    proof = secret.leave_proof(name) if secret is not None else ""
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


def _forget_here(name: str, deadline: float) -> bool:
    """``leave`` when this process reaches the store itself: the member list changed by its own client."""
    while True:
        try:
            membership.forget_member(name)
            return True
        except membership.TokenBusy:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)  # a join holds the token for milliseconds
        except RuntimeError as e:
            logger.debug("could not leave the RPC group: %s", str(e).splitlines()[0])
            return False


def shared_duty(duty: str, holder: str) -> HeldKey | None:
    """With an etcd store, a started ``HeldKey`` that says when this process is the one to do ``duty``
    (one holder in the group at a time, under an etcd lease); None when the store is not in etcd."""
    if _etcd is None:
        return None
    return HeldKey(_etcd.client, _etcd.key(f"rpcps/duty/{duty}"), holder).start()


def shard_claim(shard: int, name: str, ttl_s: int, view_revision: Callable[[], int | None]) -> HeldKey | None:
    """With an etcd store, a (not yet started) claim of primary ``name`` on ``shard``: its key under
    an etcd lease of ``ttl_s``, taken only while the shard's view is still at ``view_revision()``
    (this primary's own) and never taken again once lost; None when the store is not in etcd."""
    if _etcd is None:
        return None
    store, view = _etcd, _etcd.key(Registry.view_key(shard))
    return HeldKey(
        store.client, store.key(Registry.claim_key(shard, name)), name, ttl_s,
        conditions=lambda: [modified_at(view, view_revision() or 0)], retake=False,
    )


def shutdown() -> None:
    """Local, non-graceful shutdown: a graceful one waits forever on any dead peer."""
    global _rebuild, _alive
    if _rebuild is not None:
        _rebuild.stop()
        _rebuild = None
    if _alive is not None:
        _alive.stop()  # revoked: a restart in place is taken for gone at once, not after the TTL
        _alive = None
    try:
        rpc.shutdown(graceful=False)
    except Exception as e:  # noqa: BLE001 - shutting down must not raise over the real error
        logger.debug("rpc shutdown: %s", e)
