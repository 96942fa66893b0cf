"""classify_failure: torch RPC's error texts mapped onto retry (timeout), rejoin (peer dead) or other."""

from __future__ import annotations

import pytest

from rpcps.transport import OTHER, PEER_DEAD, TIMEOUT, classify_failure


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("RPCErr:1:RPC ran for more than set timeout (2000 ms) and will now be marked with an error", TIMEOUT),
        ("ECONNRESET: connection reset by peer (this error originated at tensorpipe/...)", PEER_DEAD),
        ("ECONNREFUSED: connection refused", PEER_DEAD),
        ("eof (this error originated at tensorpipe/transport/shm/connection_impl.cc:259)", PEER_DEAD),
        # The server dropped this worker from its group while a cut link kept it away; the worker's
        # next call after the link healed got this (tests/integration/test_multihost.py).
        ("Error on Node 0: RuntimeError: name:ps,rank:0 could not find destination id 2", PEER_DEAD),
        ("Error on Node 0: ValueError: something the server code raised", OTHER),
    ],
)
def test_classify_failure(text: str, kind: str) -> None:
    assert classify_failure(RuntimeError(text)) == kind
