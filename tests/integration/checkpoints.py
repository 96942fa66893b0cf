"""Reads what a run left in its --checkpoint-dir: the final state of a server (or of every shard).

The equivalence and resume tests compare these states instead of losses: a loss says little about
whether two runs computed the same thing, the parameters and optimizer state say everything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ps.checkpoints.snapshot_files import list_snapshots, load_snapshot
from rpcps.signature import ModelSignature


def newest_snapshot(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, state) of the newest snapshot in ``directory``, which must be valid."""
    snapshots = list_snapshots(directory)
    assert snapshots, f"no snapshot in {directory}"
    return load_snapshot(snapshots[0])


def snapshot_parameters(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Named parameters of the newest snapshot; with shards (``shard-K-of-S``), of every shard's together."""
    roots = sorted(checkpoint_dir.glob("shard-*-of-*")) or [checkpoint_dir]
    params: dict[str, torch.Tensor] = {}
    for root in roots:
        manifest, state = newest_snapshot(root)
        # A server's chunks hold its parameters back to back in signature order (rpcps.signature.FlatLayout).
        flat = torch.cat([chunk.reshape(-1) for chunk in state["masters"]])
        specs = ModelSignature.from_wire(manifest["signature"]).params
        assert flat.numel() == sum(s.numel for s in specs), f"{root}: chunks and signature disagree"
        for spec, value in zip(specs, flat.split([s.numel for s in specs])):
            params[spec.name] = value.view(spec.shape)
    return params


def tensors_of(tree: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested state (dicts, lists), keyed by where it sits: compares whole states."""
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in tensors_of(value, f"{path}/{key}").items()}
