"""classify: torch RPC's error texts mapped onto retry (timeout), rejoin (unreachable), wait (unknown) or other."""

from __future__ import annotations

import pytest

from rpcps.transport import PeerTimeout, PeerUnknown, PeerUnreachable, classify


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("RPCErr:1:RPC ran for more than set timeout (2000 ms) and will now be marked with an error", PeerTimeout),
        ("ECONNRESET: connection reset by peer (this error originated at tensorpipe/...)", PeerUnreachable),
        ("ECONNREFUSED: connection refused", PeerUnreachable),
        ("eof (this error originated at tensorpipe/transport/shm/connection_impl.cc:259)", PeerUnreachable),
        # The server dropped this worker from its group while a cut link kept it away; the worker's
        # next call after the link healed got this (tests/integration/deploy/test_multihost.py).
        ("Error on Node 0: RuntimeError: name:ps,rank:0 could not find destination id 2", PeerUnreachable),
        ("Unknown destination worker ps1", PeerUnknown),
        ("EHOSTUNREACH: host is unreachable (this error originated at tensorpipe/transport/uv/connection_impl.cc:62)", PeerUnreachable),
        # A worker asking for shard 1 before that shard joined the group (test_scale_out.py).
        ("name:worker0_r2,rank:2 could not find destination name ps1", PeerUnknown),
        # One that joined while this worker did: listed, its address not yet learnt (bench.push_throughput in CI).
        ("name:worker0_r1,rank:1 could not find destination url for name ps1_r2", PeerUnknown),
    ],
)
def test_transport_failures_are_classified(text: str, kind: type) -> None:
    classified = classify(RuntimeError(text + "\nremote traceback ..."))
    assert type(classified) is kind
    assert str(classified) == text  # the first line only: no remote traceback in the worker's log


def test_an_error_the_callee_raised_on_purpose_is_left_alone() -> None:
    error = RuntimeError("Error on Node 0: ValueError: something the server code raised")
    assert classify(error) is error
    other = ValueError("not a transport error")
    assert classify(other) is other
