"""The CTR benchmark's baselines (bench/sparse_ctr.py): fixed-size tables that hold every rank they
are fed, and a dense head that computes what rpcps's DLRM computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.sparse_ctr import HELD_OUT_BATCH, HELD_OUT_BATCHES, DenseHead, table_rows
from rpcps.examples import ctr

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("steps", [1, 150])
def test_table_rows_hold_every_rank_of_training_and_held_out_batches(steps: int) -> None:
    rows = torch.tensor(table_rows(steps))
    # The last training batch and the last held-out batch draw from the largest vocabularies.
    for worker, batch, size in ((0, steps - 1, ctr.BATCH), (ctr._EVAL_WORKER, steps + HELD_OUT_BATCHES - 1, HELD_OUT_BATCH)):
        _, ranks, _ = ctr.draw(worker, batch, size)
        assert bool((ranks.max(dim=0).values < rows).all()), f"a rank of batch {batch} is past its table"
    grown = [int(v * (1.0 + ctr.GROWTH * (steps + HELD_OUT_BATCHES - 1) / 1000.0)) for v in ctr.VOCAB]
    assert all(r >= g for r, g in zip(rows.tolist(), grown, strict=True)), "tables smaller than the grown vocabularies"


class _Fixed(nn.Module):
    """Stands in for the DLRM's sparse collection: the given pooled vectors, whatever the ids."""

    def __init__(self, pooled: list[torch.Tensor]) -> None:
        super().__init__()
        self.pooled = pooled

    def forward(self, features: dict[str, object]) -> dict[str, torch.Tensor]:
        return {f"cat{t}": v for t, v in enumerate(self.pooled)}


def test_dense_head_computes_what_the_dlrm_computes_from_the_same_pooled_vectors() -> None:
    head, dlrm = DenseHead(), ctr.DLRM()
    batch = ctr.CtrBatch(torch.randn(5, ctr.DENSE), torch.zeros(5, ctr.TABLES, dtype=torch.int64))
    pooled = [torch.randn(5, ctr.DIM) for _ in range(ctr.TABLES)]
    dlrm.embeddings = _Fixed(pooled)
    torch.testing.assert_close(head(batch.dense, pooled), dlrm(batch), rtol=0, atol=0)
