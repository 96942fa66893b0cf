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


def test_before_publication_calls_hear_the_server_is_starting() -> None:
    endpoints.withdraw()
    assert endpoints.server_ref().kind == "ServerStarting"  # type: ignore[union-attr]
    assert endpoints.shard_count("x").kind == "ServerStarting"  # type: ignore[union-attr]
