"""The ledger checker must catch every broken recovery promise it claims to check."""

from __future__ import annotations

from pathlib import Path

from harness.ledger import check_ledger, first_apply_after
from ps.checkpoints.audit import AuditLog
from ps.core.update_log import UpdateApplied


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


def test_a_crash_before_any_snapshot_restarts_from_nothing(tmp_path: Path) -> None:
    """No snapshot committed yet: the restarted server starts at version 0 and every step is
    recomputed, which is not a double apply (the chaos suite's two-shard run, seed 744890)."""
    report = check_ledger(ledger(tmp_path, [
        "start 1", "apply 1 0 0", "apply 2 1 0", "start 2", "apply 1 0 0", "apply 2 1 0", "apply 3 0 1",
    ]))
    assert report.problems == [] and report.final_version == 3 and report.updates_lost == [2]


def test_starting_over_when_a_snapshot_had_been_written_is_caught(tmp_path: Path) -> None:
    report = check_ledger(ledger(tmp_path, [
        "start 1", "apply 1 0 0", "capture 1", "snapshot 1", "committed 1", "apply 2 1 0", "start 2", "apply 1 0 0",
    ]))
    assert any("resumed to version 0, but snapshots up to 1 had been written" in p for p in report.problems)


def test_version_gap_is_caught(tmp_path: Path) -> None:
    report = check_ledger(ledger(tmp_path, ["start 1", "apply 1 0 0", "apply 3 0 1"]))
    assert any("went from 1 to 3" in p for p in report.problems)


def test_audit_log_writes_lines_the_checker_reads(tmp_path: Path) -> None:
    log = AuditLog(str(tmp_path / "a.log"), "ps0_r0")
    log.on_applied(UpdateApplied(version=1, step_seconds=0.0, applied=((0, 0, 0),), grad_bytes=4))
    log.snapshot(1)
    log.close()
    report = check_ledger(tmp_path / "a.log")
    assert report.problems == [] and report.final_version == 1
    assert first_apply_after(report, 0.0) is not None


def test_resume_to_an_older_snapshot_than_the_newest_committed_is_caught(tmp_path: Path) -> None:
    lines = ["start 1", "apply 1 0 0", "capture 1", "snapshot 1", "apply 2 0 1", "capture 2", "snapshot 2",
             "apply 3 0 2", "capture 3", "snapshot 3", "apply 4 0 3", "start 2"]
    assert check_ledger(ledger(tmp_path, [*lines, "resume 3"])).problems == []
    # The crash may have come between snapshot 3's ledger line and its rename: 2 is fine too.
    assert check_ledger(ledger(tmp_path, [*lines, "resume 2"])).problems == []
    report = check_ledger(ledger(tmp_path, [*lines, "resume 1"]))
    assert any("an older one than the newest committed" in p for p in report.problems)


def test_a_late_capture_is_caught_and_a_long_write_excuses_it(tmp_path: Path) -> None:
    applies = [f"apply {v} 0 {v - 1}" for v in range(1, 31)]
    on_time = ["start 1", *applies[:10], "capture 10", "snapshot 10", "committed 10", *applies[10:20], "capture 20",
               *applies[20:]]
    assert check_ledger(ledger(tmp_path, on_time), every_updates=10).problems == []
    late = ["start 1", *applies[:10], "capture 10", "snapshot 10", "committed 10", *applies[10:25], "capture 25", *applies[25:]]
    report = check_ledger(ledger(tmp_path, late), every_updates=10, slack=2)
    assert any("captured at version 25, 15 updates after the previous one" in p for p in report.problems)
    # The write of 10 took 14 updates (committed after apply 24): the trigger at 20 waited for it.
    slow = ["start 1", *applies[:10], "capture 10", *applies[10:23], "snapshot 10", *applies[23:24], "committed 10",
            "capture 24", *applies[24:]]
    report = check_ledger(ledger(tmp_path, slow), every_updates=10)
    assert report.problems == [] and report.write_updates == [14]


def _async_failover(behind: int) -> list[str]:
    """Primary P applies versions 1..4; standby S mirrored 1..(4 - behind) when P died and promotes
    there; S applies the lost steps again (recomputed by their workers) and goes on."""
    held = 4 - behind
    lines = ["start 1 P", "start 2 S"]
    for v in range(1, 5):
        lines.append(f"apply {v} 0 {v - 1} 1 P")
        if v <= held:
            lines += [f"mirror {v} 0 {v - 1} 1 S", f"digest {v} d{v} S"]
        lines.append(f"digest {v} {'d' if v <= held else 'lost'}{v} P")
    lines.append(f"promote 2 {held} S")
    lines += [f"apply {v} 0 {v - 1} 2 S" for v in range(held + 1, 6)]
    return lines + ["digest 4 new4 S"]


def test_an_async_promotion_may_lose_up_to_max_lag_acknowledged_versions(tmp_path: Path) -> None:
    report = check_ledger(ledger(tmp_path, _async_failover(behind=2)), max_lag=2)
    assert report.problems == []  # the lost steps applied again, and the new history's digests, are not conflicts
    assert report.failover_losses == [2] and report.final_version == 5


def test_an_async_promotion_further_behind_than_max_lag_is_caught(tmp_path: Path) -> None:
    report = check_ledger(ledger(tmp_path, _async_failover(behind=2)), max_lag=1)
    assert any("2 behind the 4 the old primary applied (at most 1 allowed)" in p for p in report.problems)
    sync = check_ledger(ledger(tmp_path, _async_failover(behind=1)))  # synchronous: no acknowledged update may go
    assert any("at most 0 allowed" in p for p in sync.problems)
