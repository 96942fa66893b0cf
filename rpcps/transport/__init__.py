"""The transport under both roles: the only package that imports ``torch.distributed.rpc``.

Roles see: ``serve``/``join``/``leave``/``shutdown`` (the process's membership in the group),
``call``/``call_async``/``ping`` (calls on other members, failing with the classified errors of
``calls``), ``async_endpoint`` (what a server exposes), ``protect`` (what peers may make this
process run; required before joining), ``group_registry`` (the group's shared facts: which process
serves each shard), and ``membership`` (the upkeep of the member list and of the store). torch RPC
is in maintenance mode upstream; keeping it behind this seam is what lets another transport replace
it later.
"""

from rpcps.transport import membership, pickling, request_filter
from rpcps.transport.calls import (
    CallFailed,
    PeerTimeout,
    PeerUnknown,
    PeerUnreachable,
    Pending,
    async_endpoint,
    call,
    call_async,
    classify,
    ping,
    ping_all,
)
from rpcps.transport.config import Address, TransportOptions
from rpcps.transport.group import (
    COORDINATOR_NAME,
    JoinFailed,
    TransportError,
    group_registry,
    join,
    leave,
    serve,
    shard_claim,
    shared_duty,
    shutdown,
    store_client,
    store_host,
    store_rebuild,
)
from rpcps.transport.pickling import Refusal, set_max_message_bytes
from rpcps.transport.protection import Surface, protect, protected
from rpcps.transport.registry import Registry, StoreUnavailable, ViewRecord
from rpcps.transport.request_filter import FilterUnavailable

REFUSAL_KINDS: tuple[str, ...] = (*pickling.REFUSAL_KINDS, *request_filter.REFUSAL_KINDS)
"""Every ``kind`` of ``rpcps_transport_refused_total``: payloads the unpickler refused, and
requests the agent refused for their message type."""

__all__ = [
    "COORDINATOR_NAME",
    "REFUSAL_KINDS",
    "Address",
    "CallFailed",
    "FilterUnavailable",
    "JoinFailed",
    "PeerTimeout",
    "PeerUnknown",
    "PeerUnreachable",
    "Pending",
    "Refusal",
    "Registry",
    "StoreUnavailable",
    "Surface",
    "TransportError",
    "TransportOptions",
    "ViewRecord",
    "async_endpoint",
    "call",
    "call_async",
    "classify",
    "group_registry",
    "join",
    "leave",
    "membership",
    "ping",
    "ping_all",
    "protect",
    "protected",
    "serve",
    "set_max_message_bytes",
    "shard_claim",
    "shared_duty",
    "shutdown",
    "store_client",
    "store_host",
    "store_rebuild",
]
