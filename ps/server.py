"""ParameterServer: owns the fp32 master parameters, the one optimizer and the model version.

Every method here may run on many RPC threads at once. One lock serialises what must be serialised
(deduplication, the optimizer step, the version) and is never held across network I/O: validation
runs before it is taken, and pulls copy a snapshot under it and send after it is released.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.futures import Future

from ps.audit import AuditLog
from ps.dedup import SequenceTracker
from ps.metrics import ServerMetrics
from ps.optim import OptimizerConfig, build_optimizer
from ps.sync_rounds import Contribution, RoundKeeper
from ps.workers import WorkerRecord, WorkerTable
from rpcps.errors import PushRejected, ServerStopping, SignatureMismatch, UnknownWorker
from rpcps.messages import ErrorReply, PullReply, PushReply, Registration
from rpcps.partition import partition_digest, shard_signature
from rpcps.signature import DEFAULT_CHUNK_BYTES, WIRE_DTYPE, FlatLayout, ModelSignature
from rpcps.wire import Chunk, check_chunk, to_dense_fp32, values_of, wire_dtype

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class ServerCoreConfig:
    """What the parameter store and its update rule need (transport settings live elsewhere)."""

    optimizer: OptimizerConfig = OptimizerConfig()
    on_nonfinite: str = "reject"
    """'reject': refuse a push holding NaN/Inf and raise on the worker; 'skip': drop it and count it."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Largest wire chunk; parameters are packed into chunks of at most this size."""
    max_workers: int = 256
    """Worker slots are 0..max_workers-1; bounds the per-slot metric series."""
    mode: str = "async"
    """'async': apply every valid push as it arrives; 'bounded': refuse pushes more than
    max_staleness updates old (the worker recomputes them); 'sync': one step per round from the
    averaged gradients of the live workers."""
    max_staleness: int | None = None
    """With mode 'bounded': the largest staleness an applied gradient may have."""
    round_timeout_s: float = 30.0
    """With mode 'sync': a round closes this long after it opened with whoever contributed."""
    min_workers: int = 1
    """With mode 'sync': a round waits (up to round_timeout_s) for this many workers."""
    wire_dtype: str = "fp32"
    """Dtype of gradients and parameters on the wire: fp32, bf16 or fp16 (masters stay fp32)."""
    shard_index: int = 0
    shard_count: int = 1
    """This server owns partition(signature, shard_count)[shard_index] (rpcps/partition.py)."""

    def __post_init__(self) -> None:
        if self.mode not in ("async", "bounded", "sync"):
            raise ValueError(f"mode must be async, bounded or sync, got {self.mode!r}")
        if self.mode == "bounded" and self.max_staleness is None:
            raise ValueError("mode 'bounded' needs max_staleness (--max-staleness K)")
        if self.mode != "bounded" and self.max_staleness is not None:
            raise ValueError("max_staleness applies to mode 'bounded' only (--mode bounded --max-staleness K)")
        wire_dtype(self.wire_dtype)  # raises ValueError naming the choices
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be >= 1, got {self.min_workers}")
        if self.round_timeout_s <= 0:
            raise ValueError(f"round_timeout_s must be > 0, got {self.round_timeout_s}")
        if self.shard_count < 1 or not 0 <= self.shard_index < self.shard_count:
            raise ValueError(f"shard_index must be in [0, shard_count), got {self.shard_index} of {self.shard_count}")
        if self.on_nonfinite not in ("reject", "skip"):
            raise ValueError(f"on_nonfinite must be 'reject' or 'skip', got {self.on_nonfinite!r}")
        if self.chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be >= 1024, got {self.chunk_bytes}")
        if not 1 <= self.max_workers <= 32000:
            raise ValueError(f"max_workers must be in [1, 32000], got {self.max_workers}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")


@dataclass
class ServerStats:
    pushes_received: int = 0
    updates_applied: int = 0
    pushes_rejected: int = 0
    pushes_skipped: int = 0
    pushes_duplicate: int = 0
    pushes_stale: int = 0
    rounds: int = 0
    staleness_sum: int = 0
    max_staleness: int = 0


class ParameterServer:
    def __init__(
        self, model: torch.nn.Module, config: ServerCoreConfig, metrics: ServerMetrics | None = None
    ) -> None:
        self.config = config
        self.model_signature = ModelSignature.of_module(model)
        """The whole model's signature (what workers register with)."""
        self.signature = shard_signature(self.model_signature, config.shard_count, config.shard_index)
        """The parameters this server owns."""
        self.partition_digest = partition_digest(self.model_signature, config.shard_count)
        self.layout = FlatLayout(self.signature, config.chunk_bytes)
        self.wire = wire_dtype(config.wire_dtype)
        self.server_id = uuid.uuid4().hex[:12]
        self.metrics = metrics or ServerMetrics()
        self._lock = threading.Lock()
        self._masters = [torch.nn.Parameter(c, requires_grad=False) for c in self.layout.empty_chunks()]
        with torch.no_grad():
            params = dict(model.named_parameters())
            for view, slot in zip(self.layout.views(self._masters), self.layout.slots):
                view.copy_(params[slot.spec.name].detach().to(WIRE_DTYPE))
        self.optimizer, self.schedule = build_optimizer(config.optimizer, list(self._masters))
        self.version = 0
        self.workers = WorkerTable(config.max_workers)
        self.stats = ServerStats()
        self._snapshot: list[torch.Tensor] = []
        self._snapshot_version = -1
        self._running = threading.Event()
        self._running.set()
        self._stopping = False
        self._finishing = False
        self.started = time.monotonic()
        self._pending_after_apply: tuple[int, float, list[int], list[torch.Tensor]] | None = None
        self.audit: AuditLog | None = None
        """Ledger of applied updates (fault-injection runs only; a write per update under the lock)."""
        self.on_update: Callable[[int], None] | None = None
        """Called with the new version after each applied update, outside the lock (checkpoint trigger)."""
        self.metrics.watch_workers(self._worker_liveness)
        self._rounds = RoundKeeper(self.layout.chunk_numels, config.round_timeout_s, config.min_workers) if config.mode == "sync" else None
        if self._rounds is not None:
            threading.Thread(target=self._round_timer, name="sync-round-timer", daemon=True).start()

    # ---- worker-facing calls -------------------------------------------------------------------

    def shard_count(self) -> int:
        return self.config.shard_count

    def register(self, slot: int, rpc_name: str, signature: list[tuple[str, list[int], str]]) -> Registration:
        theirs = ModelSignature.from_wire(signature)
        diff = self.model_signature.first_difference(theirs)
        if diff is not None:
            raise SignatureMismatch(f"worker {slot} ({rpc_name}) has a different model than the server: {diff}")
        with self._lock:
            if self._stopping:
                raise ServerStopping("the server is shutting down; try again after it restarts")
            record = self.workers.register(slot, rpc_name)
            next_step = record.tracker.floor + 1
            version = self.version
        self.metrics.registrations.inc()
        logger.info("worker slot %d registered as %s, resuming at step %d", slot, rpc_name, next_step)
        return Registration(
            record.incarnation, next_step, version, self.server_id, self.config.chunk_bytes, self.layout.chunk_numels,
            mode=self.config.mode, shard_index=self.config.shard_index, shard_count=self.config.shard_count,
            partition_digest=self.partition_digest, wire_dtype=self.config.wire_dtype,
        )

    def push(
        self,
        slot: int,
        incarnation: str,
        seq: int,
        base_version: int,
        chunks: list[torch.Tensor],
        loss: float | None = None,
    ) -> PushReply:
        """Validates and applies one gradient. Raises PushRejected and leaves parameters untouched."""
        started = time.perf_counter()
        self.metrics.pushes.inc()
        self.metrics.in_flight.inc()
        try:
            return self._push(slot, incarnation, seq, base_version, chunks, loss)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.push_seconds.observe(time.perf_counter() - started)

    def _push(
        self, slot: int, incarnation: str, seq: int, base_version: int, chunks: list[torch.Tensor], loss: float | None
    ) -> PushReply:
        admitted = self._admit(slot, incarnation, seq, chunks)
        if isinstance(admitted, PushReply):
            return admitted
        record, chunks = admitted
        with self._lock:
            early = self._early_reply(record, seq, base_version)
            if early is not None:
                return early
            staleness = self.version - base_version
            version, step_seconds = self._apply_locked(chunks, [(record, seq, loss, staleness)])
        self._after_apply(version, step_seconds, [staleness], chunks)
        return PushReply("applied", version, staleness)

    def submit(
        self,
        slot: int,
        incarnation: str,
        seq: int,
        base_version: int,
        chunks: list[torch.Tensor],
        loss: float | None = None,
    ) -> Future:
        """``push`` as a future: completed at once, or in 'sync' mode when the round closes."""
        if self._rounds is None:
            return _done(self.push(slot, incarnation, seq, base_version, chunks, loss))
        self.metrics.pushes.inc()
        admitted = self._admit(slot, incarnation, seq, chunks)
        if isinstance(admitted, PushReply):
            return _done(admitted)
        record, chunks = admitted
        reply: Future = Future()
        with self._lock:
            early = self._early_reply(record, seq, base_version, exact=True)
            if early is not None:
                return _done(early)
            live = {r.slot for r in self.workers.live()}
            self._rounds.add(live, Contribution(slot, seq, loss, 0, reply, record), chunks, len(self.workers.records))
            record.last_seen = time.monotonic()
            closed = self._close_round_locked(time.monotonic())
        self._resolve(closed)
        return reply

    def _admit(
        self, slot: int, incarnation: str, seq: int, chunks: list[Chunk]
    ) -> tuple[WorkerRecord, list[torch.Tensor]] | PushReply:
        """Counts, deduplicates and validates a push.

        Returns the record and the fp32 gradient chunks when it may be applied, else the reply.
        """
        with self._lock:
            self.stats.pushes_received += 1
            try:
                record = self._checked_record(slot, incarnation)
            except UnknownWorker:
                self.stats.pushes_rejected += 1
                self.metrics.rejected.labels("unknown_worker").inc()
                raise
            if record.tracker.seen(seq):
                self.stats.pushes_duplicate += 1
                self.metrics.duplicates.inc()
                return PushReply("duplicate", self.version, 0)
        try:
            self._validate(slot, seq, chunks)
            nonfinite = _first_nonfinite([values_of(c) for c in chunks])
        except PushRejected as e:
            self._reject(record, seq, e)
            raise
        if nonfinite is None:
            return record, [to_dense_fp32(c, n) for c, n in zip(chunks, self.layout.chunk_numels)]
        where = self._nonfinite_where(chunks, *nonfinite)
        if self.config.on_nonfinite == "reject":
            e = PushRejected(f"push {seq} from worker {slot} holds NaN/Inf in parameter {where!r}; parameters unchanged")
            self._reject(record, seq, e, reason="nonfinite")
            raise e
        with self._lock:
            record.tracker.mark(seq)
            self.stats.pushes_skipped += 1
        self.metrics.skipped.inc()
        logger.warning("skipped push %d from worker %d: NaN/Inf in %r", seq, slot, where)
        return PushReply("skipped", self.version, 0)

    def _early_reply(self, record: WorkerRecord, seq: int, base_version: int, exact: bool = False) -> PushReply | None:
        """Under the lock: the reply for a push that must not be applied now, or None."""
        if self._stopping:
            raise ServerStopping("the server is shutting down; the push was not applied")
        if not self._running.is_set():
            return PushReply("paused", self.version, 0)
        if record.tracker.seen(seq):  # a concurrent retry of the same push got here first
            self.stats.pushes_duplicate += 1
            self.metrics.duplicates.inc()
            return PushReply("duplicate", self.version, 0)
        staleness = self.version - base_version
        limit = 0 if exact else self.config.max_staleness
        if limit is not None and staleness > limit:
            # Not recorded as processed: the worker recomputes this step on fresh parameters.
            self.stats.pushes_stale += 1
            self.metrics.rejected.labels("stale").inc()
            return PushReply("stale", self.version, staleness)
        return None

    def _apply_locked(
        self, grads: list[torch.Tensor], contributions: list[tuple[WorkerRecord, int, float | None, int]]
    ) -> tuple[int, float]:
        """One optimizer step from ``grads``; records every contribution. Returns (version, step seconds)."""
        step_started = time.perf_counter()
        for master, grad in zip(self._masters, grads):
            master.grad = grad
        self.optimizer.step()
        for master in self._masters:
            master.grad = None
        if self.schedule is not None:
            self.schedule.step()
        self.version += 1
        now = time.monotonic()
        for record, seq, loss, staleness in contributions:
            if self.audit is not None:
                self.audit.applied(self.version, record.slot, seq)
            record.tracker.mark(seq)
            record.last_push = record.last_seen = now
            record.live = True
            record.note_loss(loss)
            self.stats.staleness_sum += staleness
            self.stats.max_staleness = max(self.stats.max_staleness, staleness)
        self.stats.updates_applied += 1
        return self.version, time.perf_counter() - step_started

    def _after_apply(self, version: int, step_seconds: float, staleness: list[int], grads: list[torch.Tensor]) -> None:
        if self.on_update is not None:
            self.on_update(version)
        m = self.metrics
        m.step_seconds.observe(step_seconds)
        m.updates.inc()
        m.version.set(version)
        for s in staleness:
            m.staleness.observe(s)
        m.grad_bytes.inc(len(staleness) * sum(c.numel() * c.element_size() for c in grads))

    # ---- sync rounds ---------------------------------------------------------------------------

    def _close_round_locked(self, now: float) -> list[tuple[Future, PushReply]]:
        """Under the lock: if the open round is complete (or timed out), applies it."""
        assert self._rounds is not None
        if not self._rounds.ready(now):
            return []
        round_, waiting = self._rounds.take()
        n = len(round_.contributions)
        for total in round_.sums:
            total.div_(n)
        contributions = [(c.record, c.seq, c.loss, c.staleness) for c in round_.contributions.values()]
        version, step_seconds = self._apply_locked(round_.sums, contributions)
        self._rounds.recycle(round_.sums)  # the step is done with them (only their sizes are read later)
        self.stats.rounds += 1
        if round_.missing():
            logger.warning("sync round %d closed after %.1fs without slots %s", version, now - round_.opened, sorted(round_.missing()))
        self._pending_after_apply = (version, step_seconds, [0] * n, round_.sums)
        done = [(c.reply, PushReply("applied", version, 0)) for c in round_.contributions.values()]
        return done + [(f, PushReply("stale", version, 1)) for f in waiting]

    def _resolve(self, closed: list[tuple[Future, PushReply | ErrorReply]]) -> None:
        """Outside the lock: answers futures (which sends RPC replies)."""
        if not closed:
            return
        pending, self._pending_after_apply = self._pending_after_apply, None
        if pending is not None:
            self._after_apply(*pending)
        for future, reply in closed:
            future.set_result(reply)

    def _round_timer(self) -> None:
        while True:
            time.sleep(0.05)
            with self._lock:
                if self._stopping:
                    closed = self._fail_round_locked()
                else:
                    closed = self._close_round_locked(time.monotonic())
            self._resolve(closed)
            if self._stopping:
                return

    def _fail_round_locked(self) -> list[tuple[Future, PushReply | ErrorReply]]:
        """At stop: every waiting push is answered ServerStopping (not applied)."""
        assert self._rounds is not None
        futures = list(self._rounds.waiting)
        if self._rounds.current is not None:
            futures += [c.reply for c in self._rounds.current.contributions.values()]
        self._rounds.current, self._rounds.waiting = None, []
        stopping = ErrorReply("ServerStopping", "the server is shutting down; the push was not applied")
        return [(f, stopping) for f in futures]

    def push_named(
        self,
        slot: int,
        incarnation: str,
        seq: int,
        base_version: int,
        grads: dict[str, torch.Tensor],
        loss: float | None = None,
    ) -> PushReply:
        """Like push, for clients that send one tensor per parameter name (checked by name first)."""
        try:
            chunks = [c.to(self.wire) for c in self._pack_named(slot, seq, grads)]
        except PushRejected as e:
            with self._lock:
                self.stats.pushes_received += 1
                record = self._checked_record(slot, incarnation)
            self.metrics.pushes.inc()
            self._reject(record, seq, e)
            raise
        return self.push(slot, incarnation, seq, base_version, chunks, loss)

    def _pack_named(self, slot: int, seq: int, grads: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if not isinstance(grads, dict):
            raise _Names(f"push {seq} from worker {slot}: gradients must be a dict of name -> tensor, got {type(grads).__name__}")
        unknown = sorted(set(grads) - {p.name for p in self.signature.params})
        if unknown:
            raise _Names(f"push {seq} from worker {slot} names parameters the model does not have: {unknown[:5]}")
        missing = [p.name for p in self.signature.params if p.name not in grads]
        if missing:
            raise _Names(f"push {seq} from worker {slot} is missing gradients for {missing[:5]}")
        chunks = self.layout.empty_chunks()
        for view, slot_ in zip(self.layout.views(chunks), self.layout.slots):
            grad, spec = grads[slot_.spec.name], slot_.spec
            if not isinstance(grad, torch.Tensor):
                raise PushRejected(f"push {seq} from worker {slot}: gradient of {spec.name!r} is a {type(grad).__name__}, not a tensor")
            if tuple(grad.shape) != spec.shape:
                raise PushRejected(
                    f"push {seq} from worker {slot}: gradient of {spec.name!r} has shape {list(grad.shape)}, expected {list(spec.shape)}"
                )
            if str(grad.dtype).removeprefix("torch.") != spec.dtype:
                raise _Dtype(f"push {seq} from worker {slot}: gradient of {spec.name!r} has dtype {grad.dtype}, expected {spec.dtype}")
            view.copy_(grad)
        return chunks

    def pull(self, slot: int, incarnation: str, have_version: int) -> PullReply:
        started = time.perf_counter()
        with self._lock:
            record = self._checked_record(slot, incarnation)
            record.last_seen = time.monotonic()
            paused = not self._running.is_set()
            if have_version == self.version or self._finishing:
                self.metrics.pulls.labels("unchanged").inc()
                return PullReply(self.version, None, paused, self._finishing)
            if self._snapshot_version != self.version:
                # One copy per version, shared by every worker that pulls it; the RPC layer sends it
                # after the lock is released.
                self._snapshot = [m.detach().to(self.wire, copy=True) for m in self._masters]
                self._snapshot_version = self.version
            reply = PullReply(self.version, self._snapshot, paused)
        self.metrics.pulls.labels("full").inc()
        self.metrics.param_bytes.inc(sum(c.numel() * c.element_size() for c in reply.chunks or []))
        self.metrics.pull_seconds.observe(time.perf_counter() - started)
        return reply

    def heartbeat(self, slot: int, incarnation: str) -> int:
        with self._lock:
            record = self._checked_record(slot, incarnation)
            record.last_seen = time.monotonic()
            record.live = True
            return self.version

    def leave(self, slot: int, incarnation: str) -> None:
        with self._lock:
            record = self._checked_record(slot, incarnation)
            record.left = True
            if self._rounds is not None:
                self._rounds.drop(slot)
                closed = self._close_round_locked(time.monotonic())
            else:
                closed = []
            self.workers.retired_rpc_names.append(record.rpc_name)
        self._resolve(closed)
        logger.info("worker slot %d (%s) left", slot, record.rpc_name)

    # ---- snapshots ----------------------------------------------------------------------------

    def capture_state(self) -> tuple[int, dict[str, Any]]:
        """A consistent in-memory copy of everything needed to continue exactly.

        Only memory copies happen under the lock (tens of ms for hundreds of MB); the caller
        writes the copy to disk without holding anything.
        """
        with self._lock:
            state = {
                "masters": [m.detach().clone() for m in self._masters],
                "optimizer": _clone_tensors(self.optimizer.state_dict()),
                "schedule": self.schedule.state_dict() if self.schedule is not None else None,
                "version": self.version,
                "workers": {str(slot): r.tracker.state() for slot, r in self.workers.records.items()},
            }
            return self.version, state

    def restore_state(self, state: dict[str, Any]) -> None:
        """Loads a captured state (from a verified snapshot) before any worker registers."""
        masters = state["masters"]
        if [m.numel() for m in masters] != list(self.layout.chunk_numels):
            raise ValueError("the snapshot's parameter layout differs from this server's (different --chunk-mb?)")
        with self._lock, torch.no_grad():
            for mine, saved in zip(self._masters, masters):
                mine.copy_(saved)
            self.optimizer.load_state_dict(state["optimizer"])
            if self.schedule is not None and state.get("schedule") is not None:
                self.schedule.load_state_dict(state["schedule"])
            self.version = int(state["version"])
            self.workers.restore({int(k): SequenceTracker.from_state(v) for k, v in state["workers"].items()})
            self._snapshot_version = -1
        self.metrics.version.set(self.version)

    # ---- membership upkeep (called by the reaper) ------------------------------------------------

    def take_retired_rpc_names(self) -> list[str]:
        with self._lock:
            names, self.workers.retired_rpc_names = self.workers.retired_rpc_names, []
            return names

    def member_workers(self) -> list[tuple[int, str, str, float]]:
        """(slot, incarnation, rpc name, last_seen monotonic) of every worker still in the RPC group."""
        with self._lock:
            return [(r.slot, r.incarnation, r.rpc_name, r.last_seen) for r in self.workers.records.values() if not r.left]

    def workers_live_count(self) -> int:
        with self._lock:
            return len(self.workers.live())

    def mark_alive(self, slot: int, incarnation: str) -> None:
        with self._lock:
            record = self.workers.records.get(slot)
            if record is not None and record.incarnation == incarnation:
                record.last_seen = time.monotonic()
                record.live = True

    def mark_dead(self, slot: int, incarnation: str) -> None:
        with self._lock:
            record = self.workers.records.get(slot)
            if record is not None and record.incarnation == incarnation:
                record.live = False
                record.left = True
                if self._rounds is not None:
                    self._rounds.drop(slot)  # the round timer closes it if it was waiting only for this slot

    def mark_silent(self, slot: int, incarnation: str) -> None:
        with self._lock:
            record = self.workers.records.get(slot)
            if record is not None and record.incarnation == incarnation:
                record.live = False

    # ---- control -------------------------------------------------------------------------------

    def pause(self) -> None:
        self._running.clear()
        self.metrics.paused.set(1)

    def resume(self) -> None:
        self._running.set()
        self.metrics.paused.set(0)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def finish(self) -> None:
        """Asks every worker to stop cleanly: their next pull says so (graceful shutdown)."""
        with self._lock:
            self._finishing = True
        self._running.set()

    def stop(self) -> None:
        """Refuses further pushes and registrations (the final checkpoint follows)."""
        with self._lock:
            self._stopping = True

    def master_tensors(self) -> dict[str, torch.Tensor]:
        """Named copies of the current parameters (for tests and evaluation)."""
        with self._lock:
            return {s.spec.name: v.detach().clone() for s, v in zip(self.layout.slots, self.layout.views(self._masters))}

    def summary(self) -> dict[str, Any]:
        with self._lock:
            s = self.stats
            records = list(self.workers.records.values())
            firsts = [sum(r.first_losses) / len(r.first_losses) for r in records if r.first_losses]
            lasts = [sum(r.recent_losses) / len(r.recent_losses) for r in records if r.recent_losses]
            wall = time.monotonic() - self.started
            return {
                "role": "ps",
                "initial_loss": sum(firsts) / len(firsts) if firsts else None,
                "final_loss": sum(lasts) / len(lasts) if lasts else None,
                "steps": s.pushes_received,
                "updates_applied": s.updates_applied,
                "pushes_rejected": s.pushes_rejected,
                "pushes_skipped": s.pushes_skipped,
                "pushes_duplicate": s.pushes_duplicate,
                "pushes_stale": s.pushes_stale,
                "rounds": s.rounds,
                "mode": self.config.mode,
                "shard": f"{self.config.shard_index}/{self.config.shard_count}",
                "mean_staleness": s.staleness_sum / s.updates_applied if s.updates_applied else 0.0,
                "max_staleness": s.max_staleness,
                "updates_per_second": s.updates_applied / wall if wall > 0 else 0.0,
                "wall_seconds": wall,
                "model_version": self.version,
            }

    # ---- internals -----------------------------------------------------------------------------

    def _checked_record(self, slot: int, incarnation: str) -> WorkerRecord:
        return self.workers.get(slot, incarnation)

    def _validate(self, slot: int, seq: int, chunks: list[Chunk]) -> None:
        expected = self.layout.chunk_numels
        if not isinstance(chunks, (list, tuple)) or len(chunks) != len(expected):
            got = len(chunks) if isinstance(chunks, (list, tuple)) else type(chunks).__name__
            raise PushRejected(f"push {seq} from worker {slot} has {got} gradient chunks, expected {len(expected)}")
        for i, (chunk, numel) in enumerate(zip(chunks, expected)):
            problem = check_chunk(chunk, numel, self.wire)
            if problem is not None:
                error = _Dtype if "dtype" in problem else PushRejected  # picks the metric's reason label
                raise error(f"push {seq} from worker {slot}: chunk {i} {problem} (parameters {self._chunk_names(i)})")

    def _nonfinite_where(self, chunks: list[Chunk], chunk: int, index: int) -> str:
        """The parameter holding the first NaN/Inf (index is into the values of a sparse chunk)."""
        sent = chunks[chunk]
        if isinstance(sent, tuple):
            index = int(sent[0][index])
        return self.layout.param_at(chunk, index)

    def _chunk_names(self, chunk: int) -> str:
        names = [s.spec.name for s in self.layout.slots if s.chunk == chunk]
        return f"{names[0]}..{names[-1]}" if len(names) > 1 else names[0]

    def _reject(self, record: WorkerRecord, seq: int, error: PushRejected, reason: str | None = None) -> None:
        if reason is None:
            reason = "dtype" if isinstance(error, _Dtype) else "names" if isinstance(error, _Names) else "shape"
        with self._lock:
            record.tracker.mark(seq)
            self.stats.pushes_rejected += 1
        self.metrics.rejected.labels(reason).inc()
        logger.warning("rejected: %s", error)

    def _worker_liveness(self) -> list[tuple[int, bool, float | None]]:
        with self._lock:
            return [(r.slot, r.live and not r.left, r.last_push) for r in self.workers.records.values()]


class _Dtype(PushRejected):
    pass


class _Names(PushRejected):
    pass


def _done(reply: PushReply) -> Future:
    future: Future = Future()
    future.set_result(reply)
    return future


def _clone_tensors(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone_tensors(v) for v in tree)
    return tree


def _first_nonfinite(chunks: list[torch.Tensor]) -> tuple[int, int] | None:
    """(chunk, element) of the first NaN/Inf, or None.

    A finite sum proves every element finite (NaN and Inf propagate through a sum), so the full
    element-wise scan only runs when the cheap reduction says there may be one.
    """
    for i, chunk in enumerate(chunks):
        if torch.isfinite(chunk.sum()):
            continue
        bad = (~torch.isfinite(chunk)).nonzero()
        if bad.numel():
            return i, int(bad[0, 0])
    return None
