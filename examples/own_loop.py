"""Your own training loop on rpcps: a keyword-input, dict-output transformer (the Hugging Face shape),
two loss terms, gradient accumulation over 2 micro-batches, clipping, autocast, logging only on steps
that are not replays. docs/API.md walks through it.

Start the server with the same model, then this script once per worker:

    rpcps ps --listen 127.0.0.1:29500 --model rpcps.examples.charlm_hf:model --optimizer adam --lr 1e-3 &
    python examples/own_loop.py --ps 127.0.0.1:29500 --worker-index 0 --num-workers 2 --steps 200 &
    python examples/own_loop.py --ps 127.0.0.1:29500 --worker-index 1 --num-workers 2 --steps 200

or let torchrun number the workers (RANK and WORLD_SIZE name the slot; torchrun's MASTER_ADDR/PORT
are its own store, so ``--ps`` names the server), or let ``rpcps local`` start everything:

    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --ps 127.0.0.1:29500 --steps 200
    rpcps local --workers 2 --steps 200 --model rpcps.examples.charlm_hf:model --optimizer adam --lr 1e-3 \\
        --worker-script examples/own_loop.py

Every rpcps worker flag works here (``--max-in-flight``, ``--device``, ...); this script's own flags
(``--precision``, ``--log-every``, ``--clip``) sit beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import sys

import torch

from rpcps.examples.charlm_hf import data, model
from worker.api import connect

Z_LOSS = 1e-4
"""Weight of the auxiliary z-loss (the second loss term)."""
ACCUMULATE = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16",
                        help="autocast dtype; fp16 scales the loss with a GradScaler (default bf16)")
    parser.add_argument("--log-every", type=int, default=10, help="print a step line every N steps")
    parser.add_argument("--clip", type=float, default=1.0, help="clip the gradient norm to this")
    parser.add_argument("--batch-size", type=int, default=32, help="windows of 128 bytes per micro-batch")
    parser.add_argument("--init-scale", type=float, default=2.0**16, help="fp16: the GradScaler's first loss scale")
    # rpcps's own flags (--ps, --steps, ...) are read by connect(); leave them to it.
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [own_loop pid %(process)d] %(name)s: %(message)s")

    net = model()
    # The data of slot i of n; step s always gets the same micro-batches (the stream seeks).
    slot_data = functools.partial(data, batch_size=args.batch_size)
    with connect(net, slot_data, accumulate=ACCUMULATE, steps=200) as training:
        device = training.device
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
        scaler = torch.amp.GradScaler(device.type, init_scale=args.init_scale) if args.precision == "fp16" else None
        optimizer = training.optimizer  # pushes on step(); the real optimizer is the server's
        for step in training:
            total = 0.0
            for micro in step.micro_batches:
                batch = {k: v.to(device, non_blocking=True) for k, v in micro.items()}
                autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
                with autocast:
                    out = net(**batch)
                loss = (out["loss"] + Z_LOSS * out["z_loss"]) / ACCUMULATE
                (scaler.scale(loss) if scaler is not None else loss).backward()
                total += float(loss.detach())
            step.report(total)
            if scaler is not None:
                scaler.unscale_(optimizer)  # clip the true gradient, not the scaled one
                torch.nn.utils.clip_grad_norm_(net.parameters(), args.clip)
                if scaler.step(optimizer) is None:  # Inf/NaN: the scaler skipped the optimizer
                    step.skip()
                scaler.update()
            else:
                torch.nn.utils.clip_grad_norm_(net.parameters(), args.clip)
                step.push()
            # A replay computes a step that was handed out before: log (and count) each step once.
            if not step.replay and step.index % args.log_every == 0:
                print(f"step {step.index} loss {total:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
