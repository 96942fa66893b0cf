"""The chaos driver's hold: a due kill whose target is not ready pauses training, and fires only once
the target is ready, training resumed and every worker stepping again (pure logic: the processes'
/metrics, control planes and signals are stand-ins)."""

from __future__ import annotations

import itertools
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


def test_the_driver_reads_each_replica_once_per_poll_and_polls_fast_only_near_a_planned_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "children.json").write_text(json.dumps({"ps": {"pid": os.getpid(), "metrics_port": 1}}))
    metrics = {1: {"rpcps_server_model_version": 0}}
    scrapes: list[int] = []
    monkeypatch.setattr(faults, "try_scrape", lambda port: scrapes.append(port) or metrics[port])
    monkeypatch.setattr(_Driver, "_signal", staticmethod(lambda _children, target, _sig: True))
    clock = itertools.count()
    monkeypatch.setattr(faults.time, "monotonic", lambda: float(next(clock)))  # a second per call: one per read here
    driver = _Driver(ChaosPlan(workers=1, steps=1000, kills=(Kill("ps", 100),)), tmp_path, [["ps"]])

    assert driver.poll_s() == faults.POLL_S, "nothing read yet: no rate to judge by"
    driver.step()
    assert scrapes == [1], "the version and the unreplicated updates come from one read"
    metrics[1]["rpcps_server_model_version"] = 10  # 10 updates/s, the kill 90 away
    driver.step()
    assert driver.poll_s() == faults.IDLE_POLL_S
    metrics[1]["rpcps_server_model_version"] = 96  # 86/s: the kill is due within NEAR_S
    driver.step()
    assert driver.poll_s() == faults.POLL_S
    metrics[1]["rpcps_server_model_version"] = 100
    driver.step()
    assert [str(kill) for kill, _ in driver.fired] == ["ps@100"] and driver.poll_s() == faults.IDLE_POLL_S
    lag = _Driver(ChaosPlan(workers=1, steps=1000, max_replica_lag=3), tmp_path, [["ps"]])
    lag.step()
    assert lag.poll_s() == faults.POLL_S, "a lag bound is sampled at the fast rate throughout"
