"""Fault injection: run ``rpcps local`` and crash its processes at chosen points, then check recovery.

Used by the integration tests and by ``tools/chaos.py``. Three kinds of planned crash:

- ``Kill(target, at_version)``: SIGKILL a process once the server's model version reaches a value
  (read from /metrics). A worker that already finished is replaced by the server as the target,
  so every planned crash hurts something. With ``replicas=2`` the target ``primary`` (``primaryK``
  for shard K) is whichever of the shard's two server processes serves it when the kill fires, and a
  kill waits until the shard has its standby back in sync (so every kill is a failover, not a fall
  back to a snapshot). While a due kill waits for its target (a replica catching up, a coordinator
  or evaluator restarting), training is held with the servers' own pause (``harness.control``) and
  resumed before the kill fires, so a run cannot end first however slowly processes start.
- ``KillAfterFinish(worker, delay_s)``: SIGKILL the server ``delay_s`` after a worker exited
  successfully (its steps must have been made durable first), or sooner, as soon as every worker
  has finished: the job then stops its server within a fraction of a second, and a kill that waited
  for its delay would find no server left to crash.
- ``FailPoint(name, hit)``: the server kills itself the ``hit``-th time it reaches a named point
  (``rpcps.failpoints``), e.g. between a snapshot's ledger line and the rename that commits it:
  windows far too short to hit with a signal from outside. With ``hold_s`` it crashes nothing: the
  process holds there that long (a standby slow to acknowledge), which brings about the moment
  another fail point waits for.

After the run, the promises of docs/FAULT_TOLERANCE.md are checked from the servers' audit ledgers
and the checkpoint directory (``ChaosResult.problems``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from harness import control
from harness.ledger import LedgerReport, check_ledger, recovery_after
from harness.procs import pid_alive
from harness.snapshots import verify_all
from rpcps.failpoints import POINTS, REPLICATED_POINTS
from rpcps.scrape import try_scrape

POLL_S = 0.02
"""How often the driver reads shard 0 while a planned kill is near (or a replication lag is being watched)."""
IDLE_POLL_S = 0.2
"""How often otherwise. Each read is a /metrics scrape of every shard-0 replica (about 3 ms of CPU on
both ends): at POLL_S the whole run long, the driver of one chaos test kept a sixth of a core busy,
and a kill planned at a version far ahead needs no such precision."""
NEAR_S = 0.5
"""A planned kill is near when, at the recent rate, its version is at most this far away."""
STEPS = "rpcps_worker_steps_total"
HOLD_RESEND_S = 0.5
CONTROL_TIMEOUT_S = 2.0
"""A pause or resume the driver sends: short, so a server that stopped answering does not stall the polls."""
EVALUATOR_ARGS = ("--eval-data", "rpcps.tasks:teacher_student_held_out", "--every-seconds", "1")
"""A sidecar evaluator for the built-in task (``ChaosPlan.every_role`` kills it too)."""


@dataclass(frozen=True)
class Kill:
    target: str
    """'ps', 'psK' (shard K), 'workerN', 'primary' / 'primaryK' (shard 0's / shard K's serving
    replica, with replicas=2), 'standby' / 'standbyK' (its in-sync standby), 'store' (the
    coordinator, with replicas=2), 'evaluator'; or several joined by '+' ('primary+store'), killed
    at once."""
    at_version: int
    sig: int = signal.SIGKILL

    def __str__(self) -> str:
        return f"{self.target}@{self.at_version}"


@dataclass(frozen=True)
class KillAfterFinish:
    worker: str
    delay_s: float
    server: str = "ps"

    def __str__(self) -> str:
        return f"{self.server}-after-{self.worker}-finished+{self.delay_s:.2f}s"


@dataclass(frozen=True)
class FailPoint:
    name: str
    hit: int
    hold_s: float | None = None
    """None: the process kills itself there; else it holds there this long (``rpcps.failpoints``)."""

    @property
    def action(self) -> str:
        return "kill" if self.hold_s is None else f"hold-{self.hold_s:g}"

    def __str__(self) -> str:
        return f"ps-at-{self.name}#{self.hit}" + ("" if self.hold_s is None else f"-held-{self.hold_s:g}s")


Fault = Kill | KillAfterFinish | FailPoint


@dataclass(kw_only=True, frozen=True)
class ChaosPlan:
    workers: int = 2
    steps: int = 600
    shards: int = 1
    kills: tuple[Fault, ...] = ()
    checkpoint_every_updates: int = 100
    replicas: int = 1
    extra_args: tuple[str, ...] = ()
    timeout_s: float = 240.0
    max_replica_lag: int | None = None
    """With replicas: ``--replication async --max-replica-lag`` this (None: synchronous replication)."""

    @classmethod
    def random(cls, n: int, seed: int, workers: int = 2, steps: int = 600, **kw: Any) -> ChaosPlan:
        """``n`` crashes drawn from ``seed``: mostly at random versions, some right after a worker
        finished, some at fail points (each point at most once)."""
        rng = random.Random(seed)
        total = workers * steps
        every = kw.get("checkpoint_every_updates", cls.checkpoint_every_updates)
        targets = ["primary" if kw.get("replicas", 1) > 1 else "ps"] + [f"worker{i}" for i in range(workers)]
        points = [p for p in POINTS if p not in REPLICATED_POINTS]  # random plans draw fail points without replicas only
        finishers = [f"worker{i}" for i in range(workers)]
        kills: list[Fault] = []
        for _ in range(n):
            # With a standby every server kill must be a failover: fail points and kills after a finish
            # hit a fixed process, which may be the standby.
            roll = rng.random() if kw.get("replicas", 1) == 1 else 1.0
            if roll < 0.2 and finishers:
                kills.append(KillAfterFinish(finishers.pop(rng.randrange(len(finishers))), round(rng.uniform(0.0, 0.5), 2)))
            elif roll < 0.4 and points:
                name = points.pop(rng.randrange(len(points)))
                # Every snapshot passes the snapshot points (one every N updates); each finish the finish
                # one; every update the apply one (hits counted across restarts).
                most = workers if name.startswith("finish.") else total * 8 // 10 if name == "server.after_apply" else max(1, total // (2 * every))
                kills.append(FailPoint(name, rng.randint(1, most)))
            else:
                kills.append(Kill(rng.choice(targets), rng.randint(total // 10, total * 8 // 10)))
        return cls(workers=workers, steps=steps, kills=tuple(kills), **kw)

    @classmethod
    def every_role(cls, rounds: int, pairs: int, seed: int, workers: int = 2, steps: int = 600, **kw: Any) -> ChaosPlan:
        """Every role killed ``rounds`` times (each worker, the primary, the standby, the coordinator,
        the evaluator) and ``pairs`` kills of the primary and the coordinator at once, in an order
        drawn from ``seed``, spread evenly over 5% to 85% of the run. Needs replicas=2 and an
        evaluator (``--eval-data`` in ``extra_args``)."""
        rng = random.Random(seed)
        roles = [f"worker{i}" for i in range(workers)] + ["primary", "standby", "store", "evaluator"]
        targets = roles * rounds + ["primary+store"] * pairs
        rng.shuffle(targets)
        total = workers * steps
        first, last = total // 20, total * 17 // 20
        gap = (last - first) // max(len(targets), 1)
        kills = tuple(Kill(target, first + i * gap) for i, target in enumerate(targets))
        return cls(workers=workers, steps=steps, kills=kills, **{"replicas": 2, **kw})

    @property
    def in_flight(self) -> int:
        """Pushes that may be applied between a trigger and what follows it (both directions)."""
        return 2 * self.workers * 4


@dataclass
class ChaosResult:
    exit_code: int
    summary: dict[str, Any]
    ledger: LedgerReport
    """Shard 0's ledger (the only one when unsharded)."""
    invalid_snapshots: dict[str, str]
    shard_ledgers: list[LedgerReport] = field(default_factory=list)
    fired: list[tuple[Fault, float]] = field(default_factory=list)
    """Planned crashes that happened, with their unix time (fail points: when the process died)."""
    recovery_s: list[float] = field(default_factory=list)
    """Per server crash: seconds from the crash to the next applied update (by another process, when
    the killed process is known: its standby, or its successor)."""
    notes: list[str] = field(default_factory=list)
    """What the run did besides the plan (a retargeted kill)."""
    worst_unreplicated: float = 0.0
    """The most entries shard 0's primary reported applied and not on its standby (sampled each poll)."""

    def problems(self, plan: ChaosPlan) -> list[str]:
        found = []
        if self.exit_code != 0:
            found.append(f"local exited with {self.exit_code}")
        expected = plan.workers * plan.steps
        for k, ledger in enumerate(self.shard_ledgers or [self.ledger]):
            found += [f"shard {k}: {p}" for p in ledger.problems]
            if ledger.final_version != expected:
                found.append(f"shard {k}: final version {ledger.final_version}, expected {expected} (one per worker step)")
        for path, why in self.invalid_snapshots.items():
            found.append(f"invalid snapshot on disk: {path}: {why}")
        missed = [str(k) for k in plan.kills if k not in {f for f, _ in self.fired}]
        if missed:
            found.append(f"planned crashes that did not happen: {missed}")
        return found


def run_chaos(plan: ChaosPlan, run_dir: Path, entry: str = "trainer_entry.py") -> ChaosResult:
    run_dir.mkdir(parents=True, exist_ok=True)
    ledger = run_dir / "audit.log"
    argv = [
        sys.executable, entry, "local", "--workers", str(plan.workers), "--steps", str(plan.steps), "--shards", str(plan.shards),
        "--run-dir", str(run_dir), "--checkpoint-dir", str(run_dir / "checkpoints"),
        "--checkpoint-every-updates", str(plan.checkpoint_every_updates), "--audit-log", str(ledger),
        "--max-restarts", str(len(plan.kills) + 3), "--summary-json", str(run_dir / "summary.json"),
        "--progress-s", "5", "--replicas", str(plan.replicas), *plan.extra_args,
    ]
    if plan.max_replica_lag is not None:
        argv += ["--replication", "async", "--max-replica-lag", str(plan.max_replica_lag)]
    fail_points = [k for k in plan.kills if isinstance(k, FailPoint)]
    env = {**os.environ, "RPCPS_FAILPOINTS": ";".join(f"{k.name}={k.action}@{k.hit}:{_marker(run_dir, k)}" for k in fail_points)}
    driver = _Driver(plan, run_dir, [_replica_names(k, plan.replicas) for k in range(plan.shards)])
    with open(run_dir / "local.log", "wb") as log:
        local = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + plan.timeout_s
            while local.poll() is None and time.monotonic() < deadline:
                driver.step()
                time.sleep(driver.poll_s())
            if local.poll() is None:
                held = f" (held for the planned crash {driver.by_version[0]}: its target never became ready)" if driver.held else ""
                raise TimeoutError(f"the local run did not finish within {plan.timeout_s:.0f}s{held}; see {run_dir}")
        finally:
            if local.poll() is None:
                os.killpg(local.pid, signal.SIGTERM)
                try:
                    local.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    os.killpg(local.pid, signal.SIGKILL)
                    local.wait()
    for point in fail_points:
        marker = _marker(run_dir, point)
        if marker.exists():
            driver.fired.append((point, marker.stat().st_mtime))
    shards = [Path(f"{ledger}.shard{k}") for k in range(plan.shards)] if plan.shards > 1 else [ledger]
    reports = [check_ledger(path, plan.checkpoint_every_updates, plan.in_flight, plan.max_replica_lag or 0) for path in shards]
    report = reports[0]
    # With a standby, recovery is the first update applied by another process; without, the restarted
    # server may take the killed one's name again (shard 0 hosting the store is always rank 0), so it
    # is counted from the next server start as before.
    pids = driver.killed_pids if plan.replicas > 1 else {}
    server_crashes = sorted(
        (when, pids.get(i), reports[_shard_of(fault)]) for i, (fault, when) in enumerate(driver.fired) if _hits_server(fault)
    )
    recovery = [r for when, pid, shard in server_crashes if (r := recovery_after(shard, when, pid)) is not None]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    roots = [run_dir / "checkpoints"] + sorted((run_dir / "checkpoints").glob("shard-*"))
    invalid = {str(p): why for root in roots for p, why in verify_all(root).items() if why is not None}
    return ChaosResult(local.returncode, summary, report, invalid, reports if plan.shards > 1 else [], driver.fired, recovery,
                       driver.notes, driver.worst_unreplicated)


def _marker(run_dir: Path, point: FailPoint) -> Path:
    return run_dir / f"failpoint-{point.name}-{point.hit}.fired"


def _hits_server(fault: Fault) -> bool:
    """Whether ``fault`` crashes a serving process (recovery is then measured from it); a fail point
    that holds instead of killing crashes nothing."""
    if isinstance(fault, FailPoint):
        return fault.hold_s is None
    return not isinstance(fault, Kill) or any(t.startswith(("ps", "primary")) for t in fault.target.split("+"))


def _shard_of(fault: Fault | str) -> int:
    """The shard a server crash hits (fail points and kills after a finish hit shard 0)."""
    targets = fault.target.split("+") if isinstance(fault, Kill) else [fault] if isinstance(fault, str) else []
    for target in targets:
        for prefix in ("primary", "standby", "ps"):
            rest = target.removeprefix(prefix)
            if rest != target:
                return int(rest.split("_")[0] or 0)
    return 0


def _replica_names(shard: int, replicas: int) -> list[str]:
    """The children serving ``shard``, as ``local`` names them: ps, ps_b; ps1, ps1_b; ..."""
    base = "ps" if shard == 0 else f"ps{shard}"
    return [base if r == 0 else f"{base}_{'abcdefgh'[r]}" for r in range(replicas)]


class _Driver:
    """Fires the plan's signal-sent crashes as the run reaches them (fail points fire by themselves)."""

    def __init__(self, plan: ChaosPlan, run_dir: Path, replicas: list[list[str]]) -> None:
        self.run_dir = run_dir
        self.replicas = replicas
        self.workers = [f"worker{i}" for i in range(plan.workers)]
        """Per shard, the children serving it (two each with replicas)."""
        self.shard0 = replicas[0]
        self.servers = {name for shard in replicas for name in shard}
        self.killed_pids: dict[int, int] = {}
        """Index in ``fired`` -> pid of the process that kill hit."""
        self.deferred = 0
        """Poll rounds a 'primary' kill waited for the shard's standby to be back in sync."""
        self.by_version = sorted((k for k in plan.kills if isinstance(k, Kill)), key=lambda k: k.at_version)
        self.after_finish = [k for k in plan.kills if isinstance(k, KillAfterFinish)]
        self.finished_at: dict[str, float] = {}
        self.held = False
        """Whether training is paused (``_hold``) while a due kill waits for its target."""
        self.held_asked = 0.0
        """Monotonic time of the last pause sent (re-sent while held: a server that restarted forgot it)."""
        self.released_steps: dict[str, float] = {}
        """Each answering worker's steps when the hold was released; the deferred kill fires once all moved on."""
        self.fired: list[tuple[Fault, float]] = []
        self.notes: list[str] = []
        self.worst_unreplicated = 0.0
        self.watch_lag = plan.max_replica_lag is not None
        """Every poll samples the unreplicated updates: with a lag bound to check, at POLL_S throughout."""
        self.last_read: tuple[float, float] | None = None
        self.rate = 0.0
        """Shard 0's updates per second between the last two reads."""

    def poll_s(self) -> float:
        """The pause before the next step: short while a planned kill is near, training is held for
        one, a kill after a finish is pending or a lag bound is watched; longer otherwise."""
        if self.watch_lag or self.held or self.after_finish or self.last_read is None:
            return POLL_S
        if self.by_version and self.by_version[0].at_version - self.last_read[1] <= max(self.rate * NEAR_S, 1.0):
            return POLL_S
        return IDLE_POLL_S

    def step(self) -> None:
        children = _children(self.run_dir)
        shard0 = _scrape_each(children, self.shard0)  # one read of each replica serves both figures
        self.worst_unreplicated = max(self.worst_unreplicated, _highest(shard0, "rpcps_replication_unreplicated_updates"))
        version = _highest(shard0, "rpcps_server_model_version")
        now = time.monotonic()
        if self.last_read is not None and now > self.last_read[0] and version >= self.last_read[1]:
            self.rate = (version - self.last_read[1]) / (now - self.last_read[0])
        self.last_read = (now, version)
        if self.by_version and version >= self.by_version[0].at_version:
            kill = self.by_version.pop(0)
            targets = [self._resolve(children, kill, part) for part in kill.target.split("+")]
            if None in targets:
                # No in-sync pair (or no such process) right now: try again on the next poll, with
                # training held meanwhile. The target is restarting (a fresh interpreter, then a
                # catch-up), and a run that ended first would leave the kill unfired on a slow machine.
                self.deferred += 1
                self.by_version.insert(0, kill)
                self._hold(children)
                return
            if self.held:
                self.by_version.insert(0, kill)
                self._release(children, version)
                return
            if self.released_steps and not self._stepped_since_release(children):
                # Fired once every worker has taken a step after the resume: a kill that landed while
                # one still waited out its pause poll would add that wait to the recovery measured.
                self.by_version.insert(0, kill)
                return
            self.released_steps = {}
            pids = [_pid(children, target) for target in targets if target is not None]
            if all(self._signal(children, target, kill.sig) for target in targets if target is not None):
                server_pids = [pid for pid, target in zip(pids, targets) if target in self.servers and pid is not None]
                if server_pids:
                    self.killed_pids[len(self.fired)] = server_pids[0]
                self.fired.append((kill, time.time()))
            else:
                self.by_version.insert(0, kill)  # the server is restarting: try again on the next poll
        all_finished = all(self._finished(w) is not None for w in self.workers)
        for kill in list(self.after_finish):
            finished = self._finished(kill.worker)
            due = finished is not None and (time.monotonic() - finished >= kill.delay_s or all_finished)
            if due and self._signal(children, kill.server, signal.SIGKILL):
                self.after_finish.remove(kill)
                self.fired.append((kill, time.time()))

    def _hold(self, children: dict[str, Any]) -> None:
        """Pauses each shard's serving process (with replicas, its primary: the pause is a log entry
        its standby follows); a restarted replica still catches up and is handed over in sync. Sent
        again every HOLD_RESEND_S while held: a server that restarted meanwhile forgot the pause."""
        if self.held and time.monotonic() - self.held_asked < HOLD_RESEND_S:
            return
        self.held_asked = time.monotonic()
        for shard in self.replicas:
            serving = [name for name in shard if len(shard) == 1 or _metric(children, name, "rpcps_replica_role") == 2]
            for name in serving:
                if _call(children, name, control.pause):
                    self.held = True

    def _release(self, children: dict[str, Any], version: float) -> None:
        """Resumes every server (idempotent; a standby promoted meanwhile may hold a replicated pause),
        noting each live worker's steps first."""
        self.released_steps = {w: steps for w in self.workers if (steps := _metric(children, w, STEPS)) >= 0}
        for name in sorted(self.servers):
            _call(children, name, control.resume)
        self.held = False
        self.notes.append(f"training held at version {version:.0f} while a planned kill waited for its target")

    def _stepped_since_release(self, children: dict[str, Any]) -> bool:
        """Whether every worker noted at the release has stepped since (or is gone: finished, killed)."""
        return all(not 0 <= _metric(children, w, STEPS) <= steps for w, steps in self.released_steps.items())

    def _resolve(self, children: dict[str, Any], kill: Kill, part: str) -> str | None:
        """The child to signal for one ``part`` of ``kill``'s target (None: none fits right now, e.g.
        it is restarting). A worker that already finished is replaced by the shard's primary (or
        'ps'), so every planned crash hurts something."""
        shard = _shard_of(part)
        if part.startswith(("primary", "standby")):
            pair = self._pair(children, shard)
            return None if pair is None else pair[0 if part.startswith("primary") else 1]
        if not self._finished(part):
            pid = _pid(children, part)
            return part if pid is not None and pid_alive(pid) else None  # restarting: wait for it
        fallback = self._primary(children, shard) if len(self.shard0) > 1 else "ps"
        if fallback is not None:
            self.notes.append(f"{kill}: {part} was not running; killed {fallback} instead")
        return fallback

    def _primary(self, children: dict[str, Any], shard: int) -> str | None:
        """The shard's serving replica, when it has an in-sync standby; else None."""
        pair = self._pair(children, shard)
        return None if pair is None else pair[0]

    def _pair(self, children: dict[str, Any], shard: int) -> tuple[str, str] | None:
        """(the shard's serving replica, its in-sync standby), when it has one; else None."""
        for name in self.replicas[shard]:
            port = children.get(name, {}).get("metrics_port")
            metrics = try_scrape(port) if port is not None else {}
            if metrics.get("rpcps_replica_role") == 2:
                if metrics.get("rpcps_replica_standby_in_sync") != 1:
                    return None
                others = [other for other in self.replicas[shard] if other != name]
                return (name, others[0]) if others else None
        return None

    def _finished(self, worker: str) -> float | None:
        """When ``worker`` was first seen finished (its summary is written just before it exits 0)."""
        if worker not in self.finished_at and (self.run_dir / f"{worker}.summary.json").exists():
            self.finished_at[worker] = time.monotonic()
        return self.finished_at.get(worker)

    @staticmethod
    def _signal(children: dict[str, Any], target: str, sig: int) -> bool:
        """Signals ``target`` if it is running (a zombie not reaped yet takes signals and ignores them)."""
        pid = _pid(children, target)
        if pid is None or not pid_alive(pid):
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True


def _children(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "children.json").read_text())
    except (OSError, ValueError):
        return {}


def _pid(children: dict[str, Any], name: str) -> int | None:
    return children.get(name, {}).get("pid")


def _metric(children: dict[str, Any], name: str, metric: str) -> float:
    port = children.get(name, {}).get("metrics_port")
    return try_scrape(port).get(metric, -1) if port is not None else -1


def _call(children: dict[str, Any], name: str, action: Callable[[str, float], int]) -> bool:
    """``action`` (``control.pause``/``resume``) on ``name``'s control plane; False when it does not answer
    (it is restarting)."""
    port = children.get(name, {}).get("control_port")
    if port is None:
        return False
    try:
        action(f"127.0.0.1:{port}", CONTROL_TIMEOUT_S)
    except grpc.RpcError:
        return False
    return True


def _scrape_each(children: dict[str, Any], names: list[str]) -> list[dict[str, float]]:
    """The /metrics of each of ``names`` that has a port ({} for one that does not answer)."""
    ports = [children.get(name, {}).get("metrics_port") for name in names]
    return [try_scrape(port) for port in ports if port is not None]


def _highest(scrapes: list[dict[str, float]], metric: str) -> float:
    """The highest value of ``metric`` in ``scrapes`` (shard 0's replicas: the primary's version; -1: none)."""
    return max((m.get(metric, -1) for m in scrapes), default=-1)
