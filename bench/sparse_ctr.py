#!/usr/bin/env python3
"""The CTR task on rpcps against one process holding every table in ``nn.EmbeddingBag(sparse=True)``
and against the design of PyTorch's RPC tutorial for remote embeddings (not a test).

    flock /tmp/rpcps-cpu.lock python -m bench.sparse_ctr                 # batch 4096, 2 workers
    flock /tmp/rpcps-cpu.lock python -m bench.sparse_ctr --steps 40 --batch-size 4096 --workers 2

In one run, same model (``rpcps.examples.ctr`` DLRM: 26 tables of dim 16, bottom/top MLPs), same data
generator, same batches:

* **rpcps**: ``trainer_entry.py local`` with 1 server and ``--workers`` workers, rows on the server
  (``--sparse-optimizer``, by default element-wise Adagrad like the one process's), dense part on the
  dense path (Adam).
* **one process**: the same DLRM with ``nn.EmbeddingBag(sparse=True)`` tables sized to the
  generator's vocabularies (rank as index: no hashing), ``torch.optim.Adagrad`` on the sparse
  gradients and Adam on the dense part, one process with every core; samples/s after ``--warmup``
  steps.
* **RPC tutorial design** (bench/sparse_tutorial_design.py, once per ``--tutorial-transports``):
  1 server holding every table as ``RemoteModule(nn.EmbeddingBag)`` over the same ranks, and
  ``--workers`` trainers with the dense part local (DDP), distributed autograd and
  ``DistributedOptimizer`` (Adagrad on the tables, Adam on the dense part).

The distributed sides' samples/s are over the steady part of each run (bench.common.steady_rate:
15 % to 85 % of the steps). Every side then reports held-out AUC after the same samples (rpcps from
its final snapshot).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import local_argv, print_table, run_local, run_ranks, steady_rate
from harness.sparse_eval import model_from_snapshot
from ps.core.optim import DEFAULT_LR
from ps.sparse.store import SparseConfig
from rpcps.examples import ctr
from rpcps.ports import free_ports


class DenseHead(nn.Module):
    """``rpcps.examples.ctr.DLRM`` without its sparse collection: bottom MLP, dot interaction, top MLP.

    Takes the 26 pooled vectors from wherever the baseline keeps its tables (local nn.EmbeddingBag,
    or the tutorial design's RemoteModules). Built from the same seed as rpcps's model, so every
    side starts from the same dense weights.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reference = ctr.DLRM()
        del self.reference.embeddings

    def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        ref = self.reference
        bottom = ref.bottom(dense)
        vectors = torch.stack([bottom, *pooled], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, ref._pairs[0], ref._pairs[1]]
        return ref.top(torch.cat([bottom, dots], dim=1)).squeeze(1)


INIT_SCALE = SparseConfig().init_scale
"""The baselines' tables start uniform in [-INIT_SCALE, INIT_SCALE], like rpcps's new rows."""
SPARSE_LR, DENSE_LR = SparseConfig().lr, DEFAULT_LR
"""The baselines' Adagrad (tables) and Adam (dense part) learning rates: rpcps's defaults."""


HELD_OUT_BATCHES, HELD_OUT_BATCH = 8, 512


def table_rows(steps: int) -> list[int]:
    """Rows per table that hold every rank the generator draws up to ``steps`` training batches and
    the held-out batches after them (ranks index fixed-size tables: no hashing, no collisions)."""
    last = steps + HELD_OUT_BATCHES
    return [int(v * (1.0 + ctr.GROWTH * last / 1000.0)) + 1 for v in ctr.VOCAB]


def init_tables(tables: list[nn.EmbeddingBag]) -> None:
    with torch.no_grad():
        for table in tables:
            table.weight.uniform_(-INIT_SCALE, INIT_SCALE)


def held_out_auc(model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], steps: int) -> float:
    """AUC of ``model(dense, ranks)`` on the held-out batches rpcps is evaluated on (``ctr.eval_batches``)."""
    with torch.no_grad():
        held_out = [ctr.draw(ctr._EVAL_WORKER, steps + i, HELD_OUT_BATCH) for i in range(HELD_OUT_BATCHES)]
        scores = torch.cat([model(x, r) for x, r, _ in held_out])
    return ctr.auc(scores, torch.cat([y for _, _, y in held_out]))


class OneProcessDLRM(nn.Module):
    """``DenseHead`` with one nn.EmbeddingBag(sparse=True) per table."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = DenseHead()
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, ctr.DIM, mode="sum", sparse=True) for n in rows)
        init_tables(list(self.tables))

    def forward(self, dense: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        return self.head(dense, [table(ranks[:, t : t + 1]) for t, table in enumerate(self.tables)])


def one_process(steps: int, batch: int, workers: int, warmup: int) -> dict[str, Any]:
    """Trains on the batches the rpcps workers would read (interleaved worker by worker)."""
    model = OneProcessDLRM(table_rows(steps))
    sparse = torch.optim.Adagrad([t.weight for t in model.tables], lr=SPARSE_LR)
    dense = torch.optim.Adam(model.head.parameters(), lr=DENSE_LR)
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
    return {"samples_per_s": (steps - warmup) * workers * batch / seconds, "auc": held_out_auc(model, steps)}


def rpcps(steps: int, batch: int, workers: int, extra: list[str]) -> dict[str, Any]:
    data = "rpcps.examples.ctr:ctr_data" if batch == ctr.BATCH else "rpcps.examples.ctr:ctr_data_small"
    with tempfile.TemporaryDirectory(prefix="bench-sparse-ctr-") as tmp:
        run_dir = Path(tmp)
        argv = local_argv(run_dir, model="rpcps.examples.ctr:dlrm_model", data=data, workers=workers, steps=steps,
                          extra=["--loss", "rpcps.examples.ctr:bce_loss", "--checkpoint-dir", str(run_dir / "ckpt"), *extra])
        run = run_local(argv, run_dir)
        optimizer = extra[extra.index("--sparse-optimizer") + 1]
        model = model_from_snapshot(run_dir / "ckpt", ctr.dlrm_model, SparseConfig(optimizer=optimizer))
        auc = ctr.evaluate(model, ctr.eval_batches(HELD_OUT_BATCHES, HELD_OUT_BATCH, at_batch=steps))["auc"]
    return {"samples_per_s": steady_rate(run.samples.worker_steps) * batch, "auc": auc, "server_rss_mb": run.samples.server_hwm_kb / 1024}


def tutorial_design(steps: int, batch: int, workers: int, transport: str, dense_grads: bool) -> dict[str, Any]:
    """bench/sparse_tutorial_design.py: 1 server + ``workers`` trainers, steady samples/s (15-85 %) and AUC."""
    rpc_port, dist_port = free_ports(2)
    argv = [sys.executable, "-m", "bench.sparse_tutorial_design", "--world", str(workers + 1), "--port", str(rpc_port),
            "--dist-port", str(dist_port), "--steps", str(steps), "--batch-size", str(batch), "--transport", transport,
            *(["--dense-grads"] if dense_grads else [])]
    result = run_ranks(argv, workers + 1)
    rate = steady_rate([(t, i + 1) for i, t in enumerate(result["step_times"])])
    return {"samples_per_s": rate * batch, "auc": result["auc"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="steps per worker")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=ctr.BATCH, choices=[ctr.BATCH, ctr.SMALL_BATCH])
    parser.add_argument("--warmup", type=int, default=5, help="one-process steps left out of its rate")
    parser.add_argument("--sparse-optimizer", default="adagrad", choices=["adagrad", "rowwise_adagrad"])
    parser.add_argument("--max-in-flight", type=int, default=2, help="rpcps workers' pushes in flight (staleness)")
    parser.add_argument("--tutorial-transports", default="default,uv",
                        help="TensorPipe options of the tutorial design's runs (default, uv), comma-separated; '' skips it")
    parser.add_argument("--tutorial-dense-grads", action="store_true", help="the tutorial design with nn.EmbeddingBag's sparse=False")
    parser.add_argument("--skip-one-process", action="store_true", help="leave the one-process column out")
    args = parser.parse_args()
    extra = ["--sparse-optimizer", args.sparse_optimizer, "--max-in-flight", str(args.max_in_flight)]
    ours = rpcps(args.steps, args.batch_size, args.workers, extra)
    sides = {f"rpcps, 1 server + {args.workers} workers": ours}
    if not args.skip_one_process:
        sides["one process, nn.EmbeddingBag(sparse=True)"] = one_process(args.steps, args.batch_size, args.workers, args.warmup)
    grads = "dense" if args.tutorial_dense_grads else "sparse"
    tutorial = {}
    for transport in filter(None, args.tutorial_transports.split(",")):
        tutorial[transport] = tutorial_design(args.steps, args.batch_size, args.workers, transport, args.tutorial_dense_grads)
        sides[f"RPC tutorial design ({transport}, {grads} grads)"] = tutorial[transport]
    rows = [[name, f"{v['samples_per_s']:.0f}", f"{v['auc']:.4f}"] for name, v in sides.items()]
    for name, base in sides.items():
        if base is not ours:
            rows.append([f"ratio rpcps / {name}", f"{ours['samples_per_s'] / base['samples_per_s']:.2f}", f"{ours['auc'] - base['auc']:+.4f}"])
    if len(tutorial) > 1:
        best = max(v["samples_per_s"] for v in tutorial.values())
        rows.append(["ratio rpcps / best tutorial design", f"{ours['samples_per_s'] / best:.2f}", ""])
    print_table(["", "samples/s", "AUC (held out)"], rows)
    print(f"server peak RSS {ours['server_rss_mb']:.0f} MB; {args.steps} steps x {args.workers} workers x batch {args.batch_size}; "
          f"rpcps {' '.join(extra)}")


if __name__ == "__main__":
    main()
