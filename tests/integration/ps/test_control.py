"""The control plane over real gRPC against a real in-process InProcessServer.

Workers are simulated by calling the server's register/push methods directly: the control plane is
what is under test here, not torch RPC. The `ctl` CLI is exercised as a real subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.inprocess import InProcessServer
from harness.procs import ENTRY, REPO, child_env
from ps.config import ControlConfig
from ps.control import control_pb2 as pb
from ps.control.auth import bearer_metadata
from ps.control.control_pb2_grpc import ControlStub
from ps.control.control_service import CONTROL_SERVICE, ControlServer, start_control_server
from ps.control.hooks import CheckpointHook
from ps.core.config import ServerCoreConfig
from rpcps.tasks import teacher_student_model
from tests.integration.certs import self_signed
from tests.integration.conftest import imported_modules, run_ctl

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TOKEN = "0123456789abcdef-test-token"
CALL_TIMEOUT_S = 10.0


class DirCheckpointer:
    """A small real checkpointer for these tests: saves the master tensors to a file, tmp + rename."""

    def __init__(self, server: InProcessServer, directory: Path) -> None:
        self.server = server
        self.directory = directory
        self._newest: tuple[str, int, float] | None = None

    def checkpoint_now(self) -> tuple[str, int]:
        version = self.server.version
        path = self.directory / f"step-{version:08d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"version": version, "params": self.server.master_tensors()}, tmp)
        os.replace(tmp, path)
        self._newest = (str(path), version, time.time())
        return str(path), version

    def newest(self) -> tuple[str, int, float] | None:
        return self._newest

    @property
    def durable_progress(self) -> dict[int, int]:
        return {}

    def finished_slots(self) -> dict[int, int]:
        return {}


class BrokenStorage:
    """A checkpointer whose storage fails the way a full or vanished disk does."""

    def checkpoint_now(self) -> tuple[str, int]:
        raise OSError(28, "No space left on device")

    def newest(self) -> tuple[str, int, float] | None:
        raise OSError(2, "checkpoint directory /ck is gone")

    @property
    def durable_progress(self) -> dict[int, int]:
        return {}

    def finished_slots(self) -> dict[int, int]:
        return {}


@pytest.fixture
def ps_server() -> InProcessServer:
    return InProcessServer(teacher_student_model(), ServerCoreConfig())


@pytest.fixture
def start(ps_server: InProcessServer, tmp_path: Path) -> Iterator[Callable[..., tuple[ControlServer, threading.Event]]]:
    """Starts control servers on free ports around ``ps_server``; stops them all at the end."""
    handles: list[ControlServer] = []

    def _start(
        checkpoint: CheckpointHook | None | str = "dir", **config: Any
    ) -> tuple[ControlServer, threading.Event]:
        hook = DirCheckpointer(ps_server, tmp_path) if checkpoint == "dir" else checkpoint
        shutdown = threading.Event()
        handle = start_control_server(
            ps_server.core,
            ControlConfig(addr="127.0.0.1", port=0, **config),
            checkpoint=hook,  # type: ignore[arg-type]
            request_shutdown=shutdown.set,
            registry=ps_server.core.metrics.registry,
        )
        handles.append(handle)
        return handle, shutdown

    yield _start
    for h in handles:
        h.stop(grace_s=0)


@pytest.fixture
def channel_to() -> Iterator[Callable[..., grpc.Channel]]:
    channels: list[grpc.Channel] = []

    def _open(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
        ch = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
        channels.append(ch)
        return ch

    yield _open
    for ch in channels:
        ch.close()


def _health(channel: grpc.Channel, service: str = "") -> str:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _both_health(channel: grpc.Channel) -> tuple[str, str]:
    return _health(channel, ""), _health(channel, CONTROL_SERVICE)


def _register(server: InProcessServer, slot: int) -> str:
    return server.register(slot, f"worker{slot}", server.signature.to_wire()).incarnation


def _push(server: InProcessServer, slot: int, incarnation: str, seq: int) -> str:
    chunks = [torch.full_like(c, 0.01) for c in server.layout.empty_chunks()]
    return server.push(slot, incarnation, seq, server.version, chunks, loss=1.0).status


def _code(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()  # type: ignore[attr-defined]


def test_health_goes_not_serving_serving_not_serving(start: Callable[..., Any], channel_to: Callable[..., Any]) -> None:
    handle, shutdown = start()
    ch = channel_to(handle.address)
    assert _both_health(ch) == ("NOT_SERVING", "NOT_SERVING")  # model not loaded / resume not done yet
    handle.set_serving(True)
    assert _both_health(ch) == ("SERVING", "SERVING")

    reply = ControlStub(ch).Shutdown(pb.ShutdownRequest(), timeout=CALL_TIMEOUT_S)
    assert reply.changed and shutdown.is_set()
    assert _both_health(ch) == ("NOT_SERVING", "NOT_SERVING")
    handle.set_serving(True)  # a late "ready" from the runner must not undo the shutdown
    assert _both_health(ch) == ("NOT_SERVING", "NOT_SERVING")
    assert not ControlStub(ch).Shutdown(pb.ShutdownRequest(), timeout=CALL_TIMEOUT_S).changed  # idempotent

    handle.stop(grace_s=1)
    code, _ = _code(lambda: _health(channel_to(handle.address)))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_status_reports_version_workers_and_newest_checkpoint(
    start: Callable[..., Any], channel_to: Callable[..., Any], ps_server: InProcessServer
) -> None:
    handle, _ = start()
    stub = ControlStub(channel_to(handle.address))
    first = stub.GetStatus(pb.GetStatusRequest(), timeout=CALL_TIMEOUT_S)
    assert (first.model_version, first.mode, first.optimizer, first.paused) == (0, "async", "adam", False)
    assert first.checkpointing_enabled and not first.HasField("newest_checkpoint")
    assert list(first.workers) == [] and first.server_id == ps_server.server_id
    assert first.intra_op_threads == torch.get_num_threads() >= 1

    w0, _w1 = _register(ps_server, 0), _register(ps_server, 1)
    assert _push(ps_server, 0, w0, seq=1) == "applied"
    assert _push(ps_server, 0, w0, seq=2) == "applied"
    stub.Checkpoint(pb.CheckpointRequest(), timeout=CALL_TIMEOUT_S)
    s = stub.GetStatus(pb.GetStatusRequest(), timeout=CALL_TIMEOUT_S)
    assert s.model_version == 2
    assert s.uptime_seconds > first.uptime_seconds
    assert [w.slot for w in s.workers] == [0, 1]
    assert s.workers[0].HasField("last_push_age_seconds") and 0 <= s.workers[0].last_push_age_seconds < 60
    assert not s.workers[1].HasField("last_push_age_seconds")  # registered, never pushed
    assert s.newest_checkpoint.version == 2 and Path(s.newest_checkpoint.path).exists()
    assert 0 <= s.newest_checkpoint.age_seconds < 60

    ps_server.mark_dead(1, _w1)  # only live workers are listed
    assert [w.slot for w in stub.GetStatus(pb.GetStatusRequest(), timeout=CALL_TIMEOUT_S).workers] == [0]


def test_checkpoint_on_demand_writes_a_loadable_file(
    start: Callable[..., Any], channel_to: Callable[..., Any], ps_server: InProcessServer
) -> None:
    handle, _ = start()
    w0 = _register(ps_server, 0)
    assert _push(ps_server, 0, w0, seq=1) == "applied"
    reply = ControlStub(channel_to(handle.address)).Checkpoint(pb.CheckpointRequest(), timeout=CALL_TIMEOUT_S)
    assert reply.version == 1
    saved = torch.load(reply.path, weights_only=True)
    assert saved["version"] == 1
    for name, tensor in ps_server.master_tensors().items():
        assert torch.equal(saved["params"][name], tensor)


def test_checkpoint_errors_map_to_status_codes(start: Callable[..., Any], channel_to: Callable[..., Any]) -> None:
    unconfigured, _ = start(checkpoint=None)
    code, details = _code(lambda: ControlStub(channel_to(unconfigured.address)).Checkpoint(pb.CheckpointRequest(), timeout=CALL_TIMEOUT_S))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "--checkpoint-dir" in details

    broken, _ = start(checkpoint=BrokenStorage())
    stub = ControlStub(channel_to(broken.address))
    code, details = _code(lambda: stub.Checkpoint(pb.CheckpointRequest(), timeout=CALL_TIMEOUT_S))
    assert code == grpc.StatusCode.UNAVAILABLE and "No space left on device" in details
    # Status still answers when the checkpoint directory cannot be read, and says why.
    s = stub.GetStatus(pb.GetStatusRequest(), timeout=CALL_TIMEOUT_S)
    assert "is gone" in s.checkpoint_error and not s.HasField("newest_checkpoint")


def test_pause_holds_pushes_and_resume_applies_them(
    start: Callable[..., Any], channel_to: Callable[..., Any], ps_server: InProcessServer
) -> None:
    handle, _ = start()
    stub = ControlStub(channel_to(handle.address))
    w0 = _register(ps_server, 0)
    assert _push(ps_server, 0, w0, seq=1) == "applied"

    assert stub.Pause(pb.PauseRequest(), timeout=CALL_TIMEOUT_S).changed
    assert not stub.Pause(pb.PauseRequest(), timeout=CALL_TIMEOUT_S).changed  # idempotent
    assert ps_server.paused
    assert _push(ps_server, 0, w0, seq=2) == "paused"
    s = stub.GetStatus(pb.GetStatusRequest(), timeout=CALL_TIMEOUT_S)
    assert s.paused and s.model_version == 1

    reply = stub.Resume(pb.ResumeRequest(), timeout=CALL_TIMEOUT_S)
    assert reply.changed and reply.model_version == 1
    assert _push(ps_server, 0, w0, seq=2) == "applied"  # the held push goes through on retry
    assert ps_server.version == 2 and not ps_server.paused


def test_after_shutdown_pause_and_checkpoint_are_refused(start: Callable[..., Any], channel_to: Callable[..., Any]) -> None:
    handle, shutdown = start()
    stub = ControlStub(channel_to(handle.address))
    stub.Shutdown(pb.ShutdownRequest(), timeout=CALL_TIMEOUT_S)
    assert shutdown.is_set() and handle.shutdown_requested
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=CALL_TIMEOUT_S).shutting_down
    for call in (lambda: stub.Pause(pb.PauseRequest(), timeout=CALL_TIMEOUT_S),
                 lambda: stub.Checkpoint(pb.CheckpointRequest(), timeout=CALL_TIMEOUT_S)):
        code, details = _code(call)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "shutting down" in details


def test_token_is_required_on_control_but_not_on_health(
    start: Callable[..., Any], channel_to: Callable[..., Any], ps_server: InProcessServer, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    handle, _ = start(token_file=str(token_file))
    ch = channel_to(handle.address)
    stub = ControlStub(ch)

    code, details = _code(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=CALL_TIMEOUT_S))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "missing" in details
    code, details = _code(lambda: stub.Pause(pb.PauseRequest(), metadata=bearer_metadata("nope"), timeout=CALL_TIMEOUT_S))
    assert code == grpc.StatusCode.UNAUTHENTICATED and details == "wrong token"
    assert not ps_server.paused  # the refused call did nothing

    assert stub.Pause(pb.PauseRequest(), metadata=bearer_metadata(TOKEN), timeout=CALL_TIMEOUT_S).changed
    assert ps_server.paused
    assert _health(ch) == "NOT_SERVING"  # probes need no token

    registry = ps_server.metrics.registry
    assert registry.get_sample_value("rpcps_control_requests_total", {"method": "GetStatus", "code": "UNAUTHENTICATED"}) == 1
    assert registry.get_sample_value("rpcps_control_requests_total", {"method": "Pause", "code": "UNAUTHENTICATED"}) == 1
    assert registry.get_sample_value("rpcps_control_requests_total", {"method": "Pause", "code": "OK"}) == 1


def test_a_taken_port_is_a_clear_error(start: Callable[..., Any], ps_server: InProcessServer) -> None:
    handle, _ = start()
    with pytest.raises(OSError, match="choose another --control-port"):
        start_control_server(
            ps_server.core,
            ControlConfig(addr="127.0.0.1", port=handle.port),
            checkpoint=None,
            request_shutdown=lambda: None,
            registry=ps_server.core.metrics.registry,
        )


def test_tls_round_trip(start: Callable[..., Any], channel_to: Callable[..., Any], tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    handle, _ = start(tls_cert=str(cert), tls_key=str(key))
    secure = channel_to(handle.address, grpc.ssl_channel_credentials(root_certificates=cert.read_bytes()))
    assert ControlStub(secure).GetStatus(pb.GetStatusRequest(), timeout=CALL_TIMEOUT_S).mode == "async"
    assert _health(secure) == "NOT_SERVING"
    # A plaintext client gets nothing out of a TLS server.
    code, _ = _code(lambda: ControlStub(channel_to(handle.address)).GetStatus(pb.GetStatusRequest(), timeout=5))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_ctl_cli_against_a_live_server(
    start: Callable[..., Any], ps_server: InProcessServer, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    handle, shutdown = start(token_file=str(token_file))
    handle.set_serving(True)
    w0 = _register(ps_server, 0)
    assert _push(ps_server, 0, w0, seq=1) == "applied"
    auth = ("--token-file", str(token_file))

    human = run_ctl(handle.address, "status", *auth)
    assert human.returncode == 0, human.stderr
    assert "model version 1" in human.stdout and "health        SERVING" in human.stdout
    assert "slot 0" in human.stdout and "checkpoint    none yet" in human.stdout

    ck = run_ctl(handle.address, "checkpoint", *auth, "--json")
    assert ck.returncode == 0, ck.stderr
    answer = json.loads(ck.stdout)
    assert answer["version"] == 1 and Path(answer["path"]).exists()

    status = json.loads(run_ctl(handle.address, "status", *auth, "--json").stdout)
    assert status["newest_checkpoint"]["path"] == answer["path"]
    assert status["workers"][0]["slot"] == 0 and status["health"] == "SERVING"

    paused = run_ctl(handle.address, "pause", *auth)
    assert paused.returncode == 0 and paused.stdout.startswith("paused at version 1") and ps_server.paused
    assert run_ctl(handle.address, "resume", *auth).stdout.startswith("resumed at version 1") and not ps_server.paused

    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    refused = run_ctl(handle.address, "shutdown", "--token-file", str(wrong))
    assert refused.returncode == 1 and not shutdown.is_set()
    assert refused.stderr.strip().count("\n") == 0 and "wrong token" in refused.stderr
    assert "Traceback" not in refused.stderr

    done = run_ctl(handle.address, "shutdown", *auth)
    assert done.returncode == 0 and done.stdout.startswith("shutdown requested") and shutdown.is_set()


def test_ctl_cli_imports_no_torch(start: Callable[..., Any]) -> None:
    """``rpcps ctl`` is a gRPC client: torch would add 2-3 s of start-up to every call and do nothing."""
    handle, _ = start()
    handle.set_serving(True)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(ENTRY), "ctl", "status", "--addr", handle.address, "--timeout-s", "20"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    modules = imported_modules(done.stderr)
    assert "cli.ctl_config" in modules  # the importtime lines were read at all
    assert sorted(m for m in modules if m == "torch" or m.startswith("torch.")) == []


def test_ctl_cli_unreachable_server_is_one_line(start: Callable[..., Any]) -> None:
    handle, _ = start()
    address = handle.address
    handle.stop(grace_s=0)  # the port was ours a moment ago; nothing listens there now
    result = run_ctl(address, "status")
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "unavailable" in result.stderr and "Traceback" not in result.stderr


def test_ctl_export_streams_the_live_model_loadable_into_plain_pytorch(
    start: Callable[..., Any], ps_server: InProcessServer, tmp_path: Path
) -> None:
    handle, _ = start()
    handle.set_serving(True)
    w0 = _register(ps_server, 0)
    assert _push(ps_server, 0, w0, seq=1) == "applied"
    out = tmp_path / "model.pt"
    result = run_ctl(handle.address, "export", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["model_version"] == 1 and answer["bytes"] == out.stat().st_size and answer["format"] == "torch"
    model = teacher_student_model()
    model.load_state_dict(torch.load(out, weights_only=True))
    for name, value in ps_server.master_tensors().items():
        assert torch.equal(model.state_dict()[name], value), name
    missing = run_ctl(handle.address, "export")
    assert missing.returncode == 2 and "needs --out" in missing.stderr


def test_export_of_one_shard_of_several_is_refused(channel_to: Callable[..., Any], tmp_path: Path) -> None:
    shard = InProcessServer(teacher_student_model(), ServerCoreConfig(shard_count=2, shard_index=1))
    handle = start_control_server(
        shard.core, ControlConfig(addr="127.0.0.1", port=0), checkpoint=None, request_shutdown=lambda: None,
        registry=shard.core.metrics.registry,
    )
    try:
        pieces = ControlStub(channel_to(handle.address)).ExportModel(pb.ExportModelRequest(), timeout=CALL_TIMEOUT_S)
        code, details = _code(lambda: next(pieces))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "rpcps export --checkpoint" in details
    finally:
        handle.stop(grace_s=0)
