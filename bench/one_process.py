"""The one-process limit: the same training in one plain process, on torch's default threads (not a test).

    python -m bench.one_process --model rpcps.tasks:mlp_5m --data bench.big_batch:mlp_5m_data_64 --loss mse --steps 600

No server, no wire: forward, backward and ``torch.optim.SGD`` in one loop that uses every core, the
most updates per second this machine can make of this model. Prints one JSON line: the time of every
step (seconds), for bench.common.steady_rate.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.common import emit_json
from rpcps import plugins

_FINAL_LOSS_OF = 100
"""The final loss reported is the mean training loss of this many last steps."""


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.one_process", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model factory spec")
    p.add_argument("--data", required=True, help="data factory spec (worker_index, num_workers)")
    p.add_argument("--loss", default="mse")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=600)
    args = p.parse_args()
    model = plugins.load_model(args.model)
    data = iter(plugins.load_data(args.data, 0, 1))
    loss_fn = plugins.load_loss(args.loss)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    times, losses = [], []
    for _ in range(args.steps):
        x, y = next(data)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter())
        losses.append(loss.detach())
    tail = losses[-_FINAL_LOSS_OF:]
    emit_json({"update_times": times, "threads": torch.get_num_threads(), "final_loss": float(sum(tail)) / len(tail)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
