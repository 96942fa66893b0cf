"""Builds a model with sparse tables from a server's snapshot, in this process, to evaluate it.

The dense parameters come from the snapshot's chunks, the sparse rows from its tables (restored into
a ``ps.sparse_store.SparseStore``, as a resuming server would), and the model's
``SparseEmbeddingBagCollection`` modules read rows from that store directly, with no RPC.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ps.config import SparseConfig
from ps.snapshot_files import list_snapshots, load_snapshot
from ps.sparse_checkpoint import snapshot_tables
from ps.sparse_store import SparseStore
from rpcps.signature import ModelSignature
from rpcps.sparse.spec import SparsePull, declared_tables
from worker.sparse_embedding import collections_of


class StoreRows:
    """A RowSource reading a local SparseStore (pulls of ids without a row read zeros or create one,
    exactly as on the server)."""

    def __init__(self, store: SparseStore) -> None:
        self.store = store

    def pull(self, request: SparsePull) -> SparsePull:
        return self.store.pull(request, torch.float32)


def model_from_snapshot(
    checkpoint_dir: Path, factory: Callable[[], torch.nn.Module], config: SparseConfig | None = None
) -> torch.nn.Module:
    """The model ``factory`` builds, loaded from the newest snapshot of a one-server ``checkpoint_dir``
    (``factory()`` untrained when there is none). ``config``: the run's sparse settings (its
    ``--sparse-optimizer`` decides the rows' state layout)."""
    model = factory()
    store = SparseStore(declared_tables(model), config or SparseConfig(), 0, 1)
    snapshots = list_snapshots(checkpoint_dir)
    if snapshots:
        manifest, state = load_snapshot(snapshots[0])
        flat = torch.cat([chunk.reshape(-1) for chunk in state["masters"]])
        specs = ModelSignature.from_wire(manifest["signature"]).params
        params = dict(model.named_parameters())
        with torch.no_grad():
            for spec, value in zip(specs, flat.split([s.numel for s in specs])):
                params[spec.name].copy_(value.view(spec.shape))
        store.restore(snapshot_tables(snapshots[0]))
    for module in collections_of(model):
        module.attach(StoreRows(store))
    return model
