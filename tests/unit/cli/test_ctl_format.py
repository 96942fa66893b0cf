"""Formatting of `rpcps ctl` answers and errors (pure logic over real protobuf messages)."""

from __future__ import annotations

import json

import grpc
import pytest

from cli.ctl import describe_error, format_age, format_result, format_status, status_dict
from ps.control import control_pb2 as pb


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.04, "0.0s"), (3.25, "3.2s"), (42.9, "42s"), (185, "3m05s"), (7380, "2h03m"), (93600, "1d02h")],
)
def test_format_age(seconds: float, text: str) -> None:
    assert format_age(seconds) == text


def _status(**kw: object) -> pb.GetStatusResponse:
    base: dict[str, object] = {
        "model_version": 1234, "mode": "async", "optimizer": "adam", "uptime_seconds": 3725.0, "server_id": "abc",
        "checkpointing_enabled": True,
    }
    base.update(kw)
    return pb.GetStatusResponse(**base)  # type: ignore[arg-type]


def test_status_dict_keeps_absent_fields_absent() -> None:
    r = _status(workers=[pb.WorkerStatus(slot=0, last_push_age_seconds=0.0), pb.WorkerStatus(slot=3)])
    d = status_dict(r)
    # 0.0 is a real age (just pushed) and must not be confused with "never pushed".
    assert d["workers"] == [{"slot": 0, "last_push_age_seconds": 0.0}, {"slot": 3, "last_push_age_seconds": None}]
    assert d["newest_checkpoint"] is None and d["checkpoint_error"] is None
    json.dumps(d)  # --json must be able to print it


def test_status_text_names_state_workers_and_checkpoint() -> None:
    r = _status(
        paused=True,
        workers=[pb.WorkerStatus(slot=0, last_push_age_seconds=1.5), pb.WorkerStatus(slot=7)],
        newest_checkpoint=pb.CheckpointInfo(path="/ck/step-1200", version=1200, age_seconds=65),
    )
    text = format_status({**status_dict(r), "address": "h:9500", "health": "SERVING"})
    assert "state         paused" in text
    assert "model version 1234" in text
    assert "uptime        1h02m" in text
    assert "/ck/step-1200 (version 1200, 1m05s ago)" in text
    assert "live workers  2" in text
    assert "slot 0     last push 1.5s ago" in text
    assert "slot 7     last push never" in text
    assert "health        SERVING" in text


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"checkpointing_enabled": False}, "not configured (--checkpoint-dir)"),
        ({}, "none yet"),
        ({"checkpoint_error": "gone"}, "unreadable: gone"),
        ({"shutting_down": True, "paused": True}, "state         shutting down"),
    ],
)
def test_status_text_variants(kw: dict[str, object], expected: str) -> None:
    assert expected in format_status(status_dict(_status(**kw)))


@pytest.mark.parametrize(
    ("action", "d", "expected"),
    [
        ("checkpoint", {"path": "/ck/a", "version": 5}, "checkpoint written: /ck/a (version 5)"),
        ("pause", {"changed": True, "model_version": 9}, "paused at version 9"),
        ("pause", {"changed": False, "model_version": 9}, "already paused at version 9"),
        ("resume", {"changed": True, "model_version": 9}, "resumed at version 9"),
        ("resume", {"changed": False, "model_version": 9}, "was not paused"),
        ("shutdown", {"changed": True}, "shutdown requested"),
        ("shutdown", {"changed": False}, "shutdown already requested"),
    ],
)
def test_action_results(action: str, d: dict[str, object], expected: str) -> None:
    assert format_result(action, d).startswith(expected)


def test_errors_are_one_line_with_advice() -> None:
    auth = describe_error("h:1", grpc.StatusCode.UNAUTHENTICATED, "wrong token", 5)
    assert "wrong token" in auth and "--token-file" in auth
    slow = describe_error("h:1", grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", 2.5)
    assert "within 2.5 s" in slow and "--timeout-s" in slow
    pre = describe_error("h:1", grpc.StatusCode.FAILED_PRECONDITION, "checkpointing is not configured\n", 5)
    assert pre == "h:1 answered FAILED_PRECONDITION: checkpointing is not configured"
    plain_to_tls = describe_error("h:1", grpc.StatusCode.UNAVAILABLE, "last error: UNAVAILABLE: Socket closed", 5)
    assert plain_to_tls.endswith("(if the server uses TLS, pass --tls-ca)")
    tls_to_plain = describe_error("h:1", grpc.StatusCode.UNAVAILABLE, "Tls handshake failed", 5, tls=True)
    assert "is the server plaintext?" in tls_to_plain
    refused = describe_error("h:1", grpc.StatusCode.UNAVAILABLE, "Connection refused", 5)
    assert refused == "h:1 is unavailable: Connection refused"
    for line in (auth, slow, pre):
        assert "\n" not in line


def test_status_shows_the_replica_set_and_warns_when_a_shard_runs_without_its_standby() -> None:
    paired = pb.ReplicaStatus(role="primary", epoch=3, primary="ps0_r7", standby="ps0_r9", lag_updates=1, lag_seconds=0.012,
                              failovers=1, configured=2)
    d = status_dict(_status(replica=paired))
    assert d["replica"] == {"role": "primary", "epoch": 3, "primary": "ps0_r7", "standby": "ps0_r9", "lag_updates": 1.0,
                            "lag_seconds": pytest.approx(0.012), "failovers": 1, "configured": 2, "replication": "sync",
                            "max_lag": 0, "unreplicated": 0.0}
    text = format_status(d)
    assert "replica       primary, epoch 3, 1 failover(s) by this process" in text
    assert "  standby     ps0_r9\n" in text
    assert "  lag         1 updates / 0.012s" in text
    assert "  replication sync (a push is acknowledged once the standby holds it)" in text
    alone = format_status(status_dict(_status(replica=pb.ReplicaStatus(role="primary", epoch=4, primary="ps0_r9", configured=2))))
    assert "standby     none (WARNING: started with --replicas 2" in alone
    assert "replication" not in alone and "lag" not in alone, "no replication mode or lag on a shard without a standby"
    single = format_status(status_dict(_status(replica=pb.ReplicaStatus(role="primary", epoch=1, primary="ps0_r0", configured=1))))
    assert "replica" not in single and "standby" not in single, "a --replicas 1 shard says nothing of replication"
    assert status_dict(_status())["replica"] is None and "replica" not in format_status(status_dict(_status()))


def test_status_says_what_an_asynchronous_standby_may_lack() -> None:
    ahead = pb.ReplicaStatus(role="primary", epoch=2, primary="ps0_r1", standby="ps0_r2", configured=2, replication="async",
                             max_lag=8, unreplicated=3)
    text = format_status(status_dict(_status(replica=ahead)))
    assert "  replication async, at most 8 updates behind; 3 acknowledged and not on the standby" in text


def test_status_says_how_many_threads_the_server_computes_with() -> None:
    d = status_dict(_status(intra_op_threads=3))
    assert d["intra_op_threads"] == 3
    assert "threads       3 intra-op" in format_status({**d, "address": "h:9500", "health": "SERVING"})
