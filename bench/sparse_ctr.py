#!/usr/bin/env python3
"""The CTR task on rpcps against one process holding every table in ``nn.EmbeddingBag(sparse=True)``
(not a test).

    flock /tmp/rpcps-cpu.lock python -m bench.sparse_ctr                 # batch 4096, 2 workers
    flock /tmp/rpcps-cpu.lock python -m bench.sparse_ctr --steps 40 --batch-size 4096 --workers 2

In one run, same model (``worker.ctr`` DLRM: 26 tables of dim 16, bottom/top MLPs), same data
generator, same batch size:

* **rpcps**: ``trainer_entry.py local`` with 1 server and ``--workers`` workers, rows on the server
  (``--sparse-optimizer``, by default element-wise Adagrad like the one process's), dense part on the
  dense path (Adam); samples/s over the steady part of the run (bench.common: first to last sample
  of the workers' step counters).
* **one process**: the same DLRM with ``nn.EmbeddingBag(sparse=True)`` tables sized to the
  generator's vocabularies (rank as index: no hashing), ``torch.optim.Adagrad`` on the sparse
  gradients and Adam on the dense part, one process with every core; samples/s after ``--warmup``
  steps.

Both then report held-out AUC after the same number of samples (rpcps from its final snapshot).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import local_argv, print_table, run_local
from harness.sparse_eval import model_from_snapshot
from ps.config import SparseConfig
from worker import ctr


class OneProcessDLRM(nn.Module):
    """``worker.ctr.DLRM`` with its sparse collection replaced by one nn.EmbeddingBag(sparse=True) per table."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reference = ctr.DLRM()
        del self.reference.embeddings
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, ctr.DIM, mode="sum", sparse=True) for n in rows)
        with torch.no_grad():
            for table in self.tables:
                table.weight.uniform_(-0.01, 0.01)

    def forward(self, dense: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        ref = self.reference
        bottom = ref.bottom(dense)
        pooled = [table(ranks[:, t : t + 1]) for t, table in enumerate(self.tables)]
        vectors = torch.stack([bottom, *pooled], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, ref._pairs[0], ref._pairs[1]]
        return ref.top(torch.cat([bottom, dots], dim=1)).squeeze(1)


def one_process(steps: int, batch: int, workers: int, warmup: int) -> dict[str, Any]:
    """Trains on the batches the rpcps workers would read (interleaved worker by worker)."""
    rows = [int(v * (1.0 + ctr.GROWTH * (steps + 1) / 1000.0)) + 1 for v in ctr.VOCAB]
    model = OneProcessDLRM(rows)
    sparse = torch.optim.Adagrad([t.weight for t in model.tables], lr=0.05)
    dense = torch.optim.Adam(model.reference.parameters(), lr=3e-3)
    started = None
    for step in range(steps):
        for w in range(workers):
            if step == warmup and w == 0:
                started = time.perf_counter()
            x, ranks, y = ctr.draw(w, step, batch)
            sparse.zero_grad()
            dense.zero_grad()
            ctr.bce_loss(model(x, ranks), y).backward()
            sparse.step()
            dense.step()
    assert started is not None
    seconds = time.perf_counter() - started
    model.eval()
    with torch.no_grad():
        held_out = [ctr.draw(1 << 20, steps + i, 512) for i in range(8)]
        scores = torch.cat([model(x, r) for x, r, _ in held_out])
    labels = torch.cat([y for _, _, y in held_out])
    return {"samples_per_s": (steps - warmup) * workers * batch / seconds, "auc": ctr.auc(scores, labels)}


def rpcps(steps: int, batch: int, workers: int, extra: list[str]) -> dict[str, Any]:
    data = "worker.ctr:ctr_data" if batch == ctr.BATCH else "worker.ctr:ctr_data_small"
    with tempfile.TemporaryDirectory(prefix="bench-sparse-ctr-") as tmp:
        run_dir = Path(tmp)
        argv = local_argv(run_dir, model="worker.ctr:dlrm_model", data=data, workers=workers, steps=steps,
                          extra=["--loss", "worker.ctr:bce_loss", "--checkpoint-dir", str(run_dir / "ckpt"), *extra])
        run = run_local(argv, run_dir)
        optimizer = extra[extra.index("--sparse-optimizer") + 1]
        model = model_from_snapshot(run_dir / "ckpt", ctr.dlrm_model, SparseConfig(optimizer=optimizer))
        auc = ctr.evaluate(model, ctr.eval_batches(8, 512, at_batch=steps))["auc"]
    return {"samples_per_s": run.steady_steps_per_s() * batch, "auc": auc, "server_rss_mb": run.samples.server_hwm_kb / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="steps per worker")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=ctr.BATCH, choices=[ctr.BATCH, ctr.SMALL_BATCH])
    parser.add_argument("--warmup", type=int, default=5, help="one-process steps left out of its rate")
    parser.add_argument("--sparse-optimizer", default="adagrad", choices=["adagrad", "rowwise_adagrad"])
    parser.add_argument("--max-in-flight", type=int, default=2, help="rpcps workers' pushes in flight (staleness)")
    args = parser.parse_args()
    extra = ["--sparse-optimizer", args.sparse_optimizer, "--max-in-flight", str(args.max_in_flight)]
    ours = rpcps(args.steps, args.batch_size, args.workers, extra)
    base = one_process(args.steps, args.batch_size, args.workers, args.warmup)
    print_table(
        ["", "samples/s", "AUC (held out)"],
        [[f"rpcps, 1 server + {args.workers} workers", f"{ours['samples_per_s']:.0f}", f"{ours['auc']:.4f}"],
         ["one process, nn.EmbeddingBag(sparse=True)", f"{base['samples_per_s']:.0f}", f"{base['auc']:.4f}"],
         ["ratio rpcps / one process", f"{ours['samples_per_s'] / base['samples_per_s']:.2f}",
          f"{ours['auc'] - base['auc']:+.4f}"]],
    )
    print(f"server peak RSS {ours['server_rss_mb']:.0f} MB; {args.steps} steps x {args.workers} workers x batch {args.batch_size}; "
          f"rpcps {' '.join(extra)}")


if __name__ == "__main__":
    main()
