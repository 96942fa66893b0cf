"""Push throughput of the parameter server, side by side with a raw TensorPipe call of the same payload.

For each model and number of pushing processes, two measurements are made in the same run:

* **ours**: a real ``trainer_entry.py ps`` (SGD, so the optimizer step is cheap) and N client
  processes that register like workers and push the same precomputed gradient chunks over and over
  through ``worker.client.ServerClient`` (no forward/backward, no pulls), ``--in-flight`` at a time.
  Every push is received, validated, checked for NaN/Inf and applied by the server.
* **raw**: a bare torch RPC process with the same transport options and N clients that send the same
  chunks with ``rpc_async`` to a function that returns their count: the same bytes on the wire and the
  same tiny reply as a push, with nothing done on arrival.
* **raw-read**: the same, but the function reads every element once (a sum per chunk) before it
  answers: the least any real receiver does. Over uv/basic on the 2-core machine this was written on
  it was often *faster* than ``raw`` (docs/BENCHMARKS.md), so both baselines are reported.

The ratio ours/raw is the share of the transport's speed the server keeps. Each side is measured
``--repeats`` times, interleaved, and the best run is reported (the machine this was written on is
shared and noisy). Not a test: it asserts
nothing. Run it from the repository root (and on a shared machine, under the heavy-work lock):

    python -m bench.push_throughput                      # mlp_5m and mlp_25m, 1 and 2 clients, uv/basic
    python -m bench.push_throughput --transports uv/basic,shm/basic,uv/cma --models mlp_5m
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpcps.endpoints import server_name

REPO = Path(__file__).resolve().parents[1]
_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Setup:
    model: str
    """A model factory in rpcps.tasks (mlp_5m or mlp_25m)."""
    clients: int
    transport: str
    channel: str
    seconds: float
    in_flight: int
    warmup: int


# ---- the driver ------------------------------------------------------------------------------


def run_driver(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for pair in args.transports.split(","):
        transport, _, channel = pair.partition("/")
        for model in args.models.split(","):
            for clients in (int(n) for n in args.workers.split(",")):
                setup = Setup(model, clients, transport, channel or "basic", args.seconds, args.in_flight, args.warmup)
                runs: dict[str, list[dict[str, Any]]] = {"raw": [], "raw-read": [], "ours": []}
                for _ in range(args.repeats):  # interleaved, so a noisy neighbour hurts both sides alike
                    for kind, measured in runs.items():
                        measured.append(_measure(kind, setup))
                best = {kind: max(r, key=lambda m: m["calls_per_s"]) for kind, r in runs.items()}
                rows.append({"setup": setup.__dict__, **best, "all_runs": runs})
                _print_row(rows[-1])
    print(f"\ntotal {time.monotonic() - started:.0f}s")
    _print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _measure(kind: str, setup: Setup) -> dict[str, Any]:
    from rpcps.ports import free_port
    from rpcps.scrape import try_scrape as scrape

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    port, metrics_port = free_port(), free_port()
    transport_flags = ["--rpc-transports", setup.transport, "--rpc-channels", setup.channel]
    if kind == "ours":
        server_argv = [
            sys.executable, str(REPO / "trainer_entry.py"), "ps", "--listen", f"127.0.0.1:{port}",
            "--model", f"rpcps.tasks:{setup.model}", "--optimizer", "sgd", "--lr", "1e-9",
            "--metrics-port", str(metrics_port), "--metrics-addr", "127.0.0.1", "--log-level", "WARNING",
            "--progress-s", "3600", *transport_flags,
        ]
    else:
        server_argv = [sys.executable, "-m", "bench.push_throughput", "raw-server", "--port", str(port), *transport_flags]
    with tempfile.TemporaryDirectory(prefix="rpcps-bench-") as tmp:
        go = Path(tmp) / "go"
        server_log = open(Path(tmp) / "server.log", "wb")  # noqa: SIM115 - closed below
        server = subprocess.Popen(server_argv, cwd=REPO, env=env, stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True)
        clients = [
            subprocess.Popen(
                [
                    sys.executable, "-m", "bench.push_throughput", "client", "--kind", kind, "--port", str(port),
                    "--slot", str(i), "--model", setup.model, "--seconds", str(setup.seconds),
                    "--in-flight", str(setup.in_flight), "--warmup", str(setup.warmup), "--go-file", str(go), *transport_flags,
                ],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            )
            for i in range(setup.clients)
        ]
        try:
            for c in clients:
                line = _read_line(c, _START_TIMEOUT_S)
                if line != "ready":
                    raise RuntimeError(f"{kind} client did not get ready: {line!r}\n{_drain(c)}\n{_tail(server_log)}")
            go.touch()  # every client starts its timed window now
            results = []
            for c in clients:
                line = _read_line(c, setup.seconds + 60)
                try:
                    results.append(json.loads(line))
                except ValueError:
                    raise RuntimeError(f"{kind} client failed: {line!r}\n{_drain(c)}\n{_tail(server_log)}") from None
            server_metrics = scrape(metrics_port) if kind == "ours" else {}
        finally:
            for p in [*clients, server]:
                _stop(p)
            server_log.close()
    nbytes = results[0]["payload_bytes"]
    seconds = max(r["seconds"] for r in results)
    calls = sum(r["calls"] for r in results)
    out: dict[str, Any] = {
        "calls": calls,
        "seconds": seconds,
        "calls_per_s": sum(r["calls"] / r["seconds"] for r in results),
        "gb_per_s": sum(r["calls"] * nbytes / r["seconds"] for r in results) / 1e9,
        "latency_ms_p50": _median([r["latency_ms_p50"] for r in results]),
        "payload_mb": nbytes / 1e6,
        "chunks": results[0]["chunks"],
    }
    if server_metrics:
        count = server_metrics.get("rpcps_server_push_apply_seconds_count", 0.0)
        steps = server_metrics.get("rpcps_server_optimizer_step_seconds_count", 0.0)
        out["server_apply_ms"] = 1000 * server_metrics.get("rpcps_server_push_apply_seconds_sum", 0.0) / count if count else None
        out["server_step_ms"] = 1000 * server_metrics.get("rpcps_server_optimizer_step_seconds_sum", 0.0) / steps if steps else None
        out["updates_applied"] = server_metrics.get("rpcps_server_updates_applied_total")
    return out


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


def _tail(log: Any) -> str:
    log.flush()
    return Path(log.name).read_text(errors="replace")[-3000:]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _print_row(row: dict[str, Any]) -> None:
    s = row["setup"]
    sides = ", ".join(f"{kind} {row[kind]['calls_per_s']:.1f}/s {row[kind]['gb_per_s']:.2f} GB/s" for kind in ("ours", "raw", "raw-read"))
    print(f"{s['model']} x{s['clients']} {s['transport']}/{s['channel']}: {sides}", flush=True)


def _print_table(rows: list[dict[str, Any]]) -> None:
    columns = [
        "model", "payload", "clients", "transport", "ours updates/s", "ours GB/s", "raw calls/s", "raw-read calls/s",
        "ours/raw", "ours/raw-read", "p50 ms ours / raw / raw-read", "server apply ms", "of which step ms",
    ]
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        s, raw, read, ours = row["setup"], row["raw"], row["raw-read"], row["ours"]
        cells = [
            s["model"], f"{ours['payload_mb']:.1f} MB in {ours['chunks']} chunks", str(s["clients"]),
            f"{s['transport']}/{s['channel']}", f"{ours['calls_per_s']:.1f}", f"{ours['gb_per_s']:.2f}",
            f"{raw['calls_per_s']:.1f}", f"{read['calls_per_s']:.1f}", f"{ours['calls_per_s'] / raw['calls_per_s']:.2f}",
            f"{ours['calls_per_s'] / read['calls_per_s']:.2f}",
            " / ".join(_fmt(x["latency_ms_p50"]) for x in (ours, raw, read)),
            _fmt(ours.get("server_apply_ms")), _fmt(ours.get("server_step_ms")),
        ]
        print("| " + " | ".join(cells) + " |")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


# ---- the processes it starts -----------------------------------------------------------------


def ack(chunks: list[Any]) -> int:
    """The raw server's whole job: receive the tensors, answer with a small value (like a PushReply)."""
    return len(chunks)


def ack_read(chunks: list[Any]) -> int:
    """Like ``ack``, after reading every element once."""
    for chunk in chunks:
        chunk.sum()
    return len(chunks)


def run_raw_server(args: argparse.Namespace) -> int:
    from rpcps import rpc_policy, transport

    rpc_policy.protect(extra_calls=(ack, ack_read))  # the same protection as a real server, plus the raw receivers
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    transport.serve(_address(args), server_name(0), _transport_options(args))
    stop.wait()
    transport.shutdown()
    return 0


def run_client(args: argparse.Namespace) -> int:
    import torch

    from rpcps import plugins, rpc_policy, transport
    from rpcps.signature import DEFAULT_CHUNK_BYTES, FlatLayout, ModelSignature
    from worker.client import ServerClient, result

    signature = ModelSignature.of_module(plugins.load_model(f"rpcps.tasks:{args.model}"))
    rpc_policy.protect()
    name = transport.join(_address(args), f"worker{args.slot}", _transport_options(args))
    try:
        if args.kind == "ours":
            client = ServerClient(60.0)
            reg = client.register(args.slot, name, signature.to_wire())
            layout = FlatLayout(signature, reg.chunk_bytes)

            def send(seq: int) -> Any:
                return client.push(args.slot, reg.incarnation, seq, 0, chunks, None)

            def check(future: Any) -> None:
                status = result(future).status
                if status != "applied":
                    raise RuntimeError(f"push not applied: {status}")
        else:
            layout = FlatLayout(signature, DEFAULT_CHUNK_BYTES)

            receiver = ack if args.kind == "raw" else ack_read

            def send(seq: int) -> Any:
                del seq
                return transport.call_async(server_name(0), receiver, (chunks,), 60)

            def check(future: Any) -> None:
                future.wait()

        g = torch.Generator().manual_seed(args.slot)
        chunks = [torch.randn(n, generator=g) * 1e-3 for n in layout.chunk_numels]
        seq = 0
        for _ in range(args.warmup):
            check(send(seq))
            seq += 1
        print("ready", flush=True)
        go = Path(args.go_file)
        while not go.exists():
            time.sleep(0.005)
        latencies: list[float] = []
        window: list[tuple[float, Any]] = []
        started = time.perf_counter()
        deadline = started + args.seconds
        calls = 0
        while True:
            while len(window) < args.in_flight and time.perf_counter() < deadline:
                window.append((time.perf_counter(), send(seq)))
                seq += 1
            if not window:
                break
            sent, future = window.pop(0)
            check(future)
            latencies.append(time.perf_counter() - sent)
            calls += 1
        elapsed = time.perf_counter() - started
        latencies.sort()
        print(
            json.dumps(
                {
                    "calls": calls,
                    "seconds": elapsed,
                    "payload_bytes": layout.nbytes,
                    "chunks": len(layout),
                    "latency_ms_p50": 1000 * latencies[len(latencies) // 2] if latencies else None,
                }
            ),
            flush=True,
        )
    finally:
        if args.kind == "ours":
            transport.leave(name, server_name(0))
        transport.shutdown()
    return 0


def _address(args: argparse.Namespace) -> Any:
    from rpcps.address import Address

    return Address("127.0.0.1", args.port)


def _transport_options(args: argparse.Namespace) -> Any:
    from rpcps.transport import TransportOptions

    return TransportOptions(
        rpc_timeout_s=60.0,
        rpc_transports=tuple(args.rpc_transports.split(",")),
        rpc_channels=tuple(args.rpc_channels.split(",")),
        connect_timeout_s=_START_TIMEOUT_S,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.push_throughput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp_5m,mlp_25m", help="rpcps.tasks model factories, comma-separated")
    parser.add_argument("--workers", default="1,2", help="numbers of pushing client processes, comma-separated")
    parser.add_argument("--transports", default="uv/basic", help="TRANSPORT/CHANNEL pairs, comma-separated (uv/basic, shm/basic, uv/cma)")
    parser.add_argument("--seconds", type=float, default=4.0, help="timed window per measurement")
    parser.add_argument("--in-flight", type=int, default=2, help="calls each client keeps on the wire (a worker's --max-in-flight)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per client before the window")
    parser.add_argument("--repeats", type=int, default=2, help="measurements of each side; the best is reported")
    parser.add_argument("--json", help="also write the results to this file")
    sub = parser.add_subparsers(dest="role", title="processes the driver starts (not for direct use)")
    for role, what in (("client", "one pushing client"), ("raw-server", "the bare torch RPC receiver")):
        p = sub.add_parser(role, help=what)
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--rpc-transports", default="uv")
        p.add_argument("--rpc-channels", default="basic")
        if role == "client":
            p.add_argument("--kind", choices=["ours", "raw", "raw-read"], required=True)
            p.add_argument("--slot", type=int, default=0)
            p.add_argument("--model", required=True)
            p.add_argument("--seconds", type=float, required=True)
            p.add_argument("--in-flight", type=int, required=True)
            p.add_argument("--warmup", type=int, required=True)
            p.add_argument("--go-file", required=True)
    args = parser.parse_args(argv)
    if args.role == "client":
        return run_client(args)
    if args.role == "raw-server":
        return run_raw_server(args)
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
