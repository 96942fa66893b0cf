"""Option precedence (flag > RPCPS_* > torchrun variable > default) and the value converters."""

from __future__ import annotations

import argparse
import os
from typing import Any

import pytest

from rpcps import cli
from rpcps.options import csv, host_port, json_object, non_negative_int, positive_float, positive_int

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's shell (or a torchrun parent) must not leak into these tests."""
    for key in list(os.environ):
        if key.startswith("RPCPS_") or key in TORCHRUN_VARS:
            monkeypatch.delenv(key)


def _parse(role: str, *argv: str) -> tuple[dict[str, Any], argparse.ArgumentParser]:
    parser, tables = cli.build_parser()
    args = parser.parse_args([role, *argv])
    sub = parser._subparsers._group_actions[0].choices[role]  # type: ignore[union-attr]
    return cli.resolve(args, tables[role], sub), sub


def test_default_applies_when_nothing_is_set() -> None:
    values, _ = _parse("worker")
    assert values["worker_index"] == 0 and values["num_workers"] == 1 and values["steps"] == 300


def test_torchrun_variable_beats_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    values, _ = _parse("worker")
    assert values["worker_index"] == 3 and values["num_workers"] == 4


def test_rpcps_variable_beats_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("RPCPS_WORKER_INDEX", "2")
    values, _ = _parse("worker")
    assert values["worker_index"] == 2


def test_flag_beats_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("RPCPS_WORKER_INDEX", "2")
    monkeypatch.setenv("RPCPS_STEPS", "7")
    values, _ = _parse("worker", "--worker-index", "1", "--steps", "9")
    assert values["worker_index"] == 1 and values["steps"] == 9


def test_rpcps_variable_is_converted_like_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPCPS_LISTEN", "127.0.0.1:1234")
    monkeypatch.setenv("RPCPS_RPC_TRANSPORTS", "shm, uv")
    monkeypatch.setenv("RPCPS_OPTIMIZER_ARGS", '{"lr": 0.5}')
    values, _ = _parse("ps")
    assert values["listen"] == ("127.0.0.1", 1234)
    assert values["rpc_transports"] == ("shm", "uv")
    assert values["optimizer_args"] == {"lr": 0.5}


@pytest.mark.parametrize(
    ("role", "var", "raw", "message"),
    [
        ("worker", "RPCPS_STEPS", "abc", "RPCPS_STEPS='abc' is not a valid value for --steps"),
        ("worker", "RPCPS_STEPS", "-1", "RPCPS_STEPS='-1' is not a valid value for --steps: -1 is not >= 0"),
        ("worker", "RANK", "x", "RANK='x' is not a valid value for --worker-index"),
        ("ps", "RPCPS_OPTIMIZER", "nope", "RPCPS_OPTIMIZER='nope': choose one of ['sgd', 'adam'"),
    ],
)
def test_bad_environment_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], role: str, var: str, raw: str, message: str
) -> None:
    monkeypatch.setenv(var, raw)
    with pytest.raises(SystemExit) as exit_info:
        _parse(role)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_worker_address_falls_back_to_torchrun_master(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "4567")
    monkeypatch.setenv("LOCAL_RANK", "2")
    values, sub = _parse("worker")
    config = cli.worker_config(values, sub)
    assert (config.transport.host, config.transport.port) == ("10.1.2.3", 4567)
    assert config.metrics_port == 9412  # one metrics port per local rank, so workers on one host don't collide


def test_rpcps_ps_beats_torchrun_master(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("RPCPS_PS", "127.0.0.1:999")
    values, sub = _parse("worker")
    assert cli.worker_config(values, sub).transport.port == 999


def test_worker_without_any_server_address_says_how_to_give_one(capsys: pytest.CaptureFixture[str]) -> None:
    values, sub = _parse("worker")
    with pytest.raises(SystemExit):
        cli.worker_config(values, sub)
    assert "--ps HOST:PORT is required" in capsys.readouterr().err


def test_lr_flag_overrides_lr_in_optimizer_args() -> None:
    values, _ = _parse("ps", "--optimizer", "sgd", "--optimizer-args", '{"lr": 0.1, "momentum": 0.9}', "--lr", "0.5")
    optimizer = cli.server_config(values).core.optimizer
    assert optimizer.kwargs == {"lr": 0.5, "momentum": 0.9}


def test_converters_accept_good_and_name_bad_values() -> None:
    assert host_port("[::1]:80") == ("::1", 80)
    assert host_port("h:0") == ("h", 0)
    assert csv(" a, b ,,") == ("a", "b")
    assert positive_int("1") == 1 and non_negative_int("0") == 0 and positive_float("0.5") == 0.5
    for fn, text, message in [
        (host_port, "nohost", "is not HOST:PORT"),
        (host_port, ":80", "is not HOST:PORT"),
        (host_port, "h:70000", "port 70000 is out of range"),
        (positive_int, "0", "0 is not >= 1"),
        (non_negative_int, "-3", "-3 is not >= 0"),
        (positive_float, "0", "0.0 is not > 0"),
        (json_object, "[1]", "expected a JSON object"),
    ]:
        with pytest.raises(ValueError, match=message):
            fn(text)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["worker", "--steps", "-1"], "rpcps worker: error: argument --steps: -1 is not >= 0 (see `rpcps worker --help`)"),
        (["worker", "--steps", "ten"], "rpcps worker: error: argument --steps: 'ten' is not an integer (see `rpcps worker --help`)"),
        (["ps", "--listen", "nohost"], "rpcps ps: error: argument --listen: 'nohost' is not HOST:PORT (see `rpcps ps --help`)"),
    ],
)
def test_bad_flag_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str], line: str) -> None:
    parser, _ = cli.build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [line]
