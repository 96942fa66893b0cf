"""What the restricted unpickler costs per message: torch's own ``deserialize`` with the plain
unpickler and with rpcps's, side by side in one process (not a test).

    python -m bench.unpickler_cost [--repeats 5] [--calls 20000]

For each message rpcps sends most (a push with 1 and 10 chunks, a pull reply with 10 chunks) it
times ``deserialize`` and then what torch does with a call (runs ``PythonUDF.func``: a handle in
rpcps, the function itself with the plain unpickler), best of ``--repeats`` runs of ``--calls``
messages each, and prints microseconds per message for both and the difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.rpc import internal

from bench.common import print_table
from rpcps import endpoints, rpc_policy
from rpcps.messages import PullReply, PushReply, PushStatus
from rpcps.transport import pickling, protection


def _messages() -> dict[str, tuple[bytes, list[torch.Tensor]]]:
    def push(chunks: int) -> Any:
        grads = [torch.zeros(1024) for _ in range(chunks)]
        return internal.PythonUDF(endpoints.submit, (None, 0, "a" * 32, 17, 16, grads, 0.5, 16, None), {})

    pulled = PullReply(17, [torch.zeros(1024) for _ in range(10)])
    samples = {
        "push, 1 chunk": push(1),
        "push, 10 chunks": push(10),
        "push reply with its pull, 10 chunks": PushReply(PushStatus.APPLIED, 17, 1, pulled),
    }
    return {name: internal.serialize(obj) for name, obj in samples.items()}


def _per_message_us(message: tuple[bytes, list[torch.Tensor]], calls: int, repeats: int) -> float:
    payload, tensors = message

    def run(_: Any, *args: Any) -> None:  # what torch runs: PythonUDF.func(*args)
        return None

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = internal.deserialize(payload, tensors)
            if isinstance(out, internal.PythonUDF):
                (out.func if callable(out.func) else run)(*out.args)
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def _noop_submit() -> Callable[..., None]:
    # The push samples name endpoints.submit; running the real one needs a server. Both sides run
    # this stand-in instead, so the difference is the unpickler and the handle, not the endpoint.
    def submit(*_args: Any) -> None:
        return None

    return submit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--calls", type=int, default=20_000, help="messages per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per side; the best one counts")
    args = parser.parse_args()
    pickling.register_wire_reducers()  # what every rpcps process sends
    messages = _messages()
    stand_in = _noop_submit()
    real = endpoints.submit
    policy = protection.unpickle_policy(rpc_policy.worker_api_surface())
    policy = dataclasses.replace(policy, calls={**policy.calls, ("rpcps.endpoints", "submit"): stand_in})
    rows = []
    for name, message in messages.items():
        endpoints.submit = stand_in  # type: ignore[assignment]  # resolved by name on the plain side
        try:
            pickling.uninstall()
            plain = _per_message_us(message, args.calls, args.repeats)
            pickling.install(policy)
            ours = _per_message_us(message, args.calls, args.repeats)
        finally:
            endpoints.submit = real  # type: ignore[assignment]
            pickling.uninstall()
        rows.append([name, f"{plain:.2f}", f"{ours:.2f}", f"{ours - plain:+.2f}"])
    print_table(["message", "plain us", "rpcps us", "difference us"], rows)


if __name__ == "__main__":
    main()
