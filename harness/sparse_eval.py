"""Builds a model with sparse tables from a server's snapshot, in this process, to evaluate it.

The dense parameters come from the snapshots' chunks (ps/checkpoints/export.py), the sparse rows from their
chains (restored into one ``ps.sparse.store.SparseStore``, as a resuming server would), and the model's
``SparseEmbeddingBagCollection`` modules read rows from that store directly, with no RPC.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ps.checkpoints.export import read_checkpoint
from ps.checkpoints.snapshot_files import list_snapshots
from ps.checkpoints.sparse_checkpoint import read_layouts
from ps.sparse.store import SparseConfig, SparseStore
from rpcps.sparse.embedding import collections_of
from rpcps.sparse.spec import SparsePull, declared_tables


class StoreRows:
    """A RowSource reading a local SparseStore (pulls of ids without a row read zeros, or the initial
    row of an id admission lets in, exactly as on the server)."""

    def __init__(self, store: SparseStore) -> None:
        self.store = store

    def pull(self, request: SparsePull) -> SparsePull:
        return self.store.pull(request, torch.float32)


def model_from_snapshot(
    checkpoint_dir: Path, factory: Callable[[], torch.nn.Module], config: SparseConfig | None = None
) -> torch.nn.Module:
    """The model ``factory`` builds, loaded from ``checkpoint_dir``: the newest snapshot of one server,
    or of each shard below a sharded run's root (``factory()`` untrained when there is none). Every
    shard's rows land in this one process (a restore onto one server). ``config``: the run's sparse
    settings (its ``--sparse-optimizer`` decides the rows' state layout)."""
    model = factory()
    store = SparseStore(declared_tables(model), config or SparseConfig(), 0, 1)
    if list_snapshots(checkpoint_dir) or list(checkpoint_dir.glob("shard-*-of-*")):
        model.load_state_dict(read_checkpoint(checkpoint_dir).state_dict)
        store.restore(read_layouts(checkpoint_dir))
    for module in collections_of(model):
        module.attach(StoreRows(store))
    return model
