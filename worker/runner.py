"""Runs the CLI worker (``rpcps worker``): the built-in loop over ``--model/--data/--loss``, one user
of the Python API (``worker.api``) like any user script, so every fault test of the CLI exercises it.

Joining, restarting in place when the server is replaced, draining, durability and the summary are
the API's (``worker.api.Training``). Why restart instead of reconnecting in place: torch RPC caches a
broken connection per peer forever, and re-initialising the agent inside one process lands in a new
store namespace and raced into hangs in our measurements (shared/research/torch-rpc-facts.md). A
fresh process (``os.execv``, same PID, same arguments) joins the new server cleanly in about two
seconds, most of it Python start-up, and picks up its slot's progress from the server.
"""

from __future__ import annotations

from rpcps import plugins
from worker.api import EXIT_OK, Training
from worker.config import WorkerRunConfig
from worker.local_steps import inner_optimizer


def run_worker(config: WorkerRunConfig) -> int:
    loss_fn = plugins.load_loss(config.worker.loss)  # fail on a bad spec before touching the network
    model = plugins.load_model(config.worker.model)
    spec = config.worker.data
    data = plugins.checked_batches(spec, plugins.load_data(spec, config.worker.worker_index, config.worker.num_workers))
    training = Training(model, data, config, data_name=f"--data {config.worker.data!r}")
    with training:
        device = training.device
        # Local steps: the inner optimizer lives as long as this process (a restart starts it afresh).
        inner = inner_optimizer(config.worker, [p for p in model.parameters() if p.requires_grad]) if training.local_steps else None
        for step in training:
            for inputs, targets in step.micro_batches:
                inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
                loss = loss_fn(model(inputs), targets)
                loss.backward()
                if inner is not None:
                    inner.step()
                    inner.zero_grad()
            step.push(loss)
    return EXIT_OK
