"""The byte-level transformer of ``charlm`` in the Hugging Face shape, for the own-loop example.

``model()`` takes keyword inputs and returns a dict: ``model(input_ids=..., labels=...)`` gives
``{"logits", "loss", "z_loss"}``, where ``loss`` is the next-byte cross-entropy and ``z_loss`` the
mean squared log-partition of the logits (PaLM's auxiliary term, which keeps the logits from
drifting). ``data(worker_index, num_workers)`` yields dict batches ``{"input_ids", "labels"}`` from
the same seekable stream as ``charlm`` (step ``s`` always gets the same batch). The server loads
this module by name (``--model rpcps.examples.charlm_hf:model``): it imports nothing of the worker.
The training loop that uses it is ``examples/own_loop.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rpcps.examples import charlm
from rpcps.examples.stream import ShardedStream


class CharLM(nn.Module):
    """``charlm.CharTransformer`` behind a keyword-input, dict-output forward (same parameter names)."""

    def __init__(self, shape: charlm.LMShape) -> None:
        super().__init__()
        self.lm = charlm.CharTransformer(shape)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.lm(input_ids).view(*input_ids.shape, -1)
        out = {"logits": logits}
        if labels is not None:
            flat = logits.reshape(-1, logits.shape[-1]).float()
            out["loss"] = F.cross_entropy(flat, labels.reshape(-1))
            out["z_loss"] = torch.logsumexp(flat, dim=-1).pow(2).mean()
        return out


def model(seed: int = charlm.MODEL_SEED) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CharLM(charlm.LMShape())


def data(worker_index: int, num_workers: int, seed: int = charlm.DATA_SEED, batch_size: int = charlm.BATCH_SIZE) -> ShardedStream:
    """Worker ``worker_index``'s endless, seekable stream of ``{"input_ids": (B, 128), "labels": (B, 128)}``."""
    text = charlm.corpus().train

    def fetch(idx: torch.Tensor) -> dict[str, torch.Tensor]:
        inputs, targets = charlm._windows(text, idx)
        return {"input_ids": inputs, "labels": targets.view_as(inputs)}

    return ShardedStream(
        num_samples=charlm.num_windows(text), worker_index=worker_index, num_workers=num_workers,
        batch_size=batch_size, seed=seed, fetch=fetch,  # type: ignore[arg-type]
    )
