"""The small records exchanged between workers and servers, and between a primary and its standby
(tensors travel beside them).

Every record and enum defined here may cross the wire, and nothing else may (``rpcps.rpc_policy``
builds the transport's allow-list from this module): a new reply type belongs here, as a frozen
dataclass deriving ``WireRecord`` (or a ``WireEnum``), which the transport requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rpcps.wire_records import WireEnum, WireRecord


class Mode(WireEnum):
    """How stale a gradient may be when the server applies it."""

    ASYNC = "async"
    """Apply every valid push as it arrives."""
    BOUNDED = "bounded"
    """Refuse pushes more than max_staleness updates old (the worker recomputes them)."""
    SYNC = "sync"
    """One step per round from the averaged gradients of the live workers."""
    LOCAL_STEPS = "local-steps"
    """Workers take H local steps and push the parameter delta; the server applies an outer optimizer to each."""


class PushStatus(WireEnum):
    """What the server did with one push (a refused push raises PushRejected instead)."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    """Already processed; not applied again (a retry)."""
    SKIPPED = "skipped"
    """Held NaN/Inf and the server runs --on-nonfinite skip: dropped and counted."""
    STALE = "stale"
    """Refused by a staleness bound; recompute on fresh parameters."""
    PAUSED = "paused"
    """The server is paused: not applied and not recorded; send it again after resume."""


@dataclass(frozen=True)
class Registration(WireRecord):
    incarnation: str
    """Identifies this registration of the slot; a later registration of the same slot replaces it."""
    next_step: int
    """The slot's first step the server has not processed: where the worker resumes its data."""
    version: int
    server_id: str
    chunk_bytes: int
    """The server's wire chunk limit; the worker builds the same layout from it."""
    chunk_numels: tuple[int, ...]
    mode: Mode = Mode.ASYNC
    shard_index: int = 0
    shard_count: int = 1
    partition_digest: str = ""
    wire_dtype: str = "fp32"


@dataclass(frozen=True)
class RegistrationProof(WireRecord):
    """A worker's answer to the server's challenge: it holds the job secret (``rpcps.jobsecret``)."""

    challenge: str
    """What the server's ``challenge`` endpoint returned (single use)."""
    mac: str
    """``JobSecret.registration_proof(challenge, slot, rpc_name)``."""


@dataclass(frozen=True)
class PushReply(WireRecord):
    status: PushStatus
    version: int
    staleness: int
    pulled: PullReply | None = None
    """The server's parameters after this push, when the push asked for them (``have_version``):
    what a pull at that moment would have answered, so a worker needs no pull call of its own."""


@dataclass(frozen=True)
class PullReply(WireRecord):
    version: int
    chunks: list[torch.Tensor] | None
    """None when the worker already holds ``version``."""
    paused: bool = False
    stop: bool = False
    """The server is shutting down for good: finish in-flight pushes, leave and exit cleanly."""
    buffers: list[torch.Tensor] | None = None
    """The model's buffers in signature order and their own dtypes, with every full pull from the
    shard that holds them (shard 0); None for a model without buffers."""
    applied_floor: int = -1
    """With ``chunks``: every step of the pulling slot up to this one is in them (or was recorded
    without an update)..."""
    applied_above: tuple[int, ...] = ()
    """...and so are these above it. A reply may carry the slot's later pushes too (they were applied
    before it was sent): overlapped local steps put back on top only the rounds that are not in it."""

    def holds_step(self, step: int) -> bool:
        return step <= self.applied_floor or step in self.applied_above


@dataclass(frozen=True)
class Observation(WireRecord):
    """What an observer (the sidecar evaluator) reads: the newest parameters and buffers, without a slot."""

    version: int
    chunks: list[torch.Tensor] | None
    """None when the observer already holds ``version``."""
    buffers: list[torch.Tensor] | None
    model_signature: list[tuple[str, list[int], str] | tuple[str, list[int], str, str]]
    """The whole model's signature (wire form): the observer checks its own model against it."""
    chunk_bytes: int
    shard_index: int = 0
    shard_count: int = 1


@dataclass(frozen=True)
class FinishReply(WireRecord):
    """The answer to a worker that finished its steps and asked for them to be made durable."""

    complete: bool
    """The server holds every step the worker says it finished (False: resume at ``next_step``)."""
    durable: bool
    """A committed snapshot holds them all (False when the server checkpoints nothing)."""
    next_step: int
    version: int
    checkpoint_version: int | None = None
    """The version of the committed snapshot that holds them."""


@dataclass(frozen=True)
class ErrorReply(WireRecord):
    kind: str
    message: str


@dataclass(frozen=True)
class View(WireRecord):
    """Who serves one shard: its primary and, once in sync, its standby (the group's store holds it).

    Changed only by compare-and-set (``rpcps.transport.registry``): a standby promotes itself with
    ``{e, P, S} -> {e+1, S, None}``, a primary drops its standby with ``{e, P, S} -> {e, P, None}``
    and takes one in with ``{e, P, None} -> {e, P, S}``. The epoch grows exactly at a promotion or a
    takeover, and every replication message carries it, so a deposed primary is refused.
    """

    epoch: int
    primary: str
    standby: str | None = None

    def names(self) -> tuple[str, ...]:
        return (self.primary,) if self.standby is None else (self.primary, self.standby)


# ---- replication: what a primary ships to its standby (ps.replication) ----------------------------


@dataclass(frozen=True)
class Update(WireRecord):
    """One optimizer step: a checked push, or a closed sync round (its averaged gradient)."""

    index: int
    """Position in the shard's log: dense, never reused within one history."""
    epoch: int
    """Epoch of the primary that sequenced it."""
    version: int
    """The model version this step produces."""
    chunks: list[Any]
    """The gradient as it applies: wire chunks as received (dense, or top-k pairs), or a round's fp32 mean."""
    contributions: tuple[tuple[int, int, float | None, int], ...]
    """(slot, step, loss, staleness) of every push in it."""
    buffers: list[Any] | None = None
    """The model buffers (BatchNorm statistics) that become the server's with this step: the newest
    its pushes carried; None when they carried none."""
    absent: int = 0
    """Presence mask: bit i set means the shard's parameter i (signature order) got no gradient in
    any push of this step, and the step leaves it and its optimizer state as they are (``ps.core.presence``)."""
    sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    """The push's sparse part as the primary checked it: table -> (unique int64 ids, fp32 grads)."""
    admitted: dict[str, torch.Tensor] | None = None
    """Ids the primary's pulls admitted since its previous update, per table: this step creates
    their rows first (``ps.sparse.store.SparseStore.take_admitted``)."""


@dataclass(frozen=True)
class Mark(WireRecord):
    """A push recorded as processed without a step (refused as invalid, or non-finite and skipped)."""

    index: int
    epoch: int
    slot: int
    seq: int


@dataclass(frozen=True)
class Registered(WireRecord):
    """A worker's registration; the incarnation is drawn by the primary so both replicas agree on it."""

    index: int
    epoch: int
    slot: int
    rpc_name: str
    incarnation: str


@dataclass(frozen=True)
class Removed(WireRecord):
    """A worker's registration ended (it left, or the server found its process gone or silent past its
    lease): what that incarnation sends from now on is refused, by a standby that takes over too."""

    index: int
    epoch: int
    slot: int
    incarnation: str


@dataclass(frozen=True)
class Control(WireRecord):
    """Serving state changed by the control plane: 'pause' or 'resume'."""

    index: int
    epoch: int
    action: str


@dataclass(frozen=True)
class Evicted(WireRecord):
    """An eviction decision of the primary's sparse table: the rows of ``ids`` not updated since the
    table's clock read ``clock`` go (``ps.sparse.table.SparseTable.evict``)."""

    index: int
    epoch: int
    table: str
    ids: torch.Tensor
    clock: int


LogEntry = Update | Mark | Registered | Removed | Control | Evicted
"""Everything that changes a shard's replicated state, in the order both replicas apply it."""


@dataclass(frozen=True)
class Ack(WireRecord):
    """A standby's answer to an append: it holds every entry up to ``have_through`` (in memory)."""

    epoch: int
    have_through: int
    applied_through: int


@dataclass(frozen=True)
class Fenced(WireRecord):
    """The receiver serves a newer epoch than the sender's: the sender was replaced and must stop."""

    epoch: int
    primary: str | None


@dataclass(frozen=True)
class Attached(WireRecord):
    """A primary's answer to a standby that asked to follow it: the state to copy, and where the log
    continues after it."""

    attach_id: str
    epoch: int
    index: int
    """The log index the state corresponds to: the standby receives entries from ``index + 1``."""
    version: int
    size_bytes: int
    pieces: int
    """The serialised state comes in this many pieces (``replica_snapshot``)."""
