"""A hostile peer for tests/integration/security/test_hostile_builtin_ops.py: joins a running server's RPC group
with plain torch and sends it every kind of request rpcps never sends, then prints what happened as one
JSON line on stdout.

    .venv/bin/python tests/integration/security/builtin_op_stranger.py HOST:PORT JOB_SECRET_FILE TARGET_DIR

Each attempt that would touch the disk aims at the server's job secret (overwritten, the server could
never start again) or at a new file in TARGET_DIR.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
from torch.distributed import rpc

from rpcps import endpoints
from rpcps.address import Address
from tests.integration.security import script_call_sender
from tests.integration.security.stranger import SERVER, TIMEOUT_S, attempt, join_as_stranger

UNDEFINED_TYPE = 0x1FF
"""A request type value torch does not define (the request bit 0x100 set)."""
RREF_USER_DELETE = 0x10B


def answered(error: str) -> str:
    """The native sender's answer as a Python call's: its error raised, or "ran"."""
    if error:
        raise RuntimeError(error)
    return "ran"


def main() -> int:
    address, secret_file, target_dir = Address.parse(sys.argv[1]), sys.argv[2], sys.argv[3]
    sender = script_call_sender.load()  # built by the test before the server started
    join_as_stranger(address, "builtin_stranger")
    ref = rpc.rpc_sync(SERVER, endpoints.server_ref, timeout=TIMEOUT_S)

    def autograd_wrapped() -> Any:
        with dist_autograd.context():  # a tensor that requires grad: torch wraps the call in FORWARD_AUTOGRAD_REQ
            return rpc.rpc_sync(SERVER, endpoints.shard_count, args=(ref, torch.ones(1, requires_grad=True)), timeout=TIMEOUT_S)

    def remote_builtin() -> Any:
        # Two requests: the SCRIPT_REMOTE_CALL, then to_here()'s SCRIPT_RREF_FETCH_CALL. to_here() raises
        # the fetch's refusal, or the creation's when that came back first (the two race; CI saw both).
        return rpc.remote(SERVER, torch.add, args=(torch.ones(1), 1), timeout=TIMEOUT_S).to_here(timeout=TIMEOUT_S)

    attempts: dict[str, Callable[[], Any]] = {
        # SCRIPT_CALL of a TorchScript operator outside the dispatcher: the job secret overwritten.
        "aten::save over the job secret": lambda: answered(sender.send_builtin(SERVER, "aten::save", ["attacker bytes", secret_file], TIMEOUT_S)),
        "aten::save to a new file": lambda: answered(
            sender.send_builtin(SERVER, "aten::save", ["attacker bytes", os.path.join(target_dir, "saved")], TIMEOUT_S)
        ),
        # SCRIPT_CALL through torch's own Python API: creates (shared=True) a file of 4096 bytes.
        "torch.from_file": lambda: rpc.rpc_sync(
            SERVER, torch.from_file, args=(os.path.join(target_dir, "created"), True, 4096), kwargs={"dtype": torch.uint8}, timeout=TIMEOUT_S
        ),
        "rpc.remote of a builtin": remote_builtin,  # SCRIPT_REMOTE_CALL and SCRIPT_RREF_FETCH_CALL
        "autograd-wrapped worker API call": autograd_wrapped,  # FORWARD_AUTOGRAD_REQ around an allowed PYTHON_CALL
        "undefined type": lambda: answered(sender.send_type(SERVER, UNDEFINED_TYPE, "junk", TIMEOUT_S)),
        "RREF_USER_DELETE": lambda: answered(sender.send_type(SERVER, RREF_USER_DELETE, "junk", TIMEOUT_S)),
    }
    results = {name: attempt(run) for name, run in attempts.items()}
    results["allowed"] = attempt(lambda: rpc.rpc_sync(SERVER, endpoints.shard_count, args=(ref,), timeout=TIMEOUT_S))
    print(json.dumps(results), flush=True)
    rpc.shutdown(graceful=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
