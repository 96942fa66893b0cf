"""ParameterServer: the parameters, the one optimizer, the model version, and the log that changes them.

State and one apply step, under one lock. Everything here may be called from many RPC threads at
once; the lock serialises what must be serialised (the optimizer step, the version, per-slot
progress) and is never held across network or disk I/O: pushes are validated before it is taken,
pulls copy a snapshot under it and send after it is released, checkpoints copy under it and write
after.

Every change of replicated state goes through the log (``ps.core.update_log``): it is *sequenced*
under the lock (an index, and for an update the version it will produce), *committed* (at once, or
once the standby holds it) and *applied* in index order by ``apply_committed_locked``, the one
function both a primary and its standby apply with, so their states are bit-identical at every
version. Whoever holds the lock may apply what is committed; the futures of what it applied are
completed after the lock is released (that sends the replies).

What lives elsewhere: the worker API and deduplication (``ps.api.worker_service``), push validation
(``ps.core.push_checks``), the consistency modes (``ps.api.modes``), and everything that watches the server
through the small interfaces below: the model's buffers (``ps.core.buffers``), ``on_applied`` listeners (metrics, audit ledger, checkpoint
trigger), ``capture_state``/``restore_state`` (the checkpointer) and ``status`` (control plane,
progress log, summary).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.futures import Future

from ps.core.buffers import BufferStore
from ps.core.config import ServerCoreConfig
from ps.core.dedup import SequenceTracker
from ps.core.metrics import ServerMetrics
from ps.core.optim import build_optimizer, load_state, scaled_lr
from ps.core.outer import build_outer
from ps.core.prediction import PREDICTED_OPTIMIZERS, WeightPrediction
from ps.core.presence import HeldSlices
from ps.core.pull_copies import PullCopies
from ps.core.update_log import ReplicationLog, Sequenced, UpdateApplied
from ps.core.workers import WorkerRecord, WorkerTable
from ps.sparse.store import CheckedPush, SparseStore
from ps.sparse.table import ClosedFull
from rpcps import failpoints, threads
from rpcps.errors import NotPrimary
from rpcps.messages import Control, Evicted, LogEntry, Mark, Mode, PushReply, PushStatus, Registered, Removed, Update
from rpcps.partition import partition_digest, shard_signature
from rpcps.signature import WIRE_DTYPE, FlatLayout, ModelSignature, named_state, persistent_buffers
from rpcps.sparse.spec import declared_tables
from rpcps.staleness import lr_inverse
from rpcps.wire import to_dense_fp32, wire_dtype

logger = logging.getLogger(__name__)

CONTROL_APPLY_TIMEOUT_S = 30.0
"""How long a pause or resume waits to be applied: with a standby, until it acknowledged the entry
(a standby that stopped answering is dropped within its lease, and then the entry applies)."""


@dataclass(frozen=True)
class Contribution:
    """One push's part in an update (an async update has one; a sync round one per worker)."""

    record: WorkerRecord
    seq: int
    loss: float | None
    staleness: int
    buffers: list[torch.Tensor] | None = None
    """The model buffers the push carried; the update that applies it makes them the server's."""


@dataclass(frozen=True)
class WorkerView:
    slot: int
    live: bool
    last_push_age_s: float | None
    next_step: int
    """The slot's first step the server has not processed."""


@dataclass(frozen=True)
class ServerStatus:
    """A consistent view of the server, taken under its lock."""

    version: int
    mode: Mode
    optimizer: str
    paused: bool
    finishing: bool
    uptime_s: float
    server_id: str
    shard_index: int
    shard_count: int
    workers: tuple[WorkerView, ...]
    intra_op_threads: int
    """The intra-op threads this process computes with now (rpcps.threads; they follow the host)."""
    thread_budget: str = ""
    """Why (the usable cores and who shares them), or empty before a budget was chosen."""
    host_processes: int = 1
    """rpcps processes on this host sharing its cores, this one included."""

    @property
    def live_workers(self) -> int:
        return sum(1 for w in self.workers if w.live)


class ParameterServer:
    def __init__(self, model: torch.nn.Module, config: ServerCoreConfig, metrics: ServerMetrics | None = None) -> None:
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
        self.lock = threading.Lock()
        self._masters = [torch.nn.Parameter(c, requires_grad=False) for c in self.layout.empty_chunks()]
        with torch.no_grad():
            params = dict(model.named_parameters())
            for view, slot in zip(self.layout.views(self._masters), self.layout.slots):
                view.copy_(params[slot.spec.name].detach().to(WIRE_DTYPE))
        self.optimizer: torch.optim.Optimizer
        self.schedule: torch.optim.lr_scheduler.LRScheduler | None
        if config.mode == Mode.LOCAL_STEPS:
            self.optimizer, self.schedule = build_outer(config.outer, config.min_workers, list(self._masters)), None
        else:
            self.optimizer, self.schedule = build_optimizer(config.applied_optimizer, list(self._masters))
        self.buffers = BufferStore(self.signature.buffers, dict(persistent_buffers(model)))
        specs = declared_tables(model)
        if specs and config.mode in (Mode.SYNC, Mode.LOCAL_STEPS):
            raise ValueError(f"sparse embedding tables need --mode async or bounded ({config.mode} applies dense updates only)")
        self.sparse = SparseStore(specs, config.sparse, config.shard_index, config.shard_count, self._evict) if specs else None
        """The model's sparse tables (this server's buckets of them), or None. Every change of their
        rows is an entry of the log (rows created for admitted ids and row updates with an update,
        evictions as ``Evicted``), applied in log order, so a standby's tables are the primary's."""
        if self.sparse is not None:
            self.metrics.watch_sparse(self.sparse.stats)
        self.version = 0
        self.log = ReplicationLog()
        self.epoch = 0
        """The epoch of the view this process serves under."""
        self.mirroring = False
        """This process is a standby: it applies what its primary sequenced and serves no one."""
        self.promotion: threading.Event | None = None
        """Set by a standby taking over, until it serves or gives up (``ps.replication.standby``): a
        worker's call meanwhile waits for that instead of being told this process is not the primary."""
        self.deposed = False
        """This process was a primary and learned of a newer epoch: it sequences and applies nothing more."""
        self.not_primary_reason = ""
        """What a worker calling this process is told (names the shard's primary when known)."""
        self.lease: Callable[[], float | None] = time.time
        """Asked before each apply: the unix time of the decision, or None when this process may not
        apply now (a primary whose lease ran out). Set by ``ps.replication``."""
        self.workers = WorkerTable(config.max_workers)
        self.started = time.monotonic()
        self.thread_budget: threads.HostBudget | None = None
        """The process's thread budget, for status (ps.runner sets it)."""
        self._listeners: list[Callable[[UpdateApplied], None]] = []
        self.pull_bytes = sum(self.layout.chunk_numels) * self.wire.itemsize
        """Parameter bytes a full pull sends (buffers aside)."""
        self._pull_copies = PullCopies(self.wire)
        # Local steps step the outer SGD, not --optimizer: its last step is one worker's delta, no
        # smoothed direction to extrapolate.
        predicting = (config.mode in (Mode.ASYNC, Mode.BOUNDED) and config.optimizer.name in PREDICTED_OPTIMIZERS
                      and config.predict_ahead > 0)
        self.prediction = WeightPrediction(self._masters, config.predict_ahead) if predicting else None
        """Pulls get the parameters moved ahead by the expected staleness (``ps.core.prediction``), or None."""
        self._observe_copies = PullCopies(self.wire)
        self._running = threading.Event()
        self._running.set()
        self.stopping = False
        """No more pushes or registrations are taken (the final checkpoint follows)."""
        self.finishing = False
        """Workers are told to stop for good at their next pull (graceful shutdown)."""

    def on_applied(self, listener: Callable[[UpdateApplied], None]) -> None:
        """Calls ``listener`` after every update, under the lock and in version order: keep it cheap."""
        self._listeners.append(listener)

    # ---- the update ------------------------------------------------------------------------------

    def refusal_locked(self, record: WorkerRecord, seq: int, base_version: int, max_staleness: int | None) -> PushReply | None:
        """Under the lock: the reply for a push that must not be sequenced now, or None to sequence it.

        Ask ``join_pending_locked`` first: a retry of a push sequenced and not yet applied joins it.
        """
        if self._holds_pushes_locked():
            return PushReply(PushStatus.PAUSED, self.version, 0)
        if record.tracker.seen(seq):  # a concurrent retry of the same push got here first
            self.metrics.count_duplicate()
            return PushReply(PushStatus.DUPLICATE, self.version, 0)
        staleness = self.log.last_version - base_version
        if max_staleness is not None and staleness > max_staleness:
            # Not recorded as processed: the worker recomputes this step on fresh parameters.
            self.metrics.count_stale()
            return PushReply(PushStatus.STALE, self.version, staleness)
        return None

    def _holds_pushes_locked(self) -> bool:
        # A pause waiting for the standby to hold it is not applied yet, and a push sequenced after it
        # would be applied after it: past the version the pause reports (CI saw one such push).
        pending = self.log.unapplied_control
        return not self._running.is_set() if pending is None else pending == "pause"

    def join_pending_locked(self, slot: int, seq: int) -> Future | None:
        """Under the lock: a retry of a push that is sequenced and not yet applied waits for it and is
        answered 'duplicate' then (never before: the original may still be lost with this primary)."""
        pending = self.log.pending.get((slot, seq))
        if pending is None:
            return None
        self.metrics.count_duplicate()
        reply: Future = Future()
        assert isinstance(pending.entry, Update)
        pending.replies.append((reply, PushReply(PushStatus.DUPLICATE, pending.entry.version, 0)))
        return reply

    # ---- sequencing (the primary) ----------------------------------------------------------------

    def sequence_update_locked(
        self,
        chunks: list[Any],
        grads: list[torch.Tensor] | None,
        contributions: list[tuple[int, int, float | None, int]],
        on_release: Callable[[], None] | None = None,
        buffers: list[torch.Tensor] | None = None,
        sparse: CheckedPush | None = None,
        absent: int = 0,
    ) -> Sequenced:
        """Under the lock: the next optimizer step, from ``grads`` (the fp32 form of ``chunks``); with
        ``buffers``, the model buffers that become the server's with it; with ``sparse``, the sparse
        rows it changes; ``absent``, the parameters it leaves as they are (``ps.core.presence``). It
        also carries the ids pulls admitted since the previous update: their rows are created first."""
        self._check_primary_locked()
        log = self.log
        admitted = self.sparse.take_admitted() if self.sparse is not None else None
        entry = Update(
            log.next_index, self.epoch, log.last_version + 1, list(chunks), tuple(contributions), buffers, absent,
            sparse.tables if sparse else None, admitted,
        )
        sequenced = Sequenced(entry, grads, on_release=on_release)
        log.append(sequenced)
        return sequenced

    def sequence_locked(self, make: Callable[[int, int], LogEntry]) -> Sequenced:
        """Under the lock: a non-update entry, ``make(index, epoch)``."""
        self._check_primary_locked()
        sequenced = Sequenced(make(self.log.next_index, self.epoch))
        self.log.append(sequenced)
        return sequenced

    def _evict(self, table: str, ids: torch.Tensor, clock: int) -> None:
        """The eviction thread's decision for ``table``, as a log entry (a standby decides nothing:
        it applies its primary's)."""
        with self.lock:
            if self.mirroring or self.deposed:
                return
            self.sequence_locked(lambda index, epoch: Evicted(index, epoch, table, ids, clock))
            applied = self.apply_committed_locked()
        answer(applied)

    def _check_primary_locked(self) -> None:
        if self.mirroring or self.deposed:
            raise NotPrimary(self.not_primary_reason)

    # ---- applying (both roles) -------------------------------------------------------------------

    def apply_committed_locked(self) -> list[tuple[Future, Any]]:
        """Under the lock: applies every committed entry in index order, while allowed (``lease``).

        Returns the futures to complete, with their values, once the caller has released the lock.
        """
        done: list[tuple[Future, Any]] = []
        while (sequenced := self.log.next_to_apply()) is not None:
            stamp = self.lease()
            if stamp is None:
                break
            self._apply_locked(sequenced, stamp)
            self.log.applied(sequenced)
            done += sequenced.replies
        return done

    def _apply_locked(self, sequenced: Sequenced, stamp: float) -> None:
        entry = sequenced.entry
        if isinstance(entry, Update):
            grads = sequenced.grads
            if grads is None:
                grads = [to_dense_fp32(c, n) for c, n in zip(entry.chunks, self.layout.chunk_numels)]
            self.apply_locked(grads, entry, stamp)
        elif isinstance(entry, Mark):
            self.workers.records[entry.slot].tracker.mark(entry.seq)
        elif isinstance(entry, Registered):
            self.workers.register(entry.slot, entry.rpc_name, entry.incarnation)
        elif isinstance(entry, Removed):
            self.workers.remove(entry.slot, entry.incarnation)  # the primary removed it when it sequenced this
        elif isinstance(entry, Control):
            (self._running.clear if entry.action == "pause" else self._running.set)()
            self.metrics.paused.set(1 if entry.action == "pause" else 0)
        elif isinstance(entry, Evicted) and self.sparse is not None:
            # A standby writes no delta (promoted, its first snapshot is a full): no tombstones to keep.
            self.sparse.evict(entry.table, entry.ids, entry.clock, tombstones=not self.mirroring)

    def apply_locked(self, grads: list[torch.Tensor], update: Update, stamp: float) -> int:
        """Under the lock: one optimizer step from ``grads`` and the update's sparse rows; records
        every contribution. Returns the version."""
        started = time.perf_counter()
        threads.sync()  # the host's budget may have changed since this RPC thread last computed
        for master, grad in zip(self._masters, grads):
            master.grad = grad
        held = HeldSlices(self.layout, self._masters, self.optimizer, update.absent) if update.absent else None
        if self.prediction is not None:
            self.prediction.before_step_locked()
        lr_scale = self._lr_scale(update)
        with scaled_lr(self.optimizer, lr_scale):
            self.optimizer.step()
        self.metrics.lr_scale.set(lr_scale)
        if held is not None:
            held.restore()
        for master in self._masters:
            master.grad = None
        if self.schedule is not None:
            self.schedule.step()
        sparse_rows = 0
        if self.sparse is not None and (update.sparse or update.admitted):
            sparse_rows = self.sparse.apply(CheckedPush.logged(update.sparse) if update.sparse else None, update.admitted)
        self.version += 1
        if self.version != update.version:
            raise AssertionError(f"update {update.index} produces version {update.version}, but this server is at {self.version - 1}")
        failpoints.hit("server.after_apply")
        now = time.monotonic()
        if update.buffers is not None:
            self.buffers.replace_locked(update.buffers)
        if self.prediction is not None:
            self.prediction.after_step_locked(self.version, [staleness for *_, staleness in update.contributions])
        for slot, seq, loss, _ in update.contributions:
            record = self.workers.records[slot]
            record.tracker.mark(seq)
            record.last_push = record.last_seen = now
            record.live = True
            record.note_loss(loss)
        event = UpdateApplied(
            self.version,
            time.perf_counter() - started,
            tuple((slot, seq, staleness) for slot, seq, _, staleness in update.contributions),
            sum(g.numel() * g.element_size() for g in grads) * len(update.contributions),
            update.epoch,
            stamp,
            self.mirroring,
            sparse_rows,
        )
        for listener in self._listeners:
            listener(event)
        return self.version

    def _lr_scale(self, update: Update) -> float:
        """The factor ``update``'s step scales the learning rate by: 1, or with --staleness-lr that of
        its stalest gradient. The staleness is in the log entry, so a standby scales alike."""
        if not self.config.scales_lr_by_staleness:
            return 1.0
        return lr_inverse(max(staleness for *_, staleness in update.contributions))

    def digest_locked(self) -> str:
        """Under the lock: a fingerprint (CRC-32) of the parameters, the optimizer state, the version,
        every slot's dedup record, and every sparse row (``ps.sparse.table.SparseTable.digest``).

        Replicas compare it at the same version: any flipped bit changes it (it is not a proof
        against tampering, only against divergence).
        """
        slots = sorted((slot, sorted(r.tracker.state().items())) for slot, r in self.workers.records.items())
        crc = zlib.crc32(repr((self.version, slots)).encode())
        state = self.optimizer.state
        for master in self._masters:
            crc = zlib.crc32(_bytes_of(master), crc)
            for key in sorted(state.get(master, {})):
                value = state[master][key]
                crc = zlib.crc32(_bytes_of(value) if isinstance(value, torch.Tensor) else repr(value).encode(), crc)
        if self.sparse is not None:
            crc = self.sparse.digest(crc)
        return f"{crc:08x}"

    def params_for_pull_locked(self) -> list[torch.Tensor]:
        """Under the lock: the parameters in the wire dtype, one copy per version shared by every
        worker that pulls it (the RPC layer sends it after the lock is released; ``ps.core.pull_copies``);
        with weight prediction, moved ahead by the expected staleness (``ps.core.prediction``)."""
        prediction = self.prediction
        if prediction is None:
            return self._pull_copies.for_version(self.version, self._masters)
        version = self.version

        def write(targets: list[torch.Tensor]) -> None:
            self.metrics.prediction_ahead.set(prediction.write(targets, version))

        return self._pull_copies.for_version(version, self._masters, write)

    def params_for_observe_locked(self) -> list[torch.Tensor]:
        """Under the lock: the parameters as they are, for an observer that scores the model (the
        evaluator): never predicted. Their own copies when pulls are predicted (a copy serves one
        content per version)."""
        if self.prediction is None:
            return self.params_for_pull_locked()
        return self._observe_copies.for_version(self.version, self._masters)

    # ---- snapshots -------------------------------------------------------------------------------

    def capture_state(self) -> tuple[int, dict[str, Any]]:
        """A consistent in-memory copy of everything needed to continue exactly.

        Only memory copies happen under the lock (tens of ms for hundreds of MB); the caller
        writes the copy to disk without holding anything.
        """
        with self.lock:
            return self.capture_state_locked()

    def capture_state_locked(self, include_sparse: bool = True) -> tuple[int, dict[str, Any]]:
        """``capture_state`` for a caller that holds the lock already (an ``on_applied`` listener).

        ``include_sparse=False`` leaves the sparse tables out, for a caller that captures them its own
        way under the same lock hold (the checkpointer's deltas, ps/checkpoints/sparse_checkpoint.py).
        """
        state = {
            "masters": [m.detach().clone() for m in self._masters],
            "optimizer": _clone_tensors(self.optimizer.state_dict()),
            "schedule": self.schedule.state_dict() if self.schedule is not None else None,
            "version": self.version,
            "epoch": self.epoch,
            "workers": {str(slot): r.tracker.state() for slot, r in self.workers.records.items()},
        }
        if self.sparse is not None and include_sparse:
            # Under the lock, like the rest: the rows match the dense state and the workers' progress.
            started = time.perf_counter()
            state["sparse"] = self.sparse.capture()
            self.metrics.sparse_capture_seconds.observe(time.perf_counter() - started)
        if self.buffers:
            state["buffers"] = self.buffers.named_locked()
        return self.version, state

    def capture_replica_state_locked(self, include_sparse: bool = True) -> dict[str, Any]:
        """Under the lock: the applied state as a new standby must start from it, exactly.

        Beyond a snapshot on disk: every registration (a standby that takes over must know the
        workers' incarnations) and every removed one (it must refuse them as this primary does), the pause state, and the log index the state corresponds to.
        ``include_sparse=False`` as in ``capture_state_locked`` (the primary closes a sliced copy of them).
        """
        _, state = self.capture_state_locked(include_sparse)
        state["registrations"] = {str(slot): [r.rpc_name, r.incarnation] for slot, r in self.workers.records.items() if not r.left}
        state["removed"] = {str(slot): [r.rpc_name, r.incarnation] for slot, r in self.workers.records.items() if r.left and r.incarnation}
        state["paused"] = self.paused
        state["log_index"] = self.log.applied_index
        return state

    def restore_state(self, state: dict[str, Any]) -> None:
        """Loads a captured state (a verified snapshot, or a primary's ``capture_replica_state_locked``)
        before any worker registers."""
        masters = state["masters"]
        if [m.numel() for m in masters] != list(self.layout.chunk_numels):
            raise ValueError("the snapshot's parameter layout differs from this server's (different --chunk-mb?)")
        with self.lock, torch.no_grad():
            if self.sparse is not None:  # first: it validates every table before anything else changes
                self.sparse.restore(state.get("sparse", {}))
            for mine, saved in zip(self._masters, masters):
                mine.copy_(saved)
            load_state(self.optimizer, state["optimizer"])
            if self.schedule is not None and state.get("schedule") is not None:
                self.schedule.load_state_dict(state["schedule"])
            self.version = int(state["version"])
            self.epoch = max(self.epoch, int(state.get("epoch", 0)))
            removed = {int(slot): (name, incarnation) for slot, (name, incarnation) in state.get("removed", {}).items()}
            self.workers.restore({int(k): SequenceTracker.from_state(v) for k, v in state["workers"].items()}, removed)
            for slot, (rpc_name, incarnation) in state.get("registrations", {}).items():
                self.workers.register(int(slot), rpc_name, incarnation)
            (self._running.clear if state.get("paused") else self._running.set)()
            self.log.restart_at(int(state.get("log_index", 0)), self.version)
            if self.buffers and "buffers" in state:  # a snapshot from before buffers were kept has none
                self.buffers.restore_locked(state["buffers"])
            self._pull_copies.invalidate()
            self._observe_copies.invalidate()
            if self.prediction is not None:
                self.prediction.forget_locked()
        self.metrics.version.set(self.version)

    def model_state(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The version and this server's part of the model as a state_dict: parameters in the model's
        own dtypes, then buffers (export; ``ps.checkpoints.export``). Copied under the lock, converted after it."""
        with self.lock:
            version, masters, buffers = self.version, [m.detach().clone() for m in self._masters], self.buffers.named_locked()
        return version, named_state(self.layout, masters, buffers)

    def model_export(self) -> tuple[int, dict[str, torch.Tensor], dict[str, list[ClosedFull]]]:
        """``model_state`` and, at the same version, a full capture of every sparse table, closed and
        ready to stream (``ps.checkpoints.sparse_export.live_tables``). The tables are copied in slices under each
        table's own lock first; the closing step under the server's lock copies the rows changed
        since the last delta snapshot (docs/SPARSE.md, "Export and serving")."""
        tables = self.sparse.begin_full() if self.sparse is not None else None
        try:
            if tables is not None:
                tables.copy_slices()
            with self.lock:
                version, masters, buffers = self.version, [m.detach().clone() for m in self._masters], self.buffers.named_locked()
                closed = tables.close() if tables is not None else {}
        finally:
            if tables is not None:
                tables.abort()
        return version, named_state(self.layout, masters, buffers), closed

    def master_tensors(self) -> dict[str, torch.Tensor]:
        """Named copies of the current parameters (for evaluation and tests)."""
        with self.lock:
            return {s.spec.name: v.detach().clone() for s, v in zip(self.layout.slots, self.layout.views(self._masters))}

    # ---- control ---------------------------------------------------------------------------------

    def pause(self, timeout_s: float = CONTROL_APPLY_TIMEOUT_S) -> bool:
        """Holds updates: pushes sequenced after this are answered 'paused' (a log entry, so a standby
        that takes over is paused too). Returns once the entry is applied, so ``version`` is then the
        version it holds at; False when it was not applied within ``timeout_s`` (it still will be)."""
        return self._control("pause", timeout_s)

    def resume(self, timeout_s: float = CONTROL_APPLY_TIMEOUT_S) -> bool:
        return self._control("resume", timeout_s)

    def _control(self, action: str, timeout_s: float) -> bool:
        # With a standby an entry applies once the standby holds it, after the pushes sequenced before
        # it: returning before that would report a version that one more push can still move.
        applied_here = threading.Event()
        reply: Future = Future()
        reply.add_done_callback(lambda _: applied_here.set())
        with self.lock:
            self.sequence_locked(lambda index, epoch: Control(index, epoch, action)).replies.append((reply, None))
            applied = self.apply_committed_locked()
        answer(applied)
        return applied_here.wait(timeout_s)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def finish(self) -> None:
        """Asks every worker to stop cleanly: their next pull says so (graceful shutdown)."""
        with self.lock:
            self.finishing = True
        self._running.set()

    def stop(self) -> None:
        """Refuses further pushes and registrations (the final checkpoint follows)."""
        with self.lock:
            self.stopping = True

    def status(self) -> ServerStatus:
        budget = self.thread_budget.budget if self.thread_budget is not None else None
        with self.lock:
            now = time.monotonic()
            workers = tuple(
                WorkerView(r.slot, r.live and not r.left, None if r.last_push is None else now - r.last_push, r.tracker.floor + 1)
                for r in sorted(self.workers.records.values(), key=lambda r: r.slot)
            )
            return ServerStatus(
                version=self.version, mode=self.config.mode, optimizer=self.config.optimizer_name, paused=self.paused,
                finishing=self.finishing, uptime_s=now - self.started, server_id=self.server_id,
                shard_index=self.config.shard_index, shard_count=self.config.shard_count, workers=workers,
                intra_op_threads=budget.intra_op if budget is not None else torch.get_num_threads(),
                thread_budget=budget.reason if budget is not None else "",
                host_processes=budget.sharing if budget is not None else 1,
            )


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # an ndarray is a buffer; numpy's stubs do not say so


def answer(done: list[tuple[Future, Any]]) -> None:
    """Outside the lock: completes applied entries' futures (which sends the RPC replies)."""
    for future, value in done:
        future.set_result(value)


def _clone_tensors(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone_tensors(v) for v in tree)
    return tree
