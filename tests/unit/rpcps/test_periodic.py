"""rpcps.periodic.RepeatedFailure: a failure that repeats every round is logged once, with a count."""

from __future__ import annotations

import logging

import pytest

from rpcps.periodic import RepeatedFailure


def test_a_repeated_failure_is_one_traceback_then_counts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rpcps.periodic")
    repeats = RepeatedFailure("membership-reaper")
    for _ in range(100):
        repeats.failed(LookupError("peer r7 unknown\nC++ frames..."), 1.0)
    records = caplog.records
    assert len([r for r in records if r.exc_info]) == 1, "only the first failure carries a traceback"
    counts = [r.getMessage() for r in records if "times in a row" in r.getMessage()]
    assert counts == [
        "membership-reaper has failed 10 times in a row with the same error: LookupError: peer r7 unknown",
        "membership-reaper has failed 100 times in a row with the same error: LookupError: peer r7 unknown",
    ]
    assert len(records) == 3

    caplog.clear()
    repeats.failed(OSError("disk"), 1.0)  # another error: logged afresh, and the old streak summed up
    assert [r.levelname for r in caplog.records] == ["WARNING", "ERROR"]
    assert "failed 100 times in a row with: LookupError: peer r7 unknown" in caplog.records[0].getMessage()
    caplog.clear()
    repeats.succeeded()
    repeats.succeeded()
    assert [r.getMessage() for r in caplog.records] == ["membership-reaper works again after 1 failure(s) in a row"]
