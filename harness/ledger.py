"""Replays a shard's audit ledger (``ps.checkpoints.audit``), written by every server process of the shard, and
checks the promises of docs/FAULT_TOLERANCE.md:

- the primaries' history is one line: each update V follows V-1 (across a failover too: a promoted
  standby continues from the version it holds, which it applied as ``mirror`` lines), except back to
  a snapshot at a resume (both replicas lost), and, with asynchronous replication (``max_lag``),
  back by at most ``max_lag`` versions at a promotion: those updates were acknowledged and are lost
  (``LedgerReport.failover_losses``); their steps may be applied again in the new history;
- every version has one content, whoever applied it (``apply`` or ``mirror``): no replica ever
  applied something else under that version, and no (slot, step) is in two versions of the
  history that survived;
- exactly one primary applies at any time: ordered by their stamps (the time of the lease check
  that allowed each apply), no update of epoch E-1 is applied after ``promote E``, and epochs never
  go back;
- replicas' digests of one version are equal;
- a resume goes back to the newest snapshot committed before the crash (the newest whose ledger
  line was written, or the one before it when the crash came between that line and the rename);
- snapshots are captured on time: each capture at most ``max(N, W) + slack`` updates after the
  previous one, where N is --checkpoint-every-updates and W the updates applied while the previous
  one was written. That is what bounds what a crash of an unreplicated server loses.

Lines are replayed in the order of their stamps (both replicas write into one file; a primary
frozen between a lease check and the line it guards writes that line late, stamped early).
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
    """(unix time, version) of every primary's apply line, in stamp order."""
    apply_writers: list[str] = field(default_factory=list)
    """The writer of each entry of ``applies``."""
    starts: list[float] = field(default_factory=list)
    """Unix time of every start line (each server process), in order."""
    names: dict[int, str] = field(default_factory=dict)
    """Pid -> RPC name of every server process that started."""
    crashes: list[Crash] = field(default_factory=list)
    write_updates: list[int] = field(default_factory=list)
    """Per committed snapshot: updates applied while it was written (capture to commit)."""
    promotions: list[tuple[float, int, int, str]] = field(default_factory=list)
    """(unix time, epoch, version, name) of every promotion."""
    stepdowns: list[tuple[float, int, str]] = field(default_factory=list)
    mirrored: int = 0
    """Mirror lines (updates a standby applied)."""
    failover_losses: list[int] = field(default_factory=list)
    """Per promotion behind the old primary (asynchronous replication): the versions it lost."""
    digests_compared: int = 0
    """Versions whose digest two or more replicas wrote (and that were compared)."""
    problems: list[str] = field(default_factory=list)

    @property
    def updates_lost(self) -> list[int]:
        """Per crash: updates applied after the snapshot it resumed from."""
        return [c.lost for c in self.crashes]

    @property
    def worst_write_updates(self) -> int:
        return max(self.write_updates, default=0)


@dataclass
class _Line:
    number: int
    kind: str
    args: list[str]
    stamp: float


class _Replay:
    def __init__(self, report: LedgerReport, every_updates: int | None, slack: int, max_lag: int = 0) -> None:
        self.report = report
        self.max_lag = max_lag
        self.every_updates = every_updates
        self.slack = slack
        self.version = 0
        """The primaries' history: its newest version."""
        self.history: dict[int, frozenset[tuple[int, int]]] = {}
        """Version -> the (slot, step)s it applied, in the history that survived."""
        self.where: dict[tuple[int, int], int] = {}
        """(slot, step) -> its version in that history."""
        self.mirrored: dict[int, frozenset[tuple[int, int]]] = {}
        """Version -> content, as standbys applied it (ahead of or beside the primaries)."""
        self.epoch = 0
        self.prepared: list[int] = [0]
        self.open_captures: dict[int, int] = {}
        self.last_capture: int | None = None
        self.last_write_updates = 0
        self.committed: set[int] = {0}
        """Snapshot versions renamed into place (their "committed" line)."""
        self.fresh_start = False
        """A process (re)started and no "resume" line followed yet: it may start over from nothing."""
        self.digests: dict[int, dict[str, str]] = {}

    def line(self, line: _Line) -> None:
        handler = getattr(self, f"_{line.kind}", None)
        if handler is None:
            self.report.problems.append(f"line {line.number}: unknown event {line.kind!r}")
            return
        handler(line)

    def _start(self, line: _Line) -> None:
        self.report.restarts += 1
        self.report.starts.append(line.stamp)
        if len(line.args) > 1:
            self.report.names[int(line.args[0])] = line.args[1]
        self.open_captures.clear()
        self.fresh_start = self.version > 0

    def _view(self, line: _Line) -> None:
        pass  # which view a process serves under: informational

    def _resume(self, line: _Line) -> None:
        self.fresh_start = False
        self._roll_back(line.number, int(line.args[0]))

    def _roll_back(self, number: int, target: int) -> None:
        """Rolls the surviving history back to ``target`` after a crash."""
        self._check_resume(number, target)
        self.report.crashes.append(Crash(self.version, target, self.prepared[-1]))
        self._forget_after(target)
        self.last_capture, self.last_write_updates = target, 0  # the resumed server counts its interval from here

    def _forget_after(self, target: int) -> None:
        """Drops every version above ``target`` from the history: the one that survives goes on from there."""
        for v in range(target + 1, self.version + 1):
            for key in self.history.pop(v, frozenset()):
                self.where.pop(key, None)
        self.mirrored = {v: c for v, c in self.mirrored.items() if v <= target}
        self.digests = {v: d for v, d in self.digests.items() if v <= target}
        self.version = target

    def _apply(self, line: _Line) -> None:
        v, slot, seq = (int(a) for a in line.args[:3])
        epoch = int(line.args[3]) if len(line.args) > 3 else self.epoch
        writer = line.args[4] if len(line.args) > 4 else ""
        problems = self.report.problems
        if self.fresh_start:
            # A server that crashed before any snapshot committed starts over from version 0: a resume
            # to 0 (wrong if a snapshot had been written, which _check_resume reports). Only an apply of
            # version 1 says so: a standby that (re)started beside a running primary writes a start line too.
            self.fresh_start = False
            if v == 1:
                self._roll_back(line.number, 0)
        if epoch < self.epoch:
            problems.append(f"line {line.number}: update {v} of epoch {epoch} applied by {writer} after epoch {self.epoch} began")
        self.epoch = max(self.epoch, epoch)
        if v == self.version and v in self.history and self.report.apply_writers and self.report.apply_writers[-1] == writer:
            self._add(line.number, v, slot, seq)  # another contribution to the same (sync) update
        elif v != self.version + 1:
            problems.append(f"line {line.number}: version went from {self.version} to {v}")
            self._add(line.number, v, slot, seq)
        else:
            self._add(line.number, v, slot, seq)
        self.version = max(self.version, v)
        self.report.applies.append((line.stamp, v))
        self.report.apply_writers.append(writer)

    def _add(self, number: int, v: int, slot: int, seq: int) -> None:
        key = (slot, seq)
        elsewhere = self.where.get(key)
        if elsewhere is not None and elsewhere != v:
            self.report.problems.append(f"line {number}: slot {slot} step {seq} applied twice (versions {elsewhere} and {v})")
        content = self.history.get(v, frozenset()) | {key}
        mirrored = self.mirrored.get(v)
        if mirrored is not None and key not in mirrored:
            self.report.problems.append(
                f"line {number}: version {v} applied slot {slot} step {seq} on the primary, {sorted(mirrored)} on a standby"
            )
        self.history[v] = content
        self.where[key] = v

    def _mirror(self, line: _Line) -> None:
        v, slot, seq = (int(a) for a in line.args[:3])
        self.report.mirrored += 1
        key = (slot, seq)
        content = self.mirrored.get(v, frozenset()) | {key}
        primary = self.history.get(v)
        if primary is not None and key not in primary:
            self.report.problems.append(
                f"line {line.number}: a standby applied slot {slot} step {seq} as version {v}, the primary {sorted(primary)}"
            )
        self.mirrored[v] = content

    def _promote(self, line: _Line) -> None:
        epoch, v = int(line.args[0]), int(line.args[1])
        writer = line.args[2] if len(line.args) > 2 else ""
        problems = self.report.problems
        if epoch <= self.epoch:
            problems.append(f"line {line.number}: {writer} promoted to epoch {epoch}, not above the current {self.epoch}")
        if v < self.version:
            if self.version - v > self.max_lag:
                problems.append(
                    f"line {line.number}: {writer} promoted at version {v}, {self.version - v} behind the {self.version} the old "
                    f"primary applied (at most {self.max_lag} allowed)"
                )
            self.report.failover_losses.append(self.version - v)
            self._forget_after(v)
        for held in range(self.version + 1, v + 1):  # what the standby held beyond the old primary becomes history
            content = self.mirrored.get(held)
            if content is None:
                problems.append(f"line {line.number}: {writer} promoted at version {v} without having applied version {held}")
                continue
            for key in content:
                elsewhere = self.where.get(key)
                if elsewhere is not None and elsewhere != held:
                    problems.append(f"line {line.number}: slot {key[0]} step {key[1]} applied twice (versions {elsewhere} and {held})")
                self.where[key] = held
            self.history[held] = content
        self.epoch = max(self.epoch, epoch)
        self.version = max(self.version, v)
        self.report.promotions.append((line.stamp, epoch, v, writer))

    def _stepdown(self, line: _Line) -> None:
        self.report.stepdowns.append((line.stamp, int(line.args[0]), line.args[1] if len(line.args) > 1 else ""))

    def _digest(self, line: _Line) -> None:
        v, digest = int(line.args[0]), line.args[1]
        writer = line.args[2] if len(line.args) > 2 else ""
        seen = self.digests.setdefault(v, {})
        if seen and digest not in seen.values():
            self.report.problems.append(f"line {line.number}: {writer}'s digest of version {v} is {digest}, others wrote {seen}")
        if len(seen) == 1 and writer not in seen:
            self.report.digests_compared += 1
        seen[writer] = digest

    def _capture(self, line: _Line) -> None:
        captured = int(line.args[0])
        if self.every_updates is not None and self.last_capture is not None:
            allowed = max(self.every_updates, self.last_write_updates) + self.slack
            if captured - self.last_capture > allowed:
                self.report.problems.append(
                    f"line {line.number}: snapshot captured at version {captured}, {captured - self.last_capture} updates after "
                    f"the previous one at {self.last_capture}; at most max(N={self.every_updates}, W={self.last_write_updates}) + "
                    f"{self.slack} allowed"
                )
        self.open_captures[captured] = self.version
        self.last_capture = captured

    def _snapshot(self, line: _Line) -> None:
        self.prepared.append(int(line.args[0]))

    def _committed(self, line: _Line) -> None:
        snapshot = int(line.args[0])
        self.committed.add(snapshot)
        if self.open_captures.pop(snapshot, None) is not None:
            self.last_write_updates = self.version - snapshot
            self.report.write_updates.append(self.last_write_updates)

    def _check_resume(self, n: int, target: int) -> None:
        problems = self.report.problems
        if target > self.version:
            problems.append(f"line {n}: resumed to version {target}, ahead of the last applied {self.version}")
        if target not in self.prepared:
            problems.append(f"line {n}: resumed to version {target}, for which no snapshot was ever written")
            return
        # The newest prepared snapshot may or may not have been renamed into place before the crash;
        # once its "committed" line is written it was.
        newest = sorted(set(self.prepared))
        acceptable = {newest[-1]} if newest[-1] in self.committed else set(newest[-2:])
        if target not in acceptable:
            problems.append(
                f"line {n}: resumed to version {target}, but snapshots up to {newest[-1]} had been written: an older one "
                "than the newest committed"
            )


def check_ledger(path: str | Path, every_updates: int | None = None, slack: int = 0, max_lag: int = 0) -> LedgerReport:
    """Replays the ledger at ``path``. With ``every_updates`` (the run's --checkpoint-every-updates),
    also checks that snapshots were captured on time, allowing ``slack`` updates for pushes in flight
    between a trigger and its capture. ``max_lag``: the run's --max-replica-lag (asynchronous
    replication), how far a promoted standby may be behind the primary it replaces."""
    lines = []
    for n, text in enumerate(Path(path).read_text().splitlines(), 1):
        kind, *args, stamp = text.split()
        lines.append(_Line(n, kind, args, float(stamp)))
    lines.sort(key=lambda line: (line.stamp, line.number))
    report = LedgerReport()
    replay = _Replay(report, every_updates, slack, max_lag)
    for line in lines:
        replay.line(line)
    report.final_version = replay.version
    return report


def first_apply_after(report: LedgerReport, when: float, other_than: str | None = None) -> float | None:
    """Unix time of the first update a primary applied after ``when`` (by a writer other than ``other_than``)."""
    return next((t for (t, _), w in zip(report.applies, report.apply_writers) if t > when and w != other_than), None)


def recovery_after(report: LedgerReport, crash: float, pid: int | None = None) -> float | None:
    """Seconds from a server crash at ``crash`` to the next update a primary applied.

    With the crashed process's ``pid``: the first update applied by any other process (its standby
    promoted, or its successor started). Without: counted from the next server start, since other
    threads of the dying process may still write a ledger line in the microseconds before SIGKILL lands.
    """
    if pid is not None and pid in report.names:
        applied = first_apply_after(report, crash, other_than=report.names[pid])
    else:
        start = next((t for t in report.starts if t > crash), None)
        applied = None if start is None else first_apply_after(report, start)
    return None if applied is None else applied - crash
