"""The rows of a model's sparse tables for an export (rpcps/sparse/export_files.py), streamed in slices.

From a checkpoint (``rpcps export``): each server's newest snapshot names a chain (a full and the
deltas after it; ps/checkpoints/sparse_checkpoint.py). The chain is folded the way a restore folds it
(ps/sparse/checkpoint.py ``compact``), but without building the compacted table: the deltas (small:
a full is due once they outweigh it) are folded into an overlay and a set of ids they replace or
evict, and the full's records are then read one slice at a time, minus those ids, followed by the
overlay. Each server keeps only the rows of the buckets ``BucketManifest.even(shards)`` gives it (a
snapshot ``rpcps reshard`` wrote holds every old server's chains). The ``sparse.pt`` files are
memory-mapped and each slice's pages are dropped once it is written (``madvise(MADV_DONTNEED)`` on
Linux: they are clean, read-only file pages), so memory holds a few slices and one part file, not
the table.

From a live server (``rpcps ctl export``): ``live_tables`` copies each table in slices under its own
lock (ps/sparse/table.py's ``FullCapture``, kept exact by the deltas and evictions meanwhile) and
closes the copies under the server's lock together with the dense state, so both are of one version.
The copy needs about the tables' payload in memory until it is streamed; pushes wait at most one
slice, and the closing step copies the rows changed since the last snapshot's delta (every row
changed since the start when the server takes no snapshots).

What must not live here: the export directory's format and atomic writing (rpcps.sparse.export_files).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ps.checkpoints.snapshot_files import STATE_FILE, load_file
from ps.checkpoints.sparse_checkpoint import as_chains, chain_names, read_chain
from ps.sparse.checkpoint import (
    RowRecords,
    apply_delta,
    check_chain,
    covers_all,
    keep_buckets,
    payload_ranges,
    payload_records,
)
from ps.sparse.table import Chain, ClosedFull
from rpcps.sparse.export_files import PartFile, TableParts, dense_file, manifest_bytes
from rpcps.sparse.sharding import BucketManifest, bucket_of, in_ranges

SLICE_ROWS = 1 << 18
"""Rows of a full read per slice: 20 MiB at dim 16 with row-wise Adagrad state."""
_MADV_DONTNEED = 4
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

Slices = Iterator[tuple[torch.Tensor, torch.Tensor]]
"""(ids int64 [n], rows float32 [n, width]) slices of one table; ids unique across the slices. A
slice may be a view of a memory-mapped file that is released when the next one is asked for: copy
what is kept before that."""


@dataclass
class TableSource:
    """One server's rows of one table: its full's meta (settings) and its slices."""

    meta: dict[str, Any]
    slices: Slices


def release_pages(t: torch.Tensor) -> None:
    """Drops the resident pages wholly inside contiguous ``t``, which MUST be a slice of a tensor
    memory-mapped from a file and never written (``torch.load(mmap=True)``): on anonymous memory this
    would zero the data. Pages are read from the file again if touched. A no-op off Linux."""
    if _LIBC is None or t.numel() == 0:
        return
    start = t.data_ptr()
    lo = -(-start // _PAGE) * _PAGE
    hi = (start + t.numel() * t.element_size()) // _PAGE * _PAGE
    if hi > lo:
        _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


def chain_slices(chain: Chain, keep: list[tuple[int, int]], slice_rows: int = SLICE_ROWS, mapped: bool = False) -> Slices:
    """The rows a restore of ``chain`` onto buckets ``keep`` holds, in slices of at most ``slice_rows``
    full records (module docstring). ``mapped``: the full's tensors are memory-mapped from a file and
    their pages may be dropped after each slice. Raises InvalidPayload (a broken chain) at the start."""
    full, deltas = chain
    check_chain(full, deltas)
    meta = full["meta"]
    table_id, num_buckets, width = int(meta["table_id"]), int(meta["num_buckets"]), int(meta["width"])
    overlay, replaced = RowRecords.empty(width), [torch.empty(0, dtype=torch.int64)]
    for delta in deltas:
        upserts = keep_buckets(payload_records(delta), table_id, num_buckets, payload_ranges(meta))
        overlay = apply_delta(overlay, upserts, delta["tombstones"])
        replaced += [delta["tombstones"], upserts.ids]
    gone = torch.cat(replaced).unique()  # sorted: each slice is matched by binary search, not a sort of both
    everything = covers_all(keep, num_buckets)
    records = payload_records(full)

    def kept(ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(ids.numel(), dtype=torch.bool)
        if gone.numel():
            mask &= gone[torch.searchsorted(gone, ids).clamp_(max=gone.numel() - 1)] != ids
        if not everything:
            mask &= in_ranges(bucket_of(ids, table_id, num_buckets), keep)
        return mask

    for lo in range(0, len(records), slice_rows):
        ids, rows = records.ids[lo : lo + slice_rows], records.rows[lo : lo + slice_rows]
        mask = kept(ids)
        # The consumer copies what it keeps before asking for the next slice; then the pages can go.
        yield (ids, rows) if bool(mask.all()) else (ids[mask], rows[mask])
        if mapped:
            release_pages(ids)
            release_pages(rows)
    if len(overlay):
        mask = torch.ones(len(overlay), dtype=torch.bool) if everything else in_ranges(
            bucket_of(overlay.ids, table_id, num_buckets), keep)
        yield overlay.ids[mask], overlay.rows[mask]


def checkpoint_tables(snapshots: list[tuple[Path, dict[str, Any]]], slice_rows: int = SLICE_ROWS) -> dict[str, list[TableSource]]:
    """Every table's sources in verified snapshots, one ``(path, manifest)`` per server of the run.

    Raises InvalidSnapshot (BrokenChain among them) when a chain cannot be read."""
    tables: dict[str, list[TableSource]] = {}
    for path, manifest in snapshots:
        if chain_names(manifest):
            chains, mapped = read_chain(path, manifest, mmap=True), True
        else:  # tables kept in state.pt (written by `rpcps reshard`, or before chains)
            chains, mapped = as_chains(load_file(path / STATE_FILE).get("sparse", {})), False
        index, count = int(manifest.get("shard_index", 0)), int(manifest.get("shard_count", 1))
        for name, entries in chains.items():
            for chain in entries:
                meta = chain[0]["meta"]
                keep = BucketManifest.even(count, int(meta["num_buckets"])).ranges_of(index)
                tables.setdefault(name, []).append(TableSource(meta, chain_slices(chain, keep, slice_rows, mapped)))
    return tables


def table_entry(meta: dict[str, Any]) -> dict[str, Any]:
    """A table's manifest entry (less its parts) from a payload's meta: what a reader needs to use
    the rows, and how ids the export lacks read (``unseen``; rpcps.sparse.serving)."""
    config = meta.get("config", {})
    return {
        "table_id": int(meta["table_id"]),
        "dim": int(meta["dim"]),
        "optimizer": meta["optimizer"],
        "state_width": int(meta["width"]) - int(meta["dim"]),
        "init": config.get("init"),
        "unseen": "zeros" if config.get("admission") else "init",
    }


def export_files(
    dense: dict[str, torch.Tensor],
    tables: dict[str, list[TableSource]],
    fmt: str,
    info: dict[str, Any],
    part_rows: int,
    with_state: bool = False,
) -> Iterator[tuple[str, bytes | PartFile]]:
    """The export directory's files as ``(relative path, bytes or PartFile)``, one part at a time,
    the manifest last (rpcps.sparse.export_files.write_export takes them). Each PartFile must be
    written or serialised before the next file is asked for: it fills its manifest entry then, and
    the next part reuses its buffers. ``info``: what the manifest says of the source."""
    name, data = dense_file(dense, fmt)
    yield name, data
    del data
    entries: dict[str, Any] = {}
    for table, sources in sorted(tables.items()):
        meta = sources[0].meta
        parts = TableParts(table, int(meta["dim"]), int(meta["width"]), fmt, part_rows, with_state)
        for source in sources:
            for ids, rows in source.slices:
                for part in parts.add(ids, rows):
                    yield part.path, part
        for part in parts.finish():
            yield part.path, part
        entries[table] = {**table_entry(meta), "rows": parts.rows, "with_state": with_state, "parts": parts.parts}
    yield "export.json", manifest_bytes({**info, "file_format": fmt, "dense": name, "tables": entries})


def live_tables(closed: dict[str, list[ClosedFull]]) -> dict[str, list[TableSource]]:
    """Sources over a live server's closed full captures (``ParameterServer.model_export``); each
    builds its payload when its table's turn comes, so one table's copy is compacted at a time."""
    return {name: [TableSource(c.meta, _closed_slices(c)) for c in captures] for name, captures in closed.items()}


def _closed_slices(closed: ClosedFull) -> Slices:
    records = payload_records(closed.payload())
    for lo in range(0, len(records), SLICE_ROWS):
        yield records.ids[lo : lo + SLICE_ROWS], records.rows[lo : lo + SLICE_ROWS]
