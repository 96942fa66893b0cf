"""Bearer-token checks, token files and control-plane config validation (pure logic)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ps.control.auth import bearer_metadata, check_bearer, read_token
from ps.control.control_service import ControlConfig

TOKEN = "s3cret-token"


def test_right_token_is_accepted() -> None:
    assert check_bearer(bearer_metadata(TOKEN), TOKEN) is None


def test_scheme_is_case_insensitive_and_bytes_values_work() -> None:
    assert check_bearer([("authorization", "bearer " + TOKEN)], TOKEN) is None
    assert check_bearer([("authorization", ("Bearer " + TOKEN).encode())], TOKEN) is None


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ([], "missing 'authorization: Bearer <token>'"),
        ([("x-other", "Bearer " + TOKEN)], "missing"),
        ([("authorization", "Bearer wrong")], "wrong token"),
        ([("authorization", "Bearer " + TOKEN + "x")], "wrong token"),
        ([("authorization", TOKEN)], "not of the form"),
        ([("authorization", "Basic " + TOKEN)], "not of the form"),
        ([("authorization", "Bearer ")], "not of the form"),
        ([("authorization", "Bearer " + TOKEN), ("authorization", "Bearer " + TOKEN)], "more than one"),
    ],
)
def test_refusals_say_why(metadata: list[tuple[str, str]], expected: str) -> None:
    reason = check_bearer(metadata, TOKEN)
    assert reason is not None and expected in reason
    assert TOKEN not in reason  # a refusal never echoes the secret


def test_read_token_strips_the_trailing_newline(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    assert read_token(str(f)) == TOKEN


@pytest.mark.parametrize(("content", "expected"), [("", "is empty"), ("  \n", "is empty"), ("two words", "one token")])
def test_read_token_refuses_bad_files(tmp_path: Path, content: str, expected: str) -> None:
    f = tmp_path / "token"
    f.write_text(content)
    with pytest.raises(ValueError, match=expected) as info:
        read_token(str(f))
    assert str(f) in str(info.value)


def test_read_token_names_a_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(OSError, match=f"cannot read token file {missing}"):
        read_token(str(missing))


def test_warns_about_a_token_file_others_can_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from ps.control.auth import warn_if_readable_by_others

    f = tmp_path / "token"
    f.write_text(TOKEN)
    os.chmod(f, 0o600)
    warn_if_readable_by_others(str(f))
    assert "readable by other users" not in caplog.text
    os.chmod(f, 0o644)
    warn_if_readable_by_others(str(f))
    assert "chmod 600" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"port": 70000}, "control port must be in"),
        ({"port": -1}, "control port must be in"),
        ({"tls_cert": "c.pem"}, "--tls-cert and --tls-key go together"),
        ({"tls_key": "k.pem"}, "--tls-cert and --tls-key go together"),
        ({"threads": 0}, "control threads"),
        ({"addr": ""}, "control addr"),
    ],
)
def test_control_config_validation(kwargs: dict[str, object], expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        ControlConfig(**kwargs)  # type: ignore[arg-type]


def test_control_config_defaults_are_valid() -> None:
    c = ControlConfig()
    assert (c.addr, c.port, c.token_file) == ("127.0.0.1", 9500, None)  # loopback unless a token protects it
