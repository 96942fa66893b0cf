"""What a peer may make this process run: installed in every process before it joins the group.

torch RPC runs whatever function a peer names. ``protect`` narrows that to the application's
``Surface`` (its endpoints and the records they exchange) plus what torch and this transport need
themselves (the liveness probe, the leave request, the join handshake, remote errors), and makes
the agent refuse every request that is not a Python call (``request_filter``: builtin operators,
TorchScript, RRef and autograd messages never reach the unpickler). ``group.serve``/``group.join``
refuse to start until it ran, so no process joins unprotected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rpcps import wire_records
from rpcps.transport import membership, pickling, request_filter
from rpcps.transport.calls import alive


@dataclass(frozen=True, kw_only=True)
class Surface:
    """The application's part of what peers may name."""

    calls: tuple[Callable[..., Any], ...]
    """Functions a peer may ask this process to run (module-level, importable by name)."""
    values: tuple[type, ...] = ()
    """Classes a payload may build as arguments or replies: ``wire_records.WireRecord`` dataclasses and
    ``wire_records.WireEnum`` enums only (anything else could be changed by a payload while it loads)."""

    def __post_init__(self) -> None:
        pickling.named(*self.calls, *self.values)  # raises ValueError for anything pickle cannot name
        unsafe = [cls for cls in self.values if not wire_records.is_wire_value(cls)]
        if unsafe:
            raise ValueError(
                f"values must be WireRecord dataclasses or WireEnum enums (rpcps.wire_records), got {unsafe}"
            )


def unpickle_policy(
    surface: Surface,
    max_message_bytes: int | None = None,
    on_refusal: Callable[[pickling.Refusal], None] | None = None,
) -> pickling.UnpicklePolicy:
    """Every (module, name) a peer may name in this process: the surface plus transport and torch needs."""
    calls = pickling.merged(
        pickling.JOIN_HANDSHAKE_CALLS,
        {pickling.UPDATE_GROUP_MEMBERSHIP: membership.guarded_update_group_membership},
        pickling.named(alive, membership.forget_me, *surface.calls),
    )
    values = pickling.merged(
        pickling.TORCH_VALUES,
        pickling.JOIN_HANDSHAKE_VALUES,
        pickling.named(*pickling.EXCEPTION_TYPES, *surface.values),
    )
    return pickling.UnpicklePolicy(calls=calls, values=values, max_message_bytes=max_message_bytes, on_refusal=on_refusal)


def allowed_globals(surface: Surface) -> frozenset[pickling.GlobalName]:
    """Every (module, name) a payload may name in a process protected with ``surface``."""
    return unpickle_policy(surface).allowed


def protect(
    surface: Surface,
    max_message_bytes: int | None = None,
    on_refusal: Callable[[pickling.Refusal], None] | None = None,
) -> None:
    """Restricts what peers can make this process run (call once, before joining the group).

    Raises:
        pickling.TorchInternalsChanged: this torch no longer works the way the hooks expect.
        request_filter.FilterUnavailable: the native request filter is not built for this torch.
    """
    pickling.install(unpickle_policy(surface, max_message_bytes, on_refusal))
    request_filter.install(on_refusal)


def protected() -> bool:
    return pickling.installed() and request_filter.installed()
