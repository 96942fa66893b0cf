"""store_host: the member that hosts the group's store is the one of rank 0; without one, a named error."""

from __future__ import annotations

import pytest

from rpcps.transport import TransportError, group, membership


def test_the_store_host_is_the_member_of_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(membership, "store_members", lambda: {"worker0_r1": 1, "ps_r0": 0})
    assert group.store_host() == "ps_r0"


def test_a_member_list_without_rank_0_names_what_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    # Was a bare StopIteration from next(), which named neither the list nor what was missing.
    monkeypatch.setattr(membership, "store_members", lambda: {"worker0_r1": 1})
    with pytest.raises(TransportError, match=r"no rank-0 member .*\[\('worker0_r1', 1\)\]"):
        group.store_host()
