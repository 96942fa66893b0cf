"""The model's buffers on the worker: sent with every push to the shard that holds them, loaded with
every full pull from it (how the server keeps them: ``ps.core.buffers``).

A model without buffers has none to send: nothing here runs per step.
"""

from __future__ import annotations

import torch

from rpcps.signature import ModelSignature, persistent_buffers


class ModelBuffers:
    def __init__(self, model: torch.nn.Module, signature: ModelSignature) -> None:
        named = dict(persistent_buffers(model))
        self.tensors = [named[spec.name] for spec in signature.buffers]

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def for_push(self) -> list[torch.Tensor]:
        """Host copies in their own dtypes: the wire may read them after the next step's forward pass
        has rewritten the model's own (a copy per push; buffers are small next to the gradients)."""
        return [t.detach().to("cpu", copy=True) for t in self.tensors]

    def load(self, pulled: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for mine, theirs in zip(self.tensors, pulled):
                mine.copy_(theirs, non_blocking=True)
