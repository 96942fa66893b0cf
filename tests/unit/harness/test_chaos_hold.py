"""The chaos driver's hold: a due kill whose target is not ready pauses training, and fires only once
the target is ready, training resumed and every worker stepping again (pure logic: the processes'
/metrics, control planes and signals are stand-ins)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness import faults
from harness.faults import ChaosPlan, Kill, _Driver

PORTS = {"ps": 1, "ps_b": 2, "worker0": 3, "worker1": 4}


def test_a_kill_waiting_for_its_standby_holds_training_until_it_is_in_sync_and_the_workers_step_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    children = {name: {"pid": os.getpid(), "metrics_port": port, **({"control_port": 10 + port} if name.startswith("ps") else {})}
                for name, port in PORTS.items()}
    (tmp_path / "children.json").write_text(json.dumps(children))
    metrics = {1: {"rpcps_replica_role": 2, "rpcps_replica_standby_in_sync": 0, "rpcps_server_model_version": 12},
               2: {"rpcps_replica_role": 1, "rpcps_server_model_version": 12},
               3: {"rpcps_worker_steps_total": 6}, 4: {"rpcps_worker_steps_total": 6}}
    calls: list[tuple[str, str]] = []
    signalled: list[str] = []
    monkeypatch.setattr(faults, "try_scrape", lambda port: metrics[port])
    monkeypatch.setattr(faults.control, "pause", lambda address, timeout_s: calls.append(("pause", address)) or 12)
    monkeypatch.setattr(faults.control, "resume", lambda address, timeout_s: calls.append(("resume", address)) or 12)
    monkeypatch.setattr(_Driver, "_signal", staticmethod(lambda _children, target, _sig: signalled.append(target) or True))
    plan = ChaosPlan(workers=2, steps=100, replicas=2, kills=(Kill("primary", 10),))
    driver = _Driver(plan, tmp_path, [["ps", "ps_b"]])

    driver.step()  # due, but the standby is not in sync: the primary is paused
    assert calls == [("pause", "127.0.0.1:11")] and signalled == [] and driver.held
    metrics[1]["rpcps_replica_standby_in_sync"] = 1
    driver.step()  # ready: every server resumed, nothing killed yet
    assert sorted(calls[1:]) == [("resume", "127.0.0.1:11"), ("resume", "127.0.0.1:12")] and signalled == []
    metrics[3]["rpcps_worker_steps_total"] = 7
    driver.step()  # worker1 may still sleep in its pause poll: a kill now would stretch the recovery measured
    assert signalled == []
    metrics[4]["rpcps_worker_steps_total"] = 7
    driver.step()
    assert signalled == ["ps"] and [str(kill) for kill, _ in driver.fired] == ["primary@10"]
    assert len(calls) == 3, "no pause after the kill"
