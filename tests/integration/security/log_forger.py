"""A peer that tries to forge lines in a server's log, for tests/integration/security/test_hostile_logs.py.

    .venv/bin/python tests/integration/security/log_forger.py HOST:PORT SECRET_FILE

Joins the server's RPC group with plain torch (as ``stranger.py`` does) and sends names, slots and
epochs with a newline and a fake log line in them wherever the server logs what a peer sends:
refused registrations, a refused request to drop a member, a refused attach, a stray log append,
and (holding the job secret, as a worker with a bug could) a registration that is accepted under a
name that is no member of the group, which the server's reaper then finds unknown. Prints what each
call returned as one JSON line on stdout.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from torch.distributed import rpc

from rpcps import endpoints, plugins, replica_endpoints
from rpcps.address import Address
from rpcps.jobsecret import JobSecret
from rpcps.messages import RegistrationProof
from rpcps.signature import ModelSignature
from rpcps.transport import membership
from tests.integration.security.stranger import join_as_stranger

TIMEOUT_S = 15
SERVER = f"{endpoints.server_name(0)}_r0"
FORGED = "x\nERROR ps: forged"
"""Every forged value starts so; a word after it says where it was sent."""


def attempt(run: Callable[[], Any]) -> str:
    try:
        return repr(run())[:300]
    except Exception as e:  # noqa: BLE001 - what kind of failure it was is the result
        return f"raised {type(e).__name__}: {str(e).splitlines()[0][:300]}"


def main() -> int:
    address, secret = Address.parse(sys.argv[1]), JobSecret.from_file(sys.argv[2])
    join_as_stranger(address, "forger")

    def on_server(fn: Any, *args: Any) -> Callable[[], Any]:
        return lambda: rpc.rpc_sync(SERVER, fn, args=args, timeout=TIMEOUT_S)

    ref = rpc.rpc_sync(SERVER, endpoints.server_ref, timeout=TIMEOUT_S)
    signature = ModelSignature.of_module(plugins.load_model(plugins.BUILTIN_MODEL)).to_wire()
    made_up = RegistrationProof("00" * 16, "00")

    def register_as_a_ghost() -> Any:
        challenge = rpc.rpc_sync(SERVER, endpoints.challenge, args=(ref,), timeout=TIMEOUT_S)
        name = f"{FORGED} member"
        proof = RegistrationProof(challenge, secret.registration_proof(challenge, 1, name))
        return rpc.rpc_sync(SERVER, endpoints.register, args=(ref, 1, name, signature, proof), timeout=TIMEOUT_S)

    results = {
        "name": attempt(on_server(endpoints.register, ref, 0, f"{FORGED} name", signature)),
        "slot": attempt(on_server(endpoints.register, ref, f"0{FORGED[1:]} slot", "forger", signature, made_up)),
        "leave": attempt(on_server(membership.forget_me, f"{FORGED} leave", "not a proof")),
        "attach": attempt(on_server(replica_endpoints.replica_attach, f"{FORGED} attach", {}, "", 0.0, "")),
        "append": attempt(on_server(replica_endpoints.replica_append, "0" * 32, f"9{FORGED[1:]} epoch", f"{FORGED} sender", [], 0.0, False)),
        "ghost": attempt(register_as_a_ghost),
    }
    print(json.dumps(results), flush=True)
    rpc.shutdown(graceful=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

