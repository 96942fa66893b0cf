"""Keeps a local model equal to the servers' newest, through the read-only ``observe`` call.

The first observation checks the local model against the server's signature (parameters and
buffers: a different model is refused with the first difference named) and builds each shard's flat
layout, as a worker does from its registration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rpcps.errors import SignatureMismatch
from rpcps.messages import Observation
from rpcps.partition import partition, shard_signature
from rpcps.signature import FlatLayout, ModelSignature
from worker.buffers import ModelBuffers
from worker.client import ServerClient, result
from worker.device import load_parameters


@dataclass
class _Shard:
    client: ServerClient
    layout: FlatLayout | None = None
    params: list[torch.nn.Parameter] | None = None
    version: int = -1


class Observer:
    def __init__(self, model: torch.nn.Module, clients: list[ServerClient]) -> None:
        self.signature = ModelSignature.of_module(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = ModelBuffers(model, self.signature)
        self.shards = [_Shard(c) for c in clients]

    @property
    def version(self) -> int:
        """The model version held, summed over shards (as ``rpcps_worker_model_version``)."""
        return sum(s.version for s in self.shards)

    def refresh(self) -> bool:
        """Loads the newest parameters and buffers of every shard that changed; True when any did.

        Raises SignatureMismatch for a different model, and the transport's classified failures.
        """
        replies: list[Observation] = [result(p) for p in [s.client.observe(s.version) for s in self.shards]]
        changed = False
        for k, (shard, reply) in enumerate(zip(self.shards, replies)):
            if shard.layout is None:
                self._attach(k, shard, reply)
            if reply.chunks is None:
                continue
            assert shard.layout is not None and shard.params is not None
            load_parameters(shard.layout, shard.params, reply.chunks)
            if reply.buffers is not None:
                self.buffers.load(reply.buffers)
            shard.version = reply.version
            changed = True
        return changed

    def _attach(self, k: int, shard: _Shard, reply: Observation) -> None:
        diff = ModelSignature.from_wire(reply.model_signature).first_difference(self.signature, theirs="evaluator")
        if diff is not None:
            raise SignatureMismatch(f"the evaluator's model differs from the server's: {diff}")
        if reply.shard_count != len(self.shards) or reply.shard_index != k:
            raise RuntimeError(f"server {k} says it is shard {reply.shard_index} of {reply.shard_count}, not of {len(self.shards)}")
        shard.layout = FlatLayout(shard_signature(self.signature, reply.shard_count, k), reply.chunk_bytes)
        shard.params = [self.params[i] for i in partition(self.signature, reply.shard_count)[k]]
