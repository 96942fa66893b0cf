"""``rpcps ctl`` (the real command line) against a real ``rpcps ps`` whose control plane requires a
token and speaks TLS only: the flags, the server's wiring of them and the client's errors end to end.

tests/integration/ps/test_control.py covers the control plane itself in-process; this is what an
operator does with the two processes, including getting it wrong.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from harness.procs import ProcessGroup, free_port, wait_until
from tests.integration.certs import self_signed
from tests.integration.conftest import run_ctl

pytestmark = pytest.mark.integration


def _one_line(stderr: str, starts: str) -> str:
    """The single stderr line of a failed ctl call; no traceback or gRPC noise around it."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(starts), stderr
    return lines[0]


@pytest.mark.timeout(150)
def test_ctl_over_tls_with_a_token_and_the_ways_to_get_it_wrong(procs: ProcessGroup, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(16) + "\n")
    token.chmod(0o600)
    address = f"127.0.0.1:{free_port()}"
    ps, _, _ = procs.ps("ps", "--control-addr", "127.0.0.1", "--control-port", address.rsplit(":", 1)[1],
                        "--control-token-file", str(token), "--tls-cert", str(cert), "--tls-key", str(key))
    wait_until(lambda: "control plane health: SERVING" in ps.stderr(), 60, "the server's control plane to serve")
    assert f"control plane on {address} (TLS" in ps.stderr()
    auth = ("--token-file", str(token), "--tls-ca", str(cert))

    status = run_ctl(address, "status", *auth)
    assert status.returncode == 0, status.stderr
    assert "health        SERVING" in status.stdout and "model version 0" in status.stdout
    paused = run_ctl(address, "pause", *auth)
    assert paused.returncode == 0 and paused.stdout.startswith("paused at version 0"), paused.stdout + paused.stderr
    assert "state         paused" in run_ctl(address, "status", *auth).stdout

    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    refused = run_ctl(address, "resume", "--token-file", str(wrong), "--tls-ca", str(cert))
    assert refused.returncode == 1
    assert "refused the call: wrong token" in _one_line(refused.stderr, "rpcps ctl resume: ")
    assert "state         paused" in run_ctl(address, "status", *auth).stdout, "a refused call must change nothing"

    anonymous = run_ctl(address, "status", "--tls-ca", str(cert))
    assert anonymous.returncode == 1 and "pass --token-file" in _one_line(anonymous.stderr, "rpcps ctl status: ")

    # Without the CA, a client speaks plaintext to a TLS-only server: nothing gets through.
    plaintext = run_ctl(address, "status", "--token-file", str(token))
    assert plaintext.returncode == 1
    assert "is unavailable" in _one_line(plaintext.stderr, f"rpcps ctl status: {address}")
    missing_ca = run_ctl(address, "status", "--token-file", str(token), "--tls-ca", str(tmp_path / "no-such-ca.pem"))
    assert missing_ca.returncode == 2
    assert f"cannot read --tls-ca {tmp_path / 'no-such-ca.pem'}" in _one_line(missing_ca.stderr, "rpcps ctl status: error: ")
    assert ps.alive()
