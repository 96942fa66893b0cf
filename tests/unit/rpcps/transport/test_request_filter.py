"""The request filter's Python half: which types it allows, how it logs, and how it refuses to run
without a native build that fits. The refusals themselves, over real RPC:
tests/integration/security/test_hostile_builtin_ops.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rpcps import transport
from rpcps.transport import pickling, request_filter
from rpcps.transport.native import build


def test_accepted_types_resolve_by_name_and_an_unknown_name_fails_loudly() -> None:
    defined = {"SCRIPT_CALL": 256, "PYTHON_CALL": 258}
    assert request_filter.type_values(("PYTHON_CALL",), defined) == (258,)
    with pytest.raises(pickling.TorchInternalsChanged, match="PYTHON_CALL"):
        request_filter.type_values(("PYTHON_CALL",), {"SCRIPT_CALL": 256})


def test_the_native_build_accepts_only_python_calls() -> None:
    native = request_filter.load()
    assert native.built_for == build.torch_identity() and native.source_digest == build.source_digest()
    types = native.request_types()
    assert {"SCRIPT_CALL", "SCRIPT_REMOTE_CALL", "PYTHON_CALL", "FORWARD_AUTOGRAD_REQ", "RREF_USER_DELETE"} <= set(types)
    assert request_filter.type_values(request_filter.ACCEPTED_TYPES, types) == (types["PYTHON_CALL"],)


def test_refusals_log_the_first_of_each_type_then_one_line_per_window(caplog: pytest.LogCaptureFixture) -> None:
    announce = request_filter._Announcer(window_s=3600)
    with caplog.at_level(logging.WARNING, logger=request_filter.__name__):
        assert announce("SCRIPT_CALL", "SCRIPT_CALL", 10)
        assert not any(announce("SCRIPT_CALL", "SCRIPT_CALL", 10) for _ in range(1000))  # a flood: no lines
        assert announce("other", "type 0x1ff", 4)
        assert not announce("other", "type 0x1fe", 4)  # undefined values share one key
    assert len(caplog.records) == 2
    assert "SCRIPT_CALL request from a peer (10 bytes)" in caplog.records[0].getMessage()
    again = request_filter._Announcer(window_s=0.0)
    with caplog.at_level(logging.WARNING, logger=request_filter.__name__):
        again("SCRIPT_CALL", "SCRIPT_CALL", 1)
        again._last["SCRIPT_CALL"] += 10  # the next one falls inside the window
        again("SCRIPT_CALL", "SCRIPT_CALL", 1)
        again._last["SCRIPT_CALL"] -= 10
        again("SCRIPT_CALL", "SCRIPT_CALL", 1)
    assert "(1 more like it refused since the last line)" in caplog.records[-1].getMessage()


def test_a_refusal_is_counted_under_its_own_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[pickling.Refusal] = []
    monkeypatch.setattr(request_filter, "_on_refusal", None)  # put back after the test
    request_filter.install(on_refusal=seen.append)
    request_filter._refused(256, "SCRIPT_CALL", 176)
    assert [(r.kind, r.name, r.message_bytes) for r in seen] == [("message_type", "SCRIPT_CALL", 176)]
    assert "message_type" in transport.REFUSAL_KINDS and set(pickling.REFUSAL_KINDS) < set(transport.REFUSAL_KINDS)


def test_a_missing_or_foreign_build_fails_closed_naming_the_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(request_filter, "_native", None)
    monkeypatch.setattr(build, "BUILD_ROOT", tmp_path)
    monkeypatch.setattr(build, "build_dir", lambda: tmp_path / "torch-this")
    (tmp_path / "torch-other").mkdir()
    (tmp_path / "torch-other" / f"{build.MODULE_NAME}.so").write_bytes(b"")
    with pytest.raises(request_filter.FilterUnavailable, match=r"not built for torch .*found builds for: torch-other.*rpcps\.transport\.native"):
        request_filter.load()
    (tmp_path / "torch-this").mkdir()
    (tmp_path / "torch-this" / f"{build.MODULE_NAME}.so").write_bytes(b"not a shared object")
    with pytest.raises(request_filter.FilterUnavailable, match="does not load"):
        request_filter.load()


def test_a_build_for_another_torch_is_refused_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    request_filter.load()  # the real build, found where this torch's build belongs
    monkeypatch.setattr(request_filter, "_native", None)
    monkeypatch.setattr(build, "torch_identity", lambda: "9.9.9+cpu 0000000")
    with pytest.raises(request_filter.FilterUnavailable, match=r"was built for torch 2\.\d+.*this is torch 9\.9\.9\+cpu.*native"):
        request_filter.load()


def test_no_agent_is_built_unfiltered_when_the_filter_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_filter, "_allowed", ())
    with pytest.raises(request_filter.FilterUnavailable, match="protect"), request_filter.filtered_agents():
        pass
