"""The transport under both roles: the only package that imports ``torch.distributed.rpc``.

Roles see: ``serve``/``join``/``leave``/``shutdown`` (the process's membership in the group),
``call``/``call_async``/``ping`` (calls on other members, failing with the classified errors of
``calls``), ``async_endpoint`` and ``make_ref`` (what a server exposes), ``group_registry`` (the group's
shared facts: which process serves each shard), and ``membership`` (the upkeep of the member list).
torch RPC is in maintenance mode upstream; keeping it behind this seam is what lets another
transport replace it later.
"""

from rpcps.transport import membership
from rpcps.transport.calls import (
    CallFailed,
    PeerTimeout,
    PeerUnknown,
    PeerUnreachable,
    Pending,
    Ref,
    async_endpoint,
    call,
    call_async,
    classify,
    is_local,
    make_ref,
    owner,
    ping,
)
from rpcps.transport.config import Address, TransportOptions
from rpcps.transport.group import JoinFailed, TransportError, group_registry, join, leave, serve, shutdown, store_host
from rpcps.transport.registry import Registry, StoreUnavailable, ViewRecord

__all__ = [
    "Address",
    "CallFailed",
    "JoinFailed",
    "PeerTimeout",
    "PeerUnknown",
    "PeerUnreachable",
    "Pending",
    "Ref",
    "Registry",
    "StoreUnavailable",
    "TransportError",
    "TransportOptions",
    "ViewRecord",
    "async_endpoint",
    "call",
    "call_async",
    "classify",
    "group_registry",
    "is_local",
    "join",
    "leave",
    "make_ref",
    "membership",
    "owner",
    "ping",
    "serve",
    "shutdown",
    "store_host",
]
