"""The PyTorch RPC parameter-server example's design, rebuilt small and self-contained (not a test).

What it keeps from the example (pytorch/examples ``distributed/rpc/batch/parameter_server.py`` and
the "Implementing a Parameter Server Using Distributed RPC Framework" tutorial): one server process
holds the model and ``torch.optim.SGD`` behind one ``threading.Lock``; a static world (rank 0 the
server, ranks 1..N the workers, ``init_rpc`` with a fixed world size); every worker computes a step
locally, then blocks in ``rpc_sync`` sending all its gradients, and the server steps and returns
every parameter. Nothing is chunked, overlapped, pipelined or validated.

Settings are the example's own, not rpcps's: every process calls ``torch.set_num_threads(1)``
itself (the example's design as the issue measured it; without it three processes on two cores
oversubscribe them), and TensorPipe runs on its default options with the example's 16 RPC threads
(``--transport default``; on one host TensorPipe then picks shared memory, which busy-polls a core
per process). ``--transport uv`` runs it over TCP with the ``basic`` channel instead, the transport
rpcps used to default to, for a comparison about the design alone.

    python -m bench.example_design --world N+1 --rank R --port P --model rpcps.tasks:mlp_5m \\
        --data bench.big_batch:mlp_5m_data_64 --loss mse --steps 300

Rank 0 serves until the workers are done, then prints one JSON line: the time of every update it
applied (seconds, its own clock), for bench.common.steady_rate.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import torch
from torch.distributed import rpc

from bench.common import emit_json
from rpcps import plugins

_SERVER = "example-ps"
_state: dict[str, Any] = {}
_lock = threading.Lock()
_update_times: list[float] = []


def update_and_fetch(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Applies one worker's gradients under the lock and returns every parameter (the example's hot path)."""
    model, optimizer = _state["model"], _state["optimizer"]
    with _lock:
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        optimizer.step()
        _update_times.append(time.perf_counter())
        return [p.detach().clone() for p in model.parameters()]


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.example_design", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, required=True, help="1 server + N workers")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="rpcps.tasks:mlp_5m", help="model factory spec")
    p.add_argument("--data", default="bench.big_batch:mlp_5m_data_64", help="data factory spec (worker_index, num_workers)")
    p.add_argument("--loss", default="mse", help="cross_entropy, mse or a spec")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (the example's)")
    p.add_argument("--steps", type=int, default=300, help="steps per worker")
    p.add_argument("--transport", choices=["default", "uv"], default="default", help="TensorPipe defaults, or uv + basic")
    p.add_argument("--zero-compute", action="store_true", help="workers send one precomputed gradient again and again "
                   "and drop the parameters they get back (server capacity, bench.push_throughput)")
    args = p.parse_args()
    torch.set_num_threads(1)
    transport: dict[str, Any] = {} if args.transport == "default" else {"_transports": ["uv"], "_channels": ["basic"]}
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{args.port}", num_worker_threads=16, rpc_timeout=300, **transport)
    name = _SERVER if args.rank == 0 else f"example-worker{args.rank}"
    model = plugins.load_model(args.model)
    if args.rank == 0:
        _state["model"] = model
        _state["optimizer"] = torch.optim.SGD(model.parameters(), lr=args.lr)
    rpc.init_rpc(name, rank=args.rank, world_size=args.world, rpc_backend_options=options)
    if args.rank != 0:
        _train(args, model)
    rpc.shutdown()  # graceful: the server returns once every worker has finished
    if args.rank == 0:
        emit_json({"update_times": _update_times})
    return 0


def _train(args: argparse.Namespace, model: torch.nn.Module) -> None:
    data = iter(plugins.load_data(args.data, args.rank - 1, args.world - 1))
    loss_fn = plugins.load_loss(args.loss)
    _load(model, rpc.rpc_sync(_SERVER, _fetch))  # start from the server's weights, like the example
    if args.zero_compute:
        x, y = next(data)
        loss_fn(model(x), y).backward()
        grads = [q.grad for q in model.parameters()]
        for _ in range(args.steps):
            rpc.rpc_sync(_SERVER, update_and_fetch, args=(grads,))
        return
    for _ in range(args.steps):
        x, y = next(data)
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        _load(model, rpc.rpc_sync(_SERVER, update_and_fetch, args=([q.grad for q in model.parameters()],)))


def _fetch() -> list[torch.Tensor]:
    with _lock:
        return [p.detach().clone() for p in _state["model"].parameters()]


def _load(model: torch.nn.Module, params: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)


if __name__ == "__main__":
    sys.exit(main())
