"""What a peer may make an rpcps process run or build over RPC: the worker API and its records.

Every rpcps process (server, worker, and tools that join the group) calls ``protect`` before it
joins. The list is derived from the objects themselves (``rpcps.endpoints.ENDPOINTS`` and the
classes of ``rpcps.messages``), so a new endpoint or record is covered without editing this file,
and nothing else is callable: not a server method, not ``os.system``.
"""

from __future__ import annotations

import enum
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from rpcps import endpoints, messages, transport
from rpcps.transport.registry import RECORD_KINDS, REFUSAL_REASONS
from rpcps.transport.registry import Refusal as StoreRefusal

logger = logging.getLogger(__name__)

_MIB = 1 << 20
BYTES_PER_PARAMETER = 12
"""The most a legitimate message carries per model parameter: a top-k push of every element sends
an int64 index (8 bytes) and an fp32 value (4); a dense push or a pull carries at most 4."""
MESSAGE_OVERHEAD_BYTES = 16 * _MIB
"""Room for everything besides the tensors (a model signature with many names, pickling)."""


def message_types() -> tuple[type, ...]:
    """The records and enums of ``rpcps.messages`` (what calls and replies carry besides tensors)."""
    return tuple(
        cls for _, cls in inspect.getmembers(messages, inspect.isclass)
        if cls.__module__ == messages.__name__ and (issubclass(cls, enum.Enum) or hasattr(cls, "__dataclass_fields__"))
    )


def worker_api_surface(extra_calls: Iterable[Callable[..., Any]] = ()) -> transport.Surface:
    """The worker API (every function in ``ENDPOINTS``) and its records; ``extra_calls`` for tools."""
    return transport.Surface(calls=(*endpoints.ENDPOINTS, *extra_calls), values=message_types())


def message_limit(parameters: int, max_message_mb: float | None) -> int:
    """The largest message a process accepts: ``--max-message-mb``, or derived from the model's size."""
    if max_message_mb is not None:
        return int(max_message_mb * _MIB)
    return BYTES_PER_PARAMETER * parameters + MESSAGE_OVERHEAD_BYTES


def refusal_counter(registry: CollectorRegistry) -> Counter:
    """``rpcps_transport_refused_total{kind}``, the same series in every role (docs/METRICS.md)."""
    counter = Counter(
        "rpcps_transport_refused",
        "RPC payloads refused before anything in them ran (a peer named something outside the worker API, "
        "or sent an oversized message), by kind.",
        ["kind"],
        registry=registry,
    )
    for kind in transport.REFUSAL_KINDS:
        counter.labels(kind)
    return counter


def store_refusal_counter(registry: CollectorRegistry) -> Counter:
    """``rpcps_store_records_refused_total{record,reason}``, the same series in every role that reads
    the group's store (docs/METRICS.md): records there it ignored (``rpcps.transport.registry``)."""
    counter = Counter(
        "rpcps_store_records_refused",
        "Records in the group's store (shard views, replica records, dead members) this process ignored: unsigned, "
        "wrongly signed, malformed or stale, by record and reason (each distinct text once).",
        ["record", "reason"],
        registry=registry,
    )
    for record in RECORD_KINDS:
        for reason in REFUSAL_REASONS:
            counter.labels(record, reason)
    return counter


def counting_store_refusals(counter: Counter) -> Callable[[StoreRefusal], None]:
    """An ``on_refused`` callback for ``Registry.authenticate`` (the registry logs each refusal)."""
    return lambda refusal: counter.labels(refusal.record, refusal.reason).inc()


def counting(counter: Counter) -> Callable[[transport.Refusal], None]:
    """An ``on_refusal`` callback that counts each refusal by kind (the transport logs it)."""
    return lambda refusal: counter.labels(refusal.kind).inc()


def protect(
    on_refusal: Callable[[transport.Refusal], None] | None = None,
    max_message_bytes: int | None = None,
    extra_calls: Iterable[Callable[..., Any]] = (),
) -> None:
    """Installs the worker API's protection in this process (before it joins the group)."""
    transport.protect(worker_api_surface(extra_calls), max_message_bytes=max_message_bytes, on_refusal=on_refusal)
