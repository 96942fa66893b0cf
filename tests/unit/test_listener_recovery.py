"""When a server whose RPC listener was closed restarts itself: on demand, rate-limited."""

from __future__ import annotations

from ps.lifecycle.listener_recovery import MAX_WAIT_S, MIN_UPTIME_S, ListenerRecovery


class Ranks:
    def __init__(self) -> None:
        self.value: int | None = 5

    def __call__(self) -> int | None:
        return self.value


def test_a_scan_alone_does_not_restart_a_server_until_the_wait_is_over() -> None:
    ranks = Ranks()
    r = ListenerRecovery(started=0.0, ranks_handed_out=ranks)
    assert r.restart_due(100.0) is None  # nothing lost
    r.on_lost(100.0)
    assert r.restart_due(100.0 + MAX_WAIT_S - 1) is None  # running workers carry on
    assert r.restart_due(100.0 + MAX_WAIT_S) is not None


def test_a_joining_process_restarts_it_but_not_sooner_than_the_minimum_uptime() -> None:
    ranks = Ranks()
    r = ListenerRecovery(started=0.0, ranks_handed_out=ranks)
    r.on_lost(2.0)
    ranks.value = 6  # a process took a rank: it is trying to join
    assert r.restart_due(MIN_UPTIME_S - 1) is None
    assert r.restart_due(MIN_UPTIME_S) == "a process is trying to join"


def test_an_unreadable_counter_falls_back_to_the_wait() -> None:
    ranks = Ranks()
    ranks.value = None
    r = ListenerRecovery(started=0.0, ranks_handed_out=ranks)
    r.on_lost(20.0)
    ranks.value = 9
    assert r.restart_due(30.0) is None
    assert r.restart_due(20.0 + MAX_WAIT_S) is not None


def test_later_losses_keep_the_first_time() -> None:
    r = ListenerRecovery(started=0.0, ranks_handed_out=Ranks())
    r.on_lost(20.0)
    r.on_lost(50.0)
    assert r.lost_since == 20.0
