"""``rpcps local``: a server and N workers as separate processes on this machine, supervised.

The supervisor restarts a crashed child (up to --max-restarts, with backoff), prints progress read
from the children's own /metrics endpoints, and on Ctrl-C or SIGTERM stops the workers, then the
server, and reaps every child before it returns.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from rpcps.summary import write_summary

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    summary_path: Path
    metrics_port: int
    restarts: int = 0
    process: subprocess.Popen | None = None
    done: bool = False
    next_start: float = 0.0
    log_file: Any = field(default=None, repr=False)

    def start(self) -> None:
        if self.log_file is None:
            self.log_file = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the child
        self.process = subprocess.Popen(self.argv, stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True)
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


def _flag_value(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int) and not isinstance(value[0], int):
        return f"{value[0]}:{value[1]}"
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def _flags(values: dict[str, Any], names: list[str]) -> list[str]:
    argv: list[str] = []
    for name in names:
        value = values.get(name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), _flag_value(value)]
    return argv


class Supervisor:
    def __init__(self, values: dict[str, Any], entry: str) -> None:
        from rpcps import cli

        self.values = values
        self.run_dir = Path(values["run_dir"] or tempfile.mkdtemp(prefix="rpcps-local-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.port = values["port"] or free_port()
        self.max_restarts = values["max_restarts"]
        self.interrupted = False
        base = [sys.executable, entry]
        common = [o.dest for o in cli.COMMON if o.dest != "summary_json"]
        server_only = [o.dest for o in cli.SERVER if o.flag not in cli.LOCAL_PICKS]
        self.control_port = free_port()
        training = [o.dest for o in cli.WORKER_TRAINING]
        shards = values["shards"]
        if values.get("mode") == "sync" and values.get("min_workers", 1) == 1:
            values = {**values, "min_workers": values["workers"]}  # sync rounds start with everyone
        self.servers = [
            self._child(
                "ps" if k == 0 else f"ps{k}",
                base
                + ["ps", "--listen", f"127.0.0.1:{self.port}", "--shard-index", str(k), "--store", f"127.0.0.1:{self.port}"]
                + ["--control-addr", "127.0.0.1", "--control-port", str(self.control_port if k == 0 else free_port())]
                + _flags(values, common + server_only),
            )
            for k in range(shards)
        ]
        self.server = self.servers[0]
        self.workers = [
            self._child(
                f"worker{i}",
                base
                + ["worker", "--ps", f"127.0.0.1:{self.port}", "--worker-index", str(i), "--num-workers", str(values["workers"])]
                + _flags(values, common + training),
            )
            for i in range(values["workers"])
        ]

    def _child(self, name: str, argv: list[str]) -> Child:
        port = free_port()
        summary = self.run_dir / f"{name}.summary.json"
        return Child(
            name,
            argv + ["--metrics-port", str(port), "--summary-json", str(summary)],
            self.run_dir / f"{name}.log",
            summary,
            port,
        )

    @property
    def children(self) -> list[Child]:
        return [*self.servers, *self.workers]

    def write_scrape_targets(self) -> Path:
        """Writes the children's /metrics addresses as a Prometheus file_sd targets file."""
        path = self.run_dir / "prometheus_targets.json"
        groups = [
            {"targets": [f"127.0.0.1:{c.metrics_port}"], "labels": {"role": "ps" if c in self.servers else "worker", "child": c.name}}
            for c in self.children
        ]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups, indent=2))
        os.replace(tmp, path)
        return path

    def write_children(self) -> Path:
        """Writes each child's current pid, restarts and metrics port to children.json (tools read it)."""
        path = self.run_dir / "children.json"
        info = {
            c.name: {"pid": c.process.pid if c.process else None, "restarts": c.restarts, "metrics_port": c.metrics_port}
            for c in self.children
        }
        info["ps"]["control_port"] = self.control_port
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        os.replace(tmp, path)
        return path

    def run(self) -> int:
        started = time.monotonic()
        self.write_scrape_targets()
        print(
            f"rpcps local: server on 127.0.0.1:{self.port}, {len(self.workers)} workers, logs in {self.run_dir}; "
            f"control: rpcps ctl status --addr 127.0.0.1:{self.control_port}",
            flush=True,
        )
        for server in self.servers:
            server.start()
        for w in self.workers:
            w.start()
        self.write_children()
        failed = False
        last_progress = 0.0
        try:
            while not self.interrupted:
                if all(w.done for w in self.workers):
                    break
                failed = not self._supervise()
                if failed:
                    break
                if time.monotonic() - last_progress >= self.values["progress_s"]:
                    last_progress = time.monotonic()
                    self._print_progress(started)
                time.sleep(0.2)
        finally:
            self._stop_all()
        summary = self._summary(time.monotonic() - started)
        write_summary(self.values["summary_json"], summary)
        if self.interrupted:
            print("rpcps local: interrupted; all children stopped", flush=True)
            return 130
        if failed:
            return 1
        print(
            f"rpcps local: done in {summary['wall_seconds']:.1f}s: {summary['updates_applied']} updates, "
            f"loss {_fmt(summary['initial_loss'])} -> {_fmt(summary['final_loss'])}, "
            f"{summary['updates_per_second']:.1f} updates/s",
            flush=True,
        )
        return 0

    def _supervise(self) -> bool:
        """Restarts children that died; marks finished workers. False when a child is out of restarts."""
        now = time.monotonic()
        for child in self.children:
            if child.done or child.alive():
                continue
            if child.process is not None:
                code = child.process.returncode
                child.process = None
                if child not in self.servers and code == 0:
                    child.done = True
                    continue
                if child.restarts >= self.max_restarts:
                    print(f"rpcps local: {child.name} exited with {code} and is out of restarts; see {child.log_path}", file=sys.stderr)
                    return False
                child.restarts += 1
                child.next_start = now + min(0.5 * 2.0 ** (child.restarts - 1), 30.0)
                print(f"rpcps local: {child.name} exited with {code}; restart {child.restarts}/{self.max_restarts}", flush=True)
            if now >= child.next_start:
                child.start()
                self.write_children()
        return True

    def _stop_all(self) -> None:
        # Workers first (their final pushes land), then shards > 0, then shard 0: it hosts the
        # group's store, and the others would take its loss for a crash and restart themselves.
        for group in (self.workers, self.servers[1:], [self.server]):
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

    def _print_progress(self, started: float) -> None:
        shards = [scrape(s.metrics_port) for s in self.servers]
        server = shards[0]
        steps = losses = 0.0
        n = 0
        for w in self.workers:
            m = scrape(w.metrics_port)
            if "rpcps_worker_steps_total" in m:
                steps += m["rpcps_worker_steps_total"]
                losses += m.get("rpcps_worker_loss", 0.0)
                n += 1
        elapsed = time.monotonic() - started
        updates = server.get("rpcps_server_updates_applied_total", 0.0)  # shard 0's: every shard steps alike
        print(
            f"[{elapsed:6.1f}s] steps {int(steps)}, updates {int(updates)} ({updates / elapsed:.1f}/s), "
            f"loss {losses / n if n else float('nan'):.4f}, live workers {int(server.get('rpcps_server_live_workers', 0))}",
            flush=True,
        )

    def _summary(self, wall: float) -> dict[str, Any]:
        server = _read_json(self.server.summary_path)
        workers = [_read_json(w.summary_path) for w in self.workers]
        done = [w for w in workers if w]
        firsts = [w["initial_loss"] for w in done if w.get("initial_loss") is not None]
        lasts = [w["final_loss"] for w in done if w.get("final_loss") is not None]
        updates = server.get("updates_applied", sum(w.get("updates_applied", 0) for w in done))
        return {
            "role": "local",
            "initial_loss": sum(firsts) / len(firsts) if firsts else server.get("initial_loss"),
            "final_loss": sum(lasts) / len(lasts) if lasts else server.get("final_loss"),
            "steps": sum(w.get("steps", 0) for w in done),
            "updates_applied": updates,
            "pushes_rejected": server.get("pushes_rejected", 0),
            "mean_staleness": server.get("mean_staleness", 0.0),
            "max_staleness": max((_read_json(s.summary_path).get("max_staleness", 0) for s in self.servers), default=0),
            "updates_per_second": updates / wall if wall > 0 else 0.0,
            "wall_seconds": wall,
            "restarts": {c.name: c.restarts for c in self.children},
            "server": server,
            "shards": [_read_json(s.summary_path) for s in self.servers],
            "workers": workers,
            "run_dir": str(self.run_dir),
        }


def scrape(port: int) -> dict[str, float]:
    """Reads a child's /metrics into {sample name: value} (unlabelled samples only); {} if unreachable."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                values[sample.name] = sample.value
    return values


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def run_local(values: dict[str, Any], entry: str) -> int:
    supervisor = Supervisor(values, entry)

    def on_signal(*_: object) -> None:
        supervisor.interrupted = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return supervisor.run()
