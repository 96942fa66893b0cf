"""The refusals a stranger can provoke log what it sent on one line (issue 24): a newline in a
registration's RPC name or slot, an attaching standby's name or a name to drop from the group must
not start a log line of the stranger's choosing."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from ps.api.registration_auth import RegistrationGate
from ps.core.metrics import ServerMetrics
from ps.replication.auth import ReplicaGate
from ps.replication.metrics import ReplicationMetrics
from rpcps.errors import RegistrationRefused, ReplicaRefused
from rpcps.jobsecret import JobSecret
from rpcps.messages import RegistrationProof
from rpcps.transport import membership

SECRET = JobSecret("s" * 40)
FORGED = "x\nERROR ps: forged\r\x1b[2K"


def _one_line_each(caplog: pytest.LogCaptureFixture) -> str:
    """The messages logged, having checked each is one line and none starts with the forgery."""
    messages = [r.getMessage() for r in caplog.records]
    assert messages, "nothing was logged"
    for message in messages:
        assert "\n" not in message and "\r" not in message and "\x1b" not in message, message
    assert "x\\nERROR ps: forged\\r\\x1b[2K" in "".join(messages)
    return "".join(messages)


def test_a_refused_registration_logs_its_name_and_slot_escaped(caplog: pytest.LogCaptureFixture) -> None:
    metrics = ServerMetrics(CollectorRegistry())
    gate = RegistrationGate(SECRET, metrics.registrations_refused)
    with caplog.at_level(logging.WARNING), pytest.raises(RegistrationRefused):
        gate.check(0, FORGED, None)
    with caplog.at_level(logging.WARNING), pytest.raises(RegistrationRefused):
        gate.check(FORGED, "worker0_r1", RegistrationProof(gate.challenge(), "00"))  # type: ignore[arg-type]
    text = _one_line_each(caplog)
    assert "refused registration of worker slot 0 by 'x\\nERROR" in text
    assert "refused registration of worker slot x\\nERROR ps: forged" in text
    assert metrics.registrations_refused.labels("no_proof")._value.get() == 1
    assert metrics.registrations_refused.labels("bad_proof")._value.get() == 1


def test_a_refused_attach_logs_the_standby_name_escaped(caplog: pytest.LogCaptureFixture) -> None:
    metrics = ReplicationMetrics(CollectorRegistry(), replicas=2)
    gate = ReplicaGate(SECRET, "ps0_r0", metrics.refused)
    with caplog.at_level(logging.WARNING), pytest.raises(ReplicaRefused):
        gate.check_attach(FORGED, "n", 0.0, "")
    assert "attach by 'x\\nERROR" in _one_line_each(caplog)


def test_a_long_name_is_cut_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    gate = RegistrationGate(SECRET, ServerMetrics(CollectorRegistry()).registrations_refused)
    with caplog.at_level(logging.WARNING), pytest.raises(RegistrationRefused):
        gate.check(0, "n" * 1_000_000, None)
    (record,) = caplog.records
    assert len(record.getMessage()) < 1000 and "more characters]" in record.getMessage()


def test_a_refused_request_to_drop_a_member_logs_the_name_escaped(caplog: pytest.LogCaptureFixture) -> None:
    membership.require_leave_proofs(SECRET)
    try:
        with caplog.at_level(logging.WARNING):
            assert membership.forget_me(FORGED, "not a proof") == "refused"
    finally:
        membership.require_leave_proofs(None)
    assert "refused a request to drop 'x\\nERROR" in _one_line_each(caplog)
