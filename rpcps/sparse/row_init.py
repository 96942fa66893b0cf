"""Deterministic initial values of new rows: a pure function of (seed, table id, row id).

Element j of the row of ``id`` is the j-th output of a splitmix64 stream whose key is
keyed_hash(id, derive_key(salt, seed, table_id)), mapped to a float. So a row's first value never
depends on arrival order, on batch composition, or on which server owns the id: a restore onto a
different number of servers, or a re-created evicted row, starts from exactly the same bits.

Kinds: "uniform" on [-scale, scale) (integer hashing plus one float multiply-add: bit-identical on
every platform), "normal" N(0, scale**2) (an inverse-CDF in float64, see hashing.standard_normal),
and "zeros".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from rpcps.sparse.hashing import derive_key, keyed_hash, mix64, standard_normal, stream_offsets, uniform01

_INIT_SALT = 0x1217
_CHUNK_ROWS = 8192
"""Rows hashed per block: 1 MiB per int64 temporary at dim 16."""

InitKind = Literal["uniform", "normal", "zeros"]


@dataclass(kw_only=True, frozen=True)
class RowInitConfig:
    kind: InitKind = "uniform"
    """"uniform" on [-scale, scale), "normal" with std scale, or "zeros"."""
    scale: float = 0.01
    """Half-width of the uniform range, or the normal's standard deviation. > 0."""
    seed: int = 0
    """Any int in [-2**63, 2**64); together with the table id it selects the values."""

    def __post_init__(self) -> None:
        if self.kind not in ("uniform", "normal", "zeros"):
            raise ValueError(f"init kind must be 'uniform', 'normal' or 'zeros', got {self.kind!r}")
        if not self.scale > 0:
            raise ValueError(f"init scale must be > 0, got {self.scale}")
        if not -(1 << 63) <= self.seed < 1 << 64:
            raise ValueError(f"init seed must be in [-2**63, 2**64), got {self.seed}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def initial_rows(config: RowInitConfig, table_id: int, ids: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 [len(ids), dim]: the initial embedding of each id (its optimizer state is separate)."""
    if config.kind == "zeros":
        return torch.zeros(ids.numel(), dim, dtype=torch.float32)
    row_keys = keyed_hash(ids, derive_key(_INIT_SALT, config.seed, table_id))
    to_float = uniform01 if config.kind == "uniform" else standard_normal
    out = torch.empty(ids.numel(), dim, dtype=torch.float32)
    # Element j is stream_at(row_key, j); computed for a block of rows and every j at once, because a
    # pull that creates rows in many tables pays per tensor op (a column at a time was 16 hashes per
    # table and creation's largest cost), while blocks of _CHUNK_ROWS bound the int64 temporaries.
    offsets = stream_offsets(dim)
    for lo in range(0, ids.numel(), _CHUNK_ROWS):
        block = row_keys[lo : lo + _CHUNK_ROWS].unsqueeze(1) + offsets
        out[lo : lo + _CHUNK_ROWS] = to_float(mix64(block))
    if config.kind == "uniform":
        return out.mul_(2 * config.scale).sub_(config.scale)
    return out.mul_(config.scale)
