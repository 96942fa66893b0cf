"""The command line: parses flags and environment into typed configs and hands off to a role.

Roles: ``ps`` (a parameter server), ``worker`` (one training worker), ``local`` (a server plus N
workers on this machine, supervised), ``ctl`` (a client of a running server's control plane).
Nothing but ``trainer_entry.py`` calls ``main``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from rpcps.options import (
    Option,
    add_options,
    csv,
    host_port,
    json_object,
    non_negative_int,
    positive_float,
    positive_int,
    resolve,
)

MODEL = Option("--model", "model factory 'package.module:function' returning an nn.Module; same on every role",
               "rpcps.tasks:teacher_student_model", metavar="SPEC")
COMMON = [
    MODEL,
    Option("--log-level", "logging level", "INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]),
    Option("--summary-json", "write a JSON summary of the run to this file at the end", metavar="PATH"),
    Option("--metrics-addr", "address /metrics listens on", "0.0.0.0"),
    Option("--rpc-timeout-s", "deadline of one RPC call; a hung peer fails after this", 30.0, positive_float),
    Option("--rpc-threads", "threads serving incoming RPCs", 32, positive_int),
    Option("--rpc-transports", "TensorPipe transports, comma-separated (uv = TCP; shm busy-polls a core)", ("uv",), csv),
    Option("--rpc-channels", "TensorPipe channels, comma-separated", ("basic",), csv),
]
SERVER = [
    Option("--listen", "HOST:PORT of the server's rendezvous store; workers use it as --ps", ("0.0.0.0", 29500), host_port,
           metavar="HOST:PORT"),
    Option("--metrics-port", "server /metrics port; 0 picks a free one (logged)", 9400, non_negative_int),
    Option("--optimizer", "server-side optimizer", "adam", choices=["sgd", "adam", "adamw", "adagrad", "rmsprop"]),
    Option("--optimizer-args", "optimizer keyword arguments as JSON, e.g. '{\"lr\":0.1,\"momentum\":0.9,\"nesterov\":true}'",
           None, json_object, metavar="JSON"),
    Option("--lr", "learning rate (overrides lr in --optimizer-args)", None, positive_float),
    Option("--lr-schedule", "learning-rate schedule stepped once per applied update", None,
           choices=["step", "cosine", "exponential", "linear"]),
    Option("--lr-schedule-args", "schedule keyword arguments as JSON, e.g. '{\"T_max\":1000}'", None, json_object,
           metavar="JSON"),
    Option("--mode", "async: apply every push; bounded: refuse pushes staler than --max-staleness (recomputed); "
           "sync: one step per round from the averaged gradients of the live workers", "async",
           choices=["async", "bounded", "sync"]),
    Option("--max-staleness", "with --mode bounded: largest staleness (updates) an applied gradient may have", None,
           non_negative_int, metavar="K"),
    Option("--round-timeout-s", "with --mode sync: close a round this long after it opened with whoever contributed",
           30.0, positive_float),
    Option("--min-workers", "with --mode sync: rounds wait (up to --round-timeout-s) for this many workers; "
           "local sets it to --workers", 1, positive_int),
    Option("--wire-dtype", "dtype of gradients and parameters on the wire; the server keeps fp32 masters and optimizer",
           "fp32", choices=["fp32", "bf16", "fp16"]),
    Option("--shards", "number of server shards the parameters are split over", 1, positive_int),
    Option("--shard-index", "this server's shard (0 hosts the group's store at --listen)", 0, non_negative_int),
    Option("--store", "HOST:PORT of shard 0's --listen (shards > 0 only)", None, host_port, metavar="HOST:PORT"),
    Option("--on-nonfinite", "NaN/Inf gradients: reject (error on the worker) or skip (drop and count)", "reject",
           choices=["reject", "skip"]),
    Option("--max-workers", "worker slots 0..N-1 this server accepts", 256, positive_int),
    Option("--lease-s", "a worker silent this long is checked and removed if its process is gone", 10.0, positive_float),
    Option("--chunk-mb", "largest wire chunk in MiB (parameters are packed into chunks)", 16.0, positive_float),
    Option("--progress-s", "seconds between progress log lines", 5.0, positive_float),
    Option("--checkpoint-dir", "directory for snapshots; unset disables checkpointing", None, metavar="DIR"),
    Option("--checkpoint-every-updates", "snapshot after this many applied updates", None, positive_int, metavar="N"),
    Option("--checkpoint-every-seconds", "snapshot at most this often while updates arrive", 60.0, positive_float,
           metavar="T"),
    Option("--keep-checkpoints", "newest snapshots to keep", 3, positive_int, metavar="K"),
    Option("--resume", "auto (newest valid snapshot), never, or a snapshot directory", "auto", metavar="auto|never|PATH"),
    Option("--audit-log", "append a ledger of every applied update to this file (fault-injection checks)", None,
           metavar="PATH"),
    # ---- control plane (ps/control, docs/CONTROL.md) ----
    Option("--control-addr", "address the gRPC control plane (status, checkpoint, pause, resume, shutdown) listens on",
           "0.0.0.0"),
    Option("--control-port", "control-plane port; 0 picks a free one (logged)", 9500, non_negative_int),
    Option("--control-token-file", "file holding the bearer token every control call must carry (recommended)", None,
           metavar="PATH"),
    Option("--tls-cert", "PEM certificate; with --tls-key the control plane speaks TLS only", None, metavar="PATH"),
    Option("--tls-key", "PEM private key of --tls-cert", None, metavar="PATH"),
    # ---- end control plane ----
]
WORKER_TRAINING = [
    Option("--steps", "training steps per worker slot, counted across restarts", 300, non_negative_int),
    Option("--data", "data factory 'package.module:function(worker_index, num_workers)' -> iterable of (inputs, targets)",
           "rpcps.tasks:teacher_student_data", metavar="SPEC"),
    Option("--loss", "cross_entropy, mse or 'package.module:function'", "cross_entropy", metavar="LOSS"),
    Option("--device", "auto (GPU if present, else CPU), cpu, cuda or cuda:N", "auto"),
    Option("--pull-every", "refresh parameters every N steps", 1, positive_int),
    Option("--max-in-flight", "pushes on the wire before a worker waits for a reply", 2, positive_int),
    Option("--connect-timeout-s", "how long a worker waits for its server to answer", 60.0, positive_float),
    Option("--heartbeat-s", "heartbeat interval of an idle worker", 2.0, positive_float),
    Option("--max-retries", "timeouts in a row on one call before a worker gives up on a hung server", 30, non_negative_int),
    Option("--max-reconnects", "times a worker restarts itself to reach a replaced server", 20, non_negative_int),
    Option("--topk-ratio", "send only this share of each gradient chunk (largest first) with error feedback", None,
           positive_float, metavar="R"),
    Option("--prefetch-pull", "async mode: fetch the next step's parameters while this step computes", "on",
           choices=["on", "off"]),
    Option("--max-consecutive-rejects", "rejected pushes in a row before a worker stops (exit 4)", 10, positive_int),
]
WORKER = [
    Option("--ps", "HOST:PORT of the server (its --listen)", None, host_port, metavar="HOST:PORT"),
    Option("--worker-index", "this worker's slot (data shard and recorded progress)", 0, non_negative_int, torchrun="RANK"),
    Option("--num-workers", "number of worker slots sharing the data", 1, positive_int, torchrun="WORLD_SIZE"),
    Option("--metrics-port", "worker /metrics port; 0 picks a free one (logged)", None, non_negative_int),
    *WORKER_TRAINING,
]
LOCAL = [
    Option("--workers", "worker processes to start", 2, positive_int),
    Option("--run-dir", "directory for logs and summaries of the children", None, metavar="DIR"),
    Option("--max-restarts", "restarts of a crashed child before giving up", 3, non_negative_int),
    Option("--port", "server port; 0 picks a free one", 0, non_negative_int),
]


LOCAL_PICKS = ("--listen", "--metrics-port", "--control-addr", "--control-port", "--shard-index", "--store")
"""Server options ``local`` sets itself (loopback addresses, free ports)."""


class _Parser(argparse.ArgumentParser):
    """Bad flags get one line on stderr that says where help is, not the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, list[Option]]]:
    parser = _Parser(
        prog="rpcps",
        description="rpcps: a fault-tolerant parameter server for PyTorch on torch.distributed.rpc. "
        "Precedence of settings: flag > RPCPS_* environment variable > torchrun's variables > default.",
    )
    sub = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    tables = {
        "ps": COMMON + SERVER,
        "worker": COMMON + WORKER,
        "local": COMMON + [o for o in SERVER if o.flag not in LOCAL_PICKS] + WORKER_TRAINING + LOCAL,
    }
    helps = {
        "ps": "run a parameter server (one per job)",
        "worker": "run one training worker against a server",
        "local": "run a server and N workers on this machine, supervised, with progress",
    }
    for role, options in tables.items():
        p = sub.add_parser(role, help=helps[role], description=helps[role])
        add_options(p, options)
    # ---- ctl: control-plane client (rpcps/ctl.py builds its own options) ----
    from rpcps import ctl

    ctl.add_parser(sub)
    # ---- end ctl ----
    return parser, tables


def main(argv: Sequence[str] | None = None) -> int:
    parser, tables = build_parser()
    args = parser.parse_args(argv)
    sub = parser._subparsers._group_actions[0].choices[args.role]  # type: ignore[union-attr]
    if args.role == "ctl":  # a client: no role logging, no role config
        from rpcps import ctl

        return ctl.run(args, sub)
    values = resolve(args, tables[args.role], sub)
    _configure_logging(args.role, values)
    log = logging.getLogger("rpcps")
    try:
        if args.role == "ps":
            from ps.runner import run_server

            return run_server(server_config(values))
        if args.role == "worker":
            from worker.runner import run_worker

            return run_worker(worker_config(values, sub))
        from rpcps.launch import run_local

        return run_local(values, sys.argv[0])
    except ValueError as e:  # bad settings caught by a config's validation or a plug-in spec
        print(f"rpcps {args.role}: error: {e}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as e:
        from rpcps.transport import TransportError

        if isinstance(e, (TransportError, OSError)):
            print(f"rpcps {args.role}: error: {e}", file=sys.stderr)
            return 1
        log.exception("failed")
        return 1


def transport_config(values: dict[str, Any], host: str, port: int) -> Any:
    from rpcps.transport import TransportConfig

    return TransportConfig(
        host=host,
        port=port,
        rpc_timeout_s=values["rpc_timeout_s"],
        num_worker_threads=values["rpc_threads"],
        transports=tuple(values["rpc_transports"]),
        channels=tuple(values["rpc_channels"]),
        connect_timeout_s=values.get("connect_timeout_s") or 60.0,
    )


def server_config(values: dict[str, Any]) -> Any:
    from ps.checkpointer import CheckpointConfig
    from ps.optim import OptimizerConfig
    from ps.runner import ServerRunConfig
    from ps.server import ServerCoreConfig

    kwargs = dict(values["optimizer_args"] or {"lr": 3e-3})
    if values["lr"] is not None:
        kwargs["lr"] = values["lr"]
    optimizer = OptimizerConfig(
        name=values["optimizer"],
        kwargs=kwargs,
        schedule=values["lr_schedule"],
        schedule_kwargs=values["lr_schedule_args"] or {},
    )
    host, port = values["listen"]
    if values["shard_index"] > 0:
        if values["store"] is None:
            raise ValueError("--shard-index > 0 needs --store HOST:PORT (shard 0's --listen address)")
        host, port = values["store"]
    return ServerRunConfig(
        transport=transport_config(values, host, port),
        core=ServerCoreConfig(
            optimizer=optimizer,
            on_nonfinite=values["on_nonfinite"],
            chunk_bytes=int(values["chunk_mb"] * 1024 * 1024),
            max_workers=values["max_workers"],
            mode=values["mode"],
            max_staleness=values["max_staleness"],
            round_timeout_s=values["round_timeout_s"],
            min_workers=values["min_workers"],
            wire_dtype=values["wire_dtype"],
            shard_index=values["shard_index"],
            shard_count=values["shards"],
        ),
        model=values["model"],
        metrics_addr=values["metrics_addr"],
        metrics_port=values["metrics_port"],
        lease_s=values["lease_s"],
        progress_s=values["progress_s"],
        summary_json=values["summary_json"],
        checkpoint=CheckpointConfig(
            directory=values["checkpoint_dir"],
            every_updates=values["checkpoint_every_updates"],
            every_seconds=values["checkpoint_every_seconds"],
            keep=values["keep_checkpoints"],
            resume=values["resume"],
        ),
        control=control_config(values),
        audit_log=values["audit_log"],
    )


def control_config(values: dict[str, Any]) -> Any:
    """The ps role's control-plane settings (for ServerRunConfig; see docs/CONTROL.md)."""
    from ps.control.service import ControlConfig

    return ControlConfig(
        addr=values["control_addr"],
        port=values["control_port"],
        token_file=values["control_token_file"],
        tls_cert=values["tls_cert"],
        tls_key=values["tls_key"],
    )


def worker_config(values: dict[str, Any], parser: argparse.ArgumentParser) -> Any:
    from worker.runner import WorkerRunConfig
    from worker.trainer import WorkerConfig

    address = values["ps"]
    if address is None and os.environ.get("MASTER_ADDR"):
        address = (os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500")))
    if address is None:
        parser.error("--ps HOST:PORT is required (or RPCPS_PS, or torchrun's MASTER_ADDR/MASTER_PORT)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    metrics_port = values["metrics_port"] if values["metrics_port"] is not None else 9410 + local_rank
    return WorkerRunConfig(
        transport=transport_config(values, *address),
        worker=WorkerConfig(
            worker_index=values["worker_index"],
            num_workers=values["num_workers"],
            steps=values["steps"],
            pull_every=values["pull_every"],
            max_in_flight=values["max_in_flight"],
            device=values["device"],
            model=values["model"],
            data=values["data"],
            loss=values["loss"],
            heartbeat_s=values["heartbeat_s"],
            max_retries=values["max_retries"],
            max_consecutive_rejects=values["max_consecutive_rejects"],
            topk_ratio=values["topk_ratio"],
            prefetch_pull=values["prefetch_pull"] == "on",
        ),
        metrics_addr=values["metrics_addr"],
        metrics_port=metrics_port,
        max_reconnects=values["max_reconnects"],
        summary_json=values["summary_json"],
    )


def _configure_logging(role: str, values: dict[str, Any]) -> None:
    tag = role if role != "worker" else f"worker{values.get('worker_index', 0)}"
    logging.basicConfig(
        level=values["log_level"],
        format=f"%(asctime)s %(levelname)s [{tag} pid %(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
