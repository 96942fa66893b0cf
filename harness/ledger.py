"""Replays a server's audit ledger (``ps.audit``) and checks the recovery promises of
docs/FAULT_TOLERANCE.md: versions only go up by one, except back to a snapshot at a resume; no
(slot, step) is applied twice within the history that survived; how many updates each crash lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class LedgerReport:
    final_version: int = 0
    restarts: int = 0
    applies: list[tuple[float, int]] = field(default_factory=list)
    """(unix time, version) of every apply line, in order."""
    updates_lost: list[int] = field(default_factory=list)
    """Per crash: updates applied after the snapshot it resumed from."""
    problems: list[str] = field(default_factory=list)


def check_ledger(path: str | Path) -> LedgerReport:
    report = LedgerReport()
    version = 0
    history: dict[int, tuple[int, int]] = {}  # version -> (slot, seq) in the surviving history
    applied: set[tuple[int, int]] = set()
    snapshots: set[int] = {0}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        kind, *args, stamp = line.split()
        if kind == "start":
            report.restarts += 1
        elif kind == "resume":
            target = int(args[0])
            if target not in snapshots:
                report.problems.append(f"line {n}: resumed to version {target}, for which no snapshot was ever written")
            if target > version:
                report.problems.append(f"line {n}: resumed to version {target}, ahead of the last applied {version}")
            report.updates_lost.append(version - target)
            for v in range(target + 1, version + 1):
                applied.discard(history.pop(v))
            version = target
        elif kind == "apply":
            v, slot, seq = (int(a) for a in args)
            if v != version + 1:
                report.problems.append(f"line {n}: version went from {version} to {v}")
            if (slot, seq) in applied:
                report.problems.append(f"line {n}: slot {slot} step {seq} applied twice")
            applied.add((slot, seq))
            history[v] = (slot, seq)
            report.applies.append((float(stamp), v))
            version = v
        elif kind == "snapshot":
            snapshots.add(int(args[0]))
        else:
            report.problems.append(f"line {n}: unknown event {kind!r}")
    report.final_version = version
    return report


def first_apply_after(report: LedgerReport, when: float) -> float | None:
    """Unix time of the first update applied after ``when`` (for recovery times)."""
    return next((t for t, _ in report.applies if t > when), None)
