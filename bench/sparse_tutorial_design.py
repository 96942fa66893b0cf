"""The design of PyTorch's RPC tutorial for remote embeddings, on the CTR task (not a test).

What it keeps from the tutorial ("Combining Distributed DataParallel with Distributed RPC
Framework", pytorch/examples ``distributed/rpc/ddp_rpc/main.py``): the tables live on a parameter
server as ``RemoteModule(nn.EmbeddingBag, mode="sum")``; each trainer runs the dense part locally,
replicated with ``DistributedDataParallel`` over gloo; every step runs in a
``dist_autograd.context()``: forward through the RemoteModules, ``dist_autograd.backward``, then
``DistributedOptimizer.step(context_id)``, which sends each trainer's gradients to the server's
own optimizer for that trainer (the tutorial's design: optimizer state is per trainer, not shared,
and the two trainers' steps on the server take no common lock). TensorPipe on its default options,
and no thread counts set: the tutorial sets none.

What differs, each in the design's favour or forced by the task:

* 26 tables instead of one, one RemoteModule each (the tutorial's unit), sized to the generator's
  rank range (``bench.sparse_ctr.table_rows``: ranks index the table, no hashing, no collisions;
  the tutorial's tables are fixed-size, so 64-bit ids cannot go in as they are).
* ``sparse=True`` on the EmbeddingBags by default (``--dense-grads`` for the tutorial's default):
  with dense gradients every step would ship and update all 3.2 M rows.
* The 26 lookups of a step go out together (``RemoteModule.forward_async``) instead of one after
  another.
* No separate master: the server process creates the RemoteModules and starts the trainers (the
  tutorial's fourth, idle process would only take CPU from the others on two cores).
* Two DistributedOptimizers, Adagrad on the remote tables and Adam on the local dense part (RRefs
  of its parameters, as the tutorial passes them), so the optimizers match the other two columns.

    python -m bench.sparse_tutorial_design --rank R --port P --dist-port Q --steps 30

Rank 0 (server) waits for the trainers, then prints one JSON line: every trainer step's end time
(time.monotonic, one clock for all processes on a host) and the held-out AUC of the trained model.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch import nn
from torch.distributed import rpc
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.nn.parallel import DistributedDataParallel

from bench.common import emit_json
from bench.sparse_ctr import DENSE_LR, SPARSE_LR, DenseHead, held_out_auc, init_tables, table_rows
from rpcps.examples import ctr

SERVER = "ps"


def trainer_name(index: int) -> str:
    return f"trainer{index}"


def train(tables: list[RemoteModule], index: int, steps: int, batch: int) -> dict[str, Any]:
    """One trainer's loop (runs on the trainer, started by the server over RPC, as in the tutorial)."""
    torch.manual_seed(0)
    head = DenseHead()
    model = DistributedDataParallel(head)
    sparse = DistributedOptimizer(torch.optim.Adagrad, [p for t in tables for p in t.remote_parameters()], lr=SPARSE_LR)
    dense = DistributedOptimizer(torch.optim.Adam, [rpc.RRef(p) for p in model.parameters()], lr=DENSE_LR)
    times = []
    for step in range(steps):
        x, ranks, y = ctr.draw(index, step, batch)
        with dist_autograd.context() as context_id:
            futures = [table.forward_async(ranks[:, t : t + 1]) for t, table in enumerate(tables)]
            loss = ctr.bce_loss(model(x, [f.wait() for f in futures]), y)
            dist_autograd.backward(context_id, [loss])
            sparse.step(context_id)
            dense.step(context_id)
        times.append(time.monotonic())
    return {"times": times, "dense": head.state_dict()}


def serve(args: argparse.Namespace) -> dict[str, Any]:
    """Creates the tables on this process, runs the trainers, evaluates the result."""
    kwargs = {"mode": "sum", "sparse": not args.dense_grads}
    tables = [RemoteModule(SERVER, nn.EmbeddingBag, args=(n, ctr.DIM), kwargs=kwargs) for n in table_rows(args.steps)]
    local = [t.module_rref.local_value() for t in tables]
    init_tables(local)
    futures = [rpc.rpc_async(trainer_name(i), train, args=(tables, i, args.steps, args.batch_size), timeout=0)
               for i in range(args.world - 1)]
    results = [f.wait() for f in futures]
    head = DenseHead()
    head.load_state_dict(results[0]["dense"])  # DDP keeps the replicas equal
    head.eval()
    auc = held_out_auc(lambda x, ranks: head(x, [t(ranks[:, i : i + 1]) for i, t in enumerate(local)]), args.steps)
    return {"step_times": sorted(t for r in results for t in r["times"]), "auc": auc}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sparse_tutorial_design", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=3, help="1 server + N trainers")
    p.add_argument("--rank", type=int, required=True, help="0 is the server")
    p.add_argument("--port", type=int, required=True, help="RPC rendezvous port")
    p.add_argument("--dist-port", type=int, required=True, help="the trainers' gloo process group (DDP) port")
    p.add_argument("--steps", type=int, default=30, help="steps per trainer")
    p.add_argument("--batch-size", type=int, default=ctr.BATCH)
    p.add_argument("--transport", choices=["default", "uv"], default="default", help="TensorPipe defaults, or uv + basic")
    p.add_argument("--dense-grads", action="store_true", help="nn.EmbeddingBag's default sparse=False")
    args = p.parse_args()
    transport: dict[str, Any] = {} if args.transport == "default" else {"_transports": ["uv"], "_channels": ["basic"]}
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{args.port}", **transport)
    if args.rank == 0:
        rpc.init_rpc(SERVER, rank=0, world_size=args.world, rpc_backend_options=options)
        result = serve(args)
    else:
        dist.init_process_group("gloo", rank=args.rank - 1, world_size=args.world - 1,
                                init_method=f"tcp://127.0.0.1:{args.dist_port}")
        rpc.init_rpc(trainer_name(args.rank - 1), rank=args.rank, world_size=args.world, rpc_backend_options=options)
    rpc.shutdown()  # graceful: every process returns once the server has collected the trainers' results
    if args.rank == 0:
        emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
