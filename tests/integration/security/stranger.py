"""A hostile peer for tests/integration/security/test_hostile_peers.py: joins a running server's RPC group the
way a worker does, with plain torch speaking rpcps's wire format (``register_wire_reducers``) but
with no rpcps protection of its own, tries what issue 11 showed working, and prints what happened
as one JSON line on stdout.

    .venv/bin/python tests/integration/security/stranger.py HOST:PORT MARKER_DIR SECRET_FILE_TO_READ VICTIM_RPC_NAME

Nothing here waits on a refused ``rpc.remote`` (its caller would hang until its timeout).
"""

from __future__ import annotations

import builtins
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import rpc
from torch.distributed.rpc import _utils

from ps import runner
from ps.api.worker_service import WorkerService
from ps.core.server import ParameterServer
from ps.replication.auth import attach_proof
from rpcps import endpoints, plugins, replica_endpoints
from rpcps.address import Address
from rpcps.jobsecret import JobSecret
from rpcps.messages import RegistrationProof
from rpcps.signature import ModelSignature
from rpcps.transport import membership, pickling

TIMEOUT_S = 15
SERVER = f"{endpoints.server_name(0)}_r0"
"""The victim server's RPC name: shard 0 hosting the group's store joins as rank 0."""


def join_as_stranger(address: Address, prefix: str) -> tuple[str, dist.TCPStore]:
    """Joins the job's RPC group with plain torch as ``<prefix>_r<rank>``: a peer that speaks rpcps's
    wire format (``register_wire_reducers``; without it not even the join is accepted) but has none
    of its protection. Returns its name and its client of the group's store."""
    store = dist.TCPStore(address.host, address.port, is_master=False)
    rank = int(store.add(membership.RANK_COUNTER_KEY, 1))
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{address}", rpc_timeout=TIMEOUT_S, _transports=["uv"], _channels=["basic"])
    pickling.register_wire_reducers()
    name = f"{prefix}_r{rank}"
    rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=options)
    return name, store


def attempt(run: Callable[[], Any]) -> dict[str, str]:
    try:
        value = run()
    except Exception as e:  # noqa: BLE001 - what kind of failure it was is the result
        return {"outcome": "raised", "error": str(e).splitlines()[0][:300]}
    return {"outcome": "returned", "value": repr(value)[:300]}


def main() -> int:
    address, marker_dir, secret_file, victim = Address.parse(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    join_as_stranger(address, "stranger")

    def on_server(fn: Any, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        return lambda: rpc.rpc_sync(SERVER, fn, args=args, kwargs=kwargs, timeout=TIMEOUT_S)

    marker = os.path.join(marker_dir, "ran")
    code = {
        "os.system": on_server(os.system, f"touch {marker}"),
        "eval": on_server(builtins.eval, f"open({marker!r}, 'w')"),
        "exec": on_server(builtins.exec, f"open({marker!r}, 'w')"),
        "subprocess.run": on_server(subprocess.run, ["touch", marker]),
        "Path.read_text": on_server(pathlib.Path.read_text, pathlib.Path(secret_file)),
    }
    methods = {
        "ParameterServer.pause": on_server(ParameterServer.pause, None),
        "ParameterServer.stop": on_server(ParameterServer.stop, None),
        "ParameterServer.finish": on_server(ParameterServer.finish, None),
        "ParameterServer.restore_state": on_server(ParameterServer.restore_state, None, {}),
        "ParameterServer.capture_state": on_server(ParameterServer.capture_state, None),
        "ParameterServer.__setattr__": on_server(ParameterServer.__setattr__, None, "version", -1),
        "WorkerService.register": on_server(WorkerService.register, None, 0, "x", []),
        "WorkerService.mark_dead": on_server(WorkerService.mark_dead, None, 0, ""),
        "endpoints.publish": on_server(endpoints.publish, None),
        "membership.forget_member": on_server(membership.forget_member, victim),
        "runner._snapshot_for_restart": on_server(runner._snapshot_for_restart, None, None, None),
    }
    ref = rpc.rpc_sync(SERVER, endpoints.server_ref, timeout=TIMEOUT_S)
    signature = ModelSignature.of_module(plugins.load_model(plugins.BUILTIN_MODEL)).to_wire()
    wrong = JobSecret("w" * 64)

    def forged(secret: JobSecret) -> Callable[[], Any]:
        def run() -> Any:
            challenge = rpc.rpc_sync(SERVER, endpoints.challenge, args=(ref,), timeout=TIMEOUT_S)
            proof = RegistrationProof(challenge, secret.registration_proof(challenge, 0, "stranger"))
            return rpc.rpc_sync(SERVER, endpoints.register, args=(ref, 0, "stranger", signature, proof), timeout=TIMEOUT_S)

        return run

    registration = {
        "no proof": on_server(endpoints.register, ref, 0, "stranger", signature),
        "wrong secret": forged(wrong),
        "made-up challenge": on_server(
            endpoints.register, ref, 0, "stranger", signature, RegistrationProof("00" * 16, wrong.registration_proof("00" * 16, 0, "stranger"))
        ),
    }
    group = {
        "evict a member": on_server(_utils._update_group_membership, rpc.WorkerInfo(victim, 1), [], {}, False),
        "add a ghost": on_server(_utils._update_group_membership, rpc.WorkerInfo("ghost", 30000), [], {}, True),
        "drop a worker": on_server(membership.forget_me, victim, "not a proof"),
        "torch.from_file": on_server(torch.from_file, secret_file, False, 8, dtype=torch.uint8),
    }
    results = {
        section: {name: attempt(run) for name, run in attempts.items()}
        for section, attempts in (("code", code), ("methods", methods), ("registration", registration), ("group", group))
    }
    guessed = "0" * 32
    replication = {  # attach as the server's standby to copy its state; use or feed an attachment
        "attach without proof": on_server(replica_endpoints.replica_attach, "stranger", {}, "", 0.0, ""),
        "attach with a wrong secret": on_server(replica_endpoints.replica_attach, "stranger", {}, *attach_proof(wrong, "stranger", SERVER)),
        "snapshot piece": on_server(replica_endpoints.replica_snapshot, guessed, 0),
        "ready": on_server(replica_endpoints.replica_ready, guessed),
        "watch": on_server(replica_endpoints.replica_watch, guessed),
        "append": on_server(replica_endpoints.replica_append, guessed, 99, "stranger", [], 0.0, False),
    }
    results["replication"] = {name: attempt(run) for name, run in replication.items()}

    def observe_forged() -> Any:
        challenge = rpc.rpc_sync(SERVER, endpoints.challenge, args=(ref,), timeout=TIMEOUT_S)
        return rpc.rpc_sync(SERVER, endpoints.observe, args=(ref, -1, RegistrationProof(challenge, wrong.observe_proof(challenge))),
                            timeout=TIMEOUT_S)

    # Read the model's parameters, as the sidecar evaluator does.
    results["observe"] = {"no proof": attempt(on_server(endpoints.observe, ref, -1)), "wrong secret": attempt(observe_forged)}
    results["allowed"] = {"shard_count": attempt(on_server(endpoints.shard_count, ref))}
    # 32 MB of gradients to a server started with --max-message-mb 16: refused before it runs.
    results["size"] = attempt(on_server(endpoints.submit, ref, 0, "x", 0, 0, [torch.zeros(8 << 20)], None))
    print(json.dumps(results), flush=True)
    rpc.shutdown(graceful=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
