"""The consistency modes, one strategy object each, chosen once at start-up.

- ``async``: every valid push is applied as it arrives.
- ``bounded``: like async, but a push more than ``max_staleness`` updates old is answered ``stale``
  (not recorded as processed: the worker recomputes that step on fresh parameters).
- ``local-steps``: like async, but a push is a parameter delta after H local steps, which the
  server's outer optimizer (``ps.core.outer``) applies; rounds and delta norms are counted.
- ``sync``: pushes wait in a round; the round is applied as one step from the averaged gradients of
  the live workers (``ps.api.sync_rounds``), and every push in it is answered when it closes.

A mode gets checked pushes (deduplicated, validated, fp32) and decides when the server sequences
them as an update (``ParameterServer.sequence_update_locked``); the server applies it once it is
committed, and only then is the push answered. A mode never touches the parameters itself. Its
methods run on RPC threads, take the server's lock for what they change, and complete futures
(which sends replies) outside it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Protocol

import torch
from torch.futures import Future

from ps.api.sync_rounds import RoundKeeper, SyncContribution
from ps.core.config import ServerCoreConfig
from ps.core.server import Contribution, ParameterServer, answer
from ps.core.workers import WorkerRecord
from ps.sparse.store import CheckedPush
from rpcps.errors import ServerStopping
from rpcps.messages import ErrorReply, Mode, PushReply, PushStatus

logger = logging.getLogger(__name__)

_ROUND_TICK_S = 0.05


class ConsistencyMode(Protocol):
    mode: Mode

    def submit(
        self, record: WorkerRecord, seq: int, loss: float | None, base_version: int, chunks: list[Any], grads: list[torch.Tensor],
        buffers: list[torch.Tensor] | None = None, sparse: CheckedPush | None = None, absent: int = 0,
    ) -> Future:
        """Sequences (now or with its round) a checked push: ``chunks`` as received, ``grads`` their
        fp32 form, ``buffers`` the model buffers it carried. The future gives its PushReply once the
        update is applied.

        ``sparse`` (sparse tables' rows) is applied in the same update as ``grads`` (its log entry
        carries them to a standby); a server with sparse tables refuses sync mode.
        ``absent``: the parameters the push has no gradient for (``ps.core.presence``)."""
        ...

    def drop_locked(self, slot: int) -> None:
        """Under the lock: the slot left or died; nothing may wait for it any longer."""
        ...

    def start(self) -> None:
        """Starts whatever runs in the background (sync rounds' timer)."""
        ...


def done(reply: PushReply | ErrorReply) -> Future:
    future: Future = Future()
    future.set_result(reply)
    return future


def _answer_unsequenced_locked(
    server: ParameterServer, record: WorkerRecord, seq: int, base_version: int, max_staleness: int | None
) -> Future | None:
    """Under the lock, the start every mode shares: the answer for a push that is not sequenced now (a
    retry joins the pending push it repeats; a paused server, a duplicate or a push over
    ``max_staleness`` is refused), or None to sequence it. Raises ServerStopping while the server stops."""
    if server.stopping:
        raise ServerStopping("the server is shutting down; the push was not applied")
    joined = server.join_pending_locked(record.slot, seq)
    if joined is not None:
        return joined
    refusal = server.refusal_locked(record, seq, base_version, max_staleness)
    return None if refusal is None else done(refusal)


class AsyncMode:
    """Apply every push at once; with ``max_staleness``, refuse older ones (bounded)."""

    def __init__(self, server: ParameterServer, max_staleness: int | None = None) -> None:
        self.server = server
        self.max_staleness = max_staleness
        self.mode = Mode.ASYNC if max_staleness is None else Mode.BOUNDED

    def submit(
        self, record: WorkerRecord, seq: int, loss: float | None, base_version: int, chunks: list[Any], grads: list[torch.Tensor],
        buffers: list[torch.Tensor] | None = None, sparse: CheckedPush | None = None, absent: int = 0,
    ) -> Future:
        server = self.server
        reply: Future = Future()
        with server.lock:
            early = _answer_unsequenced_locked(server, record, seq, base_version, self.max_staleness)
            if early is not None:
                return early
            staleness = server.log.last_version - base_version
            update = server.sequence_update_locked(
                chunks, grads, [(record.slot, seq, loss, staleness)], buffers=buffers, sparse=sparse, absent=absent
            )
            update.replies.append((reply, PushReply(PushStatus.APPLIED, update.entry.version, staleness)))  # type: ignore[union-attr]
            applied = server.apply_committed_locked()
        answer(applied)
        return reply

    def drop_locked(self, slot: int) -> None:
        del slot  # nothing waits for a worker in async modes

    def start(self) -> None:
        pass


class SyncMode:
    """One optimizer step per round, from the average of the live workers' gradients."""

    mode = Mode.SYNC

    def __init__(self, server: ParameterServer, round_timeout_s: float, min_workers: int) -> None:
        self.server = server
        self.rounds = RoundKeeper(server.layout.chunk_numels, round_timeout_s, min_workers)
        self._timer = threading.Thread(target=self._tick, name="sync-round-timer", daemon=True)

    def start(self) -> None:
        self._timer.start()

    def submit(
        self, record: WorkerRecord, seq: int, loss: float | None, base_version: int, chunks: list[Any], grads: list[torch.Tensor],
        buffers: list[torch.Tensor] | None = None, sparse: CheckedPush | None = None, absent: int = 0,
    ) -> Future:
        del chunks  # a round ships its mean, not the pushes it averages
        if sparse:
            raise ValueError("sync mode cannot apply sparse rows")  # the server refuses sparse tables in sync mode
        server = self.server
        reply: Future = Future()
        with server.lock:
            # A round's gradients must all be computed on the round's parameters: anything older is stale.
            early = _answer_unsequenced_locked(server, record, seq, base_version, 0)
            if early is not None:
                return early
            live = {r.slot for r in server.workers.live()}
            self.rounds.add(
                live, SyncContribution(Contribution(record, seq, loss, 0, buffers), reply), grads, len(server.workers.records), absent
            )
            record.last_seen = time.monotonic()
            closed = self._close_locked(time.monotonic())
        answer(closed)
        return reply

    def drop_locked(self, slot: int) -> None:
        self.rounds.drop(slot)  # the timer closes the round if it waited only for this slot

    def _close_locked(self, now: float) -> list[tuple[Future, PushReply | ErrorReply]]:
        """Under the lock: if the open round is complete (or timed out), sequences it as one update
        (replication after aggregation: a standby gets the mean, 1/N of the pushes' bytes)."""
        if not self.rounds.ready(now):
            return self.server.apply_committed_locked()
        round_, waiting = self.rounds.take()
        n = len(round_.contributions)
        for total in round_.sums:
            total.div_(n)
        contributions = [c.contribution for c in round_.contributions.values()]
        update = self.server.sequence_update_locked(
            round_.sums, round_.sums, [(c.record.slot, c.seq, c.loss, 0) for c in contributions],
            # The sum buffers go back to the pool once nobody needs them: after the step here, and
            # after the standby acknowledged them when a standby is following.
            on_release=lambda: self.rounds.recycle(round_.sums),
            # In arrival order, the last contribution's buffers are the newest.
            buffers=next((c.buffers for c in reversed(contributions) if c.buffers is not None), None),
            # A parameter moves when any contribution had a gradient for it (its mean counts the others' as 0).
            absent=round_.absent,
        )
        version = update.entry.version  # type: ignore[union-attr]
        update.replies.extend((c.reply, PushReply(PushStatus.APPLIED, version, 0)) for c in round_.contributions.values())
        self.server.metrics.count_round()
        if round_.missing():
            logger.warning("sync round %d closed after %.1fs without slots %s", version, now - round_.opened, sorted(round_.missing()))
        stale = [(f, PushReply(PushStatus.STALE, self.server.version, 1)) for f in waiting]
        return stale + self.server.apply_committed_locked()

    def _tick(self) -> None:
        while True:
            time.sleep(_ROUND_TICK_S)
            with self.server.lock:
                stopping = self.server.stopping
                closed = self._fail_all_locked() if stopping else self._close_locked(time.monotonic())
            answer(closed)
            if stopping:
                return

    def _fail_all_locked(self) -> list[tuple[Future, PushReply | ErrorReply]]:
        """At stop: every waiting push is answered ServerStopping (not applied)."""
        futures = list(self.rounds.waiting)
        if self.rounds.current is not None:
            futures += [c.reply for c in self.rounds.current.contributions.values()]
        self.rounds.current, self.rounds.waiting = None, []
        stopping = ErrorReply("ServerStopping", "the server is shutting down; the push was not applied")
        return [(f, stopping) for f in futures]


class LocalStepsMode(AsyncMode):
    """Each worker's delta is applied as it arrives: one outer step (``ps.core.outer``) per (slot,
    round), a round being the slot's step. Exactly-once and the rest are the async path's; this adds
    the round count (the summary's ``rounds``) and the norm of each delta (a gauge)."""

    def __init__(self, server: ParameterServer) -> None:
        super().__init__(server)
        self.mode = Mode.LOCAL_STEPS
        server.on_applied(lambda _event: server.metrics.count_round())

    def submit(
        self, record: WorkerRecord, seq: int, loss: float | None, base_version: int, chunks: list[Any], grads: list[torch.Tensor],
        buffers: list[torch.Tensor] | None = None, sparse: CheckedPush | None = None, absent: int = 0,
    ) -> Future:
        # Outside the lock: the norm is for operators (a diverging worker pushes a growing delta), not part of the step.
        # vector_norm reads each chunk once and allocates nothing (g.square() made a copy of the delta).
        self.server.metrics.delta_norm.set(math.sqrt(sum(float(torch.linalg.vector_norm(g)) ** 2 for g in grads)))
        return super().submit(record, seq, loss, base_version, chunks, grads, buffers, sparse, absent)


def make_mode(server: ParameterServer, config: ServerCoreConfig) -> ConsistencyMode:
    if config.mode == Mode.SYNC:
        return SyncMode(server, config.round_timeout_s, config.min_workers)
    if config.mode == Mode.LOCAL_STEPS:
        return LocalStepsMode(server)
    return AsyncMode(server, config.max_staleness if config.mode == Mode.BOUNDED else None)
