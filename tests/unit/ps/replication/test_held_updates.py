"""A primary that holds committed updates for want of a lease says why, and where its keeper is."""

from __future__ import annotations

import logging
import threading

import pytest

from ps.replication import primary
from ps.replication.primary import _HeldUpdates


def _blocked_keeper(release: threading.Event) -> None:
    release.wait(30)


@pytest.fixture
def keeper():
    release = threading.Event()
    thread = threading.Thread(target=_blocked_keeper, args=(release,), name="replica-keeper", daemon=True)
    thread.start()
    yield thread
    release.set()
    thread.join(5)


@pytest.mark.timeout(30)
def test_a_long_hold_is_reported_once_with_the_reason_and_the_keepers_frame(
    keeper: threading.Thread, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_HeldUpdates, "REPORT_AFTER_S", 0.0)
    held = _HeldUpdates(3, lambda: "it last read its own view in the group's store 2.5s ago", keeper)
    with caplog.at_level(logging.WARNING, logger=primary.__name__):
        held.holding(2)  # the hold starts
        held.holding(2)
        held.holding(2)
        held.released()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("shard 3: 2 committed update(s) wait for ")
    assert "it last read its own view in the group's store 2.5s ago" in lines[0]
    assert "_blocked_keeper" in lines[0], "the keeper's own frame names where it is stuck"
    assert lines[1].startswith("shard 3: applying again after ")


@pytest.mark.timeout(30)
def test_a_short_hold_says_nothing(keeper: threading.Thread, caplog: pytest.LogCaptureFixture) -> None:
    held = _HeldUpdates(0, lambda: "no lease", keeper)
    with caplog.at_level(logging.WARNING, logger=primary.__name__):
        held.holding(1)
        held.holding(1)  # well within REPORT_AFTER_S
        held.released()
    assert caplog.records == []
