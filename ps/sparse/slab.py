"""Row storage of one sparse table: a growable fp32 slab with optimizer state inline, and row metadata.

``data`` is one 2-D float32 tensor [capacity, dim + state]: the embedding and its optimizer state sit
in the same row, so a gather, an update and a scatter move both together and a snapshot can never
see an embedding without its state (the failure DeepRec#1023 describes for separate slot tables).

Per-row metadata, 7 bytes a row, chosen to fit the memory budget:
- ``last_seen`` int32: the table clock (applies or seconds) at the row's last update, for TTL/LRU.
- ``count`` float16: the access count decayed as of ``last_seen`` (see ``touch``), for LFU. float16
  keeps 11 significant bits: increments of 1 stop registering above 2048, which is harmless because
  eviction only has to tell cold rows apart; values saturate at 65504.
- ``flags`` uint8: LIVE (allocated), DIRTY (changed since the last delta capture) and LOGGED (in the
  dirty log).

Dirty rows are also appended to a log (int32) the first time they turn dirty, so a delta capture
reads the log (O(touched rows)) instead of scanning every row's flags (about 50-100 ms for 10 M rows
on this machine, more than the whole pause budget of a delta). LOGGED survives a release, so a row
evicted and reused within one delta interval is logged once, not twice. When more than 1/8 of the
rows (and at least 65536) are dirty, the log is dropped and the next capture scans the flags: by then
copying the dirty rows costs more than the scan, and the log never costs more than 0.5 byte a row
(for instance when deltas are never taken).

Rows are allocated from a LIFO free list of evicted rows first, then from the high-water mark.
Growth copies into a tensor ``growth`` times larger made with ``torch.empty``: pages past the
high-water mark are never written, so they cost address space but no resident memory.

Not thread-safe: the owning table holds its lock around every call.
"""

from __future__ import annotations

import torch

LIVE = 1
DIRTY = 2
LOGGED = 4
_FLOAT16_MAX = 65504.0
_LOG_MIN_LIMIT = 1 << 16


class RowSlab:
    """Rows [0, high_water) have been allocated at some point; LIVE says which are in use now."""

    def __init__(self, width: int, initial_rows: int = 1024, growth: float = 1.5) -> None:
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        if initial_rows < 1:
            raise ValueError(f"initial_rows must be >= 1, got {initial_rows}")
        if not 1.1 <= growth <= 4:
            raise ValueError(f"growth must be in [1.1, 4], got {growth}")
        self.width = width
        self.growth = growth
        self.data = torch.empty(initial_rows, width, dtype=torch.float32)
        self.last_seen = torch.empty(initial_rows, dtype=torch.int32)
        self.count = torch.empty(initial_rows, dtype=torch.float16)
        self.flags = torch.empty(initial_rows, dtype=torch.uint8)
        self.high_water = 0
        self._free = torch.empty(0, dtype=torch.int32)
        self._free_len = 0
        self._live = 0
        self._dirty_log: list[torch.Tensor] = []
        self._logged = 0
        self._log_overflowed = False

    def __len__(self) -> int:
        return self._live

    @property
    def capacity(self) -> int:
        return self.data.shape[0]

    @property
    def free_rows(self) -> int:
        return self._free_len

    def nbytes(self) -> int:
        """Resident bytes: rows and metadata up to the high-water mark, the free list, the dirty log."""
        per_row = self.width * 4 + 4 + 2 + 1
        return self.high_water * per_row + (self._free.numel() + self._logged) * 4

    def allocate(self, n: int) -> torch.Tensor:
        """n rows (int64), marked LIVE only: the caller writes their data and metadata."""
        reused = min(n, self._free_len)
        rows_free = self._free[self._free_len - reused : self._free_len].to(torch.int64)
        self._free_len -= reused
        fresh = n - reused
        self._reserve(self.high_water + fresh)
        rows_new = torch.arange(self.high_water, self.high_water + fresh, dtype=torch.int64)
        self.high_water += fresh
        self.flags[rows_free] |= LIVE  # keeps LOGGED: the row may still be in the dirty log
        self.flags[rows_new] = LIVE
        self._live += n
        return torch.cat([rows_free, rows_new])

    def release(self, rows: torch.Tensor) -> None:
        """Frees LIVE rows (unique; not checked) for reuse; their flags are cleared."""
        n = rows.numel()
        if self._free_len + n > self._free.numel():
            grown = torch.empty(max(self._free_len + n, int(self._free.numel() * self.growth)), dtype=torch.int32)
            grown[: self._free_len] = self._free[: self._free_len]
            self._free = grown
        self._free[self._free_len : self._free_len + n] = rows.to(torch.int32)
        self._free_len += n
        self.flags[rows] &= LOGGED
        self._live -= n

    def mark_dirty(self, rows: torch.Tensor) -> None:
        """Marks LIVE rows (unique; not checked) changed since the last ``take_dirty``."""
        flags = self.flags[rows]
        self.flags[rows] = flags | (DIRTY | LOGGED)
        if self._log_overflowed:
            return
        new = rows[(flags & LOGGED) == 0].to(torch.int32)
        self._dirty_log.append(new)
        self._logged += new.numel()
        if self._logged > max(_LOG_MIN_LIMIT, self.high_water // 8):
            self._dirty_log, self._logged, self._log_overflowed = [], 0, True

    def dirty_rows(self) -> torch.Tensor:
        """LIVE rows changed since the last ``take_dirty`` (unique); nothing is cleared."""
        candidates = self._dirty_candidates()
        return candidates[(self.flags[candidates] & (LIVE | DIRTY)) == (LIVE | DIRTY)]

    def take_dirty(self) -> torch.Tensor:
        """Like ``dirty_rows``, and starts a new interval: every row is clean and unlogged after it."""
        candidates = self._dirty_candidates()
        flags = self.flags[candidates]
        if self._log_overflowed:
            self.flags[: self.high_water] &= LIVE
        else:
            self.flags[candidates] = flags & LIVE
        self._dirty_log, self._logged, self._log_overflowed = [], 0, False
        return candidates[(flags & (LIVE | DIRTY)) == (LIVE | DIRTY)]

    @property
    def dirty_bound(self) -> int:
        """Upper bound on the rows the next delta holds."""
        return self._live if self._log_overflowed else self._logged

    def live_rows(self, lo: int, hi: int) -> torch.Tensor:
        """LIVE rows in [lo, min(hi, high_water)), ascending."""
        hi = min(hi, self.high_water)
        if lo >= hi:
            return torch.empty(0, dtype=torch.int64)
        return ((self.flags[lo:hi] & LIVE) != 0).nonzero().squeeze(1) + lo

    def touch(self, rows: torch.Tensor, now: int, decay: float) -> None:
        """Records an access at clock ``now``: count = count * decay**(now - last_seen) + 1."""
        self.count[rows] = decayed_count(self.count[rows], self.last_seen[rows], now, decay).add_(1).clamp_(
            max=_FLOAT16_MAX
        ).to(torch.float16)
        self.last_seen[rows] = now

    def _dirty_candidates(self) -> torch.Tensor:
        """int64 rows that may be dirty: the log, or after an overflow every row with DIRTY set."""
        if self._log_overflowed:
            return ((self.flags[: self.high_water] & DIRTY) != 0).nonzero().squeeze(1)
        log = torch.cat(self._dirty_log) if self._dirty_log else torch.empty(0, dtype=torch.int32)
        self._dirty_log = [log]
        return log.to(torch.int64)

    def _reserve(self, rows: int) -> None:
        if rows <= self.capacity:
            return
        capacity = max(rows, int(self.capacity * self.growth))
        if capacity >= 1 << 31:
            raise ValueError(f"slab would need {capacity} rows; at most 2**31 - 1 are supported")
        used = self.high_water
        for name in ("data", "last_seen", "count", "flags"):
            old = getattr(self, name)
            grown = torch.empty((capacity, *old.shape[1:]), dtype=old.dtype)
            grown[:used] = old[:used]
            setattr(self, name, grown)


def decayed_count(count: torch.Tensor, last_seen: torch.Tensor, now: int, decay: float) -> torch.Tensor:
    """float32 count as of ``now``, decayed by ``decay`` per clock unit since ``last_seen``.

    The decay is applied lazily like this on every touch and every eviction scan, so no pass over all
    rows is ever needed to age the counts.
    """
    age = (now - last_seen.to(torch.int64)).clamp_(min=0).to(torch.float32)
    if decay == 1.0:
        return count.to(torch.float32)
    return count.to(torch.float32) * torch.pow(torch.tensor(decay, dtype=torch.float32), age)
