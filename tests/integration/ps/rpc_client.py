"""A hand-driven worker for integration tests: joins a running server and sends pushes a real
worker never would, then prints what happened as one JSON line on stdout.

Runs in its own process (torch RPC allows one agent per process):
    .venv/bin/python tests/integration/ps/rpc_client.py HOST:PORT bad_pushes|removed_then_failover
The server must run plain SGD with lr=1 and the built-in model, so a zero gradient leaves the
parameters bit-identical while still producing a new version (and a fresh snapshot to pull).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from rpcps import plugins, rpc_policy, transport
from rpcps.address import Address
from rpcps.errors import RpcpsError
from rpcps.signature import FlatLayout, ModelSignature
from worker.client import ServerClient, result


def _attempt(call: Callable[[], Any]) -> dict[str, str]:
    try:
        value = call()
    except RpcpsError as e:
        return {"raised": type(e).__name__, "message": str(e)}
    except Exception as e:  # noqa: BLE001 - an unexpected kind is exactly what the test wants to see
        return {"raised": f"unexpected {type(e).__name__}", "message": str(e)}
    return {"raised": "", "message": repr(value)}


def bad_pushes(client: ServerClient, name: str) -> dict[str, Any]:
    signature = ModelSignature.of_module(plugins.load_model(plugins.BUILTIN_MODEL))
    replaced = client.register(0, name, signature.to_wire())
    reg = client.register(0, name, signature.to_wire())  # the first registration is now stale
    layout = FlatLayout(signature, reg.chunk_bytes)
    before = client.pull_now(0, reg.incarnation, -1)

    def push(chunks: list[torch.Tensor], seq: int, slot: int = 0, incarnation: str = reg.incarnation) -> Any:
        return result(client.push(slot, incarnation, seq, before.version, chunks, 1.0))

    def good(value: float = 0.0) -> list[torch.Tensor]:
        return [torch.full((n,), value) for n in layout.chunk_numels]

    nan = good()
    nan[0][layout.slot("2.weight").offset + 3] = float("nan")  # type: ignore[union-attr]
    named = {s.spec.name: torch.zeros(s.spec.shape) for s in layout.slots}
    outcomes = {
        "wrong_shape": _attempt(lambda: push([torch.zeros(5)] + good()[1:], 1)),
        "wrong_count": _attempt(lambda: push(good() + [torch.zeros(3)], 2)),
        "wrong_dtype": _attempt(lambda: push([c.double() for c in good()], 3)),
        "nan": _attempt(lambda: push(nan, 4)),
        "unknown_worker": _attempt(lambda: push(good(), 5, slot=7, incarnation="nope")),
        "stale_incarnation": _attempt(lambda: push(good(), 6, incarnation=replaced.incarnation)),
        "named_unknown": _attempt(lambda: client.push_named(0, reg.incarnation, 7, before.version, {**named, "x.y": torch.zeros(1)}, 1.0)),
    }
    after_rejects = client.pull_now(0, reg.incarnation, before.version)
    applied = push(good(0.0), 8)
    after = client.pull_now(0, reg.incarnation, before.version)
    return {
        "outcomes": outcomes,
        "version_before": before.version,
        "version_after_rejects": after_rejects.version,
        "zero_push": applied.status,
        "version_after_zero_push": after.version,
        "unchanged": after.chunks is not None and all(torch.equal(a, b) for a, b in zip(before.chunks, after.chunks)),
    }


def removed_then_failover(client: ServerClient, name: str) -> dict[str, Any]:
    """Registers on slot 2 and pushes step 0, says so on stdout, then (the test freezes this process
    until its primary removed it and a standby took over) pushes step 1 to the new primary with the
    removed incarnation."""
    signature = ModelSignature.of_module(plugins.load_model(plugins.BUILTIN_MODEL))
    reg = client.register(2, name, signature.to_wire())
    layout = FlatLayout(signature, reg.chunk_bytes)
    zeros = [torch.zeros(n) for n in layout.chunk_numels]
    first = _attempt(lambda: result(client.push(2, reg.incarnation, 0, reg.version, zeros, 1.0)))
    print(json.dumps({"registered": reg.incarnation, "epoch": client.view.epoch}), flush=True)
    successor = ServerClient(20.0, wait_s=120.0, newer_than=client.view.epoch)
    after = _attempt(lambda: result(successor.push(2, reg.incarnation, 1, reg.version, zeros, 1.0)))
    return {"first_push": first, "after_failover": after, "epoch": successor.view.epoch}


SCENARIOS = {"bad_pushes": bad_pushes, "removed_then_failover": removed_then_failover}


def main() -> int:
    address = Address.parse(sys.argv[1])
    scenario = SCENARIOS[sys.argv[2]]
    rpc_policy.protect()
    name = transport.join(address, "worker0", transport.TransportOptions(rpc_timeout_s=20, connect_timeout_s=30))
    try:
        # The harness starts this once the server's metrics answer, which comes before it claims its
        # shard: wait for the view as a worker does (a run once found none yet and exited 1).
        print(json.dumps(scenario(ServerClient(20.0, wait_s=60.0), name)), flush=True)
    finally:
        transport.leave(name, transport.store_host())
        transport.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
