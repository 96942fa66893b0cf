"""``rpcps ctl``: the command-line client of a parameter server's control plane.

    python trainer_entry.py ctl status|checkpoint|pause|resume|shutdown --addr HOST:PORT
        [--token-file F] [--tls-ca F] [--json] [--timeout-s S]
    python trainer_entry.py ctl export --out model.pt [--format auto|torch|safetensors] --addr HOST:PORT
    python trainer_entry.py ctl export --out EXPORT_DIR [--optimizer-state on] --addr HOST:PORT   (sparse tables)

Prints a human-readable answer (or one JSON object with ``--json``) on stdout. Any failure, be it an
unreachable server, a refused token or a failed checkpoint, is one line on stderr and a non-zero
exit status: 1 for a failed call, 2 for bad local input (a token or CA file that cannot be read).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

# gRPC's C core logs connection failures to stderr on its own; the one line this module prints says
# it better. Set before grpc is imported (below).
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cli.ctl_config import CtlConfig
from ps.control import control_pb2 as pb
from ps.control.auth import bearer_metadata, read_token
from ps.control.control_pb2_grpc import ControlStub
from rpcps.model_file import resolve_format, write_bytes
from rpcps.sparse.export_files import ExportFormatError, write_export

ACTIONS = ("status", "checkpoint", "pause", "resume", "shutdown", "export")
EXIT_CALL_FAILED = 1
EXIT_BAD_INPUT = 2


def run(action: str, config: CtlConfig, as_json: bool = False) -> int:
    addr = str(config.addr)
    prefix = f"rpcps ctl {action}"
    try:
        if action == "export" and not config.out:
            raise ValueError("export needs --out PATH (the file to write the model to)")
        metadata = _metadata(config.token_file)
        channel = _channel(addr, config.tls_ca)
    except (OSError, ValueError) as e:
        print(f"{prefix}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        with channel:
            if action == "export":
                assert config.out is not None
                result = export_model(channel, metadata, config.timeout_s, config.out, config.file_format, config.optimizer_state)
            else:
                result = call(action, channel, metadata, config.timeout_s)
    except OSError as e:
        print(f"{prefix}: error: cannot write {config.out}: {e}", file=sys.stderr)
        return EXIT_CALL_FAILED
    except ExportFormatError as e:  # the server's model needs a directory --out
        print(f"{prefix}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except grpc.RpcError as e:
        message = describe_error(addr, e.code(), e.details(), config.timeout_s, tls=config.tls_ca is not None)
        print(f"{prefix}: {message}", file=sys.stderr)
        return EXIT_CALL_FAILED
    result = {"address": addr, **result}
    print(json.dumps(result, indent=2, sort_keys=True) if as_json else format_result(action, result))
    return 0


class CallFailed(RuntimeError):
    """A control call got no answer or an error (the message says which)."""


def status(host: str, port: int, timeout_s: float = 5.0) -> dict[str, Any]:
    """One plaintext, token-less status call (``local`` asking its own servers on loopback)."""
    try:
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            return call("status", channel, (), timeout_s)
    except grpc.RpcError as e:
        raise CallFailed(describe_error(f"{host}:{port}", e.code(), e.details(), timeout_s)) from e


def health(host: str, port: int, timeout_s: float = 1.0) -> str:
    """One plaintext health check: 'SERVING', 'NOT_SERVING', or 'unknown' when the server does not answer."""
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        return _health(channel, timeout_s)


def call(action: str, channel: Any, metadata: tuple[tuple[str, str], ...], timeout_s: float) -> dict[str, Any]:
    """Makes one control call and returns its answer as plain data (what --json prints)."""
    stub = ControlStub(channel)
    kw = {"metadata": metadata, "timeout": timeout_s}
    if action == "status":
        return {**status_dict(stub.GetStatus(pb.GetStatusRequest(), **kw)), "health": _health(channel, timeout_s)}
    if action == "checkpoint":
        r = stub.Checkpoint(pb.CheckpointRequest(), **kw)
        return {"path": r.path, "version": r.version}
    if action == "pause":
        r = stub.Pause(pb.PauseRequest(), **kw)
        return {"changed": r.changed, "model_version": r.model_version}
    if action == "resume":
        r = stub.Resume(pb.ResumeRequest(), **kw)
        return {"changed": r.changed, "model_version": r.model_version}
    if action == "shutdown":
        return {"changed": stub.Shutdown(pb.ShutdownRequest(), **kw).changed}
    raise ValueError(f"unknown action {action!r}; choose one of {list(ACTIONS)}")


def export_model(
    channel: Any, metadata: tuple[tuple[str, str], ...], timeout_s: float, out: str, fmt: str, optimizer_state: bool = False
) -> dict[str, Any]:
    """Streams the server's current model into ``out`` (written whole or not at all): one file, or
    for a model with sparse tables a directory (rpcps/sparse/export_files.py)."""
    resolved = resolve_format(out, fmt)
    request = pb.ExportModelRequest(format=resolved, optimizer_state=optimizer_state)
    pieces = ControlStub(channel).ExportModel(request, metadata=metadata, timeout=timeout_s)
    first = next(pieces)
    if first.path:
        written = write_export(_export_files(first, pieces), out)
        return {"path": out, "format": resolved, "model_version": first.model_version, "bytes": written}
    data = b"".join([first.data, *(piece.data for piece in pieces)])
    if len(data) != first.total_bytes:
        raise OSError(f"the server announced {first.total_bytes} bytes but sent {len(data)}")
    write_bytes(data, out)
    return {"path": out, "format": resolved, "model_version": first.model_version, "bytes": len(data)}


def _export_files(first: Any, pieces: Iterator[Any]) -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of each file of a directory export, from its pieces (each file's first names it)."""
    path, size, parts = first.path, first.total_bytes, [first.data]
    for piece in itertools.chain(pieces, [None]):  # one file's pieces in memory at a time
        if piece is not None and not piece.path:
            parts.append(piece.data)
            continue
        data = b"".join(parts)
        if len(data) != size:
            raise OSError(f"the server announced {size} bytes of {path} but sent {len(data)}")
        yield path, data
        if piece is not None:
            path, size, parts = piece.path, piece.total_bytes, [piece.data]


def status_dict(r: Any) -> dict[str, Any]:
    """A GetStatusResponse as plain data; absent optional fields become None."""
    newest = None
    if r.HasField("newest_checkpoint"):
        c = r.newest_checkpoint
        newest = {"path": c.path, "version": c.version, "age_seconds": c.age_seconds}
    return {
        "model_version": r.model_version,
        "mode": r.mode,
        "optimizer": r.optimizer,
        "intra_op_threads": r.intra_op_threads,
        "thread_budget": r.thread_budget,
        "host_processes": r.host_processes,
        "paused": r.paused,
        "shutting_down": r.shutting_down,
        "uptime_seconds": r.uptime_seconds,
        "server_id": r.server_id,
        "workers": [
            {"slot": w.slot, "last_push_age_seconds": w.last_push_age_seconds if w.HasField("last_push_age_seconds") else None}
            for w in r.workers
        ],
        "checkpointing_enabled": r.checkpointing_enabled,
        "newest_checkpoint": newest,
        "checkpoint_error": r.checkpoint_error or None,
        "shard": f"{r.shard_index}/{r.shard_count}",
        "replica": _replica_dict(r.replica) if r.HasField("replica") else None,
        "slots": [
            {
                "slot": p.slot,
                "next_step": p.next_step,
                "durable_next_step": p.durable_next_step if p.HasField("durable_next_step") else None,
                "finished_steps": p.finished_steps or None,
                "live": p.live,
            }
            for p in r.slots
        ],
    }


def _replica_dict(r: Any) -> dict[str, Any]:
    return {
        "role": r.role, "epoch": r.epoch, "primary": r.primary, "standby": r.standby or None, "lag_updates": r.lag_updates,
        "lag_seconds": r.lag_seconds, "failovers": r.failovers, "configured": r.configured,
        "replication": r.replication or "sync", "max_lag": r.max_lag, "unreplicated": r.unreplicated,
    }


def _replication_line(replica: dict[str, Any]) -> str:
    if replica["replication"] != "async":
        return "sync (a push is acknowledged once the standby holds it)"
    return f"async, at most {replica['max_lag']} updates behind; {replica['unreplicated']:.0f} acknowledged and not on the standby"


def format_result(action: str, d: dict[str, Any]) -> str:
    """The human-readable answer to one action."""
    if action == "status":
        return format_status(d)
    if action == "checkpoint":
        return f"checkpoint written: {d['path']} (version {d['version']})"
    if action == "pause":
        verb = "paused" if d["changed"] else "already paused"
        return f"{verb} at version {d['model_version']}: pushes are held until resume"
    if action == "resume":
        verb = "resumed" if d["changed"] else "was not paused; running"
        return f"{verb} at version {d['model_version']}"
    if action == "export":
        return f"model of version {d['model_version']} written to {d['path']} ({d['bytes']} bytes, {d['format']})"
    if action == "shutdown":
        if not d["changed"]:
            return "shutdown already requested"
        return "shutdown requested: the server tells its workers to finish, writes a final checkpoint and exits"
    raise ValueError(f"unknown action {action!r}")


def format_status(d: dict[str, Any]) -> str:
    state = "shutting down" if d["shutting_down"] else "paused" if d["paused"] else "running"
    if not d["checkpointing_enabled"]:
        checkpoint = "not configured (--checkpoint-dir)"
    elif d["checkpoint_error"]:
        checkpoint = f"unreadable: {d['checkpoint_error']}"
    elif d["newest_checkpoint"] is None:
        checkpoint = "none yet"
    else:
        c = d["newest_checkpoint"]
        checkpoint = f"{c['path']} (version {c['version']}, {format_age(c['age_seconds'])} ago)"
    lines = [
        f"server        {d.get('address', '?')} (id {d['server_id']}, shard {d['shard']})",
        f"health        {d.get('health', '?')}",
        f"state         {state}",
        f"model version {d['model_version']}",
        f"mode          {d['mode']}",
        f"optimizer     {d['optimizer']}",
        f"threads       {d['intra_op_threads']} intra-op" + (f" ({d['thread_budget']})" if d.get("thread_budget") else ""),
        f"uptime        {format_age(d['uptime_seconds'])}",
        f"checkpoint    {checkpoint}",
        f"live workers  {len(d['workers'])}",
    ]
    replica = d.get("replica")
    if replica is not None and (replica["configured"] > 1 or replica["standby"] is not None):  # a lone shard has no replica set
        standby = replica["standby"] or "none"
        if replica["standby"] is None and replica["configured"] > 1:
            standby += f" (WARNING: started with --replicas {replica['configured']}; a crash now falls back to the newest snapshot)"
        lines += [
            f"replica       {replica['role']}, epoch {replica['epoch']}, {replica['failovers']} failover(s) by this process",
            f"  primary     {replica['primary']}",
            f"  standby     {standby}",
        ]
        if replica["standby"] is not None:  # lag and mode describe copies to a standby: none without one
            lines += [
                f"  lag         {replica['lag_updates']:.0f} updates / {replica['lag_seconds']:.3f}s",
                f"  replication {_replication_line(replica)}",
            ]
    for w in d["workers"]:
        age = w["last_push_age_seconds"]
        lines.append(f"  slot {w['slot']:<5} last push {'never' if age is None else format_age(age) + ' ago'}")
    if d["slots"]:
        lines.append("slot progress (steps held / durable in the newest snapshot / finished with)")
        for p in d["slots"]:
            durable = "-" if p["durable_next_step"] is None else str(p["durable_next_step"])
            finished = p["finished_steps"]
            note = ""
            if finished is not None and p["next_step"] < finished:
                note = f"  ROLLED BACK: its worker finished {finished} steps; run slot {p['slot']} again"
            lines.append(f"  slot {p['slot']:<5} {p['next_step']:>8} / {durable:>8} / {'running' if finished is None else finished}{note}")
    return "\n".join(lines)


def format_age(seconds: float) -> str:
    """A duration for people: 0.4s, 42s, 3m05s, 2h03m, 1d04h."""
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def describe_error(addr: str, code: Any, details: str | None, timeout_s: float, tls: bool = False) -> str:
    """One line saying what went wrong with a call to ``addr`` and what to do about it."""
    details = (details or "").strip() or "(no details)"
    name = getattr(code, "name", str(code))
    if name == "UNAUTHENTICATED":
        return f"{addr} refused the call: {details} (check --token-file against the server's --control-token-file)"
    if name == "DEADLINE_EXCEEDED":
        return f"no answer from {addr} within {timeout_s:g} s (is it the control port? raise --timeout-s for slow checkpoints)"
    if name == "UNAVAILABLE":
        # A TLS/plaintext mismatch shows up as a bare "Socket closed" or a handshake error.
        hint = ""
        if not tls and "Socket closed" in details:
            hint = " (if the server uses TLS, pass --tls-ca)"
        elif tls and "andshake" in details:
            hint = " (TLS failed: is the server plaintext? does --tls-ca match its certificate and name this host?)"
        return f"{addr} is unavailable: {details}{hint}"
    return f"{addr} answered {name}: {details}"


def _metadata(token_file: str | None) -> tuple[tuple[str, str], ...]:
    if token_file is None:
        return ()
    return bearer_metadata(read_token(token_file))


def _channel(addr: str, tls_ca: str | None) -> Any:
    if tls_ca is None:
        return grpc.insecure_channel(addr)
    try:
        with open(tls_ca, "rb") as f:
            ca = f.read()
    except OSError as e:
        raise OSError(f"cannot read --tls-ca {tls_ca}: {e.strerror or e}") from e
    return grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates=ca))


def _health(channel: Any, timeout_s: float) -> str:
    """Overall health of the server, or 'unknown' when it cannot be read (status still prints)."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.RpcError:
        return "unknown"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
