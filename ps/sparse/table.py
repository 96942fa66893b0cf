"""SparseTable: one embedding table's shard on one server, tying index, slab, optimizer, admission,
eviction and checkpoint capture together.

What each call does, and what it promises:

- ``pull(ids)`` -> float32 [n, dim]. Present ids read their row. Absent ids are shown to the
  admission filter once per pull; admitted ones get a new row, initialised from (seed, table id, id)
  only, with fresh optimizer state; refused ones read zeros (the default row) and are counted as
  filtered. Zeros rather than the deterministic init: a row that will never be trained should add
  nothing to the model's input, not a fixed random vector the dense layers would have to learn around.
  Duplicated ids are allowed. Rows are not marked as accessed by a pull (only by an update), so
  evaluation traffic does not keep rows alive. With ``defer=True`` (the server) admitted ids read
  their initial row without getting one yet: ``take_admitted`` hands them out and ``create`` makes
  their rows, where the server's log puts it, so that a standby makes the same rows in the same order.
- ``apply(ids, grads)``: ids unique, grads [n, dim] float32 summed per id. Rows present are updated
  in place by the row optimizer (one gather, one update, one scatter); gradients of ids without a row
  (never admitted, or evicted since their pull) are dropped and counted. Each call advances the
  "applies" clock by one. Invalid input (repeated ids, wrong shape or dtype, a non-finite gradient)
  raises before anything changes; ``apply_checked`` is the same without those checks, for the
  server, whose ``SparseStore.check_push`` has made them. A push of exactly the ids of a recent
  pull takes the rows that pull resolved instead of probing the index again (pull_memo.py: exact,
  ids the pull left without a row are looked up again).
- ``evict_step()``: examines one slice of rows (EvictionConfig.slice_rows) and evicts what the
  sweep's plan selects; returns the evicted ids, which are also kept as tombstones for the next delta.
  Call it from a background thread or between requests: the lock is held for one slice only. It also
  runs the admission filter's upkeep (halving count-min counters), so call it even without eviction.
  It is ``plan_eviction()`` (the decision: ids and the clock) then ``evict(ids, clock)`` (the removal,
  sparing rows updated since the decision); the server calls the two apart, the removal as a log entry.
- ``digest()``: a CRC of every row in id order, which two replicas compare (the audit ledger).
- ``capture_delta()``: under the lock, copies only the rows changed since the previous delta (found
  through the slab's dirty log, no scan of all rows) and takes the pending tombstones; the training
  pause is that copy. The changes are handed over: if the payload is lost, the next checkpoint must
  be a full. Do not modify a payload's tensors while a full capture is open (it reads them later).
- ``capture_full(lo, hi)``: a full snapshot of buckets [lo, hi) taken in slices of
  ``full_slice_rows`` rows, each under the lock, so training runs between slices. The slices alone
  are fuzzy (rows change while they are copied), so while the capture is open every delta captured
  and every row evicted is also applied to its copy by row number (row_image.py, outside the lock),
  and a closing step under the lock copies the rows still dirty and the rows created since the
  capture began: the result is exactly the state at the closing step, and the longest pause is one
  slice or the closing copy of touched rows. Its ``next_delta_seq`` is the seq of the next delta,
  which applies on top of it (or, equally, on top of the previous chain). It needs about twice the
  payload's bytes while it runs (the image, then the compacted result).
- ``restore(chains, ranges)``: loads full + deltas of one or more old servers into an empty table,
  keeping the rows of the given bucket ranges; the result is bit-identical to the captured state
  whatever the number of old and new servers. After a restore onto a different bucket layout, capture
  a new full before the next delta: the old chains do not describe this server's buckets.

Thread safety: one lock per table, held by each call above for its in-memory work only; nothing here
does I/O. ``stats()`` gives the counters for metrics.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch

from ps.sparse.admission import AdmissionConfig, build_admission
from ps.sparse.checkpoint import (
    FORMAT,
    InvalidPayload,
    RowRecords,
    compact,
    keep_buckets,
    payload_nbytes,
    payload_records,
)
from ps.sparse.eviction import SAMPLE_ROWS, EvictionConfig, EvictionPlan
from ps.sparse.index import IdIndex, IndexConfig, check_ids
from ps.sparse.pull_memo import PullMemo
from ps.sparse.row_image import RowImage
from ps.sparse.row_optim import ROW_OPTIMIZERS, RowOptimizer
from ps.sparse.slab import LIVE, RowSlab
from rpcps.sparse.hashing import derive_key
from rpcps.sparse.row_init import RowInitConfig, initial_rows
from rpcps.sparse.sharding import DEFAULT_BUCKETS
from rpcps.sparse.spec import TableSpec

logger = logging.getLogger(__name__)

ClockMode = Literal["applies", "seconds"]
BucketRanges = list[tuple[int, int]]
Chain = tuple[dict[str, Any], list[dict[str, Any]]]
_SAMPLE_SALT = 0x5A4D
_NONE = torch.empty(0, dtype=torch.int64)
_ADMITTED_COMPACT = 1 << 16
"""Queued admitted ids (repeats included) past which the queue is deduplicated."""


@dataclass(kw_only=True, frozen=True)
class TableConfig:
    spec: TableSpec
    """What the model declares (name, id, width), checked by TableSpec itself; the rest is the server's."""
    optimizer: RowOptimizer
    init: RowInitConfig = field(default_factory=RowInitConfig)
    admission: AdmissionConfig | None = None
    """None admits every id on first sight."""
    eviction: EvictionConfig | None = None
    """None never evicts."""
    clock: ClockMode = "applies"
    """What last_seen, TTL and count decay count: apply() calls on this table, or wall-clock seconds."""
    num_buckets: int = DEFAULT_BUCKETS
    index: IndexConfig = field(default_factory=IndexConfig)
    initial_rows: int = 1024
    """Rows the slab allocates up front (>= 1); it grows by 1.5x as needed."""
    full_slice_rows: int = 1 << 18
    """Rows a full capture copies per lock hold (>= 1): about 20 MB at 68 bytes a row."""

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, ROW_OPTIMIZERS):
            raise ValueError(f"optimizer must be one of {[c.__name__ for c in ROW_OPTIMIZERS]}, got {self.optimizer!r}")  # noqa: TRY004 - every config error is a ValueError
        if self.clock not in ("applies", "seconds"):
            raise ValueError(f"clock must be 'applies' or 'seconds', got {self.clock!r}")
        if not 1 <= self.num_buckets < 1 << 31:
            raise ValueError(f"num_buckets must be in [1, 2**31), got {self.num_buckets}")
        if self.initial_rows < 1:
            raise ValueError(f"initial_rows must be >= 1, got {self.initial_rows}")
        if self.full_slice_rows < 1:
            raise ValueError(f"full_slice_rows must be >= 1, got {self.full_slice_rows}")

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def table_id(self) -> int:
        return self.spec.table_id

    @property
    def dim(self) -> int:
        return self.spec.dim

    @property
    def width(self) -> int:
        """Slab columns: the embedding and the optimizer state."""
        return self.dim + self.optimizer.state_width(self.dim)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "table_id": self.table_id,
            "dim": self.dim,
            "optimizer": self.optimizer.to_dict(),
            "init": self.init.to_dict(),
            "admission": None if self.admission is None else self.admission.to_dict(),
            "eviction": None if self.eviction is None else self.eviction.to_dict(),
            "clock": self.clock,
            "num_buckets": self.num_buckets,
            "index": asdict(self.index),
            "initial_rows": self.initial_rows,
            "full_slice_rows": self.full_slice_rows,
        }


@dataclass(frozen=True)
class ApplyResult:
    applied: int
    """Rows updated."""
    dropped: int
    """Gradients dropped because their id has no row."""


@dataclass(frozen=True)
class EvictionSlice:
    evicted: torch.Tensor
    """int64 ids evicted by this step (also recorded as tombstones)."""
    scanned: int
    """Row numbers this step examined."""
    sweep_done: bool
    """True when this step finished a sweep; the next step starts a new one with a new plan."""
    clock: int = 0
    """The table's clock when the slice was decided (``SparseTable.evict`` spares rows updated after it)."""


@dataclass(frozen=True)
class TableStats:
    rows: int
    resident_bytes: int
    """Index + slab (rows, state, metadata, free list, dirty log) + admission filter."""
    index_bytes: int
    bytes_per_row: float
    index_bytes_per_row: float
    admitted_total: int
    filtered_total: int
    """Pulled ids refused by admission (once per pull they appear in)."""
    dropped_gradients_total: int
    evicted_total: int
    pulled_rows_total: int
    pushed_rows_total: int
    deltas_total: int
    delta_bytes_total: int
    last_delta_bytes: int
    tombstones_pending: int
    dirty_rows_pending: int
    """Upper bound on the rows the next delta holds."""
    admission_states_dropped_total: int
    """Saved admission filter states a restore could not use (logged as warnings)."""
    push_lookups_reused_total: int
    """Applies that took their rows from the pull of the same ids (pull_memo.py): only ids it left without a row are looked up."""
    push_lookups_fallback_total: int
    """Applies that looked their ids up in the index (no remembered pull of exactly those ids)."""


@dataclass
class _Counters:
    admitted: int = 0
    filtered: int = 0
    dropped: int = 0
    evicted: int = 0
    pulled: int = 0
    pushed: int = 0
    deltas: int = 0
    delta_bytes: int = 0
    last_delta_bytes: int = 0
    admission_states_dropped: int = 0
    push_lookups_reused: int = 0
    push_lookups_fallback: int = 0


class SparseTable:
    """One table's rows on one server; see the module docstring for each call's contract."""

    def __init__(self, config: TableConfig, time_fn: Callable[[], float] = time.time) -> None:
        """time_fn: the wall clock, read only when config.clock == "seconds" (tests pass a fake)."""
        self.config = config
        self._time_fn = time_fn
        self._lock = threading.Lock()
        self._index = IdIndex(config.index)
        self._slab = RowSlab(config.width, config.initial_rows)
        self._admission = build_admission(config.admission, config.table_id)
        self._epoch_unix = time_fn() if config.clock == "seconds" else 0.0
        self._applies = 0
        self._tombstones: list[torch.Tensor] = []
        self._delta_seq = 0
        self._fulls: list[FullCapture] = []
        self._plan: EvictionPlan | None = None
        self._cursor = 0
        self._sweep_end = 0
        # Seeded: which rows a capped sweep samples is reproducible for a given table.
        self._rng = torch.Generator().manual_seed(derive_key(_SAMPLE_SALT, config.table_id) & (2**63 - 1))
        self._counters = _Counters()
        self._memo = PullMemo()
        self._admitted: list[torch.Tensor] = []
        """Ids deferred pulls admitted, waiting for ``take_admitted`` (may repeat)."""
        self._admitted_n = 0
        self._admitted_bound = _ADMITTED_COMPACT

    def __len__(self) -> int:
        return len(self._index)

    def pull(self, ids: torch.Tensor, defer: bool = False) -> torch.Tensor:
        """Embeddings of ids (float32 [n, dim], a copy); creates rows for newly admitted ids.

        ``defer``: newly admitted ids get no row yet; they read their initial row (what creating it
        would write) and wait for ``take_admitted``, and the caller creates them with ``create``
        (the server, in its log's order, so that a standby creates the same rows at the same point).
        """
        check_ids(ids)
        dim = self.config.dim
        with self._lock:
            rows = self._index.lookup(ids)
            missing = rows < 0
            self._counters.pulled += ids.numel()
            if not bool(missing.any()):
                self._memo.remember(ids, rows)
                return self._slab.data.narrow(1, 0, dim).index_select(0, rows)
            new_ids, where = torch.unique(ids[missing], return_inverse=True)
            admitted = self._admission.admit(new_ids, self._now())
            self._counters.filtered += int((~admitted).sum())
            new_rows = torch.full((new_ids.numel(),), -1, dtype=torch.int64)
            if defer:
                self._wait_for_creation(new_ids[admitted])
            elif bool(admitted.any()):
                new_rows[admitted] = self._create(new_ids[admitted])
            rows[missing] = new_rows[where]
            self._memo.remember(ids, rows)
            out = torch.zeros(ids.numel(), dim, dtype=torch.float32)
            present = rows >= 0
            out[present] = self._slab.data.narrow(1, 0, dim).index_select(0, rows[present])  # after _create: it may grow the slab
            if defer and bool(admitted.any()):
                cfg = self.config
                waiting = missing.nonzero().squeeze(1)[admitted[where]]
                out[waiting] = initial_rows(cfg.init, cfg.table_id, ids[waiting], dim)
            return out

    def take_admitted(self) -> torch.Tensor:
        """The ids deferred pulls admitted since the last call (unique, ascending), for ``create``."""
        if not self._admitted:  # read without the lock (every update asks): a pull queueing now is taken next time
            return _NONE
        with self._lock:
            waiting, self._admitted, self._admitted_n = self._admitted, [], 0
        return torch.unique(torch.cat(waiting)) if waiting else _NONE

    def create(self, ids: torch.Tensor) -> int:
        """Rows for the admitted ``ids`` (unique, ascending: ``take_admitted``) that have none;
        returns how many it created. Deterministic: the same calls in the same order make the same rows."""
        with self._lock:
            absent = ids[self._index.lookup(ids) < 0]
            if absent.numel():
                self._create(absent)
            return absent.numel()

    def _wait_for_creation(self, ids: torch.Tensor) -> None:
        """Queues admitted ids for ``take_admitted``; an id pulled again before it has a row is
        queued again, so the queue is deduplicated once it outgrows what it held unique last time."""
        if not ids.numel():
            return
        self._admitted.append(ids)
        self._admitted_n += ids.numel()
        if self._admitted_n > self._admitted_bound:
            unique = torch.unique(torch.cat(self._admitted))
            self._admitted, self._admitted_n = [unique], unique.numel()
            self._admitted_bound = max(_ADMITTED_COMPACT, 2 * unique.numel())

    def apply(self, ids: torch.Tensor, grads: torch.Tensor) -> ApplyResult:
        """Updates the rows of ids with their summed gradients; see the module docstring.

        Raises:
            TypeError: ids not 1-D int64, or grads not float32.
            ValueError: ids repeat, grads not [len(ids), dim], or a gradient is NaN or infinite.
        """
        check_ids(ids)
        if grads.dtype != torch.float32:
            raise TypeError(f"grads must be float32, got {grads.dtype}")
        if grads.shape != (ids.numel(), self.config.dim):
            raise ValueError(f"grads must have shape ({ids.numel()}, {self.config.dim}), got {tuple(grads.shape)}")
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError("ids passed to apply must be unique (sum the gradients of repeated ids first)")
        if not bool(torch.isfinite(grads).all()):
            raise ValueError("grads hold NaN or infinite values; nothing was applied")
        return self.apply_checked(ids, grads)

    def apply_checked(self, ids: torch.Tensor, grads: torch.Tensor) -> ApplyResult:
        """``apply`` without its checks, for a caller that has made them (``SparseStore.check_push``):
        ids 1-D int64 and unique, grads float32 [len(ids), dim] and finite. Breaking that corrupts
        rows (a repeated id's updates overwrite each other) or poisons them with NaN."""
        with self._lock:
            self._applies += 1
            rows = self._memo.take(ids)
            if rows is None:
                rows = self._index.lookup(ids)
                self._counters.push_lookups_fallback += 1
            else:
                # The pull left these without a row; one may have been admitted since (or its
                # row forgotten by an eviction): look them up as a push without the memo would.
                unresolved = (rows < 0).nonzero().squeeze(1)
                if unresolved.numel():
                    rows[unresolved] = self._index.lookup(ids[unresolved])
                self._counters.push_lookups_reused += 1
            present = rows >= 0
            dropped = ids.numel() - int(present.sum())
            if dropped:
                rows, grads = rows[present], grads[present]
            if rows.numel():
                block = self._slab.data.index_select(0, rows)
                self.config.optimizer.step(block, grads)
                self._slab.data.index_copy_(0, rows, block)
                self._slab.touch(rows, self._now(), self._count_decay)
                self._slab.mark_dirty(rows)
            self._counters.pushed += rows.numel()
            self._counters.dropped += dropped
        return ApplyResult(applied=rows.numel(), dropped=dropped)

    def evict_step(self) -> EvictionSlice:
        """One slice of the eviction sweep (and the admission filter's upkeep); see the module docstring."""
        planned = self.plan_eviction()
        return replace(planned, evicted=self.evict(planned.evicted, planned.clock))

    def plan_eviction(self) -> EvictionSlice:
        """``evict_step``'s decision without its removal: the ids one slice of the sweep would evict
        (in ``evicted``), and the clock they were chosen at. Nothing is removed: the server ships the
        decision in its log and both replicas ``evict`` it there."""
        cfg = self.config.eviction
        with self._lock:
            now = self._now()
            self._admission.age(now)
            if cfg is None:
                return EvictionSlice(evicted=torch.empty(0, dtype=torch.int64), scanned=0, sweep_done=True, clock=now)
            if self._plan is None:
                self._plan = EvictionPlan(cfg, now, len(self._slab), self._sample_live())
                self._cursor, self._sweep_end = 0, self._slab.high_water
            lo, hi = self._cursor, min(self._cursor + cfg.slice_rows, self._sweep_end)
            rows = self._slab.live_rows(lo, hi)
            victims = rows[self._plan.select(now, self._slab.last_seen[rows], self._slab.count[rows])]
            self._cursor = hi
            done = hi >= self._sweep_end
            if done:
                self._plan = None
            return EvictionSlice(evicted=self._index.ids_of(victims), scanned=hi - lo, sweep_done=done, clock=now)

    def evict(self, ids: torch.Tensor, clock: int, tombstones: bool = True) -> torch.Tensor:
        """Evicts the rows of ``ids`` (a ``plan_eviction`` decision taken at ``clock``) that were not
        updated since: a row pushed to after the decision stays, as do ids without a row. Returns the
        ids evicted, also recorded as tombstones for the next delta unless ``tombstones`` is False
        (a standby, which takes no delta: its first snapshot once promoted is a full)."""
        with self._lock:
            rows = self._index.lookup(ids)
            keep = rows >= 0
            keep[keep.clone()] = self._slab.last_seen[rows[keep]].to(torch.int64) <= clock
            victims, evicted = rows[keep], ids[keep]
            self._index.remove(evicted)
            self._slab.release(victims)
            if victims.numel():
                self._memo.forget(victims)
            for capture in self._fulls:
                capture.queue(victims, None)
            if tombstones:
                self._tombstones.append(evicted)
            self._counters.evicted += evicted.numel()
        return evicted

    def digest(self, crc: int = 0) -> int:
        """CRC-32 of every row (id, embedding, optimizer state, last use, count) in id order and the
        table's clock, continuing ``crc``: equal on two replicas exactly when their rows are, however
        their slabs lay the rows out. The admission filter's counters are not in it."""
        with self._lock:
            records = self._records(self._slab.live_rows(0, self._slab.high_water))
            applies = self._applies
        order = torch.argsort(records.ids)
        crc = zlib.crc32(f"{self.config.name} {applies} {len(records)}".encode(), crc)
        for tensor in (records.ids, records.rows, records.last_seen, records.count):
            crc = zlib.crc32(tensor[order].contiguous().numpy().tobytes(), crc)
        return crc

    def capture_delta(self) -> dict[str, Any]:
        """Rows changed since the previous delta, and the ids evicted since; see checkpoint.py."""
        with self._lock:
            rows = self._slab.take_dirty()
            records = self._records(rows)
            tombstones = torch.cat(self._tombstones) if self._tombstones else torch.empty(0, dtype=torch.int64)
            self._tombstones = []
            meta = self._meta("delta", [(0, self.config.num_buckets)], seq=self._delta_seq)
            self._delta_seq += 1
            for capture in self._fulls:
                capture.queue(rows, records)
            payload = {"meta": meta, "records": records.to_dict(), "tombstones": tombstones}
            self._counters.deltas += 1
            self._counters.last_delta_bytes = payload_nbytes(payload)
            self._counters.delta_bytes += self._counters.last_delta_bytes
        return payload

    def drop_changes(self) -> None:
        """Forgets which rows changed since the previous delta, without copying them: the next delta
        will not hold those changes. For a caller about to take a full before any further delta: the
        full's slices copy those rows anyway, and its closing step then copies only the rows changed
        while it ran (not, say, every row pulled into a fresh table). Tombstones stay pending."""
        with self._lock:
            rows = self._slab.take_dirty()
            if self._fulls:  # another open capture's closing step would have copied these rows
                records = self._records(rows)
                for capture in self._fulls:
                    capture.queue(rows, records)

    def begin_full(self, bucket_lo: int = 0, bucket_hi: int | None = None) -> FullCapture:
        """Starts a full capture of buckets [bucket_lo, bucket_hi); drive it with step() or finish()."""
        bucket_hi = self.config.num_buckets if bucket_hi is None else bucket_hi
        if not 0 <= bucket_lo < bucket_hi <= self.config.num_buckets:
            raise ValueError(f"bucket range [{bucket_lo}, {bucket_hi}) is not within [0, {self.config.num_buckets})")
        return FullCapture(self, [(bucket_lo, bucket_hi)])

    def capture_full(self, bucket_lo: int = 0, bucket_hi: int | None = None) -> dict[str, Any]:
        """Every row of buckets [bucket_lo, bucket_hi) as of the closing step; see the module docstring."""
        return self.begin_full(bucket_lo, bucket_hi).finish()

    def restore(self, chains: list[Chain], bucket_ranges: BucketRanges) -> None:
        """Loads the rows of ``bucket_ranges`` from full + deltas chains into this empty table.

        Args:
            chains: (full, deltas in seq order) per old server; their bucket sets must not overlap.
            bucket_ranges: the [lo, hi) bucket ranges this table now owns.

        Raises:
            RuntimeError: the table is not empty.
            InvalidPayload: a payload is malformed, belongs to another table or layout, a chain has a
                gap, or two chains hold the same id. The table is unchanged then.
        """
        with self._lock:
            if self._slab.high_water:
                raise RuntimeError(f"table {self.config.name!r} must be empty to restore into it")
            loaded = [self._load_chain(full, deltas, bucket_ranges) for full, deltas in chains]
            if not loaded:
                return
            epoch = min(meta["clock_epoch_unix"] for _, meta, _ in loaded)
            parts = []
            for records, meta, _ in loaded:
                # Each old server counted seconds from its own epoch; rebase onto the earliest.
                shift = round(meta["clock_epoch_unix"] - epoch)
                parts.append(records if shift == 0 else _shift_last_seen(records, shift))
            records = RowRecords.concat(parts, self.config.width)
            if torch.unique(records.ids).numel() != len(records):
                raise InvalidPayload("two chains hold the same id: their bucket ranges overlap")
            for _, _, admission in loaded:
                self._merge_admission(admission)
            rows = self._slab.allocate(len(records))
            self._index.insert(records.ids, rows)
            self._memo.clear()  # pulls of the empty table remembered no rows for ids it has now
            self._slab.data[rows] = records.rows
            self._slab.last_seen[rows] = records.last_seen
            self._slab.count[rows] = records.count
            self._epoch_unix = epoch
            self._applies = max(int(meta["clock"]) for _, meta, _ in loaded)
            self._delta_seq = max(int(meta["next_delta_seq"]) for _, meta, _ in loaded)

    def stats(self) -> TableStats:
        with self._lock:
            rows = len(self._index)
            index_bytes = self._index.nbytes()
            resident = index_bytes + self._slab.nbytes() + self._admission.nbytes()
            c = self._counters
            return TableStats(
                rows=rows,
                resident_bytes=resident,
                index_bytes=index_bytes,
                bytes_per_row=resident / rows if rows else math.nan,
                index_bytes_per_row=index_bytes / rows if rows else math.nan,
                admitted_total=c.admitted,
                filtered_total=c.filtered,
                dropped_gradients_total=c.dropped,
                evicted_total=c.evicted,
                pulled_rows_total=c.pulled,
                pushed_rows_total=c.pushed,
                deltas_total=c.deltas,
                delta_bytes_total=c.delta_bytes,
                last_delta_bytes=c.last_delta_bytes,
                tombstones_pending=sum(t.numel() for t in self._tombstones),
                dirty_rows_pending=self._slab.dirty_bound,
                admission_states_dropped_total=c.admission_states_dropped,
                push_lookups_reused_total=c.push_lookups_reused,
                push_lookups_fallback_total=c.push_lookups_fallback,
            )

    @property
    def _count_decay(self) -> float:
        return 1.0 if self.config.eviction is None else self.config.eviction.count_decay

    def _now(self) -> int:
        if self.config.clock == "applies":
            return self._applies
        return int(self._time_fn() - self._epoch_unix)

    def _create(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for new ids: deterministic init, fresh optimizer state, count 1 (the creation)."""
        cfg = self.config
        embeddings = initial_rows(cfg.init, cfg.table_id, ids, cfg.dim)
        rows = self._slab.allocate(ids.numel())
        # pull() found these ids absent and deduplicated them, under this table's lock.
        self._index.insert_absent(ids, rows)
        self._slab.data.narrow(1, 0, cfg.dim).index_copy_(0, rows, embeddings)
        state_width = cfg.width - cfg.dim
        if state_width:
            self._slab.data.narrow(1, cfg.dim, state_width).index_copy_(0, rows, cfg.optimizer.initial_state(ids.numel(), cfg.dim))
        self._slab.last_seen[rows] = self._now()
        self._slab.count[rows] = 1.0
        self._slab.mark_dirty(rows)
        self._counters.admitted += ids.numel()
        return rows

    def _records(self, rows: torch.Tensor) -> RowRecords:
        return RowRecords(
            ids=self._index.ids_of(rows),
            rows=self._slab.data.index_select(0, rows),
            last_seen=self._slab.last_seen[rows],
            count=self._slab.count[rows],
        )

    def _keep(self, records: RowRecords, ranges: BucketRanges) -> RowRecords:
        return keep_buckets(records, self.config.table_id, self.config.num_buckets, ranges)

    def _sample_live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(last_seen, count) of up to SAMPLE_ROWS random live rows, for a capped sweep's threshold."""
        cfg = self.config.eviction
        high = self._slab.high_water
        if cfg is None or cfg.max_rows is None or len(self._slab) <= cfg.max_rows or high == 0:
            return torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.float16)
        rows = torch.randint(0, high, (SAMPLE_ROWS,), generator=self._rng)
        rows = rows[(self._slab.flags[rows] & LIVE) != 0]
        return self._slab.last_seen[rows], self._slab.count[rows]

    def _meta(self, kind: str, ranges: BucketRanges, **extra: int) -> dict[str, Any]:
        cfg = self.config
        return {
            "format": FORMAT,
            "kind": kind,
            "table": cfg.name,
            "table_id": cfg.table_id,
            "dim": cfg.dim,
            "width": cfg.width,
            "optimizer": cfg.optimizer.to_dict(),
            "num_buckets": cfg.num_buckets,
            "bucket_ranges": [[lo, hi] for lo, hi in ranges],
            "clock_mode": cfg.clock,
            "clock": self._now(),
            "clock_epoch_unix": self._epoch_unix,
            "config": cfg.to_dict(),
            **extra,
        }

    def _load_chain(
        self, full: dict[str, Any], deltas: list[dict[str, Any]], ranges: BucketRanges
    ) -> tuple[RowRecords, dict[str, Any], dict[str, torch.Tensor]]:
        compacted = compact(full, deltas)
        meta = compacted["meta"]
        cfg = self.config
        mine = {"table_id": cfg.table_id, "dim": cfg.dim, "width": cfg.width, "num_buckets": cfg.num_buckets}
        for key, value in mine.items():
            if meta[key] != value:
                raise InvalidPayload(f"checkpoint has {key}={meta[key]}, table {cfg.name!r} has {value}")
        if meta["optimizer"]["name"] != cfg.optimizer.name:
            raise InvalidPayload(
                f"checkpoint rows carry {meta['optimizer']['name']!r} state; table {cfg.name!r} uses {cfg.optimizer.name!r}"
            )
        if meta["clock_mode"] != cfg.clock:
            raise InvalidPayload(f"checkpoint clock is {meta['clock_mode']!r}; table {cfg.name!r} uses {cfg.clock!r}")
        return self._keep(payload_records(compacted), ranges), meta, compacted["admission"]

    def _merge_admission(self, state: dict[str, torch.Tensor]) -> None:
        if not state:
            return
        try:
            self._admission.merge_state(state)
        except ValueError as e:
            # The filter only delays admission; a restore must not fail because its settings changed.
            self._counters.admission_states_dropped += 1
            logger.warning("table %s: saved admission state not restored: %s", self.config.name, e)


class FullCapture:
    """A full snapshot in progress (see SparseTable.begin_full and the module docstring).

    ``step()`` copies the next slice of rows under the table lock and returns True once every slice
    is copied; ``finish()`` copies what is left, closes under the lock and returns the payload;
    ``abort()`` drops it. Steps may be interleaved with any other table call, from any thread, but
    one capture is driven by one thread.

    While open, the table queues every delta it captures and every row it evicts here (a list
    append under its lock); the capture thread applies them to its RowImage, in order, outside the
    lock, and the closing patch last. When an event is applied does not matter, only their order:
    a row changed after an event is dirty again, so a later event or the closing patch rewrites it.
    """

    def __init__(self, table: SparseTable, ranges: BucketRanges) -> None:
        self._table = table
        self._ranges = ranges
        self._events: list[tuple[torch.Tensor, RowRecords | None]] = []
        """(rows, their records) of a delta, or (rows, None) of an eviction, oldest first."""
        # Read without the lock (an int read is atomic), so the image is allocated outside it: rows
        # allocated after this read lie past `end` and are copied whole by the closing step, and rows
        # below it are copied by their slice after the registration below, with their state then.
        self.image = RowImage(table._slab.high_water, table.config.width)
        with table._lock:
            table._fulls.append(self)
        self._next = 0
        self._open = True

    def queue(self, rows: torch.Tensor, records: RowRecords | None) -> None:
        """Called by the table under its lock: a delta's rows and records, or evicted rows (None)."""
        self._events.append((rows, records))

    def step(self) -> bool:
        """Copies one slice of full_slice_rows rows; True when no slice is left."""
        end = self.image.end
        if self._next < end:
            table, lo = self._table, self._next
            self._next = min(lo + table.config.full_slice_rows, end)
            self.image.prefault(lo, self._next)
            with table._lock:
                self.image.copy(lo, self._next, table._slab, table._index)
                events, self._events = self._events, []
            self._apply(events)
        return self._next >= end

    def finish(self) -> dict[str, Any]:
        """Runs the remaining slices and the closing step; returns the full payload.

        Raises:
            RuntimeError: the capture was aborted or has finished already.
        """
        self.copy_slices()
        return self.close().payload()

    def copy_slices(self) -> None:
        """Copies every slice not copied yet, letting other table calls in between slices.

        Raises:
            RuntimeError: the capture was aborted or has finished already.
        """
        if not self._open:
            raise RuntimeError("this full capture was aborted or has finished already")
        while not self.step():
            time.sleep(0)  # lets a request thread waiting on the lock in before the next slice

    def close(self) -> ClosedFull:
        """The closing step, once every slice is copied: the capture's state is the table's now.

        Its pause is a copy of the rows dirty since the last delta and of the rows created since the
        start (none and few right after a capture_delta); a caller holding a lock of its own around
        this call and a capture_delta gets the full and the delta of one instant. Building the
        payload (``ClosedFull.payload``) happens later, outside every lock.

        Raises:
            RuntimeError: the capture was aborted or has finished already, or slices are left.
        """
        if not self._open:
            raise RuntimeError("this full capture was aborted or has finished already")
        if self._next < self.image.end:
            raise RuntimeError("close() needs every slice copied first (call copy_slices())")
        table = self._table
        try:
            with table._lock:
                dirty = table._slab.dirty_rows()
                self.queue(dirty, table._records(dirty))
                created = table._records(table._slab.live_rows(self.image.end, table._slab.high_water))
                meta = table._meta("full", self._ranges, next_delta_seq=table._delta_seq)
                admission = table._admission.state_dict()
                table._fulls.remove(self)
                self._open = False
                events, self._events = self._events, []
        finally:
            self.abort()
        return ClosedFull(self, events, created, meta, admission)

    def abort(self) -> None:
        """Stops following the table; the capture can no longer finish."""
        if self._open:
            with self._table._lock:
                self._table._fulls.remove(self)
            self._open = False
            self._events = []

    def _apply(self, events: list[tuple[torch.Tensor, RowRecords | None]]) -> None:
        for rows, records in events:
            if records is None:
                self.image.release(rows)
            else:
                self.image.patch(rows, records)


class ClosedFull:
    """A full capture closed at one instant whose payload is not built yet (see FullCapture.close)."""

    def __init__(
        self,
        capture: FullCapture,
        events: list[tuple[torch.Tensor, RowRecords | None]],
        created: RowRecords,
        meta: dict[str, Any],
        admission: dict[str, torch.Tensor],
    ) -> None:
        self._capture = capture
        self._events = events
        self._created = created
        self.meta = meta
        self._admission = admission

    def payload(self) -> dict[str, Any]:
        """The full payload (once: it releases the capture's image)."""
        capture = self._capture
        capture._apply(self._events)
        records = capture._table._keep(capture.image.records(self._created), capture._ranges)
        del capture.image
        return {"meta": self.meta, "records": records.to_dict(), "admission": self._admission}


def _shift_last_seen(records: RowRecords, shift: int) -> RowRecords:
    return RowRecords(ids=records.ids, rows=records.rows, last_seen=records.last_seen + shift, count=records.count)
