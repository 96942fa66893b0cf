"""How gradients and parameters are encoded on the wire.

Dense chunks travel in the wire dtype (fp32, bf16 or fp16): the server keeps fp32 master weights
and fp32 optimizer state and widens what it receives, the way FSDP's mixed precision transfers in
low precision and reduces in fp32. A top-k sparsified chunk travels as ``(indices, values)``: int64
positions into the chunk and their values in the wire dtype.
"""

from __future__ import annotations

import torch

WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def wire_dtype(name: str) -> torch.dtype:
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise ValueError(f"wire dtype {name!r} is not supported; choose one of {sorted(WIRE_DTYPES)}") from None


Chunk = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def check_chunk(chunk: object, numel: int, dtype: torch.dtype) -> str | None:
    """What is wrong with one received gradient chunk, or None (dense or (indices, values))."""
    if isinstance(chunk, torch.Tensor):
        if chunk.dtype != dtype:
            return f"has dtype {chunk.dtype}, expected {dtype}"
        if chunk.dim() != 1 or chunk.numel() != numel or not chunk.is_contiguous():
            return f"has shape {list(chunk.shape)}, expected [{numel}]"
        return None
    if isinstance(chunk, tuple) and len(chunk) == 2 and all(isinstance(t, torch.Tensor) for t in chunk):
        indices, values = chunk
        if indices.dtype != torch.int64 or indices.dim() != 1:
            return f"has sparse indices of dtype {indices.dtype} and shape {list(indices.shape)}, expected 1-D int64"
        if values.dtype != dtype or values.shape != indices.shape:
            return f"has sparse values of dtype {values.dtype} and shape {list(values.shape)}, expected {dtype} like the indices"
        # More entries than the chunk has elements can only repeat indices: refused, so a sparse
        # chunk never costs more than a dense one. Repeats below that are summed like any gradient
        # (index_put_ accumulates), which is why they are not checked for (a sort per chunk).
        if indices.numel() > numel:
            return f"has {indices.numel()} sparse entries, more than the chunk's {numel} elements"
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):
            return f"has sparse indices outside [0, {numel})"
        return None
    return f"is a {type(chunk).__name__}, not a tensor (or a pair of sparse indices and values)"


def values_of(chunk: Chunk) -> torch.Tensor:
    return chunk[1] if isinstance(chunk, tuple) else chunk


def to_dense_fp32(chunk: Chunk, numel: int) -> torch.Tensor:
    """The fp32 gradient a checked chunk stands for (a fresh tensor unless it already is fp32)."""
    if isinstance(chunk, tuple):
        dense = torch.zeros(numel, dtype=torch.float32)
        dense.index_put_((chunk[0],), chunk[1].float(), accumulate=True)
        return dense
    return chunk if chunk.dtype == torch.float32 else chunk.float()


class TopK:
    """Top-k sparsification with error feedback (the part not sent is added to the next step's).

    Keeps ``ratio`` of each chunk's entries, largest magnitude first; the residual makes sure every
    gradient component is applied eventually, which is what keeps convergence close to dense.
    """

    def __init__(self, chunk_numels: tuple[int, ...], ratio: float, dtype: torch.dtype) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio
        self.dtype = dtype
        self.residual = [torch.zeros(n) for n in chunk_numels]

    def compress(self, dense: list[torch.Tensor]) -> list[Chunk]:
        out: list[Chunk] = []
        for grad, residual in zip(dense, self.residual):
            residual.add_(grad)
            k = max(1, int(residual.numel() * self.ratio))
            indices = residual.abs().topk(k, sorted=False).indices
            values = residual[indices]
            out.append((indices, values.to(self.dtype)))
            residual.index_fill_(0, indices, 0.0)
        return out
