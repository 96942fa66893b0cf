"""The job secret: proofs bound to one challenge, slot and name; the server's registration gate."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from ps.api import registration_auth
from ps.api.registration_auth import RegistrationGate
from ps.core.metrics import REGISTRATION_REFUSALS, ServerMetrics
from rpcps.errors import RegistrationRefused
from rpcps.jobsecret import JobSecret, matches
from rpcps.messages import RegistrationProof
from rpcps.secret_files import create_secret_file

SECRET = JobSecret("s" * 64)


def gate(secret: JobSecret | None = SECRET) -> RegistrationGate:
    return RegistrationGate(secret, ServerMetrics(CollectorRegistry()).registrations_refused)


def refused(g: RegistrationGate, reason: str) -> float:
    return g.refused.labels(reason)._value.get()


def answer(g: RegistrationGate, slot: int = 0, name: str = "worker0_r1", secret: JobSecret = SECRET) -> RegistrationProof:
    challenge = g.challenge()
    return RegistrationProof(challenge, secret.registration_proof(challenge, slot, name))


def test_a_proof_admits_its_slot_and_name_once() -> None:
    g = gate()
    proof = answer(g)
    g.check(0, "worker0_r1", proof)
    with pytest.raises(RegistrationRefused, match="used already"):
        g.check(0, "worker0_r1", proof)  # a replay of a proof seen on the wire
    assert refused(g, "unknown_challenge") == 1


@pytest.mark.parametrize(("slot", "name"), [(1, "worker0_r1"), (0, "worker0_r2")])
def test_a_proof_does_not_transfer_to_another_slot_or_name(slot: int, name: str) -> None:
    g = gate()
    with pytest.raises(RegistrationRefused, match="wrong proof"):
        g.check(slot, name, answer(g))
    assert refused(g, "bad_proof") == 1


def test_refusals_name_the_reason_and_never_the_secret(caplog: pytest.LogCaptureFixture) -> None:
    g = gate()
    with pytest.raises(RegistrationRefused, match="--job-secret-file"):
        g.check(0, "w", None)
    with pytest.raises(RegistrationRefused, match="wrong proof"):
        g.check(0, "w", answer(g, name="w", secret=JobSecret("t" * 64)))
    with pytest.raises(RegistrationRefused, match="not issued here"):
        g.check(0, "w", RegistrationProof("made-up", "x"))
    assert "s" * 32 not in caplog.text and "refused registration of worker slot 0" in caplog.text
    assert [refused(g, r) for r in REGISTRATION_REFUSALS] == [1, 1, 1]


def test_an_observation_of_the_model_needs_its_own_fresh_proof(caplog: pytest.LogCaptureFixture) -> None:
    """``observe`` reads the parameters: a stranger without the secret must not, and a registration
    proof (another purpose) or a replayed observation proof does not pass."""
    g = gate()
    challenge = g.challenge()
    good = RegistrationProof(challenge, SECRET.observe_proof(challenge))
    g.check_observer(good)
    with pytest.raises(RegistrationRefused, match="used already"):
        g.check_observer(good)
    with pytest.raises(RegistrationRefused, match="start the evaluator with --job-secret-file"):
        g.check_observer(None)
    with pytest.raises(RegistrationRefused, match="wrong proof"):
        g.check_observer(answer(g))  # a registration proof is not an observation proof
    assert [refused(g, r) for r in REGISTRATION_REFUSALS] == [1, 1, 1]
    assert "refused an observation of the model" in caplog.text
    gate(None).check_observer(None)  # no secret configured (loopback only): open, as registration is


def test_without_a_secret_anyone_registers() -> None:
    g = gate(None)
    g.check(0, "w", None)
    assert not g.required


def test_challenges_expire_and_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    g = gate()
    clock = [1000.0]
    monkeypatch.setattr(registration_auth.time, "monotonic", lambda: clock[0])
    old = answer(g)
    clock[0] += registration_auth.TTL_S + 1
    with pytest.raises(RegistrationRefused, match="expired"):
        g.check(0, "worker0_r1", old)
    first = answer(g)
    for _ in range(registration_auth.MAX_OUTSTANDING):
        g.challenge()
    assert len(g._issued) == registration_auth.MAX_OUTSTANDING
    with pytest.raises(RegistrationRefused):
        g.check(0, "worker0_r1", first)  # evicted by a flood of challenges


def test_purposes_never_mix() -> None:
    """A leave proof for a name is not a registration proof for it, and manifests have their own key."""
    leave = SECRET.leave_proof("worker0_r1")
    assert not matches(SECRET.registration_proof("", 0, "worker0_r1"), leave)
    assert SECRET.manifest_signature({"a": 1}) == SECRET.manifest_signature({"a": 1, "hmac": "ignored"})
    assert SECRET.manifest_signature({"a": 1}) != SECRET.manifest_signature({"a": 2})
    assert not matches(leave, None) and not matches(leave, 5)
    assert "s" * 8 not in repr(SECRET)


def test_secret_files(tmp_path: Path) -> None:
    path = tmp_path / "job-secret"
    create_secret_file(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    JobSecret.from_file(str(path))
    with pytest.raises(FileExistsError):
        create_secret_file(path)  # never overwrites
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match=f"job secret file {short}: .*at least 32"):
        JobSecret.from_file(str(short))
    with pytest.raises(OSError, match="cannot read job secret file"):
        JobSecret.from_file(str(tmp_path / "missing"))
