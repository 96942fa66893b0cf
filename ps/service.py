"""The worker API of one server (``rpcps.endpoints.WorkerApi``), and its roster for the reaper.

A push goes: count it, find its slot's registration, drop it if its (slot, step) was processed
already, validate it (``ps.admission``, outside the lock), then hand it to the consistency mode
(``ps.modes``), which applies it through the server. Every refusal leaves the parameters
bit-identical and is counted by reason.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch.futures import Future

from ps.admission import Admission, Refused, RejectReason, SkipNonfinite
from ps.modes import ConsistencyMode, done, make_mode
from ps.registration_auth import RegistrationGate
from ps.server import ParameterServer
from ps.snapshot_files import SnapshotInfo
from ps.sparse_store import BadSparse, CheckedPush
from ps.workers import WorkerRecord
from rpcps import failpoints
from rpcps.errors import CheckpointFailed, RpcpsError, ServerStopping, SignatureMismatch, UnknownWorker
from rpcps.messages import FinishReply, Observation, PullReply, PushReply, PushStatus, Registration, RegistrationProof
from rpcps.signature import ModelSignature
from rpcps.sparse.spec import SparsePull
from rpcps.summary import run_summary

logger = logging.getLogger(__name__)


class Durability(Protocol):
    """How a finishing worker's steps are made to survive a crash (``ps.checkpointer.Checkpointer``)."""

    def ensure_durable(self, version: int) -> SnapshotInfo: ...

    def record_finished(self, slot: int, steps: int) -> None: ...


class WorkerService:
    def __init__(self, server: ParameterServer, mode: ConsistencyMode | None = None, gate: RegistrationGate | None = None) -> None:
        self.server = server
        self.gate = gate or RegistrationGate(None, server.metrics)
        """Who may register (the job secret); without one, anyone who reaches the RPC port."""
        self.durability: Durability | None = None
        """Set once resume is done when the server checkpoints; None: nothing is durable."""
        self.mode = mode or make_mode(server, server.config)
        self.admission = Admission(server.layout, server.signature, server.wire, server.config.on_nonfinite)
        self.metrics = server.metrics
        server.on_applied(self.metrics.count_applied)
        self.metrics.watch_workers(lambda: [(w.slot, w.live, w.last_push_age_s) for w in server.status().workers])
        self.mode.start()

    # ---- the worker API ---------------------------------------------------------------------------

    def shard_count(self) -> int:
        return self.server.config.shard_count

    def challenge(self) -> str:
        return self.gate.challenge()

    def register(
        self, slot: int, rpc_name: str, signature: list[tuple[str, list[int], str]], proof: RegistrationProof | None = None
    ) -> Registration:
        self.gate.check(slot, rpc_name, proof)
        server = self.server
        diff = server.model_signature.first_difference(ModelSignature.from_wire(signature))
        if diff is not None:
            raise SignatureMismatch(f"worker {slot} ({rpc_name}) has a different model than the server: {diff}")
        with server.lock:
            if server.stopping:
                raise ServerStopping("the server is shutting down; try again after it restarts")
            record = server.workers.register(slot, rpc_name)
            next_step = record.tracker.floor + 1
            version = server.version
        self.metrics.registrations.inc()
        logger.info("worker slot %d registered as %s, resuming at step %d", slot, rpc_name, next_step)
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
    ) -> Future:
        """Admits one push and hands it to the mode; the future gives its PushReply (or raises).

        With ``have_version`` the reply carries the parameters once the push is answered (what
        ``pull(slot, incarnation, have_version)`` gives then): one call per step instead of a push
        and a pull, the per-call cost that dominates small models. ``sparse`` is the push's sparse
        part (``rpcps.sparse.spec``): checked with the dense part and applied in the same update, so
        the (slot, step) deduplication covers both.
        """
        answered = self._submit(slot, incarnation, seq, base_version, chunks, loss, sparse)
        if have_version is None:
            return answered
        return answered.then(lambda f: self._with_params(f.value(), slot, incarnation, have_version))

    def _with_params(self, reply: Any, slot: int, incarnation: str, have_version: int) -> Any:
        if not isinstance(reply, PushReply):
            return reply  # an ErrorReply (the server is stopping)
        try:
            return replace(reply, pulled=self.pull(slot, incarnation, have_version))
        except RpcpsError:  # the slot was taken over meanwhile: the push's own answer stands
            return reply

    def _submit(
        self, slot: int, incarnation: str, seq: int, base_version: int, chunks: Any, loss: float | None, sparse: Any
    ) -> Future:
        started = time.perf_counter()
        self.metrics.count_received()
        self.metrics.in_flight.inc()
        try:
            record = self._record_for_push(slot, incarnation, seq)
            if record is None:
                return done(PushReply(PushStatus.DUPLICATE, self.server.version, 0))
            chunks, buffers = self.server.buffers.split(chunks, len(self.server.layout))
            try:
                grads = self.admission.check(slot, seq, chunks)
                if buffers is not None and not isinstance(grads, SkipNonfinite):
                    buffers = self.server.buffers.admit(slot, seq, buffers, self.admission.skip_nonfinite)
                checked = self._check_sparse(slot, seq, sparse)
            except Refused as e:
                self._refused(record, seq, e)
                raise
            for skip in (grads, buffers, checked):
                if isinstance(skip, SkipNonfinite):
                    self._skipped(record, seq, skip.where)
                    return done(PushReply(PushStatus.SKIPPED, self.server.version, 0))
            assert not isinstance(checked, SkipNonfinite)
            return self.mode.submit(record, seq, loss, base_version, grads, buffers, checked)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.push_seconds.observe(time.perf_counter() - started)

    def push(
        self, slot: int, incarnation: str, seq: int, base_version: int, chunks: Any, loss: float | None = None, sparse: Any = None
    ) -> PushReply:
        """``submit`` waited for (in-process callers; in 'sync' mode it blocks until the round closes)."""
        return self.submit(slot, incarnation, seq, base_version, chunks, loss, sparse=sparse).wait()

    def push_named(
        self, slot: int, incarnation: str, seq: int, base_version: int, grads: dict[str, torch.Tensor], loss: float | None = None
    ) -> PushReply:
        """Like push, for clients that send one tensor per parameter name (checked by name first)."""
        try:
            chunks = self.admission.pack_named(slot, seq, grads)
        except Refused as e:
            self.metrics.count_received()
            with self.server.lock:
                record = self.server.workers.get(slot, incarnation)
            self._refused(record, seq, e)
            raise
        return self.push(slot, incarnation, seq, base_version, chunks, loss)

    def pull(self, slot: int, incarnation: str, have_version: int) -> PullReply:
        started = time.perf_counter()
        server = self.server
        with server.lock:
            record = server.workers.get(slot, incarnation)
            record.last_seen = time.monotonic()
            if have_version == server.version or server.finishing:
                self.metrics.pulls.labels("unchanged").inc()
                return PullReply(server.version, None, server.paused, server.finishing)
            reply = PullReply(server.version, server.params_for_pull_locked(), server.paused, buffers=server.buffers.for_pull_locked())
        self.metrics.pulls.labels("full").inc()
        self.metrics.param_bytes.inc(sum(c.numel() * c.element_size() for c in reply.chunks or []))
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

    def observe(self, have_version: int) -> Observation:
        """A read-only look at the newest model (the sidecar evaluator): no slot, no record, no effect."""
        server, config = self.server, self.server.config
        with server.lock:
            fresh = have_version != server.version
            chunks = server.params_for_pull_locked() if fresh else None
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
        """A worker finished ``steps`` steps: returns once a committed checkpoint holds them all.

        A worker only exits successfully after this, so a server crash after it never rolls back a
        finished worker's steps (docs/FAULT_TOLERANCE.md, "Done means durable").
        """
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
            record.left = True
            self.mode.drop_locked(slot)
            self.server.workers.retired_rpc_names.append(record.rpc_name)
        logger.info("worker slot %d (%s) left", slot, record.rpc_name)

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

    def mark_dead(self, slot: int, incarnation: str) -> None:
        with self.server.lock:
            record = self._current(slot, incarnation)
            if record is not None:
                record.live = False
                record.left = True
                self.mode.drop_locked(slot)

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
            if e.nonfinite and self.admission.skip_nonfinite:
                return SkipNonfinite(f"sparse: {e}")
            reason = RejectReason.NONFINITE if e.nonfinite else RejectReason.SHAPE
            raise Refused(f"push {seq} from worker {slot}: {e}; parameters unchanged", reason) from None

    def _current(self, slot: int, incarnation: str) -> WorkerRecord | None:
        record = self.server.workers.records.get(slot)
        return record if record is not None and record.incarnation == incarnation else None

    def _refused(self, record: WorkerRecord, seq: int, error: Refused) -> None:
        with self.server.lock:
            record.tracker.mark(seq)
        self.metrics.count_rejected(error.reason)
        logger.warning("rejected: %s", error)

    def _skipped(self, record: WorkerRecord, seq: int, where: str) -> None:
        with self.server.lock:
            record.tracker.mark(seq)
        self.metrics.count_skipped()
        logger.warning("skipped push %d from worker %d: NaN/Inf in %r", seq, record.slot, where)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
