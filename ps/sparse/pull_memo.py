"""PullMemo: the id -> row resolutions of one table's recent pulls, for the pushes that follow them.

A worker pushes gradients for exactly the unique ids it pulled for that step, split by shard the
same way (``rpcps.sparse.embedding`` pulls and pushes the same ``torch.unique`` tensor per table;
``worker.sparse_client.SparseRouter`` splits both by the same manifest), so a push's index lookup
repeats its pull's: about a quarter of the server's per-id path (docs/BENCHMARKS.md). The table
remembers its last few pulls' (ids, rows) here, and a push whose ids equal a remembered pull's
takes those rows instead of probing the index again.

Exact, not a guess: the rows a push takes are the rows a lookup would find at that moment.
- A row number stays an id's row until that id is evicted or the table is restored: row creation
  only adds rows, an index rehash re-places slots but keeps every id's row number, and slab growth
  copies rows to the same row numbers. So the table calls ``forget(rows)`` with the rows an
  eviction released (they may be reused by another id before the push arrives), and ``clear()`` on
  a restore. Forgotten rows read -1, like ids without a row.
- Rows of -1 (an id the pull did not admit, or whose row was forgotten) are for the caller to look
  up again: an id admitted between the pull and the push gets its gradient, as without the memo.
- A match is consumed, so a second push of the same ids (e.g. a worker re-pushing to a promoted
  standby what it pulled from the old primary) does a normal lookup.
- ``remember`` copies the ids: a caller reusing its tensor after the pull cannot change what the
  memo's rows belong to.

Bounded: at most ``MAX_PULLS`` pulls and ``MAX_IDS`` ids (16 bytes each: the id and its row), the
oldest dropped first; a pull of more ids than that alone is not remembered. A dropped entry only
costs its push a normal lookup. Not counted in ``TableStats.resident_bytes``: at most 2 MiB per
table (52 MiB for the CTR model's 26 tables; about 3 MiB there with 2 workers).

Not thread-safe: the owning table holds its lock around every call.
"""

from __future__ import annotations

from collections import deque

import torch

MAX_PULLS = 64
"""Pulls remembered per table. A worker's pull for step t comes before its pushes of steps t - 1 and
t - 2 are applied (a window of 2 pushes in flight; the default is 1), so up to 3 pulls per worker wait
for their push. The oldest is dropped first, and it is the one whose push comes next: with fewer
entries than pulls waiting, no push would match at all (3 workers against 8 entries: none did).
64 covers 21 workers at a window of 2 (or one worker's ``--max-in-flight`` up to 62); the
scan in ``take`` compares lengths before any ids, so it stays cheap."""
MAX_IDS = 1 << 17
"""Ids remembered per table (2 MiB with their rows): a CTR pull holds about 1,100 per table and
worker, so 64 of them fit; a table pulled in far larger batches keeps fewer pulls."""


class PullMemo:
    def __init__(self) -> None:
        self._entries: deque[tuple[torch.Tensor, torch.Tensor]] = deque()
        self._ids = 0

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Keeps a pull's ids and their rows (-1 where none); ``rows`` becomes the memo's."""
        n = ids.numel()
        if n > MAX_IDS:
            return
        while self._entries and (len(self._entries) >= MAX_PULLS or self._ids + n > MAX_IDS):
            self._ids -= self._entries.popleft()[0].numel()
        self._entries.append((ids.clone(), rows))
        self._ids += n

    def take(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The rows of a remembered pull of exactly ``ids`` (consumed), oldest first; None if none.
        Rows of -1 need a lookup."""
        n = ids.numel()
        for i, (seen, rows) in enumerate(self._entries):
            # numel first: most entries differ in length, and torch.equal costs a pass over the ids.
            if seen.numel() == n and torch.equal(seen, ids):
                del self._entries[i]
                self._ids -= n
                return rows
        return None

    def forget(self, rows: torch.Tensor) -> None:
        """Rows released (evicted): no remembered id keeps them, since another id may get them."""
        for _, remembered in self._entries:
            remembered[torch.isin(remembered, rows)] = -1

    def clear(self) -> None:
        self._entries.clear()
        self._ids = 0
