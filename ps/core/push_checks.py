"""What a push must satisfy before it may touch the parameters: layout, dtypes, names, finite values.

Runs before the server's lock is taken (it reads only the push and the fixed layout). A refused push
raises ``Refused`` (a ``PushRejected``) naming the problem, with a ``RejectReason`` for the metric;
a non-finite push is refused, or under ``--on-nonfinite skip`` answered ``SkipNonfinite``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import torch

from ps.core.presence import check_absent
from rpcps.errors import PushRejected
from rpcps.signature import FlatLayout, ModelSignature
from rpcps.wire import Chunk, check_chunk, to_dense_fp32, values_of


class RejectReason(enum.StrEnum):
    """Why a push was refused (the ``reason`` label of rpcps_server_pushes_rejected_total)."""

    SHAPE = "shape"
    DTYPE = "dtype"
    NONFINITE = "nonfinite"
    UNKNOWN_WORKER = "unknown_worker"
    NAMES = "names"
    STALE = "stale"
    STOPPING = "stopping"


class Refused(PushRejected):
    """A push refused by admission; ``reason`` picks the metric label."""

    def __init__(self, message: str, reason: RejectReason) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class SkipNonfinite:
    """``Admission.check``'s answer for a non-finite push the server is told to skip (--on-nonfinite skip)."""

    where: str
    """The parameter holding the first NaN/Inf."""


class Admission:
    def __init__(self, layout: FlatLayout, signature: ModelSignature, wire: torch.dtype, on_nonfinite: str) -> None:
        self.layout = layout
        self.signature = signature
        self.wire = wire
        self.skip_nonfinite = on_nonfinite == "skip"

    def check(self, slot: int, seq: int, chunks: Any, absent: Any = 0) -> list[torch.Tensor] | SkipNonfinite:
        """The fp32 gradient chunks of a valid push, or SkipNonfinite; raises Refused.

        ``absent`` is the push's presence mask (``ps.core.presence``): an int with a bit per parameter."""
        self._check_layout(slot, seq, chunks)
        if absent:
            problem = check_absent(absent, len(self.layout.slots))
            if problem is not None:
                raise Refused(f"push {seq} from worker {slot} {problem}", RejectReason.SHAPE)
        nonfinite = _first_nonfinite([values_of(c) for c in chunks])
        if nonfinite is None:
            return [to_dense_fp32(c, n) for c, n in zip(chunks, self.layout.chunk_numels)]
        where = self._nonfinite_where(chunks, *nonfinite)
        if self.skip_nonfinite:
            return SkipNonfinite(where)
        raise Refused(f"push {seq} from worker {slot} holds NaN/Inf in parameter {where!r}; parameters unchanged", RejectReason.NONFINITE)

    def pack_named(self, slot: int, seq: int, grads: Any) -> list[torch.Tensor]:
        """Packs a push of one tensor per parameter name into wire chunks; raises Refused."""
        if not isinstance(grads, dict):
            raise Refused(
                f"push {seq} from worker {slot}: gradients must be a dict of name -> tensor, got {type(grads).__name__}",
                RejectReason.NAMES,
            )
        unknown = sorted(set(grads) - {p.name for p in self.signature.params})
        if unknown:
            raise Refused(f"push {seq} from worker {slot} names parameters the model does not have: {unknown[:5]}", RejectReason.NAMES)
        missing = [p.name for p in self.signature.params if p.name not in grads]
        if missing:
            raise Refused(f"push {seq} from worker {slot} is missing gradients for {missing[:5]}", RejectReason.NAMES)
        chunks = self.layout.empty_chunks()
        for view, placed in zip(self.layout.views(chunks), self.layout.slots):
            grad, spec = grads[placed.spec.name], placed.spec
            if not isinstance(grad, torch.Tensor):
                raise Refused(
                    f"push {seq} from worker {slot}: gradient of {spec.name!r} is a {type(grad).__name__}, not a tensor",
                    RejectReason.SHAPE,
                )
            if tuple(grad.shape) != spec.shape:
                raise Refused(
                    f"push {seq} from worker {slot}: gradient of {spec.name!r} has shape {list(grad.shape)}, "
                    f"expected {list(spec.shape)}",
                    RejectReason.SHAPE,
                )
            if str(grad.dtype).removeprefix("torch.") != spec.dtype:
                raise Refused(
                    f"push {seq} from worker {slot}: gradient of {spec.name!r} has dtype {grad.dtype}, expected {spec.dtype}",
                    RejectReason.DTYPE,
                )
            view.copy_(grad)
        return [c.to(self.wire) for c in chunks]

    def _check_layout(self, slot: int, seq: int, chunks: Any) -> None:
        expected = self.layout.chunk_numels
        if not isinstance(chunks, (list, tuple)) or len(chunks) != len(expected):
            got = len(chunks) if isinstance(chunks, (list, tuple)) else type(chunks).__name__
            raise Refused(f"push {seq} from worker {slot} has {got} gradient chunks, expected {len(expected)}", RejectReason.SHAPE)
        for i, (chunk, numel) in enumerate(zip(chunks, expected)):
            problem = check_chunk(chunk, numel, self.wire)
            if problem is not None:
                reason = RejectReason.DTYPE if "dtype" in problem else RejectReason.SHAPE
                raise Refused(f"push {seq} from worker {slot}: chunk {i} {problem} (parameters {self._chunk_names(i)})", reason)

    def _nonfinite_where(self, chunks: list[Chunk], chunk: int, index: int) -> str:
        """The parameter holding the first NaN/Inf (index is into the values of a sparse chunk)."""
        sent = chunks[chunk]
        if isinstance(sent, tuple):
            index = int(sent[0][index])
        return self.layout.param_at(chunk, index)

    def _chunk_names(self, chunk: int) -> str:
        names = [s.spec.name for s in self.layout.slots if s.chunk == chunk]
        return f"{names[0]}..{names[-1]}" if len(names) > 1 else names[0]


def _first_nonfinite(chunks: list[torch.Tensor]) -> tuple[int, int] | None:
    """(chunk, element) of the first NaN/Inf, or None.

    A finite sum proves every element finite (NaN and Inf propagate through a sum), so the full
    element-wise scan only runs when the cheap reduction says there may be one. The sum is checked
    as a Python float: one tensor operation per chunk, not two, on a path every push takes.
    """
    for i, chunk in enumerate(chunks):
        if math.isfinite(float(chunk.sum())):
            continue
        bad = (~torch.isfinite(chunk)).nonzero()
        if bad.numel():
            return i, int(bad[0, 0])
    return None
