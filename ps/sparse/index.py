"""The id -> row index of one sparse table: open addressing over torch tensors, probed in batches.

Layout (why it is small):
- ``slots``: int32 [capacity]; EMPTY (-1), TOMBSTONE (-2) or a row number. 4 bytes per slot.
- ``keys``: int64 [rows]; the id stored in each row (row -> id). 8 bytes per row. The slots hold only
  row numbers, and a probe compares ``keys[slots[pos]]`` with the id, so an id is stored once and
  doubles as the reverse map eviction and snapshots need.
So the index costs 8 + 4 / load bytes per row; the load stays in (max_load / growth, max_load] when
growing (0.53..0.8 with the defaults: 13..15.5 bytes per row).

Ids are any int64 value (negative too): no value is reserved as a marker, because markers live in
the slots, not in the keys. Every operation works on a whole batch with tensor ops: each round of the
probe loop gathers the home slot (first round), then the next 16, 64, 256, ... slots (later rounds)
of every still-unresolved id, so a batch costs about log4(longest probe sequence / 4) rounds of a few
dozen vectorised ops, and there is no Python object per id.

Linear probing; deletion leaves a tombstone (a backward shift cannot be done for a whole batch at once
without conflicts). Tombstones count toward the load, and a rehash at the same capacity clears them
when most of the load is tombstones; the capacity grows by ``growth`` otherwise. Capacity never
shrinks. Row numbers are chosen by the caller (the slab allocates them) and must be below 2**31.

Not thread-safe: the owning table holds its lock around every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rpcps.sparse.hashing import derive_key, keyed_hash, reduce_range

EMPTY = -1
TOMBSTONE = -2
_WINDOW = 16
"""Slots examined per id in the second probe round (the first looks at the home slot only)."""
_WINDOW_GROWTH = 4
"""Factor by which each later round widens the window: most ids resolve at home or in the second
round, and the few left in long runs (a batch's longest probe sequence at load 0.8 is 100-200 slots)
resolve in two or three more rounds instead of a dozen. Each round is a few dozen tensor ops whatever
its width, so rounds, not slots inspected, are what a lookup costs."""
_SLOT_SALT = 0x51_07


@dataclass(kw_only=True, frozen=True)
class IndexConfig:
    initial_slots: int = 1024
    """Slots allocated up front (4 bytes each)."""
    max_load: float = 0.8
    """(live + tombstone slots) / slots above which an insert rehashes first. In (0, 0.95]."""
    growth: float = 1.5
    """Capacity factor of a growing rehash. In [1.1, 4]."""

    def __post_init__(self) -> None:
        if not 8 <= self.initial_slots < 1 << 31:
            raise ValueError(f"initial_slots must be in [8, 2**31), got {self.initial_slots}")
        if not 0 < self.max_load <= 0.95:
            # Above 0.95 linear probing's expected probe length explodes, and at 1 a miss never ends.
            raise ValueError(f"max_load must be in (0, 0.95], got {self.max_load}")
        if not 1.1 <= self.growth <= 4:
            raise ValueError(f"growth must be in [1.1, 4], got {self.growth}")


class IdIndex:
    """Maps unique int64 ids to caller-chosen int32 row numbers, and rows back to ids."""

    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        self._key = derive_key(_SLOT_SALT)
        self._slots = torch.full((self.config.initial_slots,), EMPTY, dtype=torch.int32)
        # torch.empty: pages of rows never inserted are never touched, so they cost no RSS.
        self._keys = torch.empty(1024, dtype=torch.int64)
        self._keys_high_water = 0
        self._live = 0
        self._tombstones = 0

    def __len__(self) -> int:
        return self._live

    @property
    def capacity(self) -> int:
        return self._slots.numel()

    @property
    def tombstones(self) -> int:
        return self._tombstones

    def nbytes(self) -> int:
        """Resident bytes: every slot, plus the key of every row number ever inserted."""
        return self._slots.numel() * 4 + self._keys_high_water * 8

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Row of each id (int64, -1 where absent). ids: 1-D int64, duplicates allowed."""
        check_ids(ids)
        return self._find(ids)[0]

    def probe_lengths(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots a lookup inspects to find each present id (1 = found at home); -1 where absent."""
        check_ids(ids)
        rows, pos = self._find(ids)
        home = reduce_range(keyed_hash(ids, self._key), self.capacity)
        return torch.where(rows >= 0, (pos - home) % self.capacity + 1, -1)

    def ids_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The id stored in each row. Rows must be live (inserted and not removed); not checked."""
        return self._keys[rows]

    def ids_in(self, lo: int, hi: int) -> torch.Tensor:
        """A view of the ids stored in rows [lo, hi); rows never inserted hold garbage. Copy it
        before the index changes."""
        return self._keys[lo:hi]

    def insert(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Adds id -> row for each pair.

        Raises:
            ValueError: ids repeat, an id is already present, rows are out of [0, 2**31), or the
                shapes differ. Nothing is inserted then.
        """
        check_ids(ids)
        if rows.shape != ids.shape:
            raise ValueError(f"ids and rows must have the same shape, got {tuple(ids.shape)} and {tuple(rows.shape)}")
        n = ids.numel()
        if n == 0:
            return
        if torch.unique(ids).numel() != n:
            raise ValueError("ids passed to insert must be unique")
        if int(rows.min()) < 0 or int(rows.max()) >= 1 << 31:
            raise ValueError("rows must be in [0, 2**31)")
        present = self._find(ids)[0] >= 0
        if bool(present.any()):
            raise ValueError(f"{int(present.sum())} ids are already in the index, e.g. {int(ids[present][0])}")
        self.insert_absent(ids, rows)

    def insert_absent(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """``insert`` without its checks, for a caller that knows them true: ids unique and absent
        (it just looked them up, under the lock that guards this index), rows in [0, 2**31).

        Breaking that corrupts the index (an id in two slots), so only the table's row creation uses
        it: the presence check alone is a full probe of every new id, a large part of a pull's cost
        when many ids are new.
        """
        n = ids.numel()
        if n == 0:
            return
        self._reserve(n)
        self._store_keys(ids, rows)
        self._place(ids, rows.to(torch.int32))
        self._live += n

    def remove(self, ids: torch.Tensor) -> torch.Tensor:
        """Removes each present id; returns its former row (-1 where it was absent, which is no error).

        Raises:
            ValueError: ids repeat (a repeated id would be counted twice).
        """
        check_ids(ids)
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError("ids passed to remove must be unique")
        rows, pos = self._find(ids)
        hit = rows >= 0
        self._slots[pos[hit]] = TOMBSTONE
        removed = int(hit.sum())
        self._live -= removed
        self._tombstones += removed
        return rows

    def _find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, slot position) of each id; (-1, -1) where absent."""
        cap = self.capacity
        pos = reduce_range(keyed_hash(ids, self._key), cap)
        # The first round looks at the home slot only, with 1-D ops on the whole batch: most ids
        # resolve there, and this round handles the most ids, so it is written out without windows.
        slot = self._slots[pos].to(torch.int64)
        hit = (slot >= 0) & (self._keys[slot.clamp(min=0)] == ids)
        rows = torch.where(hit, slot, -1)
        found_at = torch.where(hit, pos, -1)
        active = (~hit & (slot != EMPTY)).nonzero().squeeze(1)
        keys, pos = ids[active], (pos[active] + 1) % cap
        width = min(_WINDOW, cap)
        # Each later round looks at `width` slots per unresolved id and resolves every id whose first
        # EMPTY slot (absent) or own row (found) lies among them. An EMPTY slot always exists
        # (load <= 0.95), so the loop ends; `cap` rounds is only a backstop.
        for _ in range(cap):
            if active.numel() == 0:
                break
            window = _window(pos, width, cap)
            slot = self._slots[window].to(torch.int64)
            hit = (slot >= 0) & (self._keys[slot.clamp(min=0)] == keys.unsqueeze(1))
            first, done = _first(hit | (slot == EMPTY))
            found = (done & hit.gather(1, first).squeeze(1)).nonzero().squeeze(1)
            rows[active[found]] = slot.gather(1, first).squeeze(1)[found]
            found_at[active[found]] = window.gather(1, first).squeeze(1)[found]
            going = (~done).nonzero().squeeze(1)
            active, keys, pos = active[going], keys[going], (pos[going] + width) % cap
            width = min(width * _WINDOW_GROWTH, cap)
        return rows, found_at

    def _place(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes rows into the first free slot of each id's probe sequence (ids known absent)."""
        cap = self.capacity
        pos = reduce_range(keyed_hash(ids, self._key), cap)
        width = 1
        for _ in range(cap):
            if rows.numel() == 0:
                break
            window = _window(pos, width, cap)
            slot = self._slots[window]
            first, has_free = _first(slot < 0)
            chosen = window.gather(1, first).squeeze(1)
            candidates = has_free.nonzero().squeeze(1)
            # Several ids may choose the same free slot in one round: the first in batch order takes
            # it (a deterministic choice); the others probe on past it, now that it is occupied.
            taken, which = torch.unique(chosen[candidates], return_inverse=True)
            winners = torch.full((taken.numel(),), rows.numel(), dtype=torch.int64)
            winners.scatter_reduce_(0, which, candidates, reduce="amin")
            self._tombstones -= int((slot.gather(1, first).squeeze(1)[winners] == TOMBSTONE).sum())
            self._slots[taken] = rows[winners]
            going = torch.ones(rows.numel(), dtype=torch.bool)
            going[winners] = False
            next_pos = torch.where(has_free, chosen + 1, pos + width) % cap
            rows, pos = rows[going], next_pos[going]
            # Fixed, not growing like _find's: ids that see the same first free slot contend for it
            # and only one wins per round, so a wider window means more contenders, not fewer rounds.
            width = min(_WINDOW, cap)

    def _reserve(self, n: int) -> None:
        """Rehashes before an insert of n ids would push the load above max_load."""
        cap, cfg = self.capacity, self.config
        if self._live + self._tombstones + n <= cfg.max_load * cap:
            return
        if self._live + n <= cfg.max_load * cap / cfg.growth:
            new_cap = cap  # mostly tombstones: clearing them is enough
        else:
            new_cap = max(int(cap * cfg.growth), math.ceil((self._live + n) / cfg.max_load) + 1)
        if new_cap >= 1 << 31:
            raise ValueError(f"index would need {new_cap} slots; at most 2**31 - 1 are supported")
        live_rows = self._slots[self._slots >= 0]
        self._slots = torch.full((new_cap,), EMPTY, dtype=torch.int32)
        self._tombstones = 0
        self._place(self._keys[live_rows.to(torch.int64)], live_rows)

    def _store_keys(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        needed = int(rows.max()) + 1
        if needed > self._keys.numel():
            grown = torch.empty(max(needed, int(self._keys.numel() * self.config.growth)), dtype=torch.int64)
            grown[: self._keys_high_water] = self._keys[: self._keys_high_water]
            self._keys = grown
        self._keys[rows] = ids
        self._keys_high_water = max(self._keys_high_water, needed)


def _window(pos: torch.Tensor, width: int, cap: int) -> torch.Tensor:
    """[m, width] slot positions pos, pos + 1, ... (wrapping) of each probe."""
    return (pos.unsqueeze(1) + torch.arange(width)) % cap


def _first(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of the first True in each row ([m, 1], 0 where none) and whether there is one ([m])."""
    return mask.to(torch.uint8).argmax(dim=1, keepdim=True), mask.any(dim=1)


def check_ids(ids: torch.Tensor) -> None:
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise TypeError(f"ids must be a 1-D int64 tensor, got {ids.dtype} with shape {tuple(ids.shape)}")
