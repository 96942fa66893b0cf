"""``rpcps local``: a server and N workers as separate processes on this machine, supervised; with
``--eval-data``, a sidecar evaluator beside them.

The supervisor restarts a crashed child (up to --max-restarts, with backoff), prints progress read
from the children's own /metrics endpoints, and on Ctrl-C or SIGTERM stops the workers, then the
server, and reaps every child before it returns.

Children running rpcps itself are forked from a fork server (``rpcps.prefork``) that imported torch
once, so a start or a restart costs a server 0.7 CPU-s instead of 4.6 (a worker 0.4 instead of 2.7)
and comes up seconds sooner on a busy host; each still shows its own command line in ``ps``. An
own-loop ``--worker-script`` starts as a fresh interpreter: it may set up its environment before it
imports torch. If local itself dies, the fork server gets SIGTERM and so do the children, which stop
as on Ctrl-C instead of training on unsupervised.

With ``--replicas 2`` it also starts the group's coordinator (``rpcps store``) first and two server
processes per shard with the same command line: the first to claim the shard serves it, the other
follows it as a hot standby. A restarted replica attaches to whichever one serves by then. With
``--store etcd://...`` no process of its own holds the store: every child joins through etcd.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cli import ctl, exits, progress
from cli.config import LocalConfig, StoreConfig
from cli.console import Console
from evaluator.config import EvaluatorRunConfig
from evaluator.scoring import check_model_spec
from ps.checkpoints.checkpointer import shard_checkpoint_config
from ps.config import ServerRunConfig
from ps.lifecycle.supervisor import RestartBackoff
from rpcps import plugins
from rpcps.address import Address, StoreAddress
from rpcps.messages import Mode
from rpcps.ports import free_port
from rpcps.prefork import ForkedProcess, ForkServer
from rpcps.process import ProcessOptions
from rpcps.scrape import try_scrape
from rpcps.secret_files import create_secret_file
from rpcps.settings import declared, to_argv
from rpcps.summary import read_summary, run_summary, write_summary
from rpcps.transport.config import TransportOptions
from worker.config import WorkerRunConfig

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 30.0
_END_CHECK_S = 120.0
"""How long the end-of-run check waits for servers to answer (one may be restarting from a crash)."""
_DONE, _WAIT, _FAILED = "done", "wait", "failed"
CHECKPOINTING_OFF = (
    "rpcps local: checkpointing is off (no --checkpoint-dir): a server crash loses the training so far, and no snapshot "
    "is left to resume from or export; pass --checkpoint-dir DIR to keep snapshots"
)
"""Said once on local's console; its children then say it at INFO only (--checkpoints-off-ok)."""
_ENTRY = Path(__file__).resolve().parents[1] / "trainer_entry.py"


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    summary_path: Path
    metrics_port: int
    control_port: int | None = None
    """A server's control-plane port (None for workers)."""
    restarts: int = 0
    process: subprocess.Popen | ForkedProcess | None = None
    done: bool = False
    next_start: float = 0.0
    backoff: RestartBackoff = field(default_factory=RestartBackoff)
    """The delay before a restart after a crash (the same rule as a hand-started server's supervisor)."""
    log_file: Any = field(default=None, repr=False)
    env: dict[str, str] | None = None
    """The child's environment (None: this process's)."""
    log_offset: int = 0
    """Where this incarnation's part of the log begins (every incarnation appends to one file)."""
    announced: bool = False
    """Whether local said what this incarnation resumed from (servers)."""
    serving: bool = False
    """Whether this incarnation serves (servers): restored, its version the model's."""

    def start(self, forks: ForkServer | None) -> None:
        """Starts this child: forked from ``forks`` when it runs rpcps and can, else as a subprocess."""
        if self.log_file is None:
            self.log_file = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the child
        self.log_file.flush()
        self.log_offset = self.log_path.stat().st_size
        self.announced = self.serving = False
        env = self.env if self.env is not None else dict(os.environ)
        if forks is not None and self.argv[1] == str(_ENTRY) and forks.can_run(env, Path.cwd()):
            with open(os.devnull, "rb") as devnull:
                out = self.log_file.fileno()
                self.process = forks.spawn(_ENTRY, self.argv[2:], env, stdin=devnull.fileno(), stdout=out, stderr=out)
        else:
            self.process = subprocess.Popen(
                self.argv, stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        logger.info("started %s (pid %d), log %s", self.name, self.process.pid, self.log_path)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.process is not None
            try:
                self.process.send_signal(sig)
            except ProcessLookupError:
                pass


class Supervisor:
    def __init__(self, config: LocalConfig, forks: ForkServer | None = None) -> None:
        """``forks``: where the children that run rpcps are forked from (None: each a fresh subprocess)."""
        self.config = config
        self._forks = forks
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="rpcps-local-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.port = config.port or free_port()
        self.interrupted = False
        self.exit_code = 1
        """What ``run`` returns when it fails: a child's own status when a restart could not fix it."""
        self._start_version: int | None = None
        """Shard 0's model version when this run began (a resumed run starts from its snapshot's)."""
        self._last_version: tuple[float, int] | None = None
        """(when, version) of the previous progress line: its rate is counted from there."""
        self._end_deadline: float | None = None
        self.console = Console(config.worker.steps * config.workers)
        self.control_port = free_port()
        etcd = config.store
        own = Address("127.0.0.1", self.port)  # without etcd: where the coordinator, or shard 0's server, hosts the store
        store: StoreAddress = etcd if etcd is not None else own
        server = config.server
        # local restarts its children itself (and counts and reports those restarts), so its server
        # does not supervise itself; every child proves the job's secret (a file: never on a command line).
        server = replace(
            server, supervise=False, transport=replace(server.transport, job_secret_file=self._job_secret(server.transport))
        )
        if server.core.mode in (Mode.SYNC, Mode.LOCAL_STEPS) and server.core.min_workers == 1:
            # sync: rounds start with everyone; local-steps: each delta is applied at 1 / workers
            server = replace(server, core=replace(server.core, min_workers=config.workers))
        # Without --checkpoint-dir, local says once on its console what that means (run_local): its
        # children need not warn in their logs about a choice it made for them.
        off = server.checkpoint.directory is None
        server_process, worker_process = (
            replace(p, checkpoints_off_ok=p.checkpoints_off_ok or off) for p in _thread_shares(config)
        )
        server = replace(server, process=server_process)
        replicas = self.replicas = server.replication.replicas
        self.coordinator: Child | None = None
        if replicas > 1 and etcd is None:  # a standby cannot take over from a primary that hosts the store every join needs
            metrics_port = free_port()
            coordinator = StoreConfig(
                listen=own,
                metrics_port=metrics_port,
                process=replace(server.process, summary_json=str(self._summary_path("store"))),
                transport=server.transport,
            )
            self.coordinator = self._child("store", "store", coordinator, metrics_port)
        self.servers: list[Child] = []
        for k in range(server.core.shard_count):
            for r in range(replicas):
                name = ("ps" if k == 0 else f"ps{k}") + ("" if r == 0 else f"_{'abcdefgh'[r]}")
                metrics_port = free_port()
                control_port = self.control_port if (k, r) == (0, 0) else free_port()
                child = replace(
                    server,
                    listen=own,
                    store=None if (k, replicas, etcd) == (0, 1, None) else store,  # without replicas or etcd shard 0 hosts it
                    metrics_port=metrics_port,
                    core=replace(server.core, shard_index=k),
                    control=replace(server.control, addr="127.0.0.1", port=control_port),
                    process=replace(server.process, summary_json=str(self._summary_path(name))),
                )
                self.servers.append(self._child(name, "ps", child, metrics_port, control_port))
        self.server = self.servers[0]
        self.workers: list[Child] = []
        for i in range(config.workers):
            name, metrics_port = f"worker{i}", free_port()
            worker_config = WorkerRunConfig(
                ps=store,
                metrics_port=metrics_port,
                process=replace(worker_process, summary_json=str(self._summary_path(name))),
                transport=server.transport,
                worker=replace(config.worker, worker_index=i, num_workers=config.workers),
            )
            worker = self._child(name, "worker", worker_config, metrics_port)
            if config.worker_script is not None:
                # The script's own code may name other defaults: --steps is what this supervisor checks.
                script = shlex.split(config.worker_script)
                worker.argv = [sys.executable, *script, *worker.argv[3:], "--steps", str(config.worker.steps)]
                # The script imports the rpcps these servers run (its own folder comes first on sys.path).
                path = os.pathsep.join(p for p in (str(_ENTRY.parent), os.environ.get("PYTHONPATH", "")) if p)
                worker.env = {**os.environ, "PYTHONPATH": path}
            self.workers.append(worker)
        self.evaluators: list[Child] = []
        if config.evaluator.eval_data is not None:
            metrics_port = free_port()
            evaluator = EvaluatorRunConfig(
                ps=store,
                metrics_port=metrics_port,
                process=replace(server.process, summary_json=str(self._summary_path("evaluator"))),
                transport=server.transport,
                evaluator=config.evaluator,
            )
            self.evaluators.append(self._child("evaluator", "evaluate", evaluator, metrics_port))

    def _job_secret(self, options: TransportOptions) -> str:
        """The secret file every child gets: --job-secret-file, or one made in the run directory (0600)."""
        if options.job_secret_file is not None:
            return options.job_secret_file
        path = self.run_dir / "job-secret"
        if not path.exists():
            create_secret_file(path)
        return str(path)

    def _summary_path(self, name: str) -> Path:
        return self.run_dir / f"{name}.summary.json"

    def _child(
        self,
        name: str,
        role: str,
        config: ServerRunConfig | WorkerRunConfig | EvaluatorRunConfig | StoreConfig,
        metrics_port: int,
        control_port: int | None = None,
    ) -> Child:
        """A child process running ``role`` with ``config`` (as the command line that reproduces it)."""
        argv = [sys.executable, str(_ENTRY), role, *to_argv(config, declared(type(config)))]
        return Child(name, argv, self.run_dir / f"{name}.log", self._summary_path(name), metrics_port, control_port)

    @property
    def children(self) -> list[Child]:
        return [*([self.coordinator] if self.coordinator is not None else []), *self.servers, *self.workers, *self.evaluators]

    def _role(self, child: Child) -> str:
        if child is self.coordinator:
            return "store"
        return "ps" if child in self.servers else "evaluator" if child in self.evaluators else "worker"

    def _shard0_primary(self) -> Child:
        """The process serving shard 0 now (with replicas, whichever reports itself primary)."""
        for child in self.servers[: self.replicas]:
            if try_scrape(child.metrics_port).get("rpcps_replica_role") == 2:
                return child
        return self.server

    def write_scrape_targets(self) -> Path:
        """Writes the children's /metrics addresses as a Prometheus file_sd targets file."""
        path = self.run_dir / "prometheus_targets.json"
        groups = [
            {"targets": [f"127.0.0.1:{c.metrics_port}"], "labels": {"role": self._role(c), "child": c.name}}
            for c in self.children
        ]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups, indent=2))
        os.replace(tmp, path)
        return path

    def write_children(self) -> Path:
        """Writes each child's current pid, restarts, metrics port and (servers) control port to children.json
        (tools read it)."""
        path = self.run_dir / "children.json"
        info = {
            c.name: {
                "pid": c.process.pid if c.process else None, "restarts": c.restarts, "metrics_port": c.metrics_port,
                **({"control_port": c.control_port} if c.control_port is not None else {}),
            }
            for c in self.children
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        os.replace(tmp, path)
        return path

    def run(self) -> int:
        started = time.monotonic()
        self.write_scrape_targets()
        where = f"store in {self.config.store}" if self.config.store is not None else f"server on 127.0.0.1:{self.port}"
        self.console.say(
            f"rpcps local: {where}, {len(self.workers)} workers, logs in {self.run_dir}; "
            f"control: rpcps ctl status --addr 127.0.0.1:{self.control_port}"
        )
        for child in self.children:
            child.start(self._forks)
        self.write_children()
        failed = False
        last_progress = 0.0
        try:
            while not self.interrupted:
                if all(w.done for w in self.workers):
                    verdict = self._check_end()
                    if verdict != _WAIT:
                        failed = verdict == _FAILED
                        break
                failed = not self._supervise()
                if failed:
                    break
                self._read_server_logs()
                if time.monotonic() - last_progress >= self.config.server.progress_s:
                    last_progress = time.monotonic()
                    self._print_progress(started)
                time.sleep(0.2)
        finally:
            self._stop_all()
        self._read_server_logs()
        self.console.close()
        summary = self._summary(time.monotonic() - started)
        write_summary(self.config.process.summary_json, summary)
        if self.interrupted:
            print("rpcps local: interrupted; all children stopped", flush=True)
            return 130
        if failed:
            return self.exit_code
        if summary["steps"] == 0:
            print(progress.nothing_left(self.config.server.checkpoint.directory, self.config.worker.steps,
                                       len(self.workers), summary["model_version"]), flush=True)
        print(progress.final_line(summary, summary["evaluator"]), flush=True)
        return 0

    def _check_end(self) -> str:
        """Every worker exited 0: do the servers hold every step of every slot?

        A slot is short when a server resumed from a checkpoint older than the one its finished
        worker made durable (the newer one was lost). Its worker is started again (it resumes where
        the server is), as a restart. Returns _DONE, _WAIT (servers not answering yet, or a worker
        restarted) or _FAILED (a slot stays short, or the servers never answer; said on stderr).
        """
        now = time.monotonic()
        if self._end_deadline is None:
            self._end_deadline = now + _END_CHECK_S
        held = self._slot_progress()
        if held is None:
            if now < self._end_deadline:
                return _WAIT
            self.console.say(f"rpcps local: the servers did not answer within {_END_CHECK_S:.0f}s after the workers finished; "
                             "cannot tell whether every step is held", error=True)
            return _FAILED
        steps = self.config.worker.steps
        short = {slot: n for slot, n in held.items() if n < steps}
        if not short:
            return _DONE
        for slot, n in sorted(short.items()):
            worker = self.workers[slot]
            if worker.restarts >= self.config.max_restarts:
                self.console.say(f"rpcps local: slot {slot} holds {n} of {steps} steps after its worker finished, and "
                                 f"{worker.name} is out of restarts; the model is short by {steps - n} steps", error=True)
                return _FAILED
            worker.restarts += 1
            worker.done = False
            worker.next_start = now
            self.console.say(f"rpcps local: slot {slot} holds {n} of {steps} steps after its worker finished (a server resumed "
                             f"from an older snapshot); running {worker.name} again, restart {worker.restarts}/{self.config.max_restarts}")
        self._end_deadline = None
        return _WAIT

    def _slot_progress(self) -> dict[int, int] | None:
        """Per worker slot, the fewest of its steps any server shard holds; None while a server does not answer,
        or answers before it serves (a restarted server's control plane is up before it has restored its
        snapshot: its slots would read empty, and local would run finished workers again)."""
        held = {slot: self.config.worker.steps for slot in range(len(self.workers))}
        for server in self.servers:
            if not server.serving:
                return None
            assert server.control_port is not None
            try:
                status = ctl.status("127.0.0.1", server.control_port)
            except ctl.CallFailed:
                return None
            progress = {s["slot"]: s["next_step"] for s in status["slots"]}
            held = {slot: min(n, progress.get(slot, 0)) for slot, n in held.items()}
        return held

    def _supervise(self) -> bool:
        """Restarts children that died; marks finished workers. False when a child is out of restarts."""
        now = time.monotonic()
        for child in self.children:
            if child.done or child.alive():
                continue
            if child.process is not None:
                code = child.process.returncode
                assert code is not None  # alive() polled it: the process has ended
                child.process = None
                if child not in self.servers and code == 0:
                    child.done = True
                    continue
                max_restarts = self.config.max_restarts
                why = exits.error_lines(child.log_path)
                if not exits.restartable(code) or child.restarts >= max_restarts:
                    verdict = "a restart cannot fix that" if not exits.restartable(code) else "out of restarts"
                    self.console.say(f"rpcps local: {child.name} {exits.describe(code)}; {verdict}", error=True)
                    for line in why:
                        self.console.say(f"  {child.name}: {line}", error=True)
                    self.console.say(f"  (its whole log: {child.log_path})", error=True)
                    self.exit_code = code if code in exits.FINAL_EXITS else 1
                    return False
                child.restarts += 1
                delay = child.backoff.after_crash(now)
                child.next_start = now + delay
                cause = f": {why[-1]}" if why else ""
                self.console.say(f"rpcps local: {child.name} {exits.describe(code)}{cause}; "
                                 f"restart {child.restarts}/{max_restarts} in {delay:.1f}s")
            if now >= child.next_start:
                child.start(self._forks)
                self.write_children()
        return True

    def _stop_all(self) -> None:
        # Workers first (their final pushes land) with the evaluator (it scores the final model while
        # the servers are still up), then standbys (stopped after their primary, they would promote
        # themselves on the way out), then shards > 0, then shard 0 (without replicas it hosts the
        # group's store, and the others would take its loss for a crash and restart themselves), then
        # the coordinator.
        shard0 = self._shard0_primary()
        standbys = (
            [c for c in self.servers if c is not shard0 and try_scrape(c.metrics_port).get("rpcps_replica_role") != 2]
            if self.replicas > 1 else []
        )
        primaries = [c for c in self.servers if c is not shard0 and c not in standbys]
        for group in (
            [*self.workers, *self.evaluators], standbys, primaries, [shard0], [self.coordinator] if self.coordinator else [],
        ):
            for c in group:
                c.signal(signal.SIGTERM)
            deadline = time.monotonic() + _STOP_GRACE_S
            for c in group:
                if c.process is None:
                    continue
                try:
                    c.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop within %.0fs; killing it", c.name, _STOP_GRACE_S)
                    c.process.kill()
                    c.process.wait()
        for c in self.children:
            if c.log_file is not None:
                c.log_file.close()

    def _read_server_logs(self) -> None:
        """Follows each server incarnation's log until it serves: says on the console, once, which version
        and snapshot it resumed from (the version alone, off /metrics, when its log is kept to
        warnings), and learns the version this run started from."""
        for server in self.servers:
            if server.serving or server.process is None:
                continue
            try:
                with open(server.log_path, "rb") as f:
                    f.seek(server.log_offset)
                    tail = f.read().decode("utf-8", "replace")
            except OSError:
                continue
            found = progress.resumed_from(tail)
            serving = progress.serving(tail) or self._health_says_serving(server)
            if found is None and serving:  # under --log-level WARNING its "resumed from" line never comes: /metrics says it
                version = self._resumed_version(server)
                found = (version, "") if version > 0 else None
            if found is not None and not server.announced:
                server.announced = True
                self.console.say(progress.resume_notice(server.name, *found))
            if serving:
                server.serving = True
                if server is self.servers[0] and self._start_version is None:
                    self._start_version = found[0] if found is not None else 0

    @staticmethod
    def _health_says_serving(server: Child) -> bool:
        """Asked while the log has not said it: under ``--log-level WARNING`` its info lines never come
        (local then never saw its servers serve and failed every run at its end check). The control
        plane's health turns SERVING where the server logs its serving line (ps/runner.py)."""
        return server.control_port is not None and ctl.health("127.0.0.1", server.control_port) == "SERVING"

    @staticmethod
    def _resumed_version(server: Child) -> int:
        """The version the server resumed from, off its /metrics (0: it started fresh, or does not answer)."""
        return max(int(try_scrape(server.metrics_port).get("rpcps_server_resumed_from_version", 0)), 0)

    def _print_progress(self, started: float) -> None:
        primary = self._shard0_primary()
        server = try_scrape(primary.metrics_port) if primary.serving else {}  # before it serves, its version is a default 0
        now = time.monotonic()
        version = int(server["rpcps_server_model_version"]) if "rpcps_server_model_version" in server else None
        rate = None
        if version is not None:
            if self._last_version is not None and version >= self._last_version[1] and now > self._last_version[0]:
                rate = (version - self._last_version[1]) / (now - self._last_version[0])
            self._last_version = (now, version)
        held = self._slot_progress() if version is not None else None
        scores = None
        for e in self.evaluators:
            scores = progress.held_out(try_scrape(e.metrics_port)) or scores
        line = progress.Progress(
            elapsed_s=now - started,
            version=version,
            rate=rate,
            steps_held=sum(held.values()) if held is not None else None,
            steps_total=self.config.worker.steps * len(self.workers),
            loss=progress.worker_loss([try_scrape(w.metrics_port) for w in self.workers]),
            live_workers=int(server["rpcps_server_live_workers"]) if "rpcps_server_live_workers" in server else None,
            held_out=scores,
        )
        self.console.progress(line)

    def _summary(self, wall: float) -> dict[str, Any]:
        shards = [read_summary(s.summary_path) for s in self.servers]
        # With replicas, the process that served shard 0 last applied the most updates.
        server = max(shards[: self.replicas], key=lambda summary: summary.get("updates_applied", -1) if summary else -1)
        workers = [read_summary(w.summary_path) for w in self.workers]
        done = [w for w in workers if w]
        firsts = [w["initial_loss"] for w in done if w.get("initial_loss") is not None]
        lasts = [w["final_loss"] for w in done if w.get("final_loss") is not None]
        updates = server.get("updates_applied", sum(w.get("updates_applied", 0) for w in done))
        version = server.get("model_version")
        start = self._start_version or 0
        return run_summary(
            "local",
            initial_loss=sum(firsts) / len(firsts) if firsts else server.get("initial_loss"),
            final_loss=sum(lasts) / len(lasts) if lasts else server.get("final_loss"),
            steps=sum(w.get("steps", 0) for w in done),
            updates_applied=updates,
            pushes_rejected=server.get("pushes_rejected", 0),
            staleness_sum=server.get("mean_staleness", 0.0) * updates,
            wall_seconds=wall,
            max_staleness=max((s.get("max_staleness", 0) for s in shards), default=0),
            restarts={c.name: c.restarts for c in self.children},
            model_version=version,
            updates_this_run=None if version is None else version - start,
            server=server,
            shards=shards,
            workers=workers,
            evaluator=read_summary(self.evaluators[0].summary_path) if self.evaluators else None,
            store=read_summary(self.coordinator.summary_path) if self.coordinator is not None else None,
            run_dir=str(self.run_dir),
        )


def _thread_shares(config: LocalConfig) -> tuple[ProcessOptions, ProcessOptions]:
    """The process settings of the servers and of the workers: the same, with or without ``--threads``.

    Every child divides the usable cores with every other rpcps process on this host itself, and keeps
    dividing them as processes come and go (rpcps.threads); a count fixed here would pin them.
    """
    return config.server.process, config.server.process


def run_local(config: LocalConfig) -> int:
    # The fork server imports torch in a process of its own while this one checks the configuration
    # (its own torch import included), so the children fork from it as soon as they start. It is
    # started on the thread that runs the job: when local ends, even killed, the fork server gets
    # SIGTERM and so does every child still running (pdeathsig), instead of training on unsupervised.
    forks = ForkServer(os.environ, Path.cwd(), pdeathsig=signal.SIGTERM)
    try:
        return _check_and_run(config, forks)
    finally:
        forks.kill()  # every child is reaped by now


def _check_and_run(config: LocalConfig, forks: ForkServer) -> int:
    # A directory of another --shards would be refused by every server, each restarted until local
    # gives up: say it once, before starting anything (ResumeRefused names what to do). The same for
    # a --model, --data or --loss that names nothing usable, or returns what the workers cannot train
    # on: every child would fail on it.
    shard_checkpoint_config(config.server.checkpoint, 0, config.server.core.shard_count)
    plugins.check_specs(config.worker.model, config.worker.data, config.worker.loss,
                        num_workers=config.workers, own_loop=config.worker_script is not None)
    if config.evaluator.eval_data is not None:
        check_model_spec(config.evaluator.model)  # an evaluator that cannot score this model: say so before starting
        plugins.resolve_callable(config.evaluator.eval_data, "eval-data")
        if config.evaluator.eval_fn is not None:
            plugins.resolve_callable(config.evaluator.eval_fn, "eval-fn")
    if config.server.checkpoint.directory is None:
        print(CHECKPOINTING_OFF, flush=True)
    else:
        print(f"rpcps local: checkpoints in {config.server.checkpoint.directory}", flush=True)
    supervisor = Supervisor(config, forks)

    def on_signal(*_: object) -> None:
        supervisor.interrupted = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return supervisor.run()
