"""A standby that leaves tells its primary which way: stopping (a shutdown, a restart to claim the
shard again) drops it from a primary that goes on serving; only a standby that is promoting fences
the primary. CI once saw a SIGTERM'd standby depose its healthy primary. A standby its primary
dropped from the view leaves too, instead of waiting to promote from a state that misses updates."""

from __future__ import annotations

from types import SimpleNamespace

from ps.replication.auth import attach_proof
from ps.replication.primary import Primary
from ps.replication.standby import Standby
from rpcps.errors import ServerStopping
from rpcps.jobsecret import JobSecret
from rpcps.messages import Ack, ErrorReply, Fenced, Mark, View
from rpcps.transport.registry import ViewRecord, encode_view

from .fakes import COMPAT, make_primary, make_standby

SECRET = JobSecret("s" * 40)
ATTACH_ID = "a" * 32


def _following() -> Standby:
    standby = make_standby(SECRET)
    standby.primary, standby.epoch, standby.attach_id = "server0", 1, ATTACH_ID
    assert isinstance(standby.append(ATTACH_ID, 1, "server0", [Mark(1, 1, 0, 0)], 0.0, False), Ack)
    return standby


def test_a_stopped_standby_asks_to_be_dropped_and_does_not_fence_its_primary() -> None:
    standby = _following()
    standby.stop()
    reply = standby.append(ATTACH_ID, 1, "server0", [Mark(2, 1, 0, 0)], 0.0, False)
    assert isinstance(reply, ErrorReply) and reply.kind == ServerStopping.__name__, reply
    assert standby.log.last_index == 1  # nothing taken in after it stopped


def test_a_promoting_standby_fences_its_old_primary() -> None:
    standby = _following()
    assert standby._leave(promoting=True)
    assert standby.append(ATTACH_ID, 1, "server0", [Mark(2, 1, 0, 0)], 0.0, False) == Fenced(2, None)
    standby.stop()  # a shutdown after the promotion began changes nothing
    assert standby.append(ATTACH_ID, 1, "server0", [], 0.0, False) == Fenced(2, None)


def _with_follower() -> Primary:
    primary = make_primary(SECRET)
    attached = primary.attach("server1", COMPAT, *attach_proof(SECRET, "server1", "server0"))
    primary.ready(attached.attach_id)
    assert primary._follower is not None
    return primary


def test_a_primary_drops_a_standby_that_stopped_and_keeps_serving() -> None:
    primary = _with_follower()
    follower = primary._follower
    follower.in_flight = 1
    primary._on_reply(follower, 0.0, ErrorReply(ServerStopping.__name__, "standby server1 stopped following"), None)
    assert follower.failed is not None and "stopped following" in follower.failed
    assert not primary.server.deposed and primary.metrics.stepdowns._value.get() == 0


def test_a_primary_fenced_by_its_standby_steps_down() -> None:
    primary = _with_follower()
    follower = primary._follower
    follower.in_flight = 1
    primary._on_reply(follower, 0.0, Fenced(2, None), None)
    assert primary.server.deposed and primary.metrics.stepdowns._value.get() == 1


def _reading(standby: Standby, view: View) -> list[str]:
    """Has ``standby`` check the shard's view, finding ``view``; returns why it detached (if it did)."""
    detached: list[str] = []
    standby._on_detached = detached.append
    standby.registry = SimpleNamespace(view=lambda shard: ViewRecord(view, encode_view(view)))
    standby._check_view()
    return detached


def test_a_standby_dropped_from_its_primarys_view_detaches_at_its_next_look() -> None:
    standby = _following()
    assert _reading(standby, View(1, "server0", "server1")) == [] and standby.in_view
    detached = _reading(standby, View(1, "server0", None))  # the same epoch and primary: a drop
    assert len(detached) == 1 and "moved on without this standby" in detached[0], detached
    assert standby._leaving.is_set() and not standby._promoting  # it neither promotes nor fences its primary


def test_a_standby_still_catching_up_waits_for_the_view_that_adds_it() -> None:
    standby = _following()
    assert _reading(standby, View(1, "server0", None)) == []
    assert not standby.in_view and not standby._leaving.is_set()
