"""free_ports: a port handed out once is not handed out again by the same process while it is
remembered, even when the kernel offers it again (``local`` gave a server's control port to its
standby too: the server could never bind it), nor one another process claimed a moment ago (CI: a
test's process bound the control port ``local`` had chosen for its server)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rpcps import ports


class _ScriptedSocket:
    """Binds to the next port of a script: what a kernel that reuses released ports can do."""

    offers: Iterator[int]

    def bind(self, address: tuple[str, int]) -> None:
        self.port = next(self.offers)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def close(self) -> None:
        pass


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A claims directory of this test's own, so scripted ports claim nothing on the host."""
    monkeypatch.setattr(ports, "_CLAIMS", tmp_path / "claims")
    return tmp_path / "claims"


@pytest.mark.timeout(10)
def test_a_port_the_kernel_offers_again_is_skipped(monkeypatch: pytest.MonkeyPatch, claims: Path) -> None:
    monkeypatch.setattr(ports, "_handed_out", type(ports._handed_out)(maxlen=8))
    _ScriptedSocket.offers = iter([40001, 40001, 40002, 40001, 40002, 40003, 40004])
    monkeypatch.setattr(ports.socket, "socket", _ScriptedSocket)
    assert ports.free_port() == 40001
    assert ports.free_port() == 40002
    assert ports.free_ports(2) == [40003, 40004]


@pytest.mark.timeout(30)
def test_real_ports_are_distinct_and_bindable() -> None:
    chosen = [ports.free_port() for _ in range(50)] + ports.free_ports(50)
    assert len(set(chosen)) == 100
    with socket.socket() as s:
        s.bind(("127.0.0.1", chosen[-1]))


@pytest.mark.timeout(30)
def test_ports_come_from_below_the_ephemeral_range_and_a_taken_one_is_skipped(
    monkeypatch: pytest.MonkeyPatch, claims: Path
) -> None:
    band = ports._band()
    if band is None:
        pytest.skip("this kernel's ephemeral range leaves no band below it")  # not on Linux with the default range
    chosen = ports.free_ports(20)
    assert all(p in band for p in chosen), chosen
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", chosen[0]))
        picks = iter([chosen[0], chosen[1]])
        monkeypatch.setattr(ports, "_handed_out", type(ports._handed_out)(maxlen=8))
        monkeypatch.setattr(ports, "_CLAIMS", claims.with_name("fresh claims"))  # as if another process chose next
        monkeypatch.setattr(ports.random, "choice", lambda _band: next(picks))
        assert ports.free_port() == chosen[1]


@pytest.mark.timeout(10)
def test_a_port_another_process_claimed_is_skipped_until_its_claim_expires(
    monkeypatch: pytest.MonkeyPatch, claims: Path
) -> None:
    claims.mkdir()
    (claims / "40001").touch()  # another process chose 40001 a moment ago
    (claims / "40002").touch()
    expired = time.time() - ports._CLAIM_S - 1
    os.utime(claims / "40002", (expired, expired))  # ... and 40002 long ago
    monkeypatch.setattr(ports, "_handed_out", type(ports._handed_out)(maxlen=8))
    _ScriptedSocket.offers = iter([40001, 40002, 40003])
    monkeypatch.setattr(ports.socket, "socket", _ScriptedSocket)
    assert ports.free_port() == 40002
    assert time.time() - (claims / "40002").stat().st_mtime < ports._CLAIM_S, "taking an expired claim renews it"
    assert ports.free_port() == 40003
    assert (claims / "40003").exists()


@pytest.mark.timeout(10)
def test_without_a_writable_claims_directory_ports_are_still_chosen(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "file").touch()
    monkeypatch.setattr(ports, "_CLAIMS", tmp_path / "file" / "claims")  # cannot be made: a file is in the way
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
