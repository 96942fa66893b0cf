"""How a model declares its sparse tables, and the shape of sparse pulls and pushes on the wire.

A module that keeps embedding rows on the servers exposes ``sparse_tables``: a tuple of
``TableSpec``. The server walks the model it builds from ``--model`` and creates one table per spec;
the worker walks its own copy and routes ids with the same specs, so both sides agree on names, ids
and widths without any extra setting. Sparse tables hold no ``nn.Parameter``: the dense signature
(and so the dense path) never sees them.

On the wire (one call per server shard per step):
- a pull sends ``{table name: unique int64 ids}`` and gets ``{table name: rows [n, dim]}`` back in
  the wire dtype;
- a push carries, beside its dense chunks, ``{table name: (unique int64 ids, summed grads [n, dim])}``
  with grads in the wire dtype. It rides on the dense push, so one (slot, step) deduplication and one
  version cover both parts: a retried push is applied once, dense and sparse together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

SparsePull = dict[str, torch.Tensor]
SparsePush = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(kw_only=True, frozen=True)
class TableSpec:
    name: str
    """Unique within the model; names the table in pulls, pushes, metrics and snapshots."""
    table_id: int
    """Stable id in [0, 2**31): keys the bucket hash and the row initialisation."""
    dim: int
    """Embedding width, in [1, 65536]."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("table name must not be empty")
        if not 0 <= self.table_id < 1 << 31:
            raise ValueError(f"table_id must be in [0, 2**31), got {self.table_id}")
        if not 1 <= self.dim <= 1 << 16:
            raise ValueError(f"dim must be in [1, 65536], got {self.dim}")


def declared_tables(model: torch.nn.Module) -> tuple[TableSpec, ...]:
    """Every TableSpec the model's modules declare; raises ValueError on a repeated name or id."""
    specs: list[TableSpec] = []
    for module in model.modules():
        specs.extend(getattr(module, "sparse_tables", ()))
    check_unique(specs)
    return tuple(specs)


def check_unique(specs: Iterable[TableSpec]) -> None:
    names: set[str] = set()
    ids: set[int] = set()
    for spec in specs:
        if spec.name in names or spec.table_id in ids:
            raise ValueError(f"sparse table {spec.name!r} (id {spec.table_id}) repeats a name or id of another table")
        names.add(spec.name)
        ids.add(spec.table_id)

