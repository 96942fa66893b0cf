"""Processes for the monitoring integration tests: a supervised local run and a real Prometheus.

Both are context managers that reap what they started even when a test fails or times out. As a
last resort, when pytest itself dies without running finalisers, each process runs with
PR_SET_PDEATHSIG (``harness.procs.dies_with_us``) so the kernel sends it SIGTERM; the local
supervisor then stops its own children.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self, TypeVar

from harness.procs import descendants, dies_with_us
from rpcps.ports import free_port

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy" / "prometheus"
T = TypeVar("T")


def wait_for(fetch: Callable[[], T], accept: Callable[[T], bool], timeout_s: float, what: str,
             context: Callable[[], str] = lambda: "") -> T:
    """Calls fetch until accept(value) holds; returns that value. On timeout, fails naming what and the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fetch()
        if accept(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}; last seen: {value!r}\n{context()}")
        time.sleep(0.5)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"({path}: {e.strerror})"


def checkpoint_flags(run_dir: Path) -> list[str] | None:
    """Flags that make a server checkpoint every second, or None if this build has no checkpointer."""
    out = subprocess.run(
        [sys.executable, "trainer_entry.py", "ps", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    if "--checkpoint-dir" not in out:
        return None
    flags = ["--checkpoint-dir", str(run_dir / "checkpoints")]
    if "--checkpoint-every-seconds" in out:
        flags += ["--checkpoint-every-seconds", "1"]
    return flags


class LocalRun:
    """``python trainer_entry.py local ...`` in the background, with its run directory."""

    def __init__(self, run_dir: Path, workers: int, steps: int, extra: list[str] | None = None) -> None:
        self.run_dir = run_dir
        self.argv = [
            sys.executable, "trainer_entry.py", "local", "--workers", str(workers), "--steps", str(steps),
            "--run-dir", str(run_dir), "--progress-s", "5", *(extra or []),
        ]
        self.targets_file = run_dir / "prometheus_targets.json"
        self.output = run_dir / "local.out"
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def __enter__(self) -> Self:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(
                dies_with_us(self.argv), cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def targets(self) -> list[dict[str, Any]]:
        """The file_sd groups the launcher wrote, waiting for the file to appear."""
        text = wait_for(
            lambda: self.targets_file.read_text() if self.targets_file.exists() else "",
            bool, 60, f"{self.targets_file} from the local launcher", self.diagnostics,
        )
        return json.loads(text)

    def endpoints(self) -> dict[str, str]:
        """child name ('ps', 'worker0', ...) -> host:port of its /metrics."""
        return {g["labels"]["child"]: g["targets"][0] for g in self.targets()}

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> int | None:
        """SIGTERM the supervisor (it stops workers, then the server) and reap it; kill what is left."""
        if self.process is None:
            return None
        children = descendants(self.process.pid)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=90)  # the supervisor grants each group of children 30 s
            except subprocess.TimeoutExpired:
                logger.warning("local supervisor did not stop in 90s; killing it and its children")
                self.process.kill()
                self.process.wait()
        for pid in children:  # normally already reaped by the supervisor
            if _is_ours(pid):
                logger.warning("killing leftover child %d of the local run", pid)
                os.kill(pid, signal.SIGKILL)
        return self.process.returncode

    def diagnostics(self) -> str:
        logs = [self.output, *sorted(self.run_dir.glob("*.log"))]
        return "\n".join(f"--- {p.name} (last lines)\n{tail(p)}" for p in logs)


def _is_ours(pid: int) -> bool:
    """True if pid still runs one of our trainer_entry.py processes (guards against a reused pid)."""
    try:
        return b"trainer_entry.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class Prometheus:
    """A throwaway Prometheus server on a free 127.0.0.1 port with its TSDB in workdir."""

    def __init__(self, binary: str, config: dict[str, Any], workdir: Path) -> None:
        self.binary = binary
        self.config = config
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_file = self.workdir / "prometheus.yml"
        config_file.write_text(json.dumps(self.config, indent=2))  # JSON is YAML
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                dies_with_us([
                    self.binary,
                    f"--config.file={config_file}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ]),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        wait_for(self._ready, bool, 60, f"Prometheus to answer on {self.url}/-/ready", lambda: tail(self.log))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.process.returncode}:\n{tail(self.log)}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", f"{url}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """Instant query; [(labels, value)] of the resulting vector."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", f"{expr!r} gave a {data['resultType']}, expected a vector"
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def active_targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]


def scrape_config_for(targets_file: Path, interval: str = "1s") -> dict[str, Any]:
    """The shipped deploy/prometheus/prometheus.yml and alerts.yml, pointed at one run's targets file.

    Keeps the shipped jobs and their role relabelling (so the test exercises them), drops the
    example static hosts, and speeds up scraping and rule evaluation.
    """
    import yaml  # a test dependency; the shipped config is YAML

    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval}
    config["rule_files"] = [str(DEPLOY / f) for f in config["rule_files"]]
    for job in config["scrape_configs"]:
        job.pop("static_configs", None)
        for sd in job["file_sd_configs"]:
            sd["files"] = [str(targets_file)]
            sd["refresh_interval"] = interval
    return config


def panels_in_row(dashboard: dict[str, Any], row_prefix: str) -> list[str]:
    """Quoted titles (as check_dashboard writes them in a query's `where`) of the panels below the row whose title starts so."""
    titles, inside = [], False
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            inside = panel["title"].startswith(row_prefix)
        elif inside:
            titles.append(repr(panel["title"]))
    return titles
