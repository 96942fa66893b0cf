"""The PyTorch RPC parameter-server example's design, rebuilt small and self-contained (not a test).

What it keeps from the example (pytorch/examples ``distributed/rpc/parameter_server`` and the
"Implementing a Parameter Server Using Distributed RPC Framework" tutorial): one server process holds
the model and its optimizer behind one ``threading.Lock``; a static world (rank 0 the server, ranks
1..N the workers, ``init_rpc`` with a fixed world size); every worker computes a step locally, then
blocks in ``rpc_sync`` sending all its gradients and receiving the full parameters back, every step.
Nothing is chunked, overlapped, pipelined or validated. The transport is TensorPipe over ``uv`` with
the ``basic`` channel, the same as rpcps's default, so the comparison is about the design.

    python -m bench.example_design --world N+1 --rank R --port P --model mlp_5m --steps 60

Rank 0 serves until the workers are done; each worker prints one JSON line with its timed steps/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import torch
from torch.distributed import rpc

from rpcps import plugins

_SERVER = "example-ps"
_state: dict[str, Any] = {}
_lock = threading.Lock()


def update_and_fetch(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Applies one worker's gradients under the lock and returns every parameter (the example's hot path)."""
    model, optimizer = _state["model"], _state["optimizer"]
    with _lock:
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        optimizer.step()
        return [p.detach().clone() for p in model.parameters()]


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.example_design", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, required=True, help="1 server + N workers")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="mlp_5m", help="a model factory in rpcps.tasks (its _data twin feeds it)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per worker")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{args.port}", num_worker_threads=32, rpc_timeout=300, _transports=["uv"], _channels=["basic"]
    )
    name = _SERVER if args.rank == 0 else f"example-worker{args.rank}"
    model = plugins.load_model(f"rpcps.tasks:{args.model}")
    if args.rank == 0:
        _state["model"] = model
        _state["optimizer"] = torch.optim.Adam(model.parameters(), lr=1e-3)
    rpc.init_rpc(name, rank=args.rank, world_size=args.world, rpc_backend_options=options)
    if args.rank != 0:
        _train(args, model)
    rpc.shutdown()  # graceful: the server returns once every worker has finished
    return 0


def _train(args: argparse.Namespace, model: torch.nn.Module) -> None:
    data = iter(plugins.load_data(f"rpcps.tasks:{args.model}_data", args.rank - 1, args.world - 1))
    params = rpc.rpc_sync(_SERVER, _fetch)  # start from the server's weights, like the example
    _load(model, params)
    started = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            started = time.perf_counter()
        x, y = next(data)
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        params = rpc.rpc_sync(_SERVER, update_and_fetch, args=([q.grad for q in model.parameters()],))
        _load(model, params)
    elapsed = time.perf_counter() - started
    nbytes = sum(q.numel() * q.element_size() for q in model.parameters())
    print(json.dumps({"steps": args.steps, "seconds": elapsed, "payload_bytes": nbytes}), flush=True)


def _fetch() -> list[torch.Tensor]:
    with _lock:
        return [p.detach().clone() for p in _state["model"].parameters()]


def _load(model: torch.nn.Module, params: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)


if __name__ == "__main__":
    sys.exit(main())
