"""The ledger checker must catch every broken recovery promise it claims to check."""

from __future__ import annotations

from pathlib import Path

from harness.ledger import check_ledger, first_apply_after
from ps.audit import AuditLog
from ps.server import UpdateApplied


def ledger(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "audit.log"
    path.write_text("".join(f"{line} {i}.0\n" for i, line in enumerate(lines)))
    return path


def test_a_clean_crash_and_resume_passes(tmp_path: Path) -> None:
    report = check_ledger(ledger(tmp_path, [
        "start 1", "apply 1 0 0", "apply 2 1 0", "snapshot 2", "apply 3 0 1",
        "start 2", "resume 2", "apply 3 0 1", "apply 4 1 1",
    ]))
    assert report.problems == []
    assert report.final_version == 4 and report.restarts == 2 and report.updates_lost == [1]


def test_double_apply_is_caught(tmp_path: Path) -> None:
    report = check_ledger(ledger(tmp_path, ["start 1", "apply 1 0 0", "apply 2 0 0"]))
    assert any("applied twice" in p for p in report.problems)


def test_resume_to_a_version_without_snapshot_is_caught(tmp_path: Path) -> None:
    report = check_ledger(ledger(tmp_path, ["start 1", "apply 1 0 0", "apply 2 0 1", "start 2", "resume 1"]))
    assert any("no snapshot was ever written" in p for p in report.problems)


def test_version_gap_is_caught(tmp_path: Path) -> None:
    report = check_ledger(ledger(tmp_path, ["start 1", "apply 1 0 0", "apply 3 0 1"]))
    assert any("went from 1 to 3" in p for p in report.problems)


def test_audit_log_writes_lines_the_checker_reads(tmp_path: Path) -> None:
    log = AuditLog(str(tmp_path / "a.log"))
    log.on_applied(UpdateApplied(version=1, step_seconds=0.0, applied=((0, 0, 0),), grad_bytes=4))
    log.snapshot(1)
    log.close()
    report = check_ledger(tmp_path / "a.log")
    assert report.problems == [] and report.final_version == 1
    assert first_apply_after(report, 0.0) is not None
