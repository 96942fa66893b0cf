"""Server capacity with zero-compute workers: rpcps, the RPC example's design and a raw TensorPipe call, side by side.

The regime a parameter server exists for: many fast workers (a GPU each) and the server the
bottleneck. Here the workers compute nothing: each client process sends the same precomputed
gradient again and again and takes the parameters back, as a worker does every step, so what is
measured is how many updates per second the server side can take. For each model, shard count and
number of clients, in one run (``--repeats`` times, interleaved, best kept):

* **ours**: real ``trainer_entry.py ps`` processes (``--shards`` of them) on their defaults, only the
  optimizer matched to the example's (SGD), and clients that register like workers and push through
  ``worker.client.ServerClient`` the way a worker does by default: one push per shard, 2 in flight,
  each reply bringing the parameters (``have_version``). Every push is received, validated, checked
  for NaN/Inf and applied, and its reply carries a snapshot of the parameters.
* **example**: bench/example_design.py ``--zero-compute``: the example's locked SGD server, each
  client blocking in ``rpc_sync`` with its gradients and getting every parameter back (no shards:
  the design has one server).
* **raw**: bare torch RPC processes (one per shard) on rpcps's default transport options whose
  function returns the tensors it received: the same bytes in and out as ours, with nothing done
  on arrival, 2 in flight per client.

Every side is measured the same way (bench.common.steady_rate): updates per second between the
moments 15 % and 85 % of its calls had completed, from the time of every completed call (ours, raw)
or every applied update (example). Not a test: it asserts nothing. Run it from the repository root
(and on a shared machine, under the CPU lock):

    python -m bench.push_throughput                              # mlp_5m and mlp_25m, 1-8 clients, 1 and 2 shards
    python -m bench.push_throughput --models mlp_5m --workers 1,2 --shards 1
"""

from __future__ import annotations

import argparse
import json
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO, child_env, emit_json, print_table, steady_rate
from rpcps.endpoints import server_name

_START_TIMEOUT_S = 180.0
SIDES = ("ours", "example", "raw")
CALLS = {"mlp_5m": 400, "mlp_25m": 100}
"""Updates per measurement (split over the clients): several seconds of steady state on 2 cores."""


@dataclass(frozen=True)
class Setup:
    model: str
    """A model factory in rpcps.tasks (mlp_5m or mlp_25m)."""
    shards: int
    clients: int
    calls: int
    """Calls per client."""
    in_flight: int


# ---- the driver ------------------------------------------------------------------------------


def run_driver(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for model in args.models.split(","):
        for shards in (int(s) for s in args.shards.split(",")):
            for clients in (int(n) for n in args.workers.split(",")):
                total = args.calls or CALLS.get(model, 200)
                setup = Setup(model, shards, clients, max(10, total // clients), args.in_flight)
                sides = [s for s in args.sides.split(",") if not (s == "example" and shards > 1)]
                runs: dict[str, list[float]] = {s: [] for s in sides}
                for _ in range(args.repeats):  # interleaved, so a noisy neighbour hurts every side alike
                    for side in sides:
                        runs[side].append(measure(side, setup))
                best = {side: max(r) for side, r in runs.items()}
                rows.append({"setup": asdict(setup), "best": best, "all_runs": runs})
                print(f"{model} shards={shards} clients={clients}: " + ", ".join(f"{s} {v:.1f}/s" for s, v in best.items()), flush=True)
    print(f"\ntotal {time.monotonic() - started:.0f}s")
    print_rows(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def print_rows(rows: list[dict[str, Any]]) -> None:
    from rpcps import plugins

    # The example design has no shards: its one-shard figure stands beside every shard count.
    example_at = {(r["setup"]["model"], r["setup"]["clients"]): r["best"]["example"] for r in rows if "example" in r["best"]}
    table = []
    for r in rows:
        s, best = r["setup"], r["best"]
        mb = sum(p.numel() for p in plugins.load_model(f"rpcps.tasks:{s['model']}").parameters()) * 4 / 1e6
        ours, raw, example = best.get("ours"), best.get("raw"), example_at.get((s["model"], s["clients"]))
        table.append([
            s["model"], str(s["shards"]), str(s["clients"]), _fmt(ours), _fmt(example), _fmt(raw),
            _ratio(ours, example, "x"), _ratio(ours, raw, ""), _fmt(ours * mb / 1e3 if ours else None, 2),
        ])
    print_table(["model", "shards", "clients", "ours upd/s", "example upd/s", "raw calls/s", "ours / example (1 shard)", "ours / raw",
                 "ours GB/s of gradient"], table)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None, unit: str) -> str:
    return "-" if not a or not b else f"{a / b:.2f}{unit}"


def measure(side: str, setup: Setup) -> float:
    """Steady updates/s of one side."""
    from rpcps.ports import free_port

    port = free_port()
    if side == "example":
        return _example(setup, port)
    with tempfile.TemporaryDirectory(prefix="rpcps-bench-push-") as tmp:
        go = Path(tmp) / "go"
        servers = [_start(_server_argv(side, setup, port, k), Path(tmp) / f"server{k}.log") for k in range(setup.shards)]
        clients = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.push_throughput", "client", "--kind", side, "--port", str(port), "--slot", str(i),
                 "--model", setup.model, "--calls", str(setup.calls), "--in-flight", str(setup.in_flight), "--go-file", str(go),
                 "--shards", str(setup.shards)],
                cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
            for i in range(setup.clients)
        ]
        try:
            for c in clients:
                line = _read_line(c, _START_TIMEOUT_S)
                if line != "ready":
                    raise RuntimeError(f"{side} client did not get ready: {line!r}\n{_drain(c)}\n{_tails(tmp)}")
            go.touch()  # every client starts now
            times: list[float] = []
            for c in clients:
                line = _read_line(c, 600)
                try:
                    times += json.loads(line)["times"]
                except ValueError:
                    raise RuntimeError(f"{side} client failed: {line!r}\n{_drain(c)}\n{_tails(tmp)}") from None
        finally:
            for p in [*clients, *reversed(servers)]:
                _stop(p)
    return steady_rate([(t, i + 1) for i, t in enumerate(sorted(times))])


def _server_argv(side: str, setup: Setup, port: int, shard: int) -> list[str]:
    if side == "raw":
        return [sys.executable, "-m", "bench.push_throughput", "raw-server", "--port", str(port), "--shard", str(shard)]
    # Shard 0 hosts the group's store at its --listen; the others join it there.
    joins = ["--store", f"127.0.0.1:{port}"] if shard else []
    return [
        sys.executable, str(REPO / "trainer_entry.py"), "ps", "--listen", f"127.0.0.1:{port}", *joins,
        "--shards", str(setup.shards), "--shard-index", str(shard), "--model", f"rpcps.tasks:{setup.model}",
        "--optimizer", "sgd", "--lr", "1e-9", "--metrics-port", "0", "--metrics-addr", "127.0.0.1", "--control-port", "0",
        "--control-addr", "127.0.0.1", "--log-level", "WARNING", "--progress-s", "3600",
    ]


TASKS = {"teacher_student_model": ("teacher_student_data", "cross_entropy")}
"""Data factory and loss of the example's one gradient, for models of rpcps.tasks other than the MLPs
(``<model>_data`` with MSE)."""


def _example(setup: Setup, port: int) -> float:
    data, loss = TASKS.get(setup.model, (f"{setup.model}_data", "mse"))
    argv = [sys.executable, "-m", "bench.example_design", "--world", str(setup.clients + 1), "--port", str(port),
            "--model", f"rpcps.tasks:{setup.model}", "--data", f"rpcps.tasks:{data}", "--loss", loss, "--steps", str(setup.calls),
            "--zero-compute"]
    with tempfile.TemporaryDirectory(prefix="rpcps-example-") as logs:
        procs = [_start([*argv, "--rank", str(r)], Path(logs) / f"rank{r}.log") for r in range(setup.clients + 1)]
        try:
            # Poll every rank: a client that dies leaves the server waiting for its updates forever.
            deadline = time.monotonic() + 900
            while procs[0].poll() is None:
                if any(p.poll() not in (None, 0) for p in procs[1:]) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                _stop(p)
        outputs = [(Path(logs) / f"rank{r}.log").read_text(errors="replace") for r in range(len(procs))]
    results = [line for line in outputs[0].splitlines() if line.startswith('{"update_times"')]
    if procs[0].returncode != 0 or not results:
        codes = ", ".join(f"rank {r}: {p.returncode}" for r, p in enumerate(procs))
        raise RuntimeError(f"example design failed ({codes}):\n" + "\n".join(o[-1500:] for o in outputs))
    times = json.loads(results[-1])["update_times"]
    return steady_rate([(t, i + 1) for i, t in enumerate(times)])


def _start(argv: list[str], log_path: Path) -> subprocess.Popen:
    # Every side's processes stay in this session, as `rpcps local`'s children do. Under the
    # kernel's autogroup scheduling a session is a scheduling group: with each process in a session
    # of its own, the example design's server (TensorPipe's default busy-polling transports) made
    # 32-35 updates/s instead of 73-77 (5M, 2 clients), rpcps 87-93 instead of 94-95. One rule
    # for all sides, the one every side is fastest under.
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        return f"<no output within {timeout:.0f}s>"
    return proc.stdout.readline().decode().strip()


def _drain(proc: subprocess.Popen) -> str:
    _stop(proc)
    assert proc.stderr is not None
    return proc.stderr.read().decode(errors="replace")[-3000:]


def _tails(tmp: str) -> str:
    return "\n".join(f"{p.name}: {p.read_text(errors='replace')[-1500:]}" for p in sorted(Path(tmp).glob("*.log")))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the processes it starts -----------------------------------------------------------------


def echo(chunks: list[Any]) -> list[Any]:
    """The raw server's whole job: answer with the tensors it received (the same bytes back, no copy)."""
    return chunks


def run_raw_server(args: argparse.Namespace) -> int:
    from rpcps import rpc_policy, transport

    rpc_policy.protect(extra_calls=(echo,))  # the same protection as a real server, plus the raw receiver
    stop_signal: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _: stop_signal.append(s))
    if args.shard == 0:
        transport.serve(_address(args), server_name(0), _transport_options())
    else:
        transport.join(_address(args), server_name(args.shard), _transport_options())  # as ps<K>_r<rank>
    while not stop_signal:
        time.sleep(0.1)
    transport.shutdown()
    return 0


def run_client(args: argparse.Namespace) -> int:
    import torch

    from rpcps import plugins, rpc_policy, transport
    from rpcps.partition import partition
    from rpcps.signature import DEFAULT_CHUNK_BYTES, FlatLayout, ModelSignature
    from worker.client import ServerClient, result

    signature = ModelSignature.of_module(plugins.load_model(f"rpcps.tasks:{args.model}"))
    rpc_policy.protect()
    name = transport.join(_address(args), f"worker{args.slot}", _transport_options())
    g = torch.Generator().manual_seed(args.slot)
    try:
        if args.kind == "ours":
            shards = [ServerClient(60.0, shard=0, wait_s=_START_TIMEOUT_S)]
            shards += [ServerClient(60.0, shard=k, wait_s=_START_TIMEOUT_S) for k in range(1, shards[0].shard_count())]
            regs = [c.register(args.slot, name, signature.to_wire()) for c in shards]
            owned = partition(signature, len(shards))
            layouts = [FlatLayout(ModelSignature(tuple(signature.params[i] for i in idx)), r.chunk_bytes) for idx, r in zip(owned, regs)]
            chunks = [[torch.randn(n, generator=g) * 1e-3 for n in lay.chunk_numels] for lay in layouts]
            versions = [-1] * len(shards)

            def send(seq: int) -> list[Any]:
                return [c.push(args.slot, r.incarnation, seq, v, ch, None, v) for c, r, v, ch in zip(shards, regs, versions, chunks)]

            def check(pending: list[Any]) -> None:
                for k, p in enumerate(pending):
                    reply = result(p)
                    if reply.status != "applied":
                        raise RuntimeError(f"push not applied: {reply.status}")
                    versions[k] = reply.pulled.version
        else:
            raw_names = _wait_for_raw_shards(transport, args.shards)
            owned = partition(signature, args.shards)
            layouts = [FlatLayout(ModelSignature(tuple(signature.params[i] for i in idx)), DEFAULT_CHUNK_BYTES) for idx in owned]
            chunks = [[torch.randn(n, generator=g) * 1e-3 for n in lay.chunk_numels] for lay in layouts]

            def send(seq: int) -> list[Any]:
                del seq
                return [transport.call_async(raw_names[k], echo, (ch,), 60) for k, ch in enumerate(chunks)]

            def check(pending: list[Any]) -> None:
                for p in pending:
                    p.wait()

        for seq in range(3):  # warm up every connection
            check(send(seq))
        print("ready", flush=True)
        go = Path(args.go_file)
        while not go.exists():
            time.sleep(0.005)
        window: list[list[Any]] = []
        times: list[float] = []
        for seq in range(3, 3 + args.calls):
            window.append(send(seq))
            if len(window) >= args.in_flight:
                check(window.pop(0))
                times.append(time.perf_counter())
        for pending in window:
            check(pending)
            times.append(time.perf_counter())
        emit_json({"times": times})
    finally:
        if args.kind == "ours":
            transport.leave(name, transport.store_host())
        transport.shutdown()
    return 0


def _wait_for_raw_shards(transport: Any, shards: int) -> list[str]:
    """Waits until every raw server (ps0, then ps1_r<rank>, ...: every joiner gets a fresh name)
    answers; returns their RPC names by shard."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    names = []
    for k in range(shards):
        while True:
            try:
                base = server_name(k)
                name = next((n for n in transport.membership.member_names() if n == base or n.startswith(f"{base}_r")), base)
                transport.ping(name, 10).wait()
                names.append(name)
                break
            except transport.PeerUnknown:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    return names


def _address(args: argparse.Namespace) -> Any:
    from rpcps.address import Address

    return Address("127.0.0.1", args.port)


def _transport_options() -> Any:
    """rpcps's defaults (what a user who changes nothing runs), with the start-up wait of a loaded machine."""
    from rpcps.transport import TransportOptions

    return TransportOptions(rpc_timeout_s=60.0, connect_timeout_s=_START_TIMEOUT_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.push_throughput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp_5m,mlp_25m", help="rpcps.tasks model factories, comma-separated")
    parser.add_argument("--workers", default="1,2,4,8", help="numbers of client processes, comma-separated")
    parser.add_argument("--shards", default="1,2", help="server shard counts, comma-separated")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"which of {', '.join(SIDES)} to measure")
    parser.add_argument("--calls", type=int, help=f"updates per measurement over all clients (default per model: {CALLS})")
    parser.add_argument("--in-flight", type=int, default=2, help="calls each ours/raw client keeps on the wire (a worker's --max-in-flight)")
    parser.add_argument("--repeats", type=int, default=1, help="measurements of each side; the best is reported")
    parser.add_argument("--json", help="also write the results to this file")
    sub = parser.add_subparsers(dest="role", title="processes the driver starts (not for direct use)")
    for role, what in (("client", "one pushing client"), ("raw-server", "a bare torch RPC receiver")):
        p = sub.add_parser(role, help=what)
        p.add_argument("--port", type=int, required=True)
        if role == "client":
            p.add_argument("--kind", choices=["ours", "raw"], required=True)
            p.add_argument("--slot", type=int, default=0)
            p.add_argument("--model", required=True)
            p.add_argument("--calls", type=int, required=True)
            p.add_argument("--in-flight", type=int, required=True)
            p.add_argument("--go-file", required=True)
            p.add_argument("--shards", type=int, default=1, help="raw servers to call (ours asks the server)")
        else:
            p.add_argument("--shard", type=int, default=0)
    args = parser.parse_args(argv)
    if args.role == "client":
        return run_client(args)
    if args.role == "raw-server":
        return run_raw_server(args)
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
