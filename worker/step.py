"""One step of a worker's loop as the code that computes it sees it (``worker.api``, the CLI's loop).

A ``Step`` is handed out by the trainer's step sequence with its index, its batch (or its K
micro-batches) and whether it is a **replay**: the same (slot, step) computed again on fresh
parameters because its first push was refused as too stale ('bounded' and 'sync' modes) or its
acknowledgement was lost with a failed primary (asynchronous replication). It ends exactly once,
with ``push`` (its gradients go to the servers, within the window) or ``skip`` (recorded as
processed, nothing applied: a GradScaler overflow). What lives here is the record and its rules;
what a push does is the trainer's (``StepSink``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class StepEnded(RuntimeError):
    """A step was pushed or skipped twice, or the loop moved on without ending it."""


class StepSink(Protocol):
    """What ends a step (``worker.trainer.Trainer``)."""

    def push_step(self, step: Step, loss: float | None) -> None: ...

    def skip_step(self, step: Step) -> None: ...

    def zero_grad_step(self, step: Step) -> None: ...

    def between_micro_batches(self, step: Step) -> None: ...


class MicroBatches(list[Any]):
    """A step's micro-batches; iterating them calls ``between`` before each one after the first, once
    the code computing the step has finished with the one before (overlapped local steps fold the
    last round's reply into the parameters there)."""

    def __init__(self, batches: list[Any], between: Callable[[], None]) -> None:
        super().__init__(batches)
        self._between = between

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(super().__iter__()):
            if i:
                self._between()
            yield batch

    def __reduce__(self) -> tuple[type[list[Any]], tuple[list[Any]]]:
        return list, (list(super().__iter__()),)  # pickled (a DataLoader, torch.save) as the plain list it is


def loss_value(loss: torch.Tensor | float | None) -> float | None:
    """The number a push reports for ``loss`` (a one-element tensor or a float; None: not reported)."""
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        return float(loss.detach())
    return float(loss)


@dataclass(eq=False)
class Step:
    """One step to compute: ``index`` (the slot's step number), ``batch`` and ``replay``."""

    index: int
    batch: Any
    """What the data yielded for this step; with accumulation over K micro-batches, a list of K."""
    replay: bool
    """This (slot, step) was handed out before and is computed again (same batch, fresh parameters):
    skip side effects that must happen once (logging a step line, counting samples)."""
    accumulate: int
    _sink: StepSink
    _state: Any = None
    """The trainer's per-step bookkeeping (shards, bound gradient buffers, timings)."""
    ended: str | None = field(default=None)
    """None while open; 'pushed' or 'skipped'."""
    loss: float | None = None
    """What ``report`` set: the loss a push without its own reports."""

    @property
    def micro_batches(self) -> list[Any]:
        """The step's micro-batches (one, the batch itself, without accumulation). In --mode local-steps
        with --overlap-rounds on, the parameters may change between them (the last round's reply folded
        in, this round's progress kept on top), as an optimizer step changes them."""
        return MicroBatches(list(self.batch) if self.accumulate > 1 else [self.batch], lambda: self._sink.between_micro_batches(self))

    def push(self, loss: torch.Tensor | float | None = None) -> None:
        """Sends the step's gradients (what backward accumulated since the step began) to the servers,
        asynchronously within the window. ``loss`` is reported (metrics, summary), not applied;
        without one, what ``report`` set."""
        self._end("pushed")
        self._sink.push_step(self, self.loss if loss is None else loss_value(loss))

    def report(self, loss: torch.Tensor | float) -> None:
        """Sets the loss the push reports, for code whose push happens elsewhere (``optimizer.step()``)."""
        self.loss = loss_value(loss)

    def skip(self) -> None:
        """Records the step as processed with nothing applied (e.g. a GradScaler found Inf/NaN)."""
        self._end("skipped")
        self._sink.skip_step(self)

    def zero_grad(self) -> None:
        """Clears the gradients accumulated so far in this step (they stay bound to the wire buffers)."""
        if self.ended is None:
            self._sink.zero_grad_step(self)

    def _end(self, how: str) -> None:
        if self.ended is not None:
            raise StepEnded(f"step {self.index} was {self.ended} already: a step ends once, with push() or skip()")
        self.ended = how
