"""The sparse tables one server holds: built from the model's table specs and ``SparseConfig``.

What the worker API needs of them: check a push's sparse part before the server's lock is taken,
pull rows for a request, apply a checked part (the server calls it under its lock, in the same
update as the push's dense part), capture and restore the tables with the server's snapshots, and
decide evictions in the background. The numerics and data structures are ``ps.sparse``'s; this
module only wires them to the server.

Replication: nothing here changes a row except from the server's log, applied in its order on a
primary and its standby alike. A pull only admits (the ids it admits wait for ``take_admitted``,
which the next update carries, and ``apply`` creates their rows); the eviction thread only decides
(``evict_once`` hands each decision to the server, which logs it and calls ``evict``).

Placement: ids go to servers by ``rpcps.sparse.sharding.BucketManifest.even(shard_count)``, the
manifest the worker routes with; a request holding an id of another server's buckets is refused, so
an id never gets a row on two servers (which a restore would refuse).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ps.sparse import CountAdmissionConfig, EvictionConfig, RowInitConfig, SparseTable, TableConfig, TableStats
from ps.sparse.row_optim import ROW_OPTIMIZERS
from ps.sparse.table import ClosedFull, FullCapture
from rpcps.settings import setting
from rpcps.sparse.sharding import BucketManifest, bucket_of, in_ranges
from rpcps.sparse.spec import SparsePull, TableSpec

logger = logging.getLogger(__name__)

SPARSE_OPTIMIZERS: dict[str, Callable[..., Any]] = {cls.name: cls for cls in ROW_OPTIMIZERS}
"""The row optimizers' classes by name (each built with its settings, ``lr=...``)."""


@dataclass(kw_only=True, frozen=True)
class SparseConfig:
    """Sparse embedding tables (the tables a model declares; docs/SPARSE.md)."""

    optimizer: str = setting(
        "rowwise_adagrad", flag="--sparse-optimizer", help="row optimizer of every sparse table, applied in place on the server",
        choices=lambda: sorted(SPARSE_OPTIMIZERS),
    )
    lr: float = setting(0.05, flag="--sparse-lr", help="learning rate of the sparse row optimizer")
    init_scale: float = setting(0.01, flag="--sparse-init-scale", help="new rows start uniform in [-scale, scale) from (seed, table, id)")
    seed: int = setting(0, flag="--sparse-seed", help="seed of the deterministic row initialisation")
    admit_count: int | None = setting(
        None, flag="--sparse-admit-count", help="admit an id once it was pulled this many times (count-min, 4 MiB per table); "
        "unset admits on first sight", metavar="N",
    )
    ttl: int | None = setting(
        None, flag="--sparse-ttl", help="evict rows not updated for this many updates of their table", metavar="UPDATES"
    )
    max_rows: int | None = setting(
        None, flag="--sparse-max-rows", help="row cap per table on each server: a sweep above it evicts the least used down to 0.9 of it",
        metavar="N",
    )
    evict_every_s: float = setting(1.0, flag="--sparse-evict-every-s", help="seconds between eviction slices (off the request path)")
    full_every_deltas: int = setting(
        8, flag="--sparse-full-every-deltas", help="snapshots hold a delta of the sparse tables (rows changed since the previous "
        "one); every this many, or once the deltas outweigh the full, a full copy taken off the request path starts a new chain",
        metavar="N",
    )

    def __post_init__(self) -> None:
        if self.optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"sparse optimizer {self.optimizer!r} is not supported; choose one of {sorted(SPARSE_OPTIMIZERS)}")
        if not self.lr > 0:
            raise ValueError(f"sparse lr must be > 0, got {self.lr}")
        if not self.init_scale > 0:
            raise ValueError(f"sparse init_scale must be > 0, got {self.init_scale}")
        if self.admit_count is not None and not 1 <= self.admit_count <= 255:
            raise ValueError(f"sparse admit_count must be in [1, 255], got {self.admit_count}")
        if self.ttl is not None and self.ttl < 1:
            raise ValueError(f"sparse ttl must be >= 1, got {self.ttl}")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"sparse max_rows must be >= 1, got {self.max_rows}")
        if not self.evict_every_s > 0:
            raise ValueError(f"sparse evict_every_s must be > 0, got {self.evict_every_s}")
        if not 1 <= self.full_every_deltas <= 1000:
            raise ValueError(f"sparse full_every_deltas must be in [1, 1000], got {self.full_every_deltas}")

@dataclass(frozen=True)
class CheckedPush:
    """A push's sparse part as ``SparseStore.check_push`` validated it: table name -> (unique int64
    ids, finite fp32 grads [n, dim]). Only ``check_push`` makes one, and ``SparseStore.apply`` takes
    nothing else: it skips the per-table checks, so unchecked rows must not reach it by another
    path (a repeated id's updates would overwrite each other; a NaN would poison its row). The one
    other maker is ``logged``: a standby applying what its primary checked and shipped in its log."""

    tables: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def __len__(self) -> int:
        return len(self.tables)

    @classmethod
    def logged(cls, tables: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> CheckedPush:
        """The part an ``Update`` of the log carries (``Update.sparse``: the primary's ``check_push`` made it)."""
        return cls(tables)


class BadSparse(ValueError):
    """A sparse pull or push part that must be refused; ``nonfinite`` marks NaN/Inf gradients."""

    def __init__(self, message: str, nonfinite: bool = False) -> None:
        super().__init__(message)
        self.nonfinite = nonfinite


def table_config(spec: TableSpec, config: SparseConfig) -> TableConfig:
    eviction = None
    if config.ttl is not None or config.max_rows is not None:
        eviction = EvictionConfig(ttl=config.ttl, max_rows=config.max_rows)
    return TableConfig(
        spec=spec,
        optimizer=SPARSE_OPTIMIZERS[config.optimizer](lr=config.lr),
        init=RowInitConfig(kind="uniform", scale=config.init_scale, seed=config.seed),
        admission=None if config.admit_count is None else CountAdmissionConfig(threshold=config.admit_count),
        eviction=eviction,
    )


Eviction = Callable[[str, torch.Tensor, int], object]
"""Takes one table's eviction decision (table name, ids, the table's clock at the decision) into
the server's log; ``SparseStore.evict`` applies it there."""


class SparseStore:
    def __init__(
        self, specs: tuple[TableSpec, ...], config: SparseConfig, shard_index: int, shard_count: int, evict: Eviction | None = None,
    ) -> None:
        """``evict``: where the eviction thread sends its decisions (the server's log); None applies
        them at once (a store without a server)."""
        self.config = config
        self.tables = {s.name: SparseTable(table_config(s, config)) for s in specs}
        self.manifest = BucketManifest.even(shard_count)
        self.ranges = self.manifest.ranges_of(shard_index)
        self._owns_all = self.ranges == [(0, self.manifest.num_buckets)]
        """One server: every id is ours, and the ownership check can skip hashing."""
        self._evict: Eviction = evict or self.evict
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._evict_loop, name="sparse-eviction", daemon=True)

    def start(self) -> None:
        """Starts the eviction thread (it also ages the admission counters)."""
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # ---- requests ------------------------------------------------------------------------------

    def pull(self, request: Any, wire: torch.dtype) -> SparsePull:
        """Rows of every requested id, in the wire dtype; raises BadSparse."""
        if not isinstance(request, dict):
            raise BadSparse(f"a sparse pull must be a dict of table name -> ids, got {type(request).__name__}")
        return {name: self.tables[name].pull(self._owned_ids(name, ids), defer=True).to(wire) for name, ids in request.items()}

    def check_push(self, part: Any, wire: torch.dtype) -> CheckedPush:
        """The fp32 form of a push's sparse part; raises BadSparse before anything changes."""
        if not isinstance(part, dict):
            raise BadSparse(f"a sparse push must be a dict of table name -> (ids, grads), got {type(part).__name__}")
        checked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, entry in part.items():
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], torch.Tensor)):
                raise BadSparse(f"sparse push for table {name!r} must be an (ids, grads) pair of tensors")
            ids, grads = self._owned_ids(name, entry[0]), entry[1]
            dim = self.tables[name].config.dim
            if grads.dtype != wire or grads.shape != (ids.numel(), dim):
                raise BadSparse(
                    f"sparse grads of table {name!r} have dtype {grads.dtype} and shape {list(grads.shape)}, "
                    f"expected {wire} [{ids.numel()}, {dim}]"
                )
            if torch.unique(ids).numel() != ids.numel():
                raise BadSparse(f"sparse push for table {name!r} repeats ids (sum their gradients on the worker)")
            if not bool(torch.isfinite(grads).all()):
                raise BadSparse(f"sparse grads of table {name!r} hold NaN/Inf", nonfinite=True)
            checked[name] = (ids, grads.float())
        return CheckedPush(checked)

    def take_admitted(self) -> dict[str, torch.Tensor] | None:
        """Per table, the ids pulls admitted since the last call (None when there are none): the
        server's next update carries them, and ``apply`` creates their rows."""
        taken = {name: table.take_admitted() for name, table in self.tables.items()}
        return {name: ids for name, ids in taken.items() if ids.numel()} or None

    def apply(self, part: CheckedPush | None, admitted: dict[str, torch.Tensor] | None = None) -> int:
        """Creates the rows of ``admitted`` ids (``take_admitted``), then applies a checked part (the
        server holds its lock); returns the rows updated."""
        if part is not None and not isinstance(part, CheckedPush):
            raise TypeError(f"SparseStore.apply takes what check_push returned, got {type(part).__name__}")
        for name, ids in (admitted or {}).items():
            self.tables[name].create(ids)
        if part is None:
            return 0
        # check_push made apply's checks (unique ids, shape, finite): not again per table.
        return sum(self.tables[name].apply_checked(ids, grads).applied for name, (ids, grads) in part.tables.items())

    def evict(self, name: str, ids: torch.Tensor, clock: int, tombstones: bool = True) -> int:
        """Applies one eviction decision (``Eviction``); returns the rows evicted. ``tombstones``:
        as ``SparseTable.evict`` (a standby keeps none: they would pile up until it is promoted)."""
        return self.tables[name].evict(ids, clock, tombstones).numel()

    def digest(self, crc: int) -> int:
        """Every table's rows folded into ``crc`` (``SparseTable.digest``), in name order."""
        for name in sorted(self.tables):
            crc = self.tables[name].digest(crc)
        return crc

    def _owned_ids(self, name: str, ids: Any) -> torch.Tensor:
        if name not in self.tables:
            raise BadSparse(f"unknown sparse table {name!r}; this model has {sorted(self.tables)}")
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise BadSparse(f"ids of sparse table {name!r} must be a 1-D int64 tensor")
        if self._owns_all:
            return ids
        buckets = bucket_of(ids, self.tables[name].config.table_id, self.manifest.num_buckets)
        if not bool(in_ranges(buckets, self.ranges).all()):
            raise BadSparse(f"ids of sparse table {name!r} include ids another server owns (a different --shards?)")
        return ids

    # ---- snapshots -----------------------------------------------------------------------------

    def capture(self) -> dict[str, list[dict[str, Any]]]:
        """Full payloads of every table's buckets on this server (the caller holds the server's lock,
        so they match the dense state and the workers' progress of the same snapshot)."""
        return {name: [table.capture_full(lo, hi) for lo, hi in self.ranges] for name, table in self.tables.items()}

    def begin_full(self) -> FullTables:
        """A full capture of every table's buckets on this server, to copy off the server's lock and
        close under it (``FullTables``)."""
        return FullTables({name: [table.begin_full(lo, hi) for lo, hi in self.ranges] for name, table in self.tables.items()})

    def restore(self, saved: dict[str, list[Any]]) -> None:
        """Loads saved tables into these (empty) ones, keeping the rows of this server's buckets.

        ``saved``: per table, (full, deltas) chains (ps/checkpoints/sparse_checkpoint.py; from any number of old
        servers: their buckets are placed by this server's manifest), or bare fulls (what ``capture``
        gives). Raises ValueError on a mismatch (ps.sparse.InvalidPayload is one).
        """
        if set(saved) != set(self.tables):
            raise ValueError(f"the snapshot holds sparse tables {sorted(saved)}, this model declares {sorted(self.tables)}")
        for name, entries in saved.items():
            chains = [entry if isinstance(entry, tuple) else (entry, []) for entry in entries]
            self.tables[name].restore(chains, self.ranges)
            logger.info("sparse table %s: restored %d rows", name, len(self.tables[name]))

    # ---- background ----------------------------------------------------------------------------

    def stats(self) -> dict[str, TableStats]:
        return {name: table.stats() for name, table in self.tables.items()}

    def evict_once(self) -> int:
        """One round of the eviction thread: one slice of every table's sweep, each decision sent
        to ``evict`` (the server's log); returns the ids decided."""
        decided = 0
        for name, table in self.tables.items():
            try:
                planned = table.plan_eviction()
                if planned.evicted.numel():
                    self._evict(name, planned.evicted, planned.clock)
            except Exception:
                logger.exception("eviction on sparse table %s failed; trying again next time", name)
                continue
            decided += planned.evicted.numel()
        return decided

    def _evict_loop(self) -> None:
        while not self._stop.wait(self.config.evict_every_s):
            if decided := self.evict_once():
                logger.debug("sparse tables: %d rows to evict", decided)

class FullTables:
    """Full captures of every table (``SparseStore.begin_full``): ``copy_slices`` copies the rows in
    slices, each under one table's own lock, so training goes on meanwhile (call it without the
    server's lock); ``close``, under the server's lock, ends them all at that instant, matching the
    dense state copied under the same hold (``FullCapture.close``); ``abort`` drops whatever is not
    closed. Driven by one thread."""

    def __init__(self, parts: dict[str, list[FullCapture]]) -> None:
        self.parts = parts

    def copy_slices(self) -> None:
        for captures in self.parts.values():
            for capture in captures:
                capture.copy_slices()

    def close(self) -> dict[str, list[ClosedFull]]:
        return {name: [capture.close() for capture in captures] for name, captures in self.parts.items()}

    def abort(self) -> None:
        for captures in self.parts.values():
            for capture in captures:
                capture.abort()  # a no-op for a closed one


def payloads(closed: dict[str, list[ClosedFull]]) -> dict[str, list[dict[str, Any]]]:
    """The full payloads of closed captures, as ``SparseStore.capture`` gives them (built outside every lock)."""
    return {name: [full.payload() for full in fulls] for name, fulls in closed.items()}
