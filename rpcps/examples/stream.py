"""One worker's endless, seekable, reshuffled stream of batches over a fixed set of samples.

Both examples number their training samples 0..n-1 and hand this class a ``fetch`` that turns a
tensor of sample indices into a batch. The stream decides which samples a worker sees and in what
order; it never touches the data itself.

- **Sharding**: worker ``i`` of ``k`` owns samples ``i, i+k, i+2k, ...``. Strided rather than
  contiguous, so every worker gets the same mix (the language-model windows run file by file, and a
  contiguous cut would give each worker its own few source files). Shards are disjoint and cover 0..n-1.
- **Epochs**: the worker's own samples are read as one long sequence, epoch after epoch, each epoch a
  fresh permutation drawn from (seed, epoch, worker). Batch ``b`` is positions ``[b*B, (b+1)*B)`` of
  that sequence, so a batch may straddle two epochs and no sample is ever dropped, even when a shard
  is smaller than a batch.
- **Seek**: batch ``b`` is a pure function of ``b``, so ``seek(b)`` costs one permutation, not ``b``
  batches: a worker restarted at step ``b`` resumes with exactly the batch it would have read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


def _epoch_seed(seed: int, epoch: int, worker_index: int) -> int:
    # A hash rather than arithmetic such as seed * 1000 + epoch, which collides once epoch reaches 1000;
    # sha256 (unlike hash()) is the same in every process, whatever PYTHONHASHSEED says.
    digest = hashlib.sha256(f"{seed}/{epoch}/{worker_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class ShardedStream:
    """Endless batches over worker ``worker_index``'s shard of ``num_samples`` samples.

    Args:
        num_samples: how many training samples there are (numbered from 0).
        worker_index: this worker's slot, in ``[0, num_workers)``.
        num_workers: how many workers share the samples; at most ``num_samples`` so none is empty.
        batch_size: samples per batch, >= 1.
        seed: picks the per-epoch permutations; the same seed gives the same stream.
        fetch: builds a batch from a 1-D int64 tensor of sample indices.
    """

    def __init__(
        self,
        *,
        num_samples: int,
        worker_index: int,
        num_workers: int,
        batch_size: int,
        seed: int,
        fetch: Callable[[torch.Tensor], Batch],
    ) -> None:
        if not 1 <= num_workers <= num_samples:
            raise ValueError(f"num_workers must be in [1, {num_samples}] (one sample each at least), got {num_workers}")
        if not 0 <= worker_index < num_workers:
            raise ValueError(f"worker_index must be in [0, {num_workers}), got {worker_index}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.worker_index = worker_index
        self.batch_size = batch_size
        self.seed = seed
        self.shard = torch.arange(worker_index, num_samples, num_workers)
        """The global indices of the samples this worker owns."""
        self.position = 0
        """The index of the batch the iterator yields next."""
        self._fetch = fetch
        self._cached: tuple[int, torch.Tensor] | None = None

    def seek(self, batch_index: int) -> None:
        if batch_index < 0:
            raise ValueError(f"batch_index must be >= 0, got {batch_index}")
        self.position = batch_index

    def indices(self, batch_index: int) -> torch.Tensor:
        """The global sample indices of batch ``batch_index``, in the order the batch holds them."""
        n = len(self.shard)
        pos, end = batch_index * self.batch_size, (batch_index + 1) * self.batch_size
        parts = []
        while pos < end:
            epoch, offset = divmod(pos, n)
            take = min(end - pos, n - offset)
            parts.append(self._order(epoch)[offset : offset + take])
            pos += take
        return self.shard[torch.cat(parts)]

    def batch(self, batch_index: int) -> Batch:
        return self._fetch(self.indices(batch_index))

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.batch(self.position)
            self.position += 1

    def _order(self, epoch: int) -> torch.Tensor:
        # Consecutive batches almost always share an epoch; keeping the last permutation makes a step
        # cost one index gather instead of a fresh randperm of the whole shard.
        if self._cached is None or self._cached[0] != epoch:
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch, self.worker_index))
            self._cached = (epoch, torch.randperm(len(self.shard), generator=g))
        return self._cached[1]
