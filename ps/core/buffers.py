"""The model's buffers on the server: the latest a worker pushed, kept in the order updates are applied.

Buffers (BatchNorm running statistics, any persistent ``register_buffer``) are state, not
parameters: nothing trains them, every forward pass in training mode rewrites them. A push carries
the worker's current buffers after its gradient chunks, in their own dtypes (never cast to the wire
dtype: ``num_batches_tracked`` is int64 and a float counter would drift); the update that applies the
push makes them the server's; every full pull hands them back, and workers load them with the
parameters. So the statistics form one running average across workers, in the order their pushes
were applied, as one process's would when ``--pull-every`` is 1. docs/FAULT_TOLERANCE.md, "Buffers",
says what that costs and what it does not promise.

With shards, shard 0 holds every buffer (``rpcps.partition.shard_signature``). A model without
buffers has an empty store: pushes carry nothing extra and nothing here runs per push.

What must not live here: validation of gradients (``ps.core.push_checks``), the lock (the server's; the
``*_locked`` methods run under it).
"""

from __future__ import annotations

from typing import Any

import torch

from ps.core.push_checks import Refused, RejectReason, SkipNonfinite
from rpcps.signature import ParamSpec


class BufferStore:
    def __init__(self, specs: tuple[ParamSpec, ...], initial: dict[str, torch.Tensor]) -> None:
        """Starts from ``initial`` (the model factory's own buffers: a fresh BatchNorm's zeros and ones)."""
        self.specs = specs
        self._current: list[torch.Tensor] = [initial[s.name].detach().to("cpu", copy=True) for s in specs]

    def __bool__(self) -> bool:
        return bool(self.specs)

    def split(self, chunks: Any, gradient_chunks: int) -> tuple[Any, list[torch.Tensor] | None]:
        """A push's gradient chunks and the buffers sent after them (None when the model has none).

        Anything malformed is left for admission to refuse by its chunk count.
        """
        if not self.specs or not isinstance(chunks, (list, tuple)) or len(chunks) != gradient_chunks + len(self.specs):
            return chunks, None
        return list(chunks[:gradient_chunks]), list(chunks[gradient_chunks:])

    def admit(self, slot: int, seq: int, buffers: list[torch.Tensor], skip_nonfinite: bool) -> list[torch.Tensor] | SkipNonfinite:
        """The pushed buffers if they fit the model exactly; raises Refused (shape, dtype, NaN/Inf).

        Non-finite statistics follow --on-nonfinite as gradients do: refused, or the push skipped.
        """
        for spec, tensor in zip(self.specs, buffers):
            where = f"push {seq} from worker {slot}: buffer {spec.name!r}"
            if not isinstance(tensor, torch.Tensor):
                raise Refused(f"{where} is a {type(tensor).__name__}, not a tensor", RejectReason.SHAPE)
            if str(tensor.dtype).removeprefix("torch.") != spec.dtype:
                raise Refused(f"{where} has dtype {tensor.dtype}, expected {spec.dtype}", RejectReason.DTYPE)
            if tuple(tensor.shape) != spec.shape:
                raise Refused(f"{where} has shape {list(tensor.shape)}, expected {list(spec.shape)}", RejectReason.SHAPE)
            if tensor.dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
                if skip_nonfinite:
                    return SkipNonfinite(spec.name)
                raise Refused(f"{where} holds NaN/Inf; parameters unchanged", RejectReason.NONFINITE)
        return buffers

    def replace_locked(self, buffers: list[torch.Tensor]) -> None:
        """Under the server's lock, by the update that applies the push that carried ``buffers``.

        The list is replaced, never written into: a pull that took the previous one may still be
        sending it.
        """
        self._current = buffers

    def for_pull_locked(self) -> list[torch.Tensor] | None:
        return self._current if self.specs else None

    def named_locked(self) -> dict[str, torch.Tensor]:
        """Copies by name (snapshots, export)."""
        return {s.name: t.clone() for s, t in zip(self.specs, self._current)}

    def restore_locked(self, saved: dict[str, torch.Tensor]) -> None:
        """Loads buffers from a snapshot; raises ValueError naming the first that does not fit."""
        restored = []
        for spec in self.specs:
            tensor = saved.get(spec.name)
            if tensor is None:
                raise ValueError(f"the snapshot has no buffer {spec.name!r}")
            if tuple(tensor.shape) != spec.shape or str(tensor.dtype).removeprefix("torch.") != spec.dtype:
                raise ValueError(
                    f"the snapshot's buffer {spec.name!r} is {tensor.dtype} {list(tensor.shape)}, "
                    f"the model's {spec.dtype} {list(spec.shape)}"
                )
            restored.append(tensor.clone())
        self._current = restored
