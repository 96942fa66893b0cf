"""An optional append-only ledger of what the server did, for fault-injection checks.

One line per event, written with a single ``write`` each (line-buffered), so a SIGKILL loses nothing
already recorded: ``start PID``, ``resume V``, ``apply V SLOT SEQ`` (update V applied SLOT's step SEQ),
``snapshot V``; each line ends with its unix time. ``check_ledger`` replays it and proves the recovery promises: versions only go up by
one, except back to a committed snapshot at a resume; no (slot, step) is applied twice within the
history that survived; at most one checkpoint interval is lost per crash.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path


class AuditLog:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the server
        self.write(f"start {os.getpid()}")

    def write(self, line: str) -> None:
        self._file.write(f"{line} {time.time():.6f}\n")

    def applied(self, version: int, slot: int, seq: int) -> None:
        self.write(f"apply {version} {slot} {seq}")

    def snapshot(self, version: int) -> None:
        self.write(f"snapshot {version}")

    def resumed(self, version: int) -> None:
        self.write(f"resume {version}")

    def close(self) -> None:
        self._file.close()


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
                report.problems.append(f"line {n}: resumed to version {target}, which no committed snapshot had")
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
