"""A push answered ``NotPrimary`` (or ``ServerStarting``) by the primary the view still names (``Trainer._complete_oldest``):
the worker asks that primary again every ``_LEASE_RETRY_S``, up to ``failover_timeout_s``, and gives up
at once when told to stop. Before, it read the same answered push again at once, for good: a worker
whose server stepped down while every process of a killed ``local`` was stopping spun a core and
never stopped."""

from __future__ import annotations

import threading
import time
from collections import deque
from types import MethodType, SimpleNamespace

import pytest

from rpcps.errors import NotPrimary, ServerStarting
from worker import trainer as trainer_module
from worker.trainer import Trainer, _InFlight

pytestmark = pytest.mark.timeout(30)


class _Answered:
    """A push already answered with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def done(self) -> bool:
        return True

    def wait(self) -> object:
        raise self.error


def _trainer(failover_timeout_s: float, error: type[Exception] = NotPrimary) -> SimpleNamespace:
    """The part of a Trainer that ``_complete_oldest`` uses, the view never moving (``_fail_over`` keeps the client)."""
    sent: list[int] = []
    fake = SimpleNamespace(
        config=SimpleNamespace(failover_timeout_s=failover_timeout_s),
        metrics=SimpleNamespace(in_flight=SimpleNamespace(set=lambda _: None)),
        _stop=threading.Event(),
        _in_flight=deque(),
        _moved=set(),
        sent=sent,
    )
    fake.shards = [SimpleNamespace(index=0, client=object(), unleased_since=None)]
    fake._fail_over = lambda link, error: None  # the store still names the same primary
    fake._push = lambda link, item: (sent.append(item.seq), setattr(item, "future", _Answered(error("not serving"))))
    for name in ("_complete_oldest", "_result", "_ask_unleased_again", "_resend_window"):
        setattr(fake, name, MethodType(getattr(Trainer, name), fake))
    fake._in_flight.extend(
        _InFlight(seq=s, shard=0, base_version=0, buffers=[], loss=None, batch=None, future=_Answered(error("not serving")))
        for s in (7, 8)
    )
    return fake


@pytest.mark.parametrize("error", [NotPrimary, ServerStarting])
def test_the_window_is_sent_again_after_a_pause_and_given_up_after_the_failover_timeout(error: type[Exception]) -> None:
    """ServerStarting: a primary that withdrew its API to step down (CI: a worker exited 1 on it)."""
    fake = _trainer(failover_timeout_s=0.5, error=error)
    started = time.monotonic()
    with pytest.raises(error):
        while True:
            fake._complete_oldest()
    took = time.monotonic() - started
    assert 0.5 <= took < 5.0
    rounds = len(fake.sent) // 2
    assert fake.sent == [7, 8] * rounds, "each retry sends the shard's whole window again, in step order"
    assert 2 <= rounds <= 0.5 / trainer_module._LEASE_RETRY_S + 1, "paced by _LEASE_RETRY_S, not read again at once"
    assert [i.seq for i in fake._in_flight] == [7, 8], "nothing is dropped from the window"


def test_a_worker_told_to_stop_gives_up_at_once() -> None:
    fake = _trainer(failover_timeout_s=60.0)
    fake._stop.set()
    started = time.monotonic()
    with pytest.raises(NotPrimary):
        fake._complete_oldest()
    assert time.monotonic() - started < 1.0
    assert fake.sent == []
