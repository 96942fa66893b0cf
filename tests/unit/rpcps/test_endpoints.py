"""The worker API's endpoints serve the published object only to calls that carry its token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rpcps import endpoints
from rpcps.messages import ErrorReply


class _Api:
    def shard_count(self) -> int:
        return 3


@pytest.fixture
def published() -> Iterator[Any]:
    endpoints.publish(_Api())  # type: ignore[arg-type]
    yield endpoints.server_ref()
    endpoints.withdraw()


def test_a_call_with_the_token_reaches_the_published_object(published: Any) -> None:
    assert isinstance(published, str) and len(published) >= 32
    assert endpoints.shard_count(published) == 3


@pytest.mark.parametrize("ref", ["", "0" * 32, None, 7])
def test_a_call_without_the_token_is_refused(published: Any, ref: Any) -> None:
    reply = endpoints.shard_count(ref)
    assert isinstance(reply, ErrorReply) and reply.kind == "UnknownWorker"


def test_every_publication_has_its_own_token(published: Any) -> None:
    endpoints.publish(_Api())  # type: ignore[arg-type]
    assert isinstance(endpoints.shard_count(published), ErrorReply)  # a restarted server's old token is void


def test_before_publication_calls_hear_the_server_is_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoints, "_published", None)
    monkeypatch.setattr(endpoints, "_unpublished", endpoints.STARTING)  # as a fresh process begins
    for reply in (endpoints.server_ref(), endpoints.shard_count("x")):
        assert isinstance(reply, ErrorReply) and reply.kind == "ServerStarting"
        assert "still starting" in reply.message


def test_after_withdrawal_calls_hear_it_withdrew_not_that_it_is_starting(published: Any) -> None:
    """A primary stepping down withdraws its API before it restarts itself: its workers' logs said
    "still starting (no model loaded yet)" of a server that had served for hours."""
    endpoints.withdraw()
    for reply in (endpoints.server_ref(), endpoints.shard_count(published)):
        assert isinstance(reply, ErrorReply) and reply.kind == "ServerStarting"  # what a worker retries
        assert "withdrew its API" in reply.message and "still starting" not in reply.message
