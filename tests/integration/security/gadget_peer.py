"""A hostile peer for tests/integration/security/test_hostile_gadgets.py: joins a running job's RPC group,
speaking rpcps's wire format but without its protection, and sends pickle gadgets that change
objects instead of naming forbidden ones (issue 24's first attack). Prints one JSON line of what
each attempt got back.

    .venv/bin/python tests/integration/security/gadget_peer.py HOST:PORT SERVER_RPC_NAME WORKER_RPC_NAME
"""

from __future__ import annotations

import json
import pickle
import sys
from typing import Any, ClassVar

from torch.distributed import rpc
from torch.distributed.rpc import internal

from rpcps import endpoints, replica_endpoints
from rpcps.address import Address
from tests.integration.security.stranger import join_as_stranger

TIMEOUT_S = 15


class Raw:
    """Pickled as exactly these bytes: one crafted object inside an otherwise ordinary call."""

    def __init__(self, data: bytes) -> None:
        self.data = data


class RawPickler(pickle._Pickler):  # type: ignore[name-defined]  # the Python pickler lets a type write raw opcodes
    dispatch: ClassVar[dict[type, Any]] = {**pickle._Pickler.dispatch, Raw: lambda self, obj: self.write(obj.data)}  # type: ignore[attr-defined]


def _unicode(text: str) -> bytes:
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def _global(module: str, name: str) -> bytes:
    return _unicode(module) + _unicode(name) + pickle.STACK_GLOBAL


def _slot_state(name: str, value: bytes) -> bytes:
    return pickle.NONE + pickle.EMPTY_DICT + _unicode(name) + value + pickle.SETITEM + pickle.TUPLE2


GADGETS = {
    # Every later tensor this process receives would come from the attacker's function.
    "rebind the tensor receiver": _global("torch.distributed.rpc.internal", "_InternalRPCPickler")
    + _slot_state("_tensor_receiver", _global("rpcps.endpoints", "shard_count")) + pickle.BUILD,
    # Every later "applied" reply would carry another value: the worker exits on an invalid status.
    "rewrite an enum member": _global("rpcps.messages", "PushStatus") + _unicode("applied") + pickle.TUPLE1
    + pickle.REDUCE + pickle.EMPTY_DICT + _unicode("_value_") + _unicode("hijacked") + pickle.SETITEM + pickle.BUILD,
    # torch would run the attacker's function for every call.
    "rebind PythonUDF.func": _global("torch.distributed.rpc.internal", "PythonUDF")
    + _slot_state("func", _global("rpcps.endpoints", "leave")) + pickle.BUILD,
    # An endpoint run while the payload loads, its result then changed by the rest of the payload.
    "call an endpoint while loading": _global("rpcps.endpoints", "server_ref") + pickle.EMPTY_TUPLE + pickle.REDUCE,
}


def attempt(to: str, func: Any, *args: Any) -> dict[str, str]:
    try:
        value = rpc.rpc_sync(to, func, args=args, timeout=TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - what kind of failure it was is the result
        return {"outcome": "raised", "error": str(e).splitlines()[0][:300]}
    return {"outcome": "returned", "value": repr(value)[:300]}


def main() -> int:
    address, server, worker = Address.parse(sys.argv[1]), sys.argv[2], sys.argv[3]
    join_as_stranger(address, "gadgets")
    internal._pickler = RawPickler
    results = {
        "server": {name: attempt(server, endpoints.shard_count, Raw(data)) for name, data in GADGETS.items()},
        "worker": {name: attempt(worker, replica_endpoints.view_changed, Raw(data), 0) for name, data in GADGETS.items()},
    }
    internal._pickler = pickle.Pickler
    # After all that, the server still answers an ordinary call the ordinary way.
    results["after"] = attempt(server, endpoints.shard_count, rpc.rpc_sync(server, endpoints.server_ref, timeout=TIMEOUT_S))
    print(json.dumps(results), flush=True)
    rpc.shutdown(graceful=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

