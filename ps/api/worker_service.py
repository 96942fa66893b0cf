"""The worker API of one server (``rpcps.endpoints.WorkerApi``), and its roster for the reaper.

A push goes: count it, find its slot's registration, drop it if its (slot, step) was processed
already, validate it (``ps.core.push_checks``, outside the lock), then hand it to the consistency mode
(``ps.api.modes``), which sequences it; the server applies it once committed. Every refusal leaves the
parameters bit-identical and is counted by reason; a refused or skipped step is still recorded as
processed through the log (a ``Mark``), so a standby knows it too.

Registrations go through the log as well (``Registered``, with the incarnation drawn here), so a
standby that takes over knows every worker's incarnation and the workers need not register again;
so do removals (``Removed``: a worker left, or the reaper or the janitor found it dead), so a
standby that takes over refuses a removed incarnation as its primary did.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch.futures import Future

from ps.api.modes import ConsistencyMode, done, make_mode
from ps.api.registration_auth import RegistrationGate
from ps.checkpoints.snapshot_files import SnapshotInfo
from ps.core.push_checks import PushChecks, Refused, RejectReason, SkipNonfinite
from ps.core.server import ParameterServer, answer
from ps.core.workers import WorkerRecord
from ps.sparse.store import BadSparse, CheckedPush
from rpcps import failpoints
from rpcps.errors import (
    ERROR_TYPES,
    CheckpointFailed,
    NotPrimary,
    PushRejected,
    RpcpsError,
    ServerStopping,
    SignatureMismatch,
    UnknownWorker,
)
from rpcps.logsafe import MESSAGE_LIMIT, peer_text
from rpcps.messages import (
    ErrorReply,
    FinishReply,
    Mark,
    Mode,
    Observation,
    PullReply,
    PushReply,
    PushStatus,
    Registered,
    Registration,
    RegistrationProof,
    Removed,
)
from rpcps.signature import ModelSignature, WireSpec
from rpcps.sparse.spec import SparsePull
from rpcps.summary import run_summary

logger = logging.getLogger(__name__)

PROMOTION_WAIT_S = 5.0
"""How long a worker's call waits for a standby that is taking over before it is told to look again."""

_REGISTRATION_WAIT_S = 30.0
"""How long a registration waits for its log entry to be applied (committed by the standby)."""


class Durability(Protocol):
    """How a finishing worker's steps are made to survive a crash (``ps.checkpoints.checkpointer.Checkpointer``)."""

    def ensure_durable(self, version: int) -> SnapshotInfo: ...

    def record_finished(self, slot: int, steps: int) -> None: ...


class WorkerService:
    def __init__(self, server: ParameterServer, mode: ConsistencyMode | None = None, gate: RegistrationGate | None = None) -> None:
        self.server = server
        self.gate = gate or RegistrationGate(None, server.metrics.registrations_refused)
        """Who may register (the job secret); without one, anyone who reaches the RPC port."""
        self.durability: Durability | None = None
        """Set once resume is done when the server checkpoints; None: nothing is durable."""
        self.mode = mode or make_mode(server, server.config)
        self.push_checks = PushChecks(server.layout, server.signature, server.wire, server.config.on_nonfinite)
        self._all_absent = (1 << len(server.layout.slots)) - 1
        """The presence mask of a push without any gradient: a skipped step."""
        self.metrics = server.metrics
        server.on_applied(self.metrics.count_applied)
        self.metrics.watch_workers(lambda: [(w.slot, w.live, w.last_push_age_s) for w in server.status().workers])
        self.mode.start()

    # ---- the worker API ---------------------------------------------------------------------------

    def shard_count(self) -> int:
        return self.server.config.shard_count

    def _check_serving(self) -> None:
        """Raises NotPrimary on a process that does not serve its shard now (a standby, a replaced
        primary); waits first, up to ``PROMOTION_WAIT_S``, for a standby that is taking over (a worker
        that read the new view may call before the standby applied its last entries and serves)."""
        server = self.server
        promotion = server.promotion
        if server.mirroring and promotion is not None:
            promotion.wait(PROMOTION_WAIT_S)
        if server.mirroring or server.deposed:
            raise NotPrimary(server.not_primary_reason)

    def challenge(self) -> str:
        return self.gate.challenge()

    def register(
        self, slot: int, rpc_name: str, signature: list[WireSpec], proof: RegistrationProof | None = None
    ) -> Registration:
        self._check_serving()
        self.gate.check(slot, rpc_name, proof)
        server = self.server
        diff = server.model_signature.first_difference(ModelSignature.from_wire(signature))
        if diff is not None:
            raise SignatureMismatch(f"worker {slot} ({rpc_name}) has a different model than the server: {diff}")
        server.workers.check_slot(slot)
        incarnation = server.workers.new_incarnation()
        with server.lock:
            if server.stopping:
                raise ServerStopping("the server is shutting down; try again after it restarts")
            sequenced = server.sequence_locked(lambda index, epoch: Registered(index, epoch, slot, rpc_name, incarnation))
            applied: Future = Future()
            sequenced.replies.append((applied, None))
            done_now = server.apply_committed_locked()
        answer(done_now)
        failure = wait_for(applied, _REGISTRATION_WAIT_S)
        if isinstance(failure, ErrorReply):
            raise ERROR_TYPES.get(failure.kind, RpcpsError)(failure.message)
        with server.lock:
            record = server.workers.get(slot, incarnation)
            next_step = record.tracker.floor + 1
            version = server.version
        self.metrics.registrations.inc()
        logger.info("worker slot %d registered as %s, resuming at step %d", slot, peer_text(rpc_name), next_step)
        config = server.config
        return Registration(
            record.incarnation, next_step, version, server.server_id, config.chunk_bytes, server.layout.chunk_numels,
            mode=config.mode, shard_index=config.shard_index, shard_count=config.shard_count,
            partition_digest=server.partition_digest, wire_dtype=config.wire_dtype,
        )

    def submit(
        self,
        slot: int,
        incarnation: str,
        seq: int,
        base_version: int,
        chunks: Any,
        loss: float | None = None,
        have_version: int | None = None,
        sparse: Any = None,
        absent: Any = 0,
    ) -> Future:
        """Admits one push and hands it to the mode; the future gives its PushReply (or raises).

        With ``have_version`` the reply carries the parameters once the push is answered (what
        ``pull(slot, incarnation, have_version)`` gives then): one call per step instead of a push
        and a pull, the per-call cost that dominates small models. ``sparse`` is the push's sparse
        part (``rpcps.sparse.spec``): checked with the dense part and applied in the same update, so
        the (slot, step) deduplication covers both. ``absent`` is the push's presence mask: the
        parameters that got no gradient, which the update leaves as they are (``ps.core.presence``).
        """
        answered = self._submit(slot, incarnation, seq, base_version, chunks, loss, sparse, absent)
        if have_version is None:
            return answered
        if answered.done():  # applied already (async modes): no callback and second future needed
            return done(self._with_params(answered.value(), slot, incarnation, have_version))
        return answered.then(lambda f: self._with_params(f.value(), slot, incarnation, have_version))

    def _with_params(self, reply: Any, slot: int, incarnation: str, have_version: int) -> Any:
        if not isinstance(reply, PushReply):
            return reply  # an ErrorReply (the server is stopping)
        try:
            return replace(reply, pulled=self.pull(slot, incarnation, have_version))
        except RpcpsError:  # the slot was taken over meanwhile: the push's own answer stands
            return reply

    def _submit(
        self, slot: int, incarnation: str, seq: int, base_version: int, chunks: Any, loss: float | None, sparse: Any,
        absent: Any = 0,
    ) -> Future:
        self._check_serving()
        started = time.perf_counter()
        self.metrics.count_received()
        self.metrics.in_flight.inc()
        try:
            record = self._record_for_push(slot, incarnation, seq)
            if record is None:
                return done(PushReply(PushStatus.DUPLICATE, self.server.version, 0))
            buffers: list[torch.Tensor] | SkipNonfinite | None
            chunks, buffers = self.server.buffers.split(chunks, len(self.server.layout))
            try:
                grads = self.push_checks.check(slot, seq, chunks, absent)
                if buffers is not None and not isinstance(grads, SkipNonfinite):
                    buffers = self.server.buffers.check(slot, seq, buffers, self.push_checks.skip_nonfinite)
                checked = self._check_sparse(slot, seq, sparse)
            except Refused as e:
                return self._refused(record, seq, e)
            for skip in (grads, buffers, checked):
                if isinstance(skip, SkipNonfinite):
                    return self._skipped(record, seq, skip.where)
            assert not isinstance(grads, SkipNonfinite) and not isinstance(buffers, SkipNonfinite)
            assert not isinstance(checked, SkipNonfinite)
            if absent and absent == self._all_absent and checked is None and self.mode.mode != Mode.SYNC:
                return self._skipped_by_worker(record, seq)
            return self.mode.submit(record, seq, loss, base_version, chunks, grads, buffers, checked, absent)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.push_seconds.observe(time.perf_counter() - started)

    def push(
        self, slot: int, incarnation: str, seq: int, base_version: int, chunks: Any, loss: float | None = None, sparse: Any = None,
        absent: int = 0,
    ) -> PushReply:
        """``submit`` waited for (in-process callers; in 'sync' mode it blocks until the round closes).

        Raises the error an RPC caller would get as an ``ErrorReply``."""
        reply = self.submit(slot, incarnation, seq, base_version, chunks, loss, sparse=sparse, absent=absent).wait()
        if isinstance(reply, ErrorReply):
            raise ERROR_TYPES.get(reply.kind, RpcpsError)(reply.message)
        return reply

    def push_named(
        self, slot: int, incarnation: str, seq: int, base_version: int, grads: dict[str, torch.Tensor], loss: float | None = None
    ) -> PushReply:
        """Like push, for clients that send one tensor per parameter name (checked by name first)."""
        try:
            chunks = self.push_checks.pack_named(slot, seq, grads)
        except Refused as e:
            self.metrics.count_received()
            with self.server.lock:
                record = self.server.workers.get(slot, incarnation)
            self._refused(record, seq, e).wait()
            raise
        return self.push(slot, incarnation, seq, base_version, chunks, loss)

    def pull(self, slot: int, incarnation: str, have_version: int) -> PullReply:
        self._check_serving()
        started = time.perf_counter()
        server = self.server
        if server.lease() is None:  # it may have been replaced: what it holds may not be the newest any more
            raise NotPrimary(f"shard {server.config.shard_index}'s primary has no lease right now; read its view again")
        with server.lock:
            record = server.workers.get(slot, incarnation)
            record.last_seen = time.monotonic()
            if have_version == server.version or server.finishing:
                self.metrics.pulls_unchanged.inc()
                return PullReply(server.version, None, server.paused, server.finishing)
            floor, above = record.tracker.processed()
            reply = PullReply(server.version, server.params_for_pull_locked(), server.paused, buffers=server.buffers.for_pull_locked(),
                              applied_floor=floor, applied_above=above)
        self.metrics.pulls_full.inc()
        self.metrics.param_bytes.inc(server.pull_bytes)
        self.metrics.pull_seconds.observe(time.perf_counter() - started)
        return reply

    def pull_rows(self, slot: int, incarnation: str, request: Any) -> SparsePull:
        """Rows of the requested ids of the model's sparse tables (this server's buckets only)."""
        server = self.server
        with server.lock:
            record = server.workers.get(slot, incarnation)
            record.last_seen = time.monotonic()
        if server.sparse is None:
            raise Refused(f"worker {slot} pulled sparse rows, but this model declares no sparse tables", RejectReason.NAMES)
        try:
            return server.sparse.pull(request, server.wire)
        except BadSparse as e:
            raise Refused(f"sparse pull from worker {slot}: {e}", RejectReason.SHAPE) from None

    def observe(self, have_version: int, proof: RegistrationProof | None = None) -> Observation:
        """A read-only look at the newest model (the sidecar evaluator): no slot, no record, no effect.
        With a job secret, ``proof`` answers a fresh challenge (``RegistrationGate.check_observer``)."""
        self.gate.check_observer(proof)
        server, config = self.server, self.server.config
        with server.lock:
            fresh = have_version != server.version
            chunks = server.params_for_observe_locked() if fresh else None
            buffers = server.buffers.for_pull_locked() if fresh else None
            version = server.version
        return Observation(
            version, chunks, buffers, server.model_signature.to_wire(), config.chunk_bytes,
            shard_index=config.shard_index, shard_count=config.shard_count,
        )

    def heartbeat(self, slot: int, incarnation: str) -> int:
        with self.server.lock:
            record = self.server.workers.get(slot, incarnation)
            record.last_seen = time.monotonic()
            record.live = True
            return self.server.version

    def finish(self, slot: int, incarnation: str, steps: int) -> FinishReply:
        """A worker finished ``steps`` steps: returns once a committed snapshot holds them all.

        A worker only exits successfully after this, so a server crash after it never rolls back a
        finished worker's steps (docs/FAULT_TOLERANCE.md, "Done means durable").
        """
        self._check_serving()
        with self.server.lock:
            record = self.server.workers.get(slot, incarnation)
            next_step, version = record.tracker.floor + 1, self.server.version
        if next_step < steps:
            logger.warning("worker slot %d says it finished %d steps, but the server holds %d", slot, steps, next_step)
            return FinishReply(complete=False, durable=False, next_step=next_step, version=version)
        if self.durability is None:
            return FinishReply(complete=True, durable=False, next_step=next_step, version=version)
        try:
            info = self.durability.ensure_durable(version)
            self.durability.record_finished(slot, steps)
        except OSError as e:
            raise CheckpointFailed(f"could not make worker slot {slot}'s steps durable: {e}") from e
        failpoints.hit("finish.after_snapshot")
        logger.info("worker slot %d finished %d steps; durable in the checkpoint of version %d", slot, steps, info.version)
        return FinishReply(complete=True, durable=True, next_step=next_step, version=version, checkpoint_version=info.version)

    def leave(self, slot: int, incarnation: str) -> None:
        with self.server.lock:
            record = self.server.workers.get(slot, incarnation)
            applied = self._remove_locked(record, "left")
            self.server.workers.retired_rpc_names.append(record.rpc_name)
        answer(applied)
        logger.info("worker slot %d (%s) left", slot, peer_text(record.rpc_name))

    # ---- the roster (what the membership reaper sees) ----------------------------------------------

    def take_retired_rpc_names(self) -> list[str]:
        with self.server.lock:
            names, self.server.workers.retired_rpc_names = self.server.workers.retired_rpc_names, []
            return names

    def member_workers(self) -> list[tuple[int, str, str, float]]:
        """(slot, incarnation, rpc name, last_seen monotonic) of every worker still in the RPC group."""
        with self.server.lock:
            return [(r.slot, r.incarnation, r.rpc_name, r.last_seen) for r in self.server.workers.records.values() if not r.left]

    def mark_alive(self, slot: int, incarnation: str) -> None:
        with self.server.lock:
            record = self._current(slot, incarnation)
            if record is not None:
                record.last_seen = time.monotonic()
                record.live = True

    def mark_silent(self, slot: int, incarnation: str) -> None:
        with self.server.lock:
            record = self._current(slot, incarnation)
            if record is not None:
                record.live = False

    def member_gone(self, rpc_name: str) -> None:
        """The group janitor removed RPC member ``rpc_name``: if it is a registered worker, its slot is dead."""
        applied = []
        with self.server.lock:
            for record in list(self.server.workers.records.values()):
                if record.rpc_name == rpc_name and not record.left:
                    applied += self._remove_locked(record, "gone")
        answer(applied)

    def mark_dead(self, slot: int, incarnation: str) -> None:
        applied = []
        with self.server.lock:
            record = self._current(slot, incarnation)
            if record is not None and not record.left:
                applied = self._remove_locked(record, "dead")
        answer(applied)

    def _remove_locked(self, record: WorkerRecord, why: str) -> list[tuple[Future, object]]:
        """Under the lock: ends ``record``'s registration here at once (nothing it sends from now on
        counts) and, on the primary, through the log, so a standby that takes over refuses it too.
        A process that does not serve leaves it to its primary's log: its own reaper or janitor must
        not end a registration its primary still holds. Returns what to answer after the lock."""
        server = self.server
        if server.mirroring or server.deposed:
            return []
        server.workers.remove(record.slot, record.incarnation)
        self.mode.drop_locked(record.slot)
        slot, incarnation = record.slot, record.incarnation
        server.sequence_locked(lambda index, epoch: Removed(index, epoch, slot, incarnation))
        self.metrics.workers_removed.labels(why).inc()
        return server.apply_committed_locked()

    # ---- the run summary ---------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        server, s = self.server, self.metrics.stats
        with server.lock:
            records = list(server.workers.records.values())
            firsts = [sum(r.first_losses) / len(r.first_losses) for r in records if r.first_losses]
            lasts = [sum(r.recent_losses) / len(r.recent_losses) for r in records if r.recent_losses]
            version = server.version
        wall = time.monotonic() - server.started
        return run_summary(
            "ps",
            initial_loss=_mean(firsts),
            final_loss=_mean(lasts),
            steps=s.pushes_received,
            updates_applied=s.updates_applied,
            pushes_rejected=s.pushes_rejected,
            staleness_sum=s.staleness_sum,
            wall_seconds=wall,
            pushes_skipped=s.pushes_skipped,
            pushes_duplicate=s.pushes_duplicate,
            pushes_stale=s.pushes_stale,
            rounds=s.rounds,
            mode=str(server.config.mode),
            shard=f"{server.config.shard_index}/{server.config.shard_count}",
            max_staleness=s.max_staleness,
            model_version=version,
        )

    # ---- internals ---------------------------------------------------------------------------------

    def _record_for_push(self, slot: int, incarnation: str, seq: int) -> WorkerRecord | None:
        """The push's registration, or None when its step was processed already (a retry)."""
        with self.server.lock:
            try:
                record = self.server.workers.get(slot, incarnation)
            except UnknownWorker:
                self.metrics.count_rejected(RejectReason.UNKNOWN_WORKER)
                raise
            if record.tracker.seen(seq):
                self.metrics.count_duplicate()
                return None
            return record

    def _check_sparse(self, slot: int, seq: int, sparse: Any) -> CheckedPush | SkipNonfinite | None:
        """The fp32 sparse part of a push, SkipNonfinite, or None when it has none; raises Refused."""
        if sparse is None:
            return None
        store = self.server.sparse
        if store is None:
            raise Refused(f"push {seq} from worker {slot} has a sparse part, but this model declares no sparse tables", RejectReason.NAMES)
        try:
            return store.check_push(sparse, self.server.wire)
        except BadSparse as e:
            if e.nonfinite and self.push_checks.skip_nonfinite:
                return SkipNonfinite(f"sparse: {e}")
            reason = RejectReason.NONFINITE if e.nonfinite else RejectReason.SHAPE
            raise Refused(f"push {seq} from worker {slot}: {e}; parameters unchanged", reason) from None

    def _current(self, slot: int, incarnation: str) -> WorkerRecord | None:
        record = self.server.workers.records.get(slot)
        return record if record is not None and record.incarnation == incarnation else None

    def _refused(self, record: WorkerRecord, seq: int, error: Refused) -> Future:
        """Records the refused step as processed (through the log); the future gives the worker's error."""
        self.metrics.count_rejected(error.reason)
        logger.warning("rejected: %s", peer_text(str(error), MESSAGE_LIMIT))  # it quotes the push's names
        return self._mark(record, seq, ErrorReply(PushRejected.__name__, str(error)))

    def _skipped(self, record: WorkerRecord, seq: int, where: str) -> Future:
        self.metrics.count_skipped()
        logger.warning("skipped push %d from worker %d: NaN/Inf in %r", seq, record.slot, where)
        return self._mark(record, seq, PushReply(PushStatus.SKIPPED, self.server.version, 0))

    def _skipped_by_worker(self, record: WorkerRecord, seq: int) -> Future:
        """A push with no gradient for any parameter (a worker's ``skip()``): recorded as processed, no
        update (a sync round counts it as a contribution of zeros instead: the others wait for it)."""
        self.metrics.count_skipped()
        logger.info("worker %d skipped step %d (no gradient for any parameter)", record.slot, seq)
        return self._mark(record, seq, PushReply(PushStatus.SKIPPED, self.server.version, 0))

    def _mark(self, record: WorkerRecord, seq: int, reply: Any) -> Future:
        future: Future = Future()
        with self.server.lock:
            sequenced = self.server.sequence_locked(lambda index, epoch: Mark(index, epoch, record.slot, seq))
            sequenced.replies.append((future, reply))
            applied = self.server.apply_committed_locked()
        answer(applied)
        return future


def wait_for(future: Future, timeout_s: float) -> Any:
    """A torch Future's value, or an ErrorReply when it did not complete within ``timeout_s``."""
    finished = threading.Event()
    future.add_done_callback(lambda _: finished.set())
    if not finished.wait(timeout_s):
        return ErrorReply("ServerStopping", f"the server did not replicate the change within {timeout_s:.0f}s; try again")
    return future.wait()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
