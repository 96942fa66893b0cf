"""Which rows an eviction sweep removes: TTL, LFU with decay, and a row cap.

The table sweeps its rows in slices of ``slice_rows`` (one slice per ``SparseTable.evict_step``
call, each under the table lock, so the lock is held for one slice at a time and never for a whole
sweep). A sweep starts with an ``EvictionPlan`` and asks it, slice by slice, which live rows to evict:

- TTL: rows whose ``last_seen`` is more than ``ttl`` clock units ago (applies or seconds, whichever
  the table counts).
- LFU: rows whose decayed count (count * count_decay ** age) is below ``min_count``.
- Row cap: when a sweep starts with more than ``max_rows`` live rows, it evicts
  live - cap_target * max_rows of them, those with the lowest score ("lfu": decayed count, "lru":
  last_seen). The score threshold is the matching quantile of a seeded random sample of live rows,
  so the cap is soft: rows created during a sweep wait for the next one, and a sample that
  misjudges the threshold leaves the rest to the next sweep. Rows evicted by TTL or LFU count
  toward the cap's quota.

This module decides; the table removes the rows, frees them and records their ids as tombstones.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from ps.sparse.slab import decayed_count

CapScore = Literal["lfu", "lru"]
SAMPLE_ROWS = 1 << 16
"""Live rows a capped sweep samples to place its score threshold."""


@dataclass(kw_only=True, frozen=True)
class EvictionConfig:
    ttl: int | None = None
    """Evict rows not updated for more than this many clock units (>= 1), or never."""
    min_count: float | None = None
    """LFU: evict rows whose decayed update count is below this (> 0), or never."""
    count_decay: float = 1.0
    """Factor applied to a row's count per clock unit, in (0, 1]; 1 keeps plain counts."""
    max_rows: int | None = None
    """Row cap (>= 1): a sweep that starts above it evicts down to cap_target * max_rows."""
    cap_target: float = 0.9
    """Fraction of max_rows a capped sweep aims for, in (0, 1]."""
    cap_score: CapScore = "lfu"
    """Which rows a capped sweep evicts first: lowest decayed count ("lfu") or oldest ("lru")."""
    slice_rows: int = 1 << 16
    """Rows examined per evict_step (the lock is held for one slice), >= 1."""

    def __post_init__(self) -> None:
        if self.ttl is not None and self.ttl < 1:
            raise ValueError(f"ttl must be >= 1 or None, got {self.ttl}")
        if self.min_count is not None and not (math.isfinite(self.min_count) and self.min_count > 0):
            raise ValueError(f"min_count must be > 0 or None, got {self.min_count}")
        if not 0 < self.count_decay <= 1:
            raise ValueError(f"count_decay must be in (0, 1], got {self.count_decay}")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 or None, got {self.max_rows}")
        if not 0 < self.cap_target <= 1:
            raise ValueError(f"cap_target must be in (0, 1], got {self.cap_target}")
        if self.cap_score not in ("lfu", "lru"):
            raise ValueError(f"cap_score must be 'lfu' or 'lru', got {self.cap_score!r}")
        if self.slice_rows < 1:
            raise ValueError(f"slice_rows must be >= 1, got {self.slice_rows}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EvictionPlan:
    """The decisions of one sweep. ``quota`` is how many more rows the cap wants gone."""

    def __init__(self, config: EvictionConfig, now: int, live: int, sample: tuple[torch.Tensor, torch.Tensor]) -> None:
        """sample: (last_seen, count) of a random sample of live rows, used only by the cap."""
        self.config = config
        self.quota = 0
        self.threshold = -math.inf
        if config.max_rows is not None and live > config.max_rows:
            self.quota = live - math.floor(config.cap_target * config.max_rows)
            scores = self._scores(now, *sample)
            if scores.numel() > 0:
                q = min(1.0, self.quota / live)
                self.threshold = float(torch.quantile(scores.to(torch.float64), q))

    def select(self, now: int, last_seen: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """Bool mask over one slice's live rows (in row order): which to evict."""
        cfg = self.config
        victims = torch.zeros(last_seen.numel(), dtype=torch.bool)
        if cfg.ttl is not None:
            victims |= (now - last_seen.to(torch.int64)) > cfg.ttl
        if cfg.min_count is not None:
            victims |= decayed_count(count, last_seen, now, cfg.count_decay) < cfg.min_count
        self.quota -= int(victims.sum())
        if self.quota > 0:
            wanted = ~victims & (self._scores(now, last_seen, count) <= self.threshold)
            # The first `quota` candidates in row order; ties at the threshold make more candidates
            # than the quota, and the quota is what bounds the cut.
            wanted &= torch.cumsum(wanted, 0) <= self.quota
            self.quota -= int(wanted.sum())
            victims |= wanted
        return victims

    def _scores(self, now: int, last_seen: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        if self.config.cap_score == "lru":
            return last_seen.to(torch.float64)
        return decayed_count(count, last_seen, now, self.config.count_decay).to(torch.float64)
