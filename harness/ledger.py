"""Replays a server's audit ledger (``ps.audit``) and checks the recovery promises of
docs/FAULT_TOLERANCE.md:

- versions only go up by one, except back to a snapshot at a resume;
- no (slot, step) is applied twice within the history that survived;
- a resume goes back to the newest snapshot committed before the crash (the newest whose ledger
  line was written, or the one before it when the crash came between that line and the rename);
- snapshots are captured on time: each capture at most ``max(N, W) + slack`` updates after the
  previous one, where N is --checkpoint-every-updates and W the updates applied while the previous
  one was written (a trigger that fires during a write is served right after it). That is what bounds
  what a crash loses: at most ``max(N, W) + W`` updates (plus pushes in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Crash:
    version: int
    """The last version applied before the crash."""
    resumed_to: int
    newest_prepared: int
    """The newest snapshot whose ledger line was written before the crash (0: none)."""

    @property
    def lost(self) -> int:
        return self.version - self.resumed_to


@dataclass
class LedgerReport:
    final_version: int = 0
    restarts: int = 0
    applies: list[tuple[float, int]] = field(default_factory=list)
    """(unix time, version) of every apply line, in order."""
    starts: list[float] = field(default_factory=list)
    """Unix time of every start line (each server process), in order."""
    crashes: list[Crash] = field(default_factory=list)
    write_updates: list[int] = field(default_factory=list)
    """Per committed snapshot: updates applied while it was written (capture to commit)."""
    problems: list[str] = field(default_factory=list)

    @property
    def updates_lost(self) -> list[int]:
        """Per crash: updates applied after the snapshot it resumed from."""
        return [c.lost for c in self.crashes]

    @property
    def worst_write_updates(self) -> int:
        return max(self.write_updates, default=0)


def check_ledger(path: str | Path, every_updates: int | None = None, slack: int = 0) -> LedgerReport:
    """Replays the ledger at ``path``. With ``every_updates`` (the run's --checkpoint-every-updates),
    also checks that snapshots were captured on time, allowing ``slack`` updates for pushes in flight
    between a trigger and its capture."""
    report = LedgerReport()
    version = 0
    history: dict[int, tuple[int, int]] = {}  # version -> (slot, seq) in the surviving history
    applied: set[tuple[int, int]] = set()
    prepared: list[int] = [0]  # snapshot versions whose ledger line was written, in order
    committed: set[int] = {0}  # snapshot versions renamed into place (their "committed" line)
    open_captures: dict[int, int] = {}  # captured version -> the version when it was captured (pending its line)
    last_capture: int | None = None
    last_write_updates = 0
    fresh_start = False
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        kind, *args, stamp = line.split()
        if kind == "start":
            report.restarts += 1
            report.starts.append(float(stamp))
            open_captures.clear()
            fresh_start = version > 0  # a restart; until a "resume" line says otherwise, from nothing
        elif kind == "resume":
            fresh_start = False
            version = _resume(report, n, int(args[0]), version, prepared, committed, history, applied)
            last_capture, last_write_updates = version, 0  # the resumed server counts its interval from here
        elif kind == "apply":
            v, slot, seq = (int(a) for a in args)
            if fresh_start:
                # A server that crashed before any snapshot committed starts over from version 0: a
                # resume to 0 (wrong if a snapshot had been written, which _check_resume reports).
                fresh_start = False
                version = _resume(report, n, 0, version, prepared, committed, history, applied)
                last_capture, last_write_updates = 0, 0
            if v != version + 1:
                report.problems.append(f"line {n}: version went from {version} to {v}")
            if (slot, seq) in applied:
                report.problems.append(f"line {n}: slot {slot} step {seq} applied twice")
            applied.add((slot, seq))
            history[v] = (slot, seq)
            report.applies.append((float(stamp), v))
            version = v
        elif kind == "capture":
            captured = int(args[0])
            if every_updates is not None and last_capture is not None:
                allowed = max(every_updates, last_write_updates) + slack
                if captured - last_capture > allowed:
                    report.problems.append(
                        f"line {n}: snapshot captured at version {captured}, {captured - last_capture} updates after the "
                        f"previous one at {last_capture}; at most max(N={every_updates}, W={last_write_updates}) + "
                        f"{slack} allowed"
                    )
            open_captures[captured] = version
            last_capture = captured
        elif kind == "snapshot":
            prepared.append(int(args[0]))
        elif kind == "committed":
            snapshot = int(args[0])
            committed.add(snapshot)
            if open_captures.pop(snapshot, None) is not None:
                last_write_updates = version - snapshot
                report.write_updates.append(last_write_updates)
        else:
            report.problems.append(f"line {n}: unknown event {kind!r}")
    report.final_version = version
    return report


def _resume(
    report: LedgerReport,
    n: int,
    target: int,
    version: int,
    prepared: list[int],
    committed: set[int],
    history: dict[int, tuple[int, int]],
    applied: set[tuple[int, int]],
) -> int:
    """Rolls the surviving history back to ``target`` after a crash; returns the new version."""
    _check_resume(report, n, target, version, prepared, committed)
    report.crashes.append(Crash(version, target, prepared[-1]))
    for v in range(target + 1, version + 1):
        applied.discard(history.pop(v))
    return target


def _check_resume(
    report: LedgerReport, n: int, target: int, version: int, prepared: list[int], committed: set[int]
) -> None:
    if target > version:
        report.problems.append(f"line {n}: resumed to version {target}, ahead of the last applied {version}")
    if target not in prepared:
        report.problems.append(f"line {n}: resumed to version {target}, for which no snapshot was ever written")
        return
    # The newest prepared snapshot may or may not have been renamed into place before the crash;
    # once its "committed" line is written it was.
    newest = sorted(set(prepared))
    acceptable = {newest[-1]} if newest[-1] in committed else set(newest[-2:])
    if target not in acceptable:
        report.problems.append(
            f"line {n}: resumed to version {target}, but snapshots up to {newest[-1]} had been written: an older one "
            "than the newest committed"
        )


def first_apply_after(report: LedgerReport, when: float) -> float | None:
    """Unix time of the first update applied after ``when``."""
    return next((t for t, _ in report.applies if t > when), None)


def recovery_after(report: LedgerReport, crash: float) -> float | None:
    """Seconds from a server crash at ``crash`` to the first update its successor applied.

    Counted from the next server start rather than from ``crash`` itself: other threads of the
    dying process may still write a ledger line in the microseconds before SIGKILL lands.
    """
    start = next((t for t in report.starts if t > crash), None)
    applied = None if start is None else first_apply_after(report, start)
    return None if applied is None else applied - crash
