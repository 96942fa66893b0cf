"""Settings declared once on the config classes: precedence, conversion, errors, child command lines."""

from __future__ import annotations

import dataclasses
import os
import typing

import pytest

from cli.config import LocalConfig
from cli.main import ROLES, parse
from ps.config import ServerRunConfig
from rpcps.address import Address
from rpcps.messages import Mode
from rpcps.settings import build, declared, to_argv
from worker.config import WorkerRunConfig

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's shell (or a torchrun parent) must not leak into these tests."""
    for key in list(os.environ):
        if key.startswith("RPCPS_") or key in TORCHRUN_VARS:
            monkeypatch.delenv(key)


def _worker(*argv: str) -> WorkerRunConfig:
    return parse(["worker", "--ps", "127.0.0.1:1", *argv])[1]


def test_defaults_apply_when_nothing_is_set() -> None:
    config = _worker()
    assert (config.worker.worker_index, config.worker.num_workers, config.worker.steps) == (0, 1, 300)
    assert parse(["ps"])[1] == ServerRunConfig()


def test_torchrun_variable_beats_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (_worker().worker.worker_index, _worker().worker.num_workers) == (3, 4)


def test_rpcps_variable_beats_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RPCPS_WORKER_INDEX", "2")
    assert _worker().worker.worker_index == 2


def test_flag_beats_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RPCPS_WORKER_INDEX", "2")
    monkeypatch.setenv("RPCPS_STEPS", "7")
    config = _worker("--worker-index", "1", "--steps", "9")
    assert (config.worker.worker_index, config.worker.steps) == (1, 9)


def test_environment_values_are_converted_like_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPCPS_LISTEN", "127.0.0.1:1234")
    monkeypatch.setenv("RPCPS_RPC_TRANSPORTS", "shm, uv")
    monkeypatch.setenv("RPCPS_OPTIMIZER_ARGS", '{"lr": 0.5}')
    monkeypatch.setenv("RPCPS_MODE", "sync")
    monkeypatch.setenv("RPCPS_CHUNK_MB", "0.5")
    config = parse(["ps"])[1]
    assert config.listen == Address("127.0.0.1", 1234)
    assert config.transport.rpc_transports == ("shm", "uv")
    assert config.core.optimizer.optimizer_kwargs == {"lr": 0.5}
    assert config.core.mode is Mode.SYNC and config.core.chunk_bytes == 512 * 1024


@pytest.mark.parametrize(
    ("role", "var", "raw", "message"),
    [
        ("worker", "RPCPS_STEPS", "abc", "RPCPS_STEPS='abc' is not a valid value for --steps: 'abc' is not an integer"),
        ("worker", "RANK", "x", "RANK='x' is not a valid value for --worker-index"),
        ("ps", "RPCPS_OPTIMIZER", "nope", "RPCPS_OPTIMIZER='nope' is not a valid value for --optimizer: 'nope' is not one of"),
        ("ps", "RPCPS_PREFETCH_PULL", "maybe", ""),  # not a ps setting: ignored
    ],
)
def test_a_bad_environment_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], role: str, var: str, raw: str, message: str
) -> None:
    monkeypatch.setenv(var, raw)
    argv = [role, *(["--ps", "h:1"] if role == "worker" else [])]
    if not message:
        parse(argv)
        return
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_worker_address_falls_back_to_torchrun_master(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "4567")
    assert parse(["worker"])[1].ps == Address("10.1.2.3", 4567)
    monkeypatch.setenv("RPCPS_PS", "127.0.0.1:999")
    assert parse(["worker"])[1].ps == Address("127.0.0.1", 999)


def test_worker_without_any_server_address_says_how_to_give_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(["worker"])
    assert exit_info.value.code == 2
    assert "--ps HOST:PORT" in capsys.readouterr().err


def test_lr_flag_overrides_lr_in_optimizer_args() -> None:
    config = parse(["ps", "--optimizer", "sgd", "--optimizer-args", '{"lr": 0.1, "momentum": 0.9}', "--lr", "0.5"])[1]
    assert config.core.optimizer.optimizer_kwargs == {"lr": 0.5, "momentum": 0.9}


def test_control_flags_build_the_control_config() -> None:
    config = parse(["ps", "--control-addr", "127.0.0.1", "--control-port", "0", "--control-token-file", "/t",
                    "--tls-cert", "/c", "--tls-key", "/k"])[1].control
    assert (config.addr, config.port, config.token_file, config.tls_cert, config.tls_key) == ("127.0.0.1", 0, "/t", "/c", "/k")


def test_ctl_reads_its_address_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPCPS_ADDR", "ps-0.example:9600")
    args, config = parse(["ctl", "status"])
    assert config.addr == Address("ps-0.example", 9600) and args.action == "status" and not args.json
    args, config = parse(["ctl", "pause", "--addr", "h:1", "--json"])  # the flag wins over the variable
    assert config.addr == Address("h", 1) and args.json


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["worker", "--ps", "h:1", "--steps", "-1"], "rpcps worker: error: --steps must be >= 1, got -1"),
        (["ps", "--async-beta2", "1"], "rpcps ps: error: --async-beta2 must be in [0, 1) (0.999 is torch's own), got 1.0"),
        (["ps", "--outer-lr", "-1"], "rpcps ps: error: outer lr must be > 0 (--outer-lr), got -1.0"),
        (["worker", "--steps", "ten"], "rpcps worker: error: argument --steps: 'ten' is not an integer (see `rpcps worker --help`)"),
        (["ps", "--listen", "nohost"], "rpcps ps: error: argument --listen: 'nohost' is not HOST:PORT (see `rpcps ps --help`)"),
        (["ps", "--mode", "bounded"], "rpcps ps: error: --mode 'bounded' needs max_staleness (--max-staleness K)"),
        (["ps", "--tls-cert", "/c"], "rpcps ps: error: --tls-cert and --tls-key go together: pass both for TLS, or neither for plaintext"),
        (["ctl", "restart"], None),
    ],
)
def test_a_bad_flag_is_one_line_that_names_it(capsys: pytest.CaptureFixture[str], argv: list[str], line: str | None) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    if line is not None:
        assert err == [line]
    else:
        assert "invalid choice: 'restart'" in err[0]


def test_a_message_about_a_field_behind_another_flag_keeps_its_words(capsys: pytest.CaptureFixture[str]) -> None:
    """``optimizer`` is the field of --sparse-optimizer; "optimizer 'sgd' ..." is about --optimizer."""
    with pytest.raises(SystemExit):
        parse(["ps", "--optimizer", "sgd", "--optimizer-args", '{"momentom": 0.9}'])
    assert capsys.readouterr().err.startswith("rpcps ps: error: optimizer 'sgd' has no setting 'momentom'; it accepts ['lr', ")


def test_choices_come_from_the_registries_that_implement_them() -> None:
    from ps.core.optim import OPTIMIZERS, SCHEDULES
    from rpcps.wire import WIRE_DTYPES

    by_flag = {d.flag: d for d in declared(ServerRunConfig)}
    assert by_flag["--optimizer"].choices == sorted(OPTIMIZERS)
    assert by_flag["--lr-schedule"].choices == sorted(SCHEDULES)
    assert by_flag["--wire-dtype"].choices == list(WIRE_DTYPES)
    assert by_flag["--mode"].choices == [m.value for m in Mode]


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_flag_of_a_role_is_declared_once(role: str) -> None:
    """Within a role, a flag may appear on several fields only when they are the same setting
    (``local`` hands one --model to its server and its workers): same type, default and help."""
    groups: dict[str, list] = {}
    for d in ROLES[role].settings():
        groups.setdefault(d.flag, []).append(d)
    for flag, same in groups.items():
        first = same[0]
        for other in same[1:]:
            assert (other.type, other.default, other.setting.help) == (first.type, first.default, first.setting.help), flag


@pytest.mark.parametrize("config_class", [ServerRunConfig, WorkerRunConfig, LocalConfig])
def test_every_field_is_a_setting_a_group_or_a_documented_internal(config_class: type) -> None:
    """A field that is neither a setting nor a group is set by code; it must say so (a docstring in the source)."""
    import inspect

    def walk(cls: type) -> None:
        hints = typing.get_type_hints(cls)
        source = inspect.getsource(cls)
        for f in dataclasses.fields(cls):
            if "rpcps.setting" in f.metadata:
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name])
                continue
            after = source.split(f"    {f.name}:", 1)[1].split("\n", 2)
            assert after[1].strip().startswith('"""'), f"{cls.__name__}.{f.name} is internal but undocumented"

    walk(config_class)


def test_a_child_command_line_reproduces_its_config() -> None:
    """``local`` starts children with to_argv(config): parsing it back must give the same config."""
    server = ServerRunConfig(
        listen=Address("127.0.0.1", 4000),
        metrics_port=0,
        core=dataclasses.replace(ServerRunConfig().core, mode=Mode.BOUNDED, max_staleness=3, chunk_bytes=1 << 20, shard_count=2),
    )
    server = dataclasses.replace(
        server,
        core=dataclasses.replace(server.core, optimizer=dataclasses.replace(server.core.optimizer, name="sgd", kwargs={"lr": 0.1}, lr=0.2)),
    )
    assert parse(["ps", *to_argv(server, declared(ServerRunConfig))])[1] == server
    worker = build(WorkerRunConfig, {}, ps=Address("::1", 5))
    worker = dataclasses.replace(worker, worker=dataclasses.replace(worker.worker, prefetch_pull=False, topk_ratio=0.25))
    assert parse(["worker", *to_argv(worker, declared(WorkerRunConfig))])[1] == worker


def test_local_hands_shared_settings_to_server_and_workers() -> None:
    config = parse(["local", "--model", "m:f", "--workers", "3", "--rpc-timeout-s", "7"])[1]
    assert config.server.model == config.worker.model == "m:f"
    assert config.workers == 3 and config.server.transport.rpc_timeout_s == 7.0
