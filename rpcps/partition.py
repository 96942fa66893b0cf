"""Which server shard owns which parameters.

Whole tensors are assigned to shards so that bytes are balanced: largest first, each to the shard
holding the fewest bytes so far (ties: the lowest shard index), parameters of equal size in model
order. The result depends only on the model signature and the shard count, so every process
computes the same partition on its own; it is recorded in every snapshot and checked at resume.
Tensors are never split: one tensor larger than a fair share leaves that shard heavier (say so in
the log and docs rather than split optimizer state across processes). Buffers are not partitioned:
shard 0 holds them all (they are small, and one shard keeps them in one order of updates).
"""

from __future__ import annotations

import hashlib

from rpcps.signature import ModelSignature


def partition(signature: ModelSignature, shards: int) -> list[list[int]]:
    """Parameter indices (in signature order) owned by each of ``shards`` shards."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if shards > len(signature.params):
        raise ValueError(
            f"{shards} shards for a model with {len(signature.params)} parameter tensors: some shards would own nothing; "
            f"use at most {len(signature.params)}"
        )
    owned: list[list[int]] = [[] for _ in range(shards)]
    load = [0] * shards
    order = sorted(range(len(signature.params)), key=lambda i: (-signature.params[i].numel, i))
    for i in order:
        target = min(range(shards), key=lambda s: (load[s], s))
        owned[target].append(i)
        load[target] += signature.params[i].numel
    return [sorted(indices) for indices in owned]


def shard_signature(signature: ModelSignature, shards: int, index: int) -> ModelSignature:
    if not 0 <= index < shards:
        raise ValueError(f"shard index must be in [0, {shards}), got {index}")
    params = tuple(signature.params[i] for i in partition(signature, shards)[index])
    return ModelSignature(params, signature.buffers if index == 0 else ())


def partition_digest(signature: ModelSignature, shards: int) -> str:
    # Of the parameters only: the partition does not depend on buffers, and snapshots written before
    # buffers were part of a signature must still match.
    params_only = ModelSignature(signature.params)
    h = hashlib.sha256(f"{params_only.digest()}|{shards}|{partition(signature, shards)}".encode())
    return h.hexdigest()[:16]


def imbalance(signature: ModelSignature, shards: int) -> float:
    """Largest shard's bytes over the mean (1.0 is perfect balance)."""
    loads = [sum(signature.params[i].numel for i in part) for part in partition(signature, shards)]
    return max(loads) / (sum(loads) / shards)
