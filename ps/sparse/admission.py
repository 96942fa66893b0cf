"""Admission of new ids into a sparse table: by count (count-min sketch) or by a deterministic coin.

An id that is not admitted gets no row: its pull reads the table's default row (zeros, see
table.py) and its gradients are dropped and counted. Only ids without a row are ever shown to the
filter, once per pull in which they appear.

- ``CountAdmission``: a count-min sketch of ``depth`` x ``width`` uint8 counters that saturate at
  255, memory fixed at construction (depth * width bytes, 4 MiB by default) however many ids go
  by. An id is admitted once its estimate (the minimum of its cells) reaches ``threshold``. The
  estimate never undercounts, so collisions can only admit an id early, never late. The counters
  are halved every ``halve_every`` clock units (from the eviction path, off the request path) so
  that a long run does not saturate the sketch and admit everything. A retried pull counts again.
- ``ProbabilityAdmission``: admits an id when a hash of (seed, table, id, window) falls below
  ``probability``, with window = clock // reroll_every (0 when reroll_every is None). A retry, or any
  other pull within the same window, decides the same way; with reroll_every=None an id refused once
  is refused forever, so the filter then admits a fixed random subset of the id space.

Not thread-safe: the owning table holds its lock around every call.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from rpcps.sparse.hashing import derive_key, keyed_hash, reduce_range, shift_right_logical

_COUNT_SALT = 0xC0_117
_COIN_SALT = 0xC0_1A
_COUNTER_MAX = 255


@dataclass(kw_only=True, frozen=True)
class CountAdmissionConfig:
    threshold: int
    """Sightings (pulls) after which an id is admitted, in [1, 255]; 1 admits on first sight."""
    width: int = 1 << 20
    """Counters per sketch row, in [64, 2**31)."""
    depth: int = 4
    """Sketch rows (independent hashes), in [1, 16]."""
    halve_every: int | None = None
    """Halve every counter this many clock units after the last halving (>= 1), or never."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.threshold <= _COUNTER_MAX:
            raise ValueError(f"threshold must be in [1, {_COUNTER_MAX}], got {self.threshold}")
        if not 64 <= self.width < 1 << 31:
            raise ValueError(f"width must be in [64, 2**31), got {self.width}")
        if not 1 <= self.depth <= 16:
            raise ValueError(f"depth must be in [1, 16], got {self.depth}")
        if self.halve_every is not None and self.halve_every < 1:
            raise ValueError(f"halve_every must be >= 1 or None, got {self.halve_every}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "count", **asdict(self)}


@dataclass(kw_only=True, frozen=True)
class ProbabilityAdmissionConfig:
    probability: float
    """Chance that an id is admitted at a decision, in [2**-24, 1]."""
    reroll_every: int | None = None
    """Clock units per decision window (>= 1); None: one decision per id, forever."""
    seed: int = 0

    def __post_init__(self) -> None:
        # Decisions compare 24 hash bits, so smaller probabilities would round to "never".
        if not (math.isfinite(self.probability) and 2.0**-24 <= self.probability <= 1):
            raise ValueError(f"probability must be in [2**-24, 1], got {self.probability}")
        if self.reroll_every is not None and self.reroll_every < 1:
            raise ValueError(f"reroll_every must be >= 1 or None, got {self.reroll_every}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "probability", **asdict(self)}


AdmissionConfig = CountAdmissionConfig | ProbabilityAdmissionConfig


class Admission(Protocol):
    def admit(self, ids: torch.Tensor, now: int) -> torch.Tensor:
        """Bool mask over ids (unique, none of them in the table): which get a row now."""
        ...

    def age(self, now: int) -> None:
        """Periodic upkeep, called off the request path."""
        ...

    def nbytes(self) -> int: ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors to checkpoint (empty when the filter has no state)."""
        ...

    def merge_state(self, state: dict[str, torch.Tensor]) -> None:
        """Adds a saved state into this one (several servers' states merge on a resharded restore)."""
        ...


class _Stateless:
    """Upkeep and checkpoint methods of a filter that keeps no state."""

    def age(self, now: int) -> None:
        pass

    def nbytes(self) -> int:
        return 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def merge_state(self, state: dict[str, torch.Tensor]) -> None:
        pass


class AdmitAll(_Stateless):
    def admit(self, ids: torch.Tensor, now: int) -> torch.Tensor:
        return torch.ones(ids.numel(), dtype=torch.bool)


class CountMinFilter:
    def __init__(self, config: CountAdmissionConfig, table_id: int) -> None:
        self.config = config
        self._keys = [derive_key(_COUNT_SALT, config.seed, table_id, d) for d in range(config.depth)]
        self._counters = torch.zeros(config.depth * config.width, dtype=torch.uint8)
        self._halved_at = 0

    def estimate(self, ids: torch.Tensor) -> torch.Tensor:
        """int32 count-min estimate of how often each id was counted (saturates at 255)."""
        return self._counters[self._cells(ids)].to(torch.int32).amin(dim=0)

    def admit(self, ids: torch.Tensor, now: int) -> torch.Tensor:
        cells = self._cells(ids)
        # One id touches one cell per sketch row, but two ids may share a cell, so the increments
        # are counted per distinct cell; the uint8 arithmetic is done in int32 to saturate, not wrap.
        distinct, hits = torch.unique(cells, return_counts=True)
        bumped = (self._counters[distinct].to(torch.int32) + hits.to(torch.int32)).clamp_(max=_COUNTER_MAX)
        self._counters[distinct] = bumped.to(torch.uint8)
        return self._counters[cells].to(torch.int32).amin(dim=0) >= self.config.threshold

    def age(self, now: int) -> None:
        every = self.config.halve_every
        if every is not None and now - self._halved_at >= every:
            self._counters >>= 1
            self._halved_at = now

    def nbytes(self) -> int:
        return self._counters.numel()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"counters": self._counters.clone()}

    def merge_state(self, state: dict[str, torch.Tensor]) -> None:
        """Saturating sum; a merged sketch overcounts ids of the other servers' buckets, so after a
        resharded restore some ids are admitted a little early (never late).

        Raises:
            ValueError: the saved sketch has another shape (width or depth changed); nothing merged.
        """
        saved = state["counters"]
        if saved.shape != self._counters.shape or saved.dtype != torch.uint8:
            raise ValueError(
                f"saved admission sketch has shape {tuple(saved.shape)} {saved.dtype}, "
                f"this table's has {tuple(self._counters.shape)} uint8 (width or depth changed)"
            )
        total = self._counters.to(torch.int32) + saved.to(torch.int32)
        self._counters = total.clamp_(max=_COUNTER_MAX).to(torch.uint8)

    def _cells(self, ids: torch.Tensor) -> torch.Tensor:
        """[depth, n] flat counter positions of each id."""
        width = self.config.width
        return torch.stack(
            [reduce_range(keyed_hash(ids, key), width) + d * width for d, key in enumerate(self._keys)]
        )


class CoinFilter(_Stateless):
    def __init__(self, config: ProbabilityAdmissionConfig, table_id: int) -> None:
        self.config = config
        self._table_id = table_id
        # Compared with the top 24 bits of a hash: exact integer arithmetic, so p = 1 admits all.
        self._limit = round(config.probability * (1 << 24))

    def admit(self, ids: torch.Tensor, now: int) -> torch.Tensor:
        every = self.config.reroll_every
        window = 0 if every is None else now // every
        key = derive_key(_COIN_SALT, self.config.seed, self._table_id, window)
        return shift_right_logical(keyed_hash(ids, key), 40) < self._limit


def build_admission(config: AdmissionConfig | None, table_id: int) -> Admission:
    if config is None:
        return AdmitAll()
    if isinstance(config, CountAdmissionConfig):
        return CountMinFilter(config, table_id)
    return CoinFilter(config, table_id)

