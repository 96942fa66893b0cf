"""Chained checkpoints of one server's sparse tables: a full every few snapshots, a delta in between.

Each snapshot directory (ps/checkpoints/snapshot_files.py) holds, beside ``state.pt``, a ``sparse.pt`` with
either a **full** (every row of this server's buckets, one payload per table and bucket range) or a
**delta** (per table: the rows changed since the previous snapshot and the ids evicted since;
ps/sparse/checkpoint.py). Its manifest says which, and names the chain the sparse tables need:

    "sparse": {"kind": "delta", "chain": ["step-...100", "step-...140", "step-...180"], "chain_id": "9f0c..."}

full first, this snapshot last; ``chain_id`` is drawn at random for each full and repeated by its
deltas, so a link replaced by a snapshot of the same name from another run or chain is refused. The manifest, with its checksums and commit marker, is written as
before, so a snapshot exists only when committed; a delta is usable only with every link of its
chain committed and intact, so the checkpointer's purge keeps every link of the snapshots it keeps.

The training pause (under the server's lock, beside the dense copy) is a copy of the touched rows
(``capture_delta``). A full is never copied under that lock once the server runs: it is
``prepare``d off the request path, in slices under each table's own lock (ps/sparse/table.py's
FullCapture keeps it exact), and closed by the next snapshot's capture, which also takes a delta
first so the close has almost nothing left to copy. A new full starts a new chain; that is the
compaction: the old chains are dropped by the purge once no kept snapshot needs them.

A chain breaks whenever a delta's changes do not reach the disk (a failed write, a capture thrown
away, a restart): the store's dirty log was handed over, so the next snapshot must be a full.
Until a prepared full is ready, that one is copied under the server's lock
(``rpcps_sparse_full_snapshots_total{capture="locked"}``); this happens for the first snapshot of a
server, where tables are small or just restored.

What must not live here: the commit protocol (snapshot_files), when snapshots are taken
(checkpointer), and the table numerics (ps/sparse/).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ps.checkpoints.snapshot_files import (
    STATE_FILE,
    InvalidSnapshot,
    Signer,
    is_plain_name,
    list_snapshots,
    load_file,
    read_manifest,
)
from ps.core.metrics import ServerMetrics
from ps.sparse.checkpoint import InvalidPayload, check_chain, payload_nbytes
from ps.sparse.store import FullTables, SparseStore
from ps.sparse.table import Chain, ClosedFull

logger = logging.getLogger(__name__)

SPARSE_FILE = "sparse.pt"
MANIFEST_KEY = "sparse"
Kind = Literal["full", "delta"]
TableChains = dict[str, list[Chain]]
"""Table name -> (full, deltas) per bucket range of the servers that wrote them."""


class BrokenChain(InvalidSnapshot):
    """A snapshot whose sparse tables need a link (a full or delta of its chain) that is missing or
    corrupt. Not the snapshot's own fault: it is not quarantined, and resume says what to do."""

    def __init__(self, snapshot: Path, link: Path, reason: str) -> None:
        super().__init__(f"snapshot {snapshot} needs {link / SPARSE_FILE} (a link of its sparse chain), which is unusable: {reason}")
        self.snapshot = snapshot
        self.link = link


@dataclass
class SparseCapture:
    """The sparse part of one snapshot as captured under the server's lock; built into a payload later."""

    kind: Kind
    chain_id: str
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Payloads ready as they are: deltas, or fulls copied under the lock."""
    closed: dict[str, list[ClosedFull]] = field(default_factory=dict)
    """Prepared fulls closed at the capture, whose payloads are built outside the lock."""

    def payload(self) -> dict[str, Any]:
        """What ``sparse.pt`` holds (once: building a closed full releases its copy)."""
        tables = dict(self.tables)
        for name, closed in self.closed.items():
            tables[name] = [c.payload() for c in closed]
        self.closed = {}
        return {"kind": self.kind, "tables": tables}


class SparseCheckpoints:
    """The chain state of one checkpointer: what the next snapshot's sparse part is, and capturing it.

    ``capture_locked`` runs under the server's lock (it reads the tables at the snapshot's version);
    ``prepare`` runs in the checkpointer's thread without it. Call ``committed`` or ``broken`` for
    every capture taken, in order: the chain continues only from a committed one.
    """

    def __init__(self, store: SparseStore, metrics: ServerMetrics) -> None:
        self.store = store
        self.metrics = metrics
        self.chain: list[str] | None = None
        """Snapshot names of the current chain on disk, full first; None: the next one must be a full."""
        self._chain_id = ""
        self._full_bytes = 0
        self._delta_bytes = 0
        self._prepared: FullTables | None = None

    def full_due(self) -> bool:
        """True when the next snapshot should be a full: no chain, ``full_every_deltas`` deltas on it,
        or its deltas outweigh its full (a restore would read more deltas than rows)."""
        if self.chain is None:
            return True
        deltas = len(self.chain) - 1
        return deltas >= self.store.config.full_every_deltas or self._delta_bytes > self._full_bytes

    @property
    def full_ready(self) -> bool:
        """A prepared full waits for the next capture to close it."""
        return self._prepared is not None

    def prepare(self) -> None:
        """Copies a full of every table off the request path, to be closed by the next capture (no-op
        when one is ready or none is due). Call it without holding the server's lock."""
        if self._prepared is not None or not self.full_due():
            return
        started = time.perf_counter()
        # From here the next snapshot must be this full: the changes dropped below are in no delta.
        self.chain = None
        for table in self.store.tables.values():
            table.drop_changes()
        prepared = self.store.begin_full()
        try:
            prepared.copy_slices()
        except BaseException:
            prepared.abort()
            raise
        self._prepared = prepared
        logger.info("sparse tables: full prepared off the request path in %.2fs", time.perf_counter() - started)

    def capture_locked(self) -> SparseCapture:
        """Under the server's lock: the sparse part of the snapshot of this instant."""
        started = time.perf_counter()
        deltas = {name: table.capture_delta() for name, table in self.store.tables.items()}
        if self._prepared is not None:
            prepared, self._prepared = self._prepared, None
            closed = prepared.close()
            capture = SparseCapture("full", uuid.uuid4().hex, closed=closed)
            self.metrics.sparse_full_snapshots.labels("sliced").inc()
        elif self.chain is None:
            # No chain to continue and no full ready: the first snapshot of this server, or the one
            # after a lost delta. Copied here, so this pause is the tables' size.
            capture = SparseCapture("full", uuid.uuid4().hex, tables=self.store.capture())
            self.metrics.sparse_full_snapshots.labels("locked").inc()
        else:
            capture = SparseCapture("delta", self._chain_id, tables={name: [delta] for name, delta in deltas.items()})
        self.metrics.sparse_capture_seconds.observe(time.perf_counter() - started)
        return capture

    def manifest_entry(self, capture: SparseCapture, name: str) -> dict[str, Any]:
        """What a snapshot named ``name`` holding ``capture`` records in its manifest (MANIFEST_KEY)."""
        return {"kind": capture.kind, "chain": self._chain_for(capture, name), "chain_id": capture.chain_id}

    def _chain_for(self, capture: SparseCapture, name: str) -> list[str]:
        if capture.kind == "full":
            return [name]
        assert self.chain is not None, "a delta is captured only while a chain is open"
        return [*self.chain, name]

    def committed(self, capture: SparseCapture, name: str, payload: dict[str, Any]) -> None:
        """``capture`` is committed as snapshot ``name``: the chain continues from it."""
        nbytes = sum(payload_nbytes(p) for parts in payload["tables"].values() for p in parts)
        self.chain = self._chain_for(capture, name)
        self._chain_id = capture.chain_id
        if capture.kind == "full":
            self._full_bytes, self._delta_bytes = nbytes, 0
        else:
            self._delta_bytes += nbytes
        self.metrics.sparse_chain_deltas.set(len(self.chain) - 1)

    def broken(self, reason: str) -> None:
        """A captured delta will not reach the disk (``reason`` is logged): the next snapshot is a full."""
        if self.chain is not None:
            logger.warning("sparse tables: %s; the next snapshot holds a full copy of them", reason)
        self.chain = None

    def close(self) -> None:
        """Drops a prepared full (the checkpointer stops)."""
        if self._prepared is not None:
            self._prepared.abort()
            self._prepared = None


# ---- reading chains back -------------------------------------------------------------------------


def chain_names(manifest: dict[str, Any]) -> list[str]:
    """The chain a manifest names (empty for a snapshot without a sparse chain); raises InvalidSnapshot."""
    info = manifest.get(MANIFEST_KEY)
    if info is None:
        return []
    chain = info.get("chain") if isinstance(info, dict) else None
    if not isinstance(chain, list) or not chain or not all(is_plain_name(n) for n in chain):
        raise InvalidSnapshot(f"manifest field {MANIFEST_KEY!r} must name a chain of snapshot directories, got {info!r}")
    return chain


def read_chain(snapshot: Path, manifest: dict[str, Any], verify: Signer | None = None, mmap: bool = False) -> TableChains:
    """The sparse tables of a verified snapshot: its own ``sparse.pt`` and every link before it
    (``mmap``: their tensors mapped from the files, read-only; ``snapshot_files.load_file``).

    Raises:
        BrokenChain: a link is missing, fails its checksum, belongs to another chain, or its payloads
            do not continue the full (a gap in the delta sequence).
        InvalidSnapshot: the snapshot's own manifest names no valid chain.
    """
    names = chain_names(manifest)
    if not names or names[-1] != snapshot.name:
        raise InvalidSnapshot(f"{snapshot}: its sparse chain {names} does not end with the snapshot itself")
    chain_id = manifest[MANIFEST_KEY].get("chain_id")
    files = []
    for i, name in enumerate(names):
        link = snapshot.parent / name
        try:
            if name != snapshot.name:  # the snapshot's own files were verified by whoever gave us its manifest
                theirs = read_manifest(link, verify)
                if chain_names(theirs) != names[: i + 1] or theirs[MANIFEST_KEY].get("chain_id") != chain_id:
                    raise InvalidSnapshot(f"it belongs to another chain ({theirs[MANIFEST_KEY]})")
            files.append(_load_sparse_file(link, mmap))
        except InvalidSnapshot as e:
            raise BrokenChain(snapshot, link, str(e)) from None
    try:
        return _chains(files, names)
    except InvalidPayload as e:
        raise BrokenChain(snapshot, snapshot.parent / names[0], str(e)) from None


def read_layouts(root: Path, verify: Signer | None = None) -> TableChains:
    """Every table's chains from the newest valid snapshot of each server that wrote into ``root``
    (``root`` itself for one server, ``shard-K-of-S`` below it for S): what a restore onto any number
    of servers reads. Raises InvalidSnapshot when a server's directory has no usable snapshot."""
    dirs = sorted(p for p in root.glob("shard-*-of-*") if p.is_dir() and list_snapshots(p)) or [root]
    merged: TableChains = {}
    for directory in dirs:
        for table, chains in _newest_chains(directory, verify).items():
            merged.setdefault(table, []).extend(chains)
    return merged


def snapshot_tables(path: Path, verify: Signer | None = None) -> TableChains:
    """The sparse tables of snapshot ``path`` (verified), as chains: its chain, or, for a snapshot from
    before chains or written by ``rpcps reshard``, the tables inside its state.pt. Raises InvalidSnapshot (BrokenChain among them)."""
    manifest = read_manifest(path, verify)
    if chain_names(manifest):
        return read_chain(path, manifest, verify)
    state = load_file(path / STATE_FILE)
    return as_chains(state.get("sparse", {}))


def as_chains(saved: dict[str, list[Any]]) -> TableChains:
    """Tables kept inside a state.pt as chains: bare fulls (``SparseStore.capture``, snapshots from
    before chains) or (full, deltas) chains (``rpcps reshard`` writes those)."""
    return {name: [entry if isinstance(entry, tuple) else (entry, []) for entry in entries] for name, entries in saved.items()}


def _newest_chains(directory: Path, verify: Signer | None) -> TableChains:
    problems = []
    for path in list_snapshots(directory):
        try:
            return snapshot_tables(path, verify)
        except InvalidSnapshot as e:
            problems.append(str(e))
    raise InvalidSnapshot(f"no usable snapshot of sparse tables in {directory}: {'; '.join(problems) or 'none written'}")


def _load_sparse_file(link: Path, mmap: bool = False) -> dict[str, Any]:
    data = load_file(link / SPARSE_FILE, mmap)
    if not isinstance(data, dict) or data.get("kind") not in ("full", "delta") or not isinstance(data.get("tables"), dict):
        raise InvalidSnapshot(f"{link / SPARSE_FILE} is not a sparse checkpoint file")
    return data


def _chains(files: list[dict[str, Any]], names: list[str]) -> TableChains:
    """Raises InvalidPayload unless the first file is a full and the rest deltas of the same tables."""
    kinds = [f["kind"] for f in files]
    if kinds[0] != "full" or "full" in kinds[1:]:
        raise InvalidPayload(f"a chain is one full then deltas; {names} hold {kinds}")
    tables = set(files[0]["tables"])
    out: TableChains = {}
    for name in sorted(tables):
        deltas = []
        for link, f in zip(names[1:], files[1:]):
            parts = f["tables"].get(name)
            if not isinstance(parts, list) or len(parts) != 1:
                raise InvalidPayload(f"{link} holds no delta of table {name!r}")
            deltas.append(parts[0])
        chains = [(full, deltas) for full in files[0]["tables"][name]]
        for full, ds in chains:
            check_chain(full, ds)
        out[name] = chains
    return out
