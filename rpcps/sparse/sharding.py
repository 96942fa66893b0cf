"""Placement of sparse rows: id -> virtual bucket (a hash), bucket -> server (a manifest).

Buckets are the unit of placement and of checkpoint files, so changing the number of servers moves
whole buckets and never rehashes ids: a restore onto N servers reads the files whose bucket ranges
meet each server's buckets and keeps the rows of its own. The bucket hash includes the table id (a
popular id value such as 0 in every table does not pile onto one server) and uses its own key, so it
is independent of the row-initialisation hash and of the index's slot hash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from rpcps.sparse.hashing import derive_key, keyed_hash, reduce_range

DEFAULT_BUCKETS = 4096
_BUCKET_SALT = 0xB0C4


def bucket_of(ids: torch.Tensor, table_id: int, num_buckets: int = DEFAULT_BUCKETS) -> torch.Tensor:
    """Virtual bucket of each id (int64 in [0, num_buckets))."""
    return reduce_range(keyed_hash(ids, derive_key(_BUCKET_SALT, table_id)), num_buckets)


def in_ranges(buckets: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Bool mask: which buckets fall in any of the half-open [lo, hi) ranges."""
    mask = torch.zeros(buckets.numel(), dtype=torch.bool)
    for lo, hi in ranges:
        mask |= (buckets >= lo) & (buckets < hi)
    return mask


@dataclass(kw_only=True, frozen=True)
class BucketRange:
    lo: int
    hi: int
    """Buckets [lo, hi) belong to ``server``."""
    server: int


@dataclass(kw_only=True, frozen=True)
class BucketManifest:
    """Which server owns which buckets: ranges that tile [0, num_buckets) in order, no gaps."""

    num_buckets: int
    num_servers: int
    ranges: tuple[BucketRange, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.num_buckets < 1 << 31:
            raise ValueError(f"num_buckets must be in [1, 2**31), got {self.num_buckets}")
        if not 1 <= self.num_servers <= self.num_buckets:
            raise ValueError(f"num_servers must be in [1, num_buckets={self.num_buckets}], got {self.num_servers}")
        edge = 0
        for r in self.ranges:
            if r.lo != edge or r.hi <= r.lo:
                raise ValueError(f"ranges must tile [0, {self.num_buckets}) in order; {r} does not start at {edge}")
            if not 0 <= r.server < self.num_servers:
                raise ValueError(f"range {r} names server {r.server}; servers are 0..{self.num_servers - 1}")
            edge = r.hi
        if edge != self.num_buckets:
            raise ValueError(f"ranges end at bucket {edge}, not at num_buckets={self.num_buckets}")
        unowned = set(range(self.num_servers)) - {r.server for r in self.ranges}
        if unowned:
            raise ValueError(f"servers {sorted(unowned)} own no bucket")

    @classmethod
    def even(cls, num_servers: int, num_buckets: int = DEFAULT_BUCKETS) -> BucketManifest:
        """One contiguous range per server, sizes differing by at most one bucket."""
        if not 1 <= num_servers <= num_buckets:
            raise ValueError(f"num_servers must be in [1, num_buckets={num_buckets}], got {num_servers}")
        edges = [s * num_buckets // num_servers for s in range(num_servers + 1)]
        ranges = tuple(BucketRange(lo=edges[s], hi=edges[s + 1], server=s) for s in range(num_servers))
        return cls(num_buckets=num_buckets, num_servers=num_servers, ranges=ranges)

    def ranges_of(self, server: int) -> list[tuple[int, int]]:
        return [(r.lo, r.hi) for r in self.ranges if r.server == server]

    def server_of(self, ids: torch.Tensor, table_id: int) -> torch.Tensor:
        """Owning server of each id (int64)."""
        owner = torch.empty(self.num_buckets, dtype=torch.int64)
        for r in self.ranges:
            owner[r.lo : r.hi] = r.server
        return owner[bucket_of(ids, table_id, self.num_buckets)]

    def to_json(self) -> str:
        return json.dumps(
            {
                "num_buckets": self.num_buckets,
                "num_servers": self.num_servers,
                "ranges": [[r.lo, r.hi, r.server] for r in self.ranges],
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> BucketManifest:
        """Raises ValueError when the text is not a manifest or breaks its rules."""
        try:
            raw = json.loads(text)
            ranges = tuple(BucketRange(lo=int(lo), hi=int(hi), server=int(s)) for lo, hi, s in raw["ranges"])
            return cls(num_buckets=int(raw["num_buckets"]), num_servers=int(raw["num_servers"]), ranges=ranges)
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a bucket manifest: {e}") from None
