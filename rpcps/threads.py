"""How many CPU threads a process computes with (torch's intra-op threads), kept right while it runs.

torch's own default is one intra-op thread per core in every process. A host that runs a server and
its workers side by side then has several times more compute threads than cores, and idle OpenMP
threads spin while they wait for work: on 2 cores, a server and two workers on torch's defaults ran
a 22k-parameter model 7x slower and a 5M one 2.5x slower than with one thread each
(shared/research/torch-rpc-facts.md). Every role picks its budget here, the same way:

1. ``--threads N`` (or ``RPCPS_THREADS``), when given: pinned for the life of the process;
2. ``OMP_NUM_THREADS``, when set: pinned too. Except torchrun's own ``OMP_NUM_THREADS=1`` (it sets
   that for every multi-process run, ``LOCAL_WORLD_SIZE`` > 1 under ``TORCHELASTIC_RUN_ID``), which
   is ignored: the host budget below does the job it does, without leaving cores idle. Pin one thread
   under torchrun with ``--threads 1``.
3. otherwise the **host budget**: the usable cores (rpcps.cpu_limits: the least of the affinity mask
   and the cgroup CPU quota) shared with every other rpcps process on this host that draws on the same cores (its pool)
   (rpcps.host_registry), by what each uses rather than by head count:

   * a *light* process (a server, the store, an evaluator, a worker that computes on a GPU) mostly
     waits or feeds a device. It reserves the cores it has been using lately (a moving average of its
     CPU time, at least ``MIN_USE``) and computes with about that many threads, never more than an
     equal split of the cores (a GPU worker: at most ``GPU_WORKER_THREADS``);
   * a *pinned* process reserves what it uses too, and keeps its threads;
   * the *compute* processes (CPU workers) share what the others leave, equally, rounded to whole
     threads with some hysteresis (``HYSTERESIS``) so a neighbour's use wobbling around a boundary
     does not flip the count every second.

   On 2 cores: ``local --workers 1`` gives the server (about 5 % of a core) 1 thread and the worker 2;
   a server and two workers, however started, get 1 each; a third worker started later leaves every
   process at 1, and the log and gauges say that 4 processes now share the host.

Every process re-reads the registry every ``POLL_S`` and recomputes. What goes wrong on the way (an
unreadable cgroup, a registry it cannot join, read or write, a malformed ``OMP_NUM_THREADS``, a
recomputation that fails) never ends the process: the budget goes on with what it knows, logs a
warning when the trouble starts (and a line when it ends, not one every second while it lasts) and
counts every occurrence by ``PROBLEMS`` (``rpcps_<role>_thread_budget_problems_total``). torch keeps the intra-op thread
count per OS thread (OpenMP's ``nthreads-var``), so setting it from the background thread would not
reach the threads that compute: the threads that compute call ``sync()`` between steps (a worker's
loop, a server's optimizer step), which applies a new budget on the calling thread, once.

What must not live here: how the cores are counted (rpcps.cpu_limits) or how processes find each
other (rpcps.host_registry); anything about the roles beyond their kind.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from rpcps import cpu_limits, host_registry
from rpcps.host_registry import Entry, HostRegistry

logger = logging.getLogger(__name__)

GPU_WORKER_THREADS = 2
"""A GPU worker's CPU threads: data, staging and the loop; more only compete with its neighbours."""
POLL_S = 1.0
"""How often a process re-reads the host's registry and its own CPU use."""
USE_TAU_S = 3.0
"""Time constant of the moving average of a process's CPU use."""
MIN_USE = 0.05
"""The least a light process reserves, in cores (an idle server still answers heartbeats)."""
LIGHT_SLACK = 0.1
"""A light process gets threads for what it uses beyond this fraction of a core (0.05 cores: 1 thread, 1.3: 2)."""
HYSTERESIS = 0.6
"""A compute process's share moves to a new whole number only once the exact share is this far from
the current one (1 -> 2 above 1.6 cores, 2 -> 1 below 1.4)."""
PRIOR_USE = {"server": 0.25, "store": 0.05, "evaluator": 0.25, "worker": 0.5}
"""What a light process is assumed to use before its first measurement."""
KINDS = ("compute", "light", "pinned")
PROBLEMS = ("cgroup_unreadable", "registry", "bad_setting", "recompute_failed")
"""What can go wrong with a budget: the ``problem`` label of ``rpcps_<role>_thread_budget_problems_total``."""
OnProblem = Callable[[str], None]


@dataclass(frozen=True)
class ThreadBudget:
    """The intra-op threads a process uses, and why (for the log, ``ctl status`` and the gauges)."""

    intra_op: int
    reason: str
    sharing: int = 1
    """rpcps processes on this host sharing the usable cores, this one included (1 when pinned or alone)."""
    usable: int = 0
    """The usable cores (rpcps.cpu_limits); 0 when not counted (a pinned budget)."""

    def __post_init__(self) -> None:
        if self.intra_op < 1:
            raise ValueError(f"intra_op threads must be >= 1, got {self.intra_op}")


def usable_cores() -> int:
    """The cores this process may keep busy: the least of its affinity and its cgroup CPU quota."""
    return cpu_limits.usable_cores().cores


def omp_num_threads(environ: Mapping[str, str] | None = None, on_problem: OnProblem | None = None) -> int | None:
    """``OMP_NUM_THREADS`` when it is set to a whole number >= 1 by someone other than torchrun's default, else None."""
    environ = os.environ if environ is None else environ
    value = _positive_int(environ, "OMP_NUM_THREADS", on_problem)
    if value == 1 and environ.get("TORCHELASTIC_RUN_ID") and (_positive_int(environ, "LOCAL_WORLD_SIZE", on_problem) or 1) > 1:
        return None  # torchrun's blanket default for multi-process runs, not a choice (see the module docstring)
    return value


def _positive_int(environ: Mapping[str, str], name: str, on_problem: OnProblem | None) -> int | None:
    raw = environ.get(name, "").strip()
    try:
        value = int(raw)
    except ValueError:
        if raw:
            logger.warning("ignoring %s=%r: not a whole number", name, raw)
            if on_problem is not None:
                on_problem("bad_setting")
        return None
    return value if value >= 1 else None


def pinned(requested: int | None, environ: Mapping[str, str] | None = None, on_problem: OnProblem | None = None) -> ThreadBudget | None:
    """The budget a setting pins (``--threads``, else ``OMP_NUM_THREADS``), or None when the host decides."""
    if requested is not None:
        return ThreadBudget(requested, "--threads")
    omp = omp_num_threads(environ, on_problem)
    return ThreadBudget(omp, "OMP_NUM_THREADS") if omp is not None else None


def kind_of(role: str, *, gpu: bool = False) -> str:
    """A role's kind when nothing pins its threads: CPU workers compute, everyone else is light."""
    return "compute" if role == "worker" and not gpu else "light"


def share(cores: int, me: Entry, others: Sequence[Entry], current: int | None, *, cap: int | None = None) -> int:
    """This process's intra-op threads on ``cores`` usable cores shared with ``others`` (see the module docstring).

    Args:
        cores: the usable cores.
        me: this process's entry (its kind and its recent CPU use).
        others: the other live processes on this host.
        current: this process's threads now (None before the first choice): the hysteresis keeps it.
        cap: the most threads this process may have (a GPU worker's ``GPU_WORKER_THREADS``).
    """
    if me.kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {me.kind!r}")
    if me.kind == "pinned":
        return me.threads
    everyone = [me, *others]
    if me.kind == "light":
        fair = max(1, math.floor(cores / len(everyone) + 0.5))
        threads = min(fair, math.ceil(me.use - LIGHT_SLACK))
    else:
        reserved = sum(min(float(cores), max(p.use, MIN_USE)) for p in everyone if p.kind != "compute")
        computing = sum(1 for p in everyone if p.kind == "compute")
        exact = max(0.0, cores - reserved) / computing
        threads = math.floor(exact + 0.5)
        if current is not None and abs(exact - current) <= HYSTERESIS:
            threads = current
    if cap is not None:
        threads = min(threads, cap)
    return max(1, min(threads, cores))


def describe(usable: cpu_limits.UsableCores, others: Sequence[Entry], kind: str) -> str:
    """Why: the usable cores, who shares them and how this process's share is counted."""
    if not others:
        sharing = "alone on this host"
    else:
        roles = collections.Counter(p.role + ("" if p.kind != "pinned" else " (pinned)") for p in others)
        listed = ", ".join(f"{n} {role}{'s' if n > 1 else ''}" for role, n in sorted(roles.items()))
        sharing = f"shared with {len(others)} other rpcps process{'es' if len(others) > 1 else ''} on this host ({listed})"
    how = {"compute": "an equal part of what the light processes leave", "light": "about the cores it uses"}[kind]
    return f"{usable.describe()}, {sharing}; this {kind} process takes {how}"


# The budget the threads that compute apply between steps (``sync``): a new generation is a new count.
_target = 0
_generation = 0
_applied = threading.local()
_lock = threading.Lock()


def _publish_target(threads: int) -> None:
    global _target, _generation
    with _lock:
        if threads != _target:
            _target = threads
            _generation += 1


def sync() -> None:
    """Applies the process's current budget to the calling thread if it changed since this thread last did.

    Call it where a thread is about to compute (a worker's step, a server's optimizer step). Costs an
    attribute read when nothing changed.
    """
    generation = _generation
    if getattr(_applied, "generation", -1) != generation and _target > 0:
        torch.set_num_threads(_target)
        _applied.generation = generation


class _Troubles:
    """The budget's problems that last (an unreadable cgroup is unreadable at every poll): a warning when
    one starts and a line when it ends, never one per poll; every occurrence counted by ``on_problem``."""

    def __init__(self, on_problem: OnProblem | None) -> None:
        self._on_problem = on_problem
        self._active: set[str] = set()

    def occurred(self, problem: str, message: str, *args: object, exc_info: bool = False, what: str | None = None) -> None:
        """``what`` tells apart troubles counted under one ``problem`` (reading and writing the registry)."""
        key = what or problem
        if key not in self._active:
            self._active.add(key)
            logger.warning(message + " (said once while it lasts; counted in thread_budget_problems_total)", *args, exc_info=exc_info)
        if self._on_problem is not None:
            self._on_problem(problem)

    def cleared(self, problem: str, message: str) -> None:
        if problem in self._active:
            self._active.discard(problem)
            logger.info(message)


class HostBudget:
    """This process's thread budget, kept right while it runs (see the module docstring).

    ``start`` chooses and applies the first budget on the calling thread; unless a setting pins it, a
    daemon thread then re-reads the host's registry every ``POLL_S`` and calls ``on_change`` (from that
    thread) whenever the threads or the processes sharing the host change, and ``on_problem`` with one
    of ``PROBLEMS`` whenever something on the way fails (the budget goes on with what it knows).
    """

    def __init__(
        self,
        role: str,
        requested: int | None = None,
        *,
        gpu: bool = False,
        environ: Mapping[str, str] | None = None,
        directory: str | Path | None = None,
        on_change: Callable[[ThreadBudget], None] | None = None,
        on_problem: OnProblem | None = None,
        poll_s: float = POLL_S,
        limits: Callable[[], cpu_limits.UsableCores] = cpu_limits.usable_cores,
    ) -> None:
        environ = os.environ if environ is None else environ
        self.role = role
        self._troubles = _Troubles(on_problem)
        self._pin = pinned(requested, environ, on_problem)
        self._kind = "pinned" if self._pin is not None else kind_of(role, gpu=gpu)
        self._cap = GPU_WORKER_THREADS if gpu and self._pin is None else None
        self._directory = Path(directory) if directory else host_registry.default_dir(environ)
        self._on_change = on_change
        self._poll_s = poll_s
        self._limits = limits
        # What it is assumed to use until it is measured: a CPU worker keeps its threads busy.
        self._use = float(self._pin.intra_op if self._pin is not None else 1) if kind_of(role, gpu=gpu) == "compute" else PRIOR_USE.get(role, 0.25)
        self._registry: HostRegistry | None = None
        self._pool = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.budget = ThreadBudget(1, "not chosen yet")

    def start(self) -> ThreadBudget:
        """Chooses, applies on this thread, logs and returns the first budget; starts following the host."""
        started = time.time()
        threads = self._pin.intra_op if self._pin is not None else 1
        self._pool = self._limits().pool
        entry = Entry(pid=os.getpid(), role=self.role, kind=self._kind, started=started, use=self._use, threads=threads, pool=self._pool)
        try:
            self._registry = HostRegistry(self._directory, entry)
        except OSError as e:
            self._troubles.occurred(
                "registry", "cannot join the host's process registry at %s (%s): the budget counts this process alone", self._directory, e
            )
        budget = self._choose(None)
        self._set(budget, first=True)
        self._thread = threading.Thread(target=self._follow, name="thread-budget", daemon=True)
        self._thread.start()
        return budget

    def stop(self) -> None:
        """Stops following and leaves the registry (a killed process leaves it by its lock)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._registry is not None:
            self._registry.close()

    def _choose(self, current: int | None) -> ThreadBudget:
        entries: dict[str, Entry] = {}
        if self._registry is not None:
            try:
                entries = self._registry.entries()
            except OSError as e:
                self._troubles.occurred(
                    "registry", "cannot read the host's process registry at %s (%s): the budget counts this process alone",
                    self._directory, e,
                )
            else:
                self._troubles.cleared("registry", f"the host's process registry at {self._directory} is readable again")
        usable = self._limits()
        if usable.unreadable:
            self._troubles.occurred("cgroup_unreadable", "%s: the budget counts the affinity's cores only", usable.quota_source)
        else:
            self._troubles.cleared("cgroup_unreadable", "cgroups are readable again")
        self._pool = usable.pool
        own = self._registry.path.name if self._registry is not None else None
        # Only the processes that draw on the same cores divide them (a container with a CPU limit has its own).
        others = [e for name, e in sorted(entries.items()) if name != own and (not e.pool or not usable.pool or e.pool == usable.pool)]
        if self._pin is not None:
            return replace(self._pin, sharing=1 + len(others))
        me = Entry(pid=os.getpid(), role=self.role, kind=self._kind, started=0.0, use=self._use, threads=current or 1)
        threads = share(usable.cores, me, others, current, cap=self._cap)
        reason = describe(usable, others, self._kind) + ("; capped for a GPU worker" if self._cap is not None and threads == self._cap else "")
        return ThreadBudget(threads, reason, sharing=1 + len(others), usable=usable.cores)

    def _set(self, budget: ThreadBudget, *, first: bool = False) -> None:
        old = self.budget
        self.budget = budget
        _publish_target(budget.intra_op)
        if first:
            sync()
            logger.info("intra-op threads: %d (%s)", torch.get_num_threads(), budget.reason)
        elif budget.intra_op != old.intra_op:
            logger.info("intra-op threads: %d -> %d (%s)", old.intra_op, budget.intra_op, budget.reason)
        elif self._pin is None:  # a pinned count says nothing about its neighbours: only the gauge follows them
            logger.info("intra-op threads stay %d (%s)", budget.intra_op, budget.reason)
        self._publish(threads=budget.intra_op)
        if self._on_change is not None:
            self._on_change(budget)

    def _follow(self) -> None:
        last_cpu, last_wall = time.process_time(), time.monotonic()
        published_use = self._use
        while not self._stop.wait(self._poll_s):
            try:
                cpu, wall = time.process_time(), time.monotonic()
                if wall > last_wall:
                    weight = 1.0 - math.exp(-(wall - last_wall) / USE_TAU_S)
                    self._use += ((cpu - last_cpu) / (wall - last_wall) - self._use) * weight
                last_cpu, last_wall = cpu, wall
                budget = self._choose(self.budget.intra_op)
                if budget.intra_op != self.budget.intra_op or budget.sharing != self.budget.sharing or budget.usable != self.budget.usable:
                    self._set(budget)
                    published_use = self._use
                elif self._registry is not None and abs(self._use - published_use) >= 0.05:
                    self._publish()
                    published_use = self._use
                self._troubles.cleared("recompute_failed", "thread budget: recomputing works again")
            except Exception:  # noqa: BLE001 - the budget must never end the process; the last one stands
                self._troubles.occurred(
                    "recompute_failed", "thread budget: recomputing failed; keeping %d threads", self.budget.intra_op, exc_info=True
                )

    def _publish(self, **changes: Any) -> None:
        """Tells the host this process's threads and use (others divide the cores by it); ``changes``
        are ``Entry`` fields."""
        if self._registry is None:
            return
        try:
            self._registry.publish(replace(self._registry.entry, use=round(self._use, 3), pool=self._pool, **changes))
        except OSError as e:
            self._troubles.occurred("registry", "cannot update this process's entry in the host's registry (%s)", e, what="registry-write")
            return
        self._troubles.cleared("registry-write", "this process's entry in the host's registry is written again")


def problem_counter(registry: CollectorRegistry, role: str) -> OnProblem:
    """Registers ``rpcps_<role>_thread_budget_problems_total`` (by ``PROBLEMS``); returns what counts one (an ``on_problem``)."""
    problems = Counter(
        f"rpcps_{role}_thread_budget_problems",
        "Times the thread budget could not read the cgroup or the host registry, found a malformed OMP_NUM_THREADS, "
        "or failed to recompute; it went on with what it knew (rpcps.threads).",
        ["problem"], registry=registry,
    )
    for problem in PROBLEMS:
        problems.labels(problem=problem)
    return lambda problem: problems.labels(problem=problem).inc()


class BudgetGauges:
    """A role's gauges of its budget: ``rpcps_<role>_intra_op_threads``, ``_host_processes`` and ``_usable_cores``."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.intra_op = Gauge(
            f"rpcps_{role}_intra_op_threads",
            f"Intra-op CPU threads the {role} computes with now: --threads, OMP_NUM_THREADS or its share of the host (rpcps.threads).",
            registry=registry,
        )
        self.host_processes = Gauge(
            f"rpcps_{role}_host_processes", "rpcps processes on this host sharing its usable cores, this one included.", registry=registry
        )
        self.usable_cores = Gauge(
            f"rpcps_{role}_usable_cores", "Cores this process may keep busy: the least of its affinity and cgroup CPU quota.",
            registry=registry,
        )
        self.count_problem = problem_counter(registry, role)
        """An ``on_problem`` of ``HostBudget``."""

    def show(self, budget: ThreadBudget) -> None:
        """Sets the gauges (an ``on_change`` of ``HostBudget``)."""
        self.intra_op.set(budget.intra_op)
        self.host_processes.set(budget.sharing)
        self.usable_cores.set(budget.usable)
