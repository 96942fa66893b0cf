"""A standby learns that the shard's view names it from its primary's appends, not only from its own
read of the view every half second. Between the hand-over (the view names it; entries now wait for
its acknowledgement) and that read, a primary killed together with the coordinator left a standby
holding every acknowledged entry that found the restarted store empty, could not tell it was the
view's standby, and detached; the shard came back from an older snapshot (CI's every-role chaos
soak, seed 234013)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ps.replication import standby as standby_module
from ps.replication.standby import Standby
from rpcps.messages import Ack, Mark, View
from rpcps.transport.registry import ViewReading, ViewRecord, encode_view

from .fakes import make_standby

ATTACH_ID = "a" * 32


def _following() -> Standby:
    standby = make_standby(None)
    standby.primary, standby.epoch, standby.attach_id = "server0", 1, ATTACH_ID
    return standby


def test_an_append_that_says_the_view_names_this_standby_puts_it_in_the_view() -> None:
    standby = _following()
    assert isinstance(standby.append(ATTACH_ID, 1, "server0", [Mark(1, 1, 0, 0)], 0.0, False), Ack)
    assert not standby.in_view  # still catching up
    assert isinstance(standby.append(ATTACH_ID, 1, "server0", [Mark(2, 1, 0, 0)], 0.0, True), Ack)
    assert standby.in_view


def test_an_append_of_another_epoch_or_sender_does_not() -> None:
    standby = _following()
    standby.append(ATTACH_ID, 2, "server0", [], 0.0, True)
    standby.append(ATTACH_ID, 1, "server9", [], 0.0, True)
    assert not standby.in_view


@pytest.mark.timeout(30)
def test_told_by_its_primary_it_promotes_from_a_coordinator_restarted_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    standby = _following()
    standby.server.version = 7
    standby.append(ATTACH_ID, 1, "server0", [Mark(1, 1, 0, 0)], 0.0, True)
    written: list[View] = []

    def change_view(shard: int, expected: object, new: View) -> ViewRecord:
        written.append(new)
        return ViewRecord(new, encode_view(new))

    standby.registry = SimpleNamespace(read_view=lambda shard: ViewReading("", None), change_view=change_view)
    promoted: list[ViewRecord] = []
    detached: list[str] = []
    standby._on_promoted = lambda record, took: promoted.append(record)
    standby._on_detached = detached.append
    monkeypatch.setattr(standby_module, "_forget", lambda name, secret: None)
    standby.log.applied(standby.log.next_to_apply())  # what the applier thread does (the promotion drains to here)
    standby._promote("its process is gone")
    assert detached == [] and written == [View(2, "server1")]
    assert [r.view for r in promoted] == [View(2, "server1")] and standby.server.epoch == 2
