"""Helpers shared by the benchmarks that drive ``trainer_entry.py local`` (not a test).

``run_local`` starts one ``local`` run in a fresh run directory and, while it runs, samples from
outside what the run's own summary cannot say: the server's and the workers' /metrics (updates
applied; steps, compute and blocked seconds) and shard 0's memory from ``/proc/<pid>/status``. The
ports and pids come from the run directory's ``children.json``, the file ``local`` writes for tools.

The children run on the product's defaults: nothing here sets thread counts or other settings for
them (the product chooses its own threads; a benchmark that pinned them would measure something
users do not run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def child_env(extra_pythonpath: str | None = None) -> dict[str, str]:
    """This environment with the repository (and ``extra_pythonpath``) importable; nothing else changed."""
    paths = [str(REPO)] + ([extra_pythonpath] if extra_pythonpath else []) + [os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


STEADY_FROM, STEADY_TO = 0.15, 0.85
"""The steady part of a run: from the moment it had made 15 % of its final count to 85 %."""


def run_in_scratch(directory: Path, run: Callable[[], None]) -> None:
    """Creates ``directory`` (it must not exist yet), runs ``run``, then removes it whatever happened."""
    directory.mkdir(parents=True, exist_ok=False)
    try:
        run()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def emit_json(obj: Any) -> None:
    """Writes ``obj`` to stdout as one JSON line, every byte of it (the line a parent process parses).

    ``print`` loses data here: with ``PYTHONUNBUFFERED=1`` (set on this machine and on many CI
    runners) stdout has no buffered layer, and when a signal interrupts a write blocked on a full
    pipe the part not yet written is dropped without an error. Measured: a 2 MB line printed under a
    10 ms timer reached the reader as 64 KiB; the example design's 12000 update times once arrived
    cut at 128 KiB and failed bench.cpu_split. ``os.write`` returns how much went out; the rest is
    written again until none is left.
    """
    line = json.dumps(obj) + "\n"
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError):  # an in-memory stream (a caller's capture): no pipe to cut the line
        sys.stdout.write(line)
        sys.stdout.flush()
        return
    rest = memoryview(line.encode())
    while rest:
        rest = rest[os.write(fd, rest):]


def steady_rate(samples: Sequence[tuple[float, float]]) -> float:
    """Count per second over the steady part of a run, from (seconds, running count) samples.

    The moments the count crossed ``STEADY_FROM`` and ``STEADY_TO`` of its final value are
    interpolated between samples. That leaves out start-up (imports, model build, joining,
    registration: seconds on a small machine) and the tail (workers finishing at different times),
    and measures every side of a comparison the same way, whatever its count is (a server's applied
    updates sampled from /metrics, or one timestamp per update).
    """
    final = samples[-1][1] if samples else 0.0
    if final <= 0:
        return float("nan")
    start, end = _crossing(samples, STEADY_FROM * final), _crossing(samples, STEADY_TO * final)
    return (STEADY_TO - STEADY_FROM) * final / (end - start) if end > start else float("nan")


def _crossing(samples: Sequence[tuple[float, float]], target: float) -> float:
    for (t0, v0), (t1, v1) in zip([(samples[0][0], 0.0), *samples], samples):
        if v1 >= target:
            return t1 if v1 == v0 else t0 + (t1 - t0) * (target - v0) / (v1 - v0)
    return samples[-1][0]


def proc_memory_kb(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of a live process in KiB, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])
    except (KeyError, ValueError):
        return None


@dataclass
class Samples:
    """What the sampler saw, every ``interval_s``: (seconds since start, value)."""

    worker_steps: list[tuple[float, float]] = field(default_factory=list)
    """Sum of rpcps_worker_steps_total over the workers."""
    server_updates: list[tuple[float, float]] = field(default_factory=list)
    """Shard 0's rpcps_server_updates_applied_total."""
    worker_last: dict[str, dict[str, float]] = field(default_factory=dict)
    """The newest /metrics read of each worker (its final counters, give or take one interval)."""
    server_rss_kb: list[tuple[float, int]] = field(default_factory=list)
    """VmRSS of shard 0's process."""
    server_hwm_kb: int = 0
    server_pid: int | None = None
    worker_rss_kb: list[tuple[float, int]] = field(default_factory=list)
    """The largest VmRSS over the worker processes."""
    worker_hwm_kb: int = 0
    """The largest VmHWM over the worker processes."""


@dataclass
class LocalRun:
    summary: dict[str, Any]
    samples: Samples
    run_dir: Path
    elapsed_s: float

    def steady_steps_per_s(self) -> float:
        """Worker steps per second between the first and the last sample that saw steps.

        Leaves out process start-up, model build and registration (seconds on this machine), which
        would otherwise dominate short runs.
        """
        seen = [(t, v) for t, v in self.samples.worker_steps if v > 0]
        if len({v for _, v in seen}) < 3:  # too few complete samples (e.g. a scrape missed): no steady window
            return self.summary_steps_per_s()
        return (seen[-1][1] - seen[0][1]) / (seen[-1][0] - seen[0][0])

    def steady_updates_per_s(self) -> float:
        """Shard 0's applied updates per second over the steady part of the run (``steady_rate``)."""
        return steady_rate(self.samples.server_updates)

    def summary_steps_per_s(self) -> float:
        """Sum over the workers of steps / their own wall time (includes their start-up)."""
        return sum(w["steps"] / w["wall_seconds"] for w in self.summary["workers"] if w.get("wall_seconds"))

    def communication_fraction(self) -> float:
        """Blocked-on-network share of the workers' step time, pooled over the workers."""
        comp = sum(m.get("rpcps_worker_compute_seconds_total", 0.0) for m in self.samples.worker_last.values())
        comm = sum(m.get("rpcps_worker_communication_blocked_seconds_total", 0.0) for m in self.samples.worker_last.values())
        return comm / (comp + comm) if comp + comm > 0 else float("nan")


def local_argv(
    run_dir: Path, *, model: str, data: str, workers: int, steps: int, extra: Sequence[str] = (), loss: str = "mse"
) -> list[str]:
    return [
        sys.executable, str(REPO / "trainer_entry.py"), "local", "--workers", str(workers), "--steps", str(steps),
        "--model", model, "--data", data, "--loss", loss, "--run-dir", str(run_dir),
        "--summary-json", str(run_dir / "summary.json"), "--progress-s", "3600", "--log-level", "WARNING", *extra,
    ]


def run_local(
    argv: list[str],
    run_dir: Path,
    *,
    interval_s: float = 0.25,
    extra_pythonpath: str | None = None,
    stop_after_s: float | None = None,
    scrape_workers: bool = True,
) -> LocalRun:
    """Runs ``local`` to the end (or SIGTERMs it after ``stop_after_s``) while a thread samples its children.

    ``scrape_workers=False`` reads only the server's /metrics (a comparison with a design that has
    no endpoints to scrape should not load rpcps's workers with scrapes).

    Raises if it fails. A stopped run's summary is whatever ``local`` wrote on its way out ({} if nothing).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    samples = Samples()
    done = threading.Event()
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=child_env(extra_pythonpath), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = threading.Thread(target=_sample, args=(run_dir, samples, done, started, interval_s, scrape_workers), daemon=True)
    sampler.start()
    try:
        try:
            _, err = proc.communicate(timeout=stop_after_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # local stops its workers, then the servers
            _, err = proc.communicate(timeout=120)
    finally:
        done.set()
        sampler.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 and stop_after_s is None:
        raise RuntimeError(f"local run failed ({proc.returncode}): {' '.join(argv)}\n{err.decode(errors='replace')[-3000:]}")
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() or stop_after_s is None else {}
    return LocalRun(summary=summary, samples=samples, run_dir=run_dir, elapsed_s=time.monotonic() - started)


def _sample(run_dir: Path, samples: Samples, done: threading.Event, started: float, interval_s: float, scrape_workers: bool) -> None:
    from rpcps.scrape import try_scrape as scrape

    children = run_dir / "children.json"
    while not done.wait(interval_s):
        try:
            info = json.loads(children.read_text())
        except (OSError, ValueError):
            continue  # not written yet, or being rewritten
        now = time.monotonic() - started
        ps = info.get("ps", {})
        if ps.get("pid"):
            samples.server_pid = ps["pid"]
            mem = proc_memory_kb(ps["pid"])
            if mem:
                samples.server_rss_kb.append((now, mem[0]))
                samples.server_hwm_kb = max(samples.server_hwm_kb, mem[1])
        worker_mem = [m for m in (proc_memory_kb(c["pid"]) for n, c in info.items() if n.startswith("worker") and c.get("pid")) if m]
        if worker_mem:
            samples.worker_rss_kb.append((now, max(m[0] for m in worker_mem)))
            samples.worker_hwm_kb = max(samples.worker_hwm_kb, *(m[1] for m in worker_mem))
        updates = scrape(ps["metrics_port"]).get("rpcps_server_updates_applied_total") if ps.get("metrics_port") else None
        if updates is not None:
            samples.server_updates.append((now, updates))
        if not scrape_workers:
            continue
        total, complete = 0.0, True
        for name, child in info.items():
            if not name.startswith("worker") or not child.get("metrics_port"):
                continue
            values = scrape(child["metrics_port"])
            if values:
                samples.worker_last[name] = values
                total += values.get("rpcps_worker_steps_total", 0.0)
            else:
                complete = False  # not up yet or already gone: this sample would undercount
        if complete and total > 0:
            samples.worker_steps.append((now, total))


def run_ranks(argv: list[str], ranks: int, timeout_s: float = 900) -> dict[str, Any]:
    """Runs ``ranks`` processes of ``argv`` (+ --rank R when more than one) and returns rank 0's last stdout line, parsed as JSON.

    For the benchmarks' stand-alone designs (bench/example_design.py, bench/sparse_tutorial_design.py):
    rank 0 reports what it measured as one JSON line at the end. Raises if any rank fails; kills
    every rank that is still running on the way out.
    """
    procs = [
        subprocess.Popen([*argv, *(["--rank", str(r)] if ranks > 1 else [])], cwd=REPO, env=child_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for r in range(ranks)
    ]
    try:
        outs = []
        for r, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(argv[:4])} rank {r} failed: {err.decode(errors='replace')[-2000:]}")
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return json.loads(outs[0].decode().strip().splitlines()[-1])


def print_table(columns: list[str], rows: list[list[str]]) -> str:
    """Prints a Markdown table (pasted into docs/benchmarks-log.md as is) and returns it."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


@dataclass
class HandRun:
    """What ``run_by_hand`` saw: the server's applied updates, each process's log and budget gauges."""

    server_updates: list[tuple[float, float]]
    """(seconds since start, the server's rpcps_server_updates_applied_total)."""
    logs: dict[str, str]
    """Each process's log (ps, worker0, ...)."""
    host_processes: dict[str, list[tuple[float, float]]]
    """Each process's rpcps_*_host_processes gauge over time (only with ``scrape_all``)."""
    intra_op: dict[str, list[tuple[float, float]]]
    """Each process's rpcps_*_intra_op_threads gauge over time (only with ``scrape_all``)."""
    late_started_s: float | None
    """When the late worker was started (seconds since start), if one was."""

    def steady_updates_per_s(self) -> float:
        return steady_rate(self.server_updates)

    def rate_between(self, t0: float, t1: float) -> float:
        """Updates per second between two moments (interpolated between samples)."""
        def at(t: float) -> float:
            for (a, va), (b, vb) in zip(self.server_updates, self.server_updates[1:]):
                if a <= t <= b:
                    return va + (vb - va) * (t - a) / (b - a) if b > a else vb
            raise ValueError(f"no samples around {t:.1f}s")
        return (at(t1) - at(t0)) / (t1 - t0)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def run_by_hand(
    run_dir: Path,
    *,
    model: str,
    data: str,
    loss: str,
    workers: int,
    steps: int,
    extra: Sequence[str] = (),
    late_worker_at: float | None = None,
    late_worker_steps: int | None = None,
    interval_s: float = 0.5,
    scrape_all: bool = False,
    timeout_s: float = 900,
    server_wrapper: Callable[[list[str]], list[str]] | None = None,
    on_sample: Callable[[dict[str, int], float | None], None] | None = None,
) -> HandRun:
    """A server and ``workers`` workers started as separate processes, the way README's "Running it on a
    cluster" starts them on one host: no ``local``, no thread flag, no thread environment.

    ``extra`` goes to the server (its optimizer). With ``late_worker_at`` (a fraction of the
    ``workers * steps`` updates), one more worker (slot ``workers``) is started by hand once the server
    has applied that many. ``server_wrapper`` rewrites the server's command line (to run it in a
    cgroup: harness.cgroups.enter_argv). ``on_sample`` gets, at every sample, the pid of every process
    by name (``ps`` the serving process, ``ps-supervisor`` its parent) and the server's applied updates
    (None before it answers). The only flags beyond the README's are ports (so the sampler
    can find the endpoints) and a summary file per process. Raises if a process fails.
    """
    from rpcps.ports import free_port
    from rpcps.scrape import try_scrape as scrape

    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    total = workers + (1 if late_worker_at is not None else 0)
    ports = {"ps": free_port(), **{f"worker{i}": free_port() for i in range(total)}}
    entry = str(REPO / "trainer_entry.py")
    common = ["--model", model, "--log-level", "INFO"]

    def worker_argv(i: int, n: int) -> list[str]:
        return [sys.executable, entry, "worker", "--ps", f"127.0.0.1:{port}", "--worker-index", str(i), "--num-workers", str(total),
                "--steps", str(n), "--data", data, "--loss", loss, "--metrics-port", str(ports[f"worker{i}"]),
                "--summary-json", str(run_dir / f"worker{i}.json"), *common]

    argvs = {"ps": [sys.executable, entry, "ps", "--listen", f"127.0.0.1:{port}", "--metrics-port", str(ports["ps"]),
                    "--summary-json", str(run_dir / "ps.json"), *common, *extra]}
    if server_wrapper is not None:
        argvs["ps"] = server_wrapper(argvs["ps"])
    argvs.update({f"worker{i}": worker_argv(i, steps) for i in range(workers)})
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Any] = {}

    def start(name: str, argv: list[str]) -> None:
        logs[name] = open(run_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in the finally below
        procs[name] = subprocess.Popen(argv, cwd=REPO, env=child_env(), stdout=logs[name], stderr=subprocess.STDOUT)

    updates: list[tuple[float, float]] = []
    host: dict[str, list[tuple[float, float]]] = {}
    threads: dict[str, list[tuple[float, float]]] = {}
    late_at: float | None = None
    started = time.monotonic()
    try:
        for name, argv in argvs.items():
            start(name, argv)
        deadline = started + timeout_s
        while any(procs[n].poll() is None for n in procs if n != "ps"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"hand-started run did not finish in {timeout_s:.0f}s ({run_dir})")
            time.sleep(interval_s)  # the sampling interval, not synchronisation: every loop reads the state afresh
            now = time.monotonic() - started
            for name in list(procs) if scrape_all else ["ps"]:
                values = scrape(ports[name]) if procs[name].poll() is None else None
                if not values:
                    continue
                role = "server" if name == "ps" else "worker"
                if name == "ps" and "rpcps_server_updates_applied_total" in values:
                    updates.append((now, values["rpcps_server_updates_applied_total"]))
                if f"rpcps_{role}_host_processes" in values:
                    host.setdefault(name, []).append((now, values[f"rpcps_{role}_host_processes"]))
                    threads.setdefault(name, []).append((now, values[f"rpcps_{role}_intra_op_threads"]))
            if on_sample is not None:
                pids = {name: p.pid for name, p in procs.items() if name != "ps"}
                pids["ps-supervisor"] = procs["ps"].pid
                serving = _children(procs["ps"].pid)  # rpcps ps supervises itself: the server is its child
                if serving:
                    pids["ps"] = serving[0]
                on_sample(pids, updates[-1][1] if updates else None)
            if late_worker_at is not None and late_at is None and updates and updates[-1][1] >= late_worker_at * workers * steps:
                late_at = now
                start(f"worker{workers}", worker_argv(workers, late_worker_steps or steps))
            failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(f"{failed} failed; logs in {run_dir}")
        procs["ps"].send_signal(signal.SIGTERM)
        procs["ps"].wait(timeout=120)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in logs.values():
            f.close()
    return HandRun(updates, {n: (run_dir / f"{n}.log").read_text(errors="replace") for n in procs}, host, threads, late_at)
