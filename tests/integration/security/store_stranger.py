"""A stranger on the group's store for tests/integration/security/test_hostile_store.py (issue 24): joins a
running server's RPC group with plain torch (no rpcps protection, no job secret), serves a fake
worker API that records every call, writes a view naming itself as shard 0's primary into the store
(signed with a wrong key: the attacker cannot know the job's) and tells the workers about it with
``view_changed``, over and over, as the measured attack did. It says it joined (a JSON line on
stdout), attacks once GO_FILE exists, says so, keeps serving its fake API until STOP_FILE exists
(both polled, with a deadline), and prints the calls its fake API received.

    .venv/bin/python tests/integration/security/store_stranger.py HOST:PORT GO_FILE STOP_FILE ROUNDS WORKER_RPC_NAME...
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from torch.distributed import rpc

from rpcps import endpoints, replica_endpoints
from rpcps.address import Address
from rpcps.jobsecret import JobSecret
from rpcps.messages import View
from rpcps.transport.registry import encode_view
from tests.integration.security.stranger import join_as_stranger

TIMEOUT_S = 15
DEADLINE_S = 240
FORGED_EPOCH = 99


class Trap:
    """A fake worker API: every method records its name (a ``submit`` is a gradient received)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def record(*args: Any, **kwargs: Any) -> None:
            del args, kwargs
            with self.lock:
                self.calls[name] = self.calls.get(name, 0) + 1

        return record


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> int:
    address, go_file, stop_file, rounds, workers = Address.parse(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]
    name, store = join_as_stranger(address, "stranger")
    trap = Trap()
    endpoints.publish(trap)  # type: ignore[arg-type]
    print(json.dumps({"event": "joined", "name": name}), flush=True)
    _wait_for(go_file)
    forged = View(FORGED_EPOCH, name)
    text = encode_view(forged, JobSecret("w" * 64), 0, name)
    hints = 0
    errors: dict[str, str] = {}
    for _ in range(rounds):
        store.set("rpcps/view/0", text)
        for worker in workers:
            try:
                rpc.rpc_sync(worker, replica_endpoints.view_changed, args=(0, forged), timeout=TIMEOUT_S)
                hints += 1
            except RuntimeError as e:  # a worker that finished or restarted meanwhile
                errors.setdefault(worker, str(e).splitlines()[0][:200])
    print(json.dumps({"event": "attacked", "name": name, "hints": hints, "errors": errors}), flush=True)
    _wait_for(stop_file)
    with trap.lock:
        calls = dict(trap.calls)
    print(json.dumps({"event": "done", "calls": calls}), flush=True)
    rpc.shutdown(graceful=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
