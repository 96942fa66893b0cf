"""The membership reaper (``ps.lifecycle.reaper``) judges each member's failed ping on its own, whatever the
failure, and logs a failure that repeats every sweep once, with a count (issue 24, part 5: a worker
that exited without leaving made every sweep raise ``PeerUnknown`` before any member was judged)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry
from torch.futures import Future

from ps.core.metrics import ServerMetrics
from ps.lifecycle.reaper import MembershipReaper, RepeatedFailures
from rpcps import transport
from rpcps.transport import calls, membership

ME, STORE = "ps0_r0", "store_r0"
LEASE_S = 10.0


@dataclass
class FakeRoster:
    """(slot, incarnation, rpc name, last_seen) per slot, and what the reaper told it."""

    workers: dict[int, tuple[str, str, float]]
    alive: list[int] = field(default_factory=list)
    silent: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    broken: set[int] = field(default_factory=set)
    """Slots whose mark_alive raises (a roster bug must not stop the sweep)."""

    def take_retired_rpc_names(self) -> list[str]:
        return []

    def member_workers(self) -> list[tuple[int, str, str, float]]:
        return [(slot, inc, name, seen) for slot, (inc, name, seen) in self.workers.items() if slot not in self.dead]

    def mark_alive(self, slot: int, incarnation: str) -> None:
        if slot in self.broken:
            raise KeyError(slot)
        self.alive.append(slot)

    def mark_silent(self, slot: int, incarnation: str) -> None:
        self.silent.append(slot)

    def mark_dead(self, slot: int, incarnation: str) -> None:
        self.dead.append(slot)


def answered() -> calls.Pending:
    future: Future = Future()
    future.set_result(True)
    return calls.Pending(future)


def failed_with(error: BaseException) -> calls.Pending:
    future: Future = Future()
    future.set_exception(error)
    return calls.Pending(future)


def raising(error: Exception) -> Callable[[], calls.Pending]:
    def start() -> calls.Pending:
        raise error

    return start


@pytest.fixture
def pings(monkeypatch: pytest.MonkeyPatch) -> dict[str, Callable[[], calls.Pending]]:
    """name -> how starting its ping goes (a name not listed answers). Only the transport is faked:
    ``ping_all``, the classification and the reaper are the real ones."""
    table: dict[str, Callable[[], calls.Pending]] = {}
    monkeypatch.setattr(calls, "ping", lambda name, timeout_s: table.get(name, answered)())
    monkeypatch.setattr(membership, "my_name", lambda: ME)
    return table


def reaper(roster: FakeRoster, metrics: ServerMetrics | None = None, store_host: str = ME) -> MembershipReaper:
    return MembershipReaper(
        roster, LEASE_S, store_host, failures=metrics.reaper_ping_failures if metrics is not None else None
    )


def failures(metrics: ServerMetrics, kind: str) -> float:
    return metrics.reaper_ping_failures.labels(kind)._value.get()


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ps.lifecycle.reaper"]


def unknown(name: str) -> transport.PeerUnknown:
    return calls.classify(RuntimeError(f"could not find destination name {name}"))  # type: ignore[return-value]


def test_peer_unknown_when_starting_a_ping_marks_that_worker_dead_and_the_sweep_goes_on(
    pings: dict[str, Callable[[], calls.Pending]], caplog: pytest.LogCaptureFixture
) -> None:
    now = time.monotonic()
    roster = FakeRoster({0: ("a", "left_r1", now), 1: ("b", "alive_r2", now), 2: ("c", "killed_r3", now)})
    pings["left_r1"] = raising(unknown("left_r1"))  # exited without leave; the janitor removed it
    pings["killed_r3"] = lambda: failed_with(RuntimeError("ECONNREFUSED: connection refused"))
    metrics = ServerMetrics(CollectorRegistry())
    with caplog.at_level(logging.INFO, logger="ps.lifecycle.reaper"):
        reaper(roster, metrics).sweep()
    assert sorted(roster.dead) == [0, 2] and roster.alive == [1]
    assert failures(metrics, "unknown") == 1 and failures(metrics, "unreachable") == 1
    assert [line.split(" is gone")[0] for line in lines(caplog)] == ["left_r1 (slot 0)", "killed_r3 (slot 2)"]


def test_an_unexpected_error_from_ping_counts_as_no_answer_logged_once(
    pings: dict[str, Callable[[], calls.Pending]], caplog: pytest.LogCaptureFixture
) -> None:
    now = time.monotonic()
    roster = FakeRoster({0: ("a", "odd_r1", now), 1: ("b", "late_r2", now), 2: ("c", "fine_r3", now)})
    pings["odd_r1"] = raising(TypeError("no\nERROR ps: forged"))  # raised while starting the call
    pings["late_r2"] = lambda: failed_with(ValueError("not a RuntimeError"))  # raised while waiting for it
    metrics = ServerMetrics(CollectorRegistry())
    r = reaper(roster, metrics)
    with caplog.at_level(logging.INFO, logger="ps.lifecycle.reaper"):
        for _ in range(5):
            r.sweep()
    assert roster.dead == [] and roster.silent.count(0) == 5 and roster.silent.count(1) == 5
    assert roster.alive == [2] * 5, "one bad member never stops the sweep of the others"
    assert failures(metrics, "error") == 10
    logged = lines(caplog)
    assert len(logged) == 2, logged  # one line per member, not one per sweep
    assert all("\n" not in line for line in logged)
    assert "failed: TypeError: no;" in logged[0], "the first line of the error only"
    # Past its lease it is dead, as a member that never answers is.
    roster.workers = {slot: (inc, name, now - LEASE_S - 1) for slot, (inc, name, _) in roster.workers.items()}
    with caplog.at_level(logging.INFO, logger="ps.lifecycle.reaper"):
        r.sweep()
    assert sorted(roster.dead) == [0, 1]
    assert any("odd_r1 (slot 0) has not answered" in line and "its pings failed" in line for line in lines(caplog))


def test_a_store_host_that_fails_every_sweep_is_logged_once_with_a_count(
    pings: dict[str, Callable[[], calls.Pending]], caplog: pytest.LogCaptureFixture
) -> None:
    roster = FakeRoster({})
    pings[STORE] = raising(unknown(STORE))
    metrics = ServerMetrics(CollectorRegistry())
    r = reaper(roster, metrics, store_host=STORE)
    with caplog.at_level(logging.INFO, logger="ps.lifecycle.reaper"):
        for _ in range(30):
            r.sweep()
        assert not r.store_host_lost, "a name this agent does not know is not proof that the store is gone"
        assert len(lines(caplog)) == 1 and "store host store_r0 failed" in lines(caplog)[0]
        del pings[STORE]  # it answers again
        r.sweep()
    assert failures(metrics, "unknown") == 30
    assert "store_r0 failed 30 times in a row (unknown)" in lines(caplog)[-1]
    assert len(lines(caplog)) == 2


def test_an_unreachable_store_host_is_lost(pings: dict[str, Callable[[], calls.Pending]]) -> None:
    pings[STORE] = lambda: failed_with(RuntimeError("EOF: end of file"))
    r = reaper(FakeRoster({}), store_host=STORE)
    r.sweep()
    assert r.store_host_lost


def test_a_roster_that_raises_for_one_member_does_not_stop_the_sweep(
    pings: dict[str, Callable[[], calls.Pending]], caplog: pytest.LogCaptureFixture
) -> None:
    now = time.monotonic()
    roster = FakeRoster({0: ("a", "w_r1", now), 1: ("b", "w_r2", now)}, broken={0})
    r = reaper(roster)
    with caplog.at_level(logging.INFO, logger="ps.lifecycle.reaper"):
        r.sweep()
        r.sweep()
    assert roster.alive == [1, 1]
    assert len([line for line in lines(caplog) if "could not act on w_r1" in line]) == 1


def test_repeated_failures_remind_once_a_while_and_sum_up_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    repeats = RepeatedFailures(remind_s=60.0)
    with caplog.at_level(logging.INFO, logger="ps.lifecycle.reaper"):
        assert repeats.failed("x\nERROR forged", "error", "E", now=0.0)
        assert not any(repeats.failed("x\nERROR forged", "error", "E", now=float(t)) for t in range(1, 121))
        assert repeats.count("x\nERROR forged") == 121
        assert repeats.failed("x\nERROR forged", "gone", "G", now=121.0), "another kind starts another streak"
        repeats.keep_only(set(), now=122.0)
    logged = lines(caplog)
    assert len(logged) == 3, logged  # the reminders at 60 s and 120 s, and the sum of the first streak
    assert logged[0].startswith("x\\nERROR forged still fails (error): 61 times in a row over 60s")
    assert logged[2].startswith("x\\nERROR forged failed 121 times in a row (error) over 121s")
    assert repeats.count("x\nERROR forged") == 0


def test_ping_all_never_raises_for_one_member(pings: dict[str, Callable[[], calls.Pending]]) -> None:
    pings["a"] = raising(unknown("a"))
    pings["b"] = lambda: failed_with(RuntimeError("rpcerr:1 ran for more than set timeout"))
    pings["c"] = raising(OSError("anything"))
    results = calls.ping_all(["a", "b", "c", "d"], 1.0)
    assert [type(r).__name__ for r in results] == ["PeerUnknown", "PeerTimeout", "OSError", "NoneType"]
