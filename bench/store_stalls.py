"""How often the group's TCPStore stops answering every client, side by side: the store behind torch's
own listener and behind rpcps's (``rpcps.transport.store_client.host_store``), one run (not a test).

    python -m bench.store_stalls [--connects 200]

For each side, a child process hosts the store and another child polls it (``get`` every 50 ms on
one open connection, as a member's registry does); this process opens ``--connects`` fresh clients
in a row. Printed per side: fresh connects that took over 1 s, the poller's calls that took over
1 s and its slowest. torch's listener makes the store's one thread ask DNS for every connecting
peer's name (docs/FAULT_TOLERANCE.md, "Stalls of the store"): where the resolver drops a query, the
store stops for its 5 s timeout. A resolver that never drops one shows no stall on either side.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time

import torch.distributed as dist

from bench.common import print_table
from rpcps.ports import free_port

_HOST = """
import datetime, sys, time
import torch.distributed as dist
from rpcps.transport.store_client import host_store
port, ours = int(sys.argv[1]), sys.argv[2] == "rpcps"
timeout = datetime.timedelta(seconds=60)
store = host_store("127.0.0.1", port, timeout) if ours else dist.TCPStore(
    "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timeout)
store.set("ready", "1")
time.sleep(3600)
"""

_POLLER = """
import datetime, sys, time
import torch.distributed as dist
client = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=60))
print("polling", flush=True)
while True:
    started = time.monotonic()
    client.get("ready")
    print(f"{time.monotonic() - started:.3f}", flush=True)
    time.sleep(0.05)
"""


def _side(listener: str, connects: int) -> list[str]:
    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", _HOST, str(port), listener])
    poller = None
    try:
        first = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        first.wait(["ready"])
        poller = subprocess.Popen([sys.executable, "-c", _POLLER, str(port)], stdout=subprocess.PIPE, text=True)
        assert poller.stdout is not None
        poller.stdout.readline()  # "polling": its connection is open
        slow = []
        for _ in range(connects):
            started = time.monotonic()
            dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
            took = time.monotonic() - started
            if took > 1.0:
                slow.append(took)
            time.sleep(0.02)
        poller.kill()
        calls = [float(line) for line in poller.stdout.read().split()]
    finally:
        for proc in (poller, host):
            if proc is not None:
                proc.kill()
                proc.wait()
    stalled = [c for c in calls if c > 1.0]
    return [listener, str(connects), f"{len(slow)}" + (f" ({', '.join(f'{s:.2f}' for s in slow)} s)" if slow else ""),
            f"{len(stalled)} of {len(calls)}", f"{max(calls):.3f} s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connects", type=int, default=200, help="fresh clients opened per side")
    args = parser.parse_args()
    rows = [_side(listener, args.connects) for listener in ("torch", "rpcps")]
    print_table(["store's listener", "fresh connects", "connects over 1 s", "poller calls over 1 s", "poller's slowest"], rows)


if __name__ == "__main__":
    main()
