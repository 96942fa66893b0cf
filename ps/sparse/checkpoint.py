"""Checkpoint payloads of sparse tables: full snapshots, chained deltas, compaction.

A payload is a plain dict of tensors, ints, floats and strings, so ``torch.save`` writes it and
``torch.load(weights_only=True)`` reads it back without running code. Writing it to disk (commit
marker, SHA-256 manifest, fsync, rename) is ps/checkpoints/snapshot_files.py's job, not this module's.

    {"meta": {...}, "records": {"ids", "rows", "last_seen", "count"},
     "tombstones": int64 [m]   (delta only),
     "admission": {...}        (full only: the admission filter's tensors, possibly empty)}

``meta`` holds: format, kind ("full" or "delta"), table, table_id, dim, width, optimizer (its
settings), num_buckets, bucket_ranges (the buckets the payload may hold rows of), clock_mode, clock,
clock_epoch_unix, and next_delta_seq (full) or seq (delta).

A chain is one full plus the deltas with seq = next_delta_seq, next_delta_seq + 1, ... of the same
table on the same server. Applying a delta removes every id in its tombstones or its records, then
adds its records: a delta holds the final state of each row it names, so the order inside one delta
does not matter, and applying chains in order gives exactly the state when the last delta was
captured. Compaction is that fold, written as a new full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rpcps.sparse.sharding import bucket_of, in_ranges

FORMAT = "rpcps-sparse-v1"


class InvalidPayload(ValueError):
    """A payload that cannot be used as asked (the message says why)."""


@dataclass(frozen=True)
class RowRecords:
    """Rows keyed by id, with their optimizer state inline and their eviction metadata."""

    ids: torch.Tensor
    """int64 [n]"""
    rows: torch.Tensor
    """float32 [n, width]: embedding then optimizer state."""
    last_seen: torch.Tensor
    """int32 [n]"""
    count: torch.Tensor
    """float16 [n]"""

    @classmethod
    def empty(cls, width: int) -> RowRecords:
        return cls(
            ids=torch.empty(0, dtype=torch.int64),
            rows=torch.empty(0, width, dtype=torch.float32),
            last_seen=torch.empty(0, dtype=torch.int32),
            count=torch.empty(0, dtype=torch.float16),
        )

    @classmethod
    def concat(cls, parts: list[RowRecords], width: int) -> RowRecords:
        if not parts:
            return cls.empty(width)
        if len(parts) == 1:
            return parts[0]
        return cls(
            ids=torch.cat([p.ids for p in parts]),
            rows=torch.cat([p.rows for p in parts]),
            last_seen=torch.cat([p.last_seen for p in parts]),
            count=torch.cat([p.count for p in parts]),
        )

    def __len__(self) -> int:
        return self.ids.numel()

    def select(self, which: torch.Tensor) -> RowRecords:
        """The records at a bool mask or an index tensor."""
        return RowRecords(
            ids=self.ids[which], rows=self.rows[which], last_seen=self.last_seen[which], count=self.count[which]
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.rows, self.last_seen, self.count))

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {"ids": self.ids, "rows": self.rows, "last_seen": self.last_seen, "count": self.count}

    @classmethod
    def from_dict(cls, raw: dict[str, torch.Tensor], width: int) -> RowRecords:
        """Raises InvalidPayload when a tensor is missing or has the wrong dtype or shape."""
        expected = {"ids": torch.int64, "rows": torch.float32, "last_seen": torch.int32, "count": torch.float16}
        for key, dtype in expected.items():
            t = raw.get(key)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype:
                raise InvalidPayload(f"records[{key!r}] must be a {dtype} tensor")
        n = raw["ids"].numel()
        for key in ("ids", "last_seen", "count"):
            if raw[key].shape != (n,):
                raise InvalidPayload(f"records[{key!r}] has shape {tuple(raw[key].shape)}, expected ({n},)")
        if raw["rows"].shape != (n, width):
            raise InvalidPayload(f"records['rows'] has shape {tuple(raw['rows'].shape)}, expected ({n}, {width})")
        return cls(ids=raw["ids"], rows=raw["rows"], last_seen=raw["last_seen"], count=raw["count"])


def apply_delta(base: RowRecords, upserts: RowRecords, tombstones: torch.Tensor) -> RowRecords:
    """base without the ids in tombstones or upserts, followed by upserts (which must be unique)."""
    gone = torch.cat([tombstones, upserts.ids])
    if gone.numel() == 0:
        return base
    kept = base.select(~torch.isin(base.ids, gone))
    return RowRecords.concat([kept, upserts], base.rows.shape[1])


def keep_buckets(
    records: RowRecords, table_id: int, num_buckets: int, ranges: list[tuple[int, int]]
) -> RowRecords:
    """The records whose bucket falls in ``ranges`` (no hashing when they cover every bucket)."""
    if covers_all(ranges, num_buckets):
        return records
    return records.select(in_ranges(bucket_of(records.ids, table_id, num_buckets), ranges))


def payload_records(payload: dict[str, Any]) -> RowRecords:
    return RowRecords.from_dict(payload["records"], int(payload["meta"]["width"]))


def payload_nbytes(payload: dict[str, Any]) -> int:
    """Bytes of the payload's tensors (what torch.save writes, less a few hundred bytes of framing)."""
    total = payload_records(payload).nbytes()
    total += sum(t.numel() * t.element_size() for t in _tensors(payload.get("admission", {})))
    if "tombstones" in payload:
        total += payload["tombstones"].numel() * 8
    return total


def check_chain(full: dict[str, Any], deltas: list[dict[str, Any]]) -> None:
    """Raises InvalidPayload unless ``deltas`` continue ``full``: same table, seq without gaps."""
    meta = _check_meta(full, "full")
    expected = int(meta["next_delta_seq"])
    for delta in deltas:
        d = _check_meta(delta, "delta")
        for key in ("table_id", "dim", "width", "num_buckets"):
            if d[key] != meta[key]:
                raise InvalidPayload(f"delta seq {d['seq']} has {key}={d[key]}, the full has {meta[key]}")
        if d["optimizer"]["name"] != meta["optimizer"]["name"]:
            raise InvalidPayload(f"delta seq {d['seq']} was written by another optimizer")
        if int(d["seq"]) != expected:
            raise InvalidPayload(f"delta chain breaks: expected seq {expected}, got {d['seq']}")
        tombstones = delta.get("tombstones")
        if not isinstance(tombstones, torch.Tensor) or tombstones.dtype != torch.int64 or tombstones.dim() != 1:
            raise InvalidPayload(f"delta seq {d['seq']} has no 1-D int64 tombstones")
        expected += 1


def compact(full: dict[str, Any], deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """full + deltas -> one full with the state as of the last delta (the inputs are not changed).

    Raises:
        InvalidPayload: the deltas do not continue the full (see check_chain) or a tensor is malformed.
    """
    check_chain(full, deltas)
    meta = full["meta"]
    table_id, num_buckets, ranges = int(meta["table_id"]), int(meta["num_buckets"]), payload_ranges(meta)
    records = payload_records(full)
    for delta in deltas:
        upserts = keep_buckets(payload_records(delta), table_id, num_buckets, ranges)
        records = apply_delta(records, upserts, delta["tombstones"])
    last = deltas[-1]["meta"] if deltas else meta
    new_meta = {
        **meta,
        "clock": last["clock"],
        "clock_epoch_unix": last["clock_epoch_unix"],
        "next_delta_seq": int(last["seq"]) + 1 if deltas else int(meta["next_delta_seq"]),
    }
    return {"meta": new_meta, "records": records.to_dict(), "admission": dict(full.get("admission", {}))}


def _check_meta(payload: dict[str, Any], kind: str) -> dict[str, Any]:
    meta = payload.get("meta") if isinstance(payload, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InvalidPayload(f"not an {FORMAT} payload")
    if meta.get("kind") != kind:
        raise InvalidPayload(f"expected a {kind} payload, got a {meta.get('kind')!r} one")
    return meta


def payload_ranges(meta: dict[str, Any]) -> list[tuple[int, int]]:
    """The bucket ranges a payload may hold rows of."""
    return [(int(lo), int(hi)) for lo, hi in meta["bucket_ranges"]]


def covers_all(ranges: list[tuple[int, int]], num_buckets: int) -> bool:
    """True when the ranges cover every bucket (no filtering needed)."""
    edge = 0
    for lo, hi in sorted(ranges):
        if lo > edge:
            return False
        edge = max(edge, hi)
    return edge >= num_buckets


def _tensors(tree: dict[str, Any]) -> list[torch.Tensor]:
    return [v for v in tree.values() if isinstance(v, torch.Tensor)]
