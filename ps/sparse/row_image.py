"""A row-indexed copy of a slab that patches keep current: the working buffer of a full capture.

A full capture (table.FullCapture) copies slab rows [0, end) slice by slice while training goes on.
The image keeps each copy at its slab row number, so later changes are applied by row number with
plain indexed writes, never by matching ids (no sort, no ``isin`` over millions of ids):

- ``copy(lo, hi)``: contiguous copies of rows, ids and metadata of [lo, hi), and which are live.
- ``patch(rows, records)``: rows changed after their copy (a delta taken meanwhile, or the closing
  step's dirty rows) overwrite their position and are live.
- ``release(rows)``: rows freed after their copy are dead (their id was evicted).
- ``records(extra)``: the live positions, compacted, followed by ``extra`` (rows allocated after
  the capture started, at or beyond ``end``, which the closing step copies whole).

Every call happens under the table lock, in the order of the events, except ``records``, which runs
after the capture is closed. Positions at or beyond ``end`` are ignored by patch and release.
"""

from __future__ import annotations

import torch

from ps.sparse.checkpoint import RowRecords
from ps.sparse.index import IdIndex
from ps.sparse.slab import LIVE, RowSlab


class RowImage:
    def __init__(self, end: int, width: int) -> None:
        self.end = end
        self._width = width
        self._ids = torch.empty(end, dtype=torch.int64)
        self._rows = torch.empty(end, width, dtype=torch.float32)
        self._last_seen = torch.empty(end, dtype=torch.int32)
        self._count = torch.empty(end, dtype=torch.float16)
        self._alive = torch.zeros(end, dtype=torch.bool)

    def prefault(self, lo: int, hi: int) -> None:
        """Writes positions [lo, hi) once, so the kernel maps their pages now, outside the table lock,
        and not during ``copy`` under it (first-touch page faults were about half of a copy's time)."""
        for buffer in (self._ids, self._rows, self._last_seen, self._count):
            buffer[lo:hi].zero_()

    def copy(self, lo: int, hi: int, slab: RowSlab, index: IdIndex) -> None:
        """Copies slab rows [lo, hi) (hi <= end) as they are now; dead rows copy garbage, masked off."""
        self._rows[lo:hi] = slab.data[lo:hi]
        self._ids[lo:hi] = index.ids_in(lo, hi)
        self._last_seen[lo:hi] = slab.last_seen[lo:hi]
        self._count[lo:hi] = slab.count[lo:hi]
        self._alive[lo:hi] = (slab.flags[lo:hi] & LIVE) != 0

    def patch(self, rows: torch.Tensor, records: RowRecords) -> None:
        """The current state of live slab ``rows`` (unique), one record each, in the same order."""
        mine = rows < self.end
        at = rows[mine]
        self._rows[at] = records.rows[mine]
        self._ids[at] = records.ids[mine]
        self._last_seen[at] = records.last_seen[mine]
        self._count[at] = records.count[mine]
        self._alive[at] = True

    def release(self, rows: torch.Tensor) -> None:
        self._alive[rows[rows < self.end]] = False

    def records(self, extra: RowRecords) -> RowRecords:
        """Live positions in row order, then ``extra``: one copy of each, into right-sized tensors."""
        keep = self._alive.nonzero().squeeze(1)
        n = keep.numel()
        out = RowRecords(
            ids=torch.empty(n + len(extra), dtype=torch.int64),
            rows=torch.empty(n + len(extra), self._width, dtype=torch.float32),
            last_seen=torch.empty(n + len(extra), dtype=torch.int32),
            count=torch.empty(n + len(extra), dtype=torch.float16),
        )
        for name in ("ids", "rows", "last_seen", "count"):
            target = getattr(out, name)
            torch.index_select(getattr(self, f"_{name}"), 0, keep, out=target[:n])
            target[n:] = getattr(extra, name)
        return out
