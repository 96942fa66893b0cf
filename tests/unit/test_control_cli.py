"""The ps role's control-plane flags and the ctl subcommand's parsing (no server involved)."""

from __future__ import annotations

import pytest

from rpcps import cli, ctl
from rpcps.options import resolve


def _values(argv: list[str]) -> tuple[dict[str, object], object]:
    parser, tables = cli.build_parser()
    args = parser.parse_args(argv)
    sub = parser._subparsers._group_actions[0].choices[args.role]  # type: ignore[union-attr]
    options = tables.get(args.role, ctl.OPTIONS)
    return resolve(args, options, sub), args


def test_ps_control_flags_build_a_control_config() -> None:
    values, _ = _values(["ps", "--control-addr", "127.0.0.1", "--control-port", "0", "--control-token-file", "/t",
                         "--tls-cert", "/c", "--tls-key", "/k"])
    c = cli.control_config(values)
    assert (c.addr, c.port, c.token_file, c.tls_cert, c.tls_key) == ("127.0.0.1", 0, "/t", "/c", "/k")


def test_ps_control_defaults() -> None:
    values, _ = _values(["ps"])
    c = cli.control_config(values)
    assert (c.addr, c.port, c.token_file, c.tls_cert) == ("0.0.0.0", 9500, None, None)


def test_tls_cert_without_key_is_refused_by_name() -> None:
    values, _ = _values(["ps", "--tls-cert", "/c"])
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        cli.control_config(values)


def test_ctl_reads_its_address_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPCPS_ADDR", "ps-0.example:9600")
    values, args = _values(["ctl", "status"])
    assert values["addr"] == ("ps-0.example", 9600) and args.action == "status" and not args.json
    values, args = _values(["ctl", "pause", "--addr", "h:1", "--json"])  # the flag wins over the variable
    assert values["addr"] == ("h", 1) and args.json


def test_ctl_refuses_an_unknown_action(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _values(["ctl", "restart"])
    assert info.value.code == 2 and "invalid choice: 'restart'" in capsys.readouterr().err
