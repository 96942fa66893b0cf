"""deploy/bare-metal/rpcps-node.sh: settings, commands, supervision (restarts, backoff, give-ups, stop).

The launcher runs a stub in place of Python here: the stub records each start (arguments, pid,
LOCAL_RANK and the RPCPS_* it was given) and exits with the next code scripted for its process, so
these tests check the launcher's own logic in seconds. tests/integration/deploy/test_multihost.py runs it
with real rpcps processes.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from harness.procs import REPO, wait_until

NODE = REPO / "deploy" / "bare-metal" / "rpcps-node.sh"

# Records one JSON line per start, then exits with the next scripted code for this process
# (codes.ps, codes.<slot> or codes.torchrun); "hang" waits for a signal.
STUB = textwrap.dedent(
    r"""
    #!/usr/bin/env bash
    dir=$(dirname "$0")
    case " $* " in
        *" -m torch.distributed.run "*) who=torchrun ;;
        *" ps "*) who=ps ;;
        *) who=$(echo "$*" | sed -n 's/.*--worker-index \([0-9]*\).*/\1/p') ;;
    esac
    env_json=$(env | grep -E '^(RPCPS_|LOCAL_RANK=|TP_SOCKET_IFNAME=)' | sort | sed 's/"/\\"/g; s/.*/"&"/' | paste -sd, -)
    read -r -a stat < "/proc/$$/stat"  # field 6: the session (the stub's name has no spaces)
    printf '{"who": "%s", "pid": %d, "sid": %d, "args": "%s", "env": [%s], "data_limit_kb": "%s"}\n' "$who" $$ "${stat[5]}" "$*" "$env_json" "$(ulimit -d)" >> "$dir/starts"
    codes="$dir/codes.$who"
    code=$(head -n 1 "$codes" 2>/dev/null)
    [ -f "$codes" ] && sed -i 1d "$codes"
    if [ "$code" = hang ]; then
        echo "stub $who hanging"
        exec sleep 300
    fi
    echo "stub $who exits ${code:-0}"
    exit "${code:-0}"
    """
).lstrip()


class Stub:
    def __init__(self, root: Path) -> None:
        self.dir = root / "stub"
        self.dir.mkdir()
        self.python = self.dir / "python"
        self.python.write_text(STUB)
        self.python.chmod(0o755)
        self.logs = root / "logs"

    def script(self, who: str, *codes: int | str) -> None:
        (self.dir / f"codes.{who}").write_text("".join(f"{c}\n" for c in codes))

    def starts(self, who: str | None = None) -> list[dict]:
        path = self.dir / "starts"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [r for r in rows if who is None or r["who"] == who]

    def argv(self, role: str, *args: str) -> list[str]:
        return ["bash", str(NODE), role, "--python", str(self.python), "--log-dir", str(self.logs), "--backoff-s", "0", *args]

    def run(self, role: str, *args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(role, *args), capture_output=True, text=True, timeout=timeout, env=_env(env), check=False)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RPCPS_", "TP_SOCKET"))}
    env.update(extra or {})
    return env


@pytest.fixture
def stub(tmp_path: Path) -> Stub:
    return Stub(tmp_path)


def dry(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    role, *rest = args
    return subprocess.run(["bash", str(NODE), role, "--dry-run", *rest], capture_output=True, text=True, timeout=30,
                          env=_env(env), check=False)


# ---- settings and commands (--dry-run prints them) ----

def test_server_command_takes_flags_over_the_env_file_over_defaults(tmp_path: Path) -> None:
    env_file = tmp_path / "rpcps.env"
    env_file.write_text("RPCPS_CHECKPOINT_DIR=/from/env-file\nRPCPS_METRICS_PORT=9401\nRPCPS_LOG_DIR=/nonexistent/logs\n")
    result = dry("server", "--env-file", str(env_file), "--checkpoint-dir", "/from/flag", "--", "--optimizer", "sgd")
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert f"{REPO}/trainer_entry.py ps --listen 0.0.0.0:29500 --checkpoint-dir /from/flag --metrics-port 9401" in line
    assert line.endswith("--control-port 9500 --supervise off --optimizer sgd > /nonexistent/logs/ps.log")


def test_workers_get_consecutive_slots_metrics_ports_and_local_ranks() -> None:
    result = dry("workers", "--ps", "ps-0:29500", "--count", "2", "--first-index", "4", "--num-workers", "8",
                 "--metrics-port-base", "9500", "--log-dir", "-", "--", "--steps", "10")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    for local, line in enumerate(lines):
        assert line.startswith(f"LOCAL_RANK={local} ")
        assert f"worker --ps ps-0:29500 --worker-index {4 + local} --num-workers 8 --metrics-port {9500 + local} --steps 10 > -" in line


def test_local_index_picks_one_worker_of_a_node_as_systemd_instances_do() -> None:
    result = dry("workers", "--ps", "ps-0:29500", "--local-index", "3", "--first-index", "8", "--num-workers", "16")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("LOCAL_RANK=3 ")
    assert "--worker-index 11 --num-workers 16 --metrics-port 9413 > /var/log/rpcps/worker11.log" in result.stdout


def test_memory_max_caps_every_process_it_starts(stub: Stub) -> None:
    """An oversized message then fails to allocate and the process restarts, instead of swapping the node."""
    assert dry("server", "--memory-max-mb", "2048").stdout.splitlines()[0] == f"ulimit -d {2048 * 1024}"
    assert "ulimit" not in dry("server").stdout  # no cap unless asked
    stub.script("ps", 0)
    assert stub.run("server", env={"RPCPS_MEMORY_MAX_MB": "2048"}).returncode == 0
    assert stub.starts("ps")[0]["data_limit_kb"] == str(2048 * 1024)


def test_store_role_starts_the_coordinator_where_the_servers_look_for_it() -> None:
    """The coordinator listens at RPCPS_STORE, the address a shared env file gives the servers as --store."""
    result = dry("store", "--log-dir", "-", env={"RPCPS_STORE": "10.0.0.9:29400", "RPCPS_METRICS_PORT": "9400"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("trainer_entry.py store --listen 10.0.0.9:29400 --metrics-port 9390 > -")
    flags = dry("store", "--listen", "127.0.0.1:1234", "--metrics-port", "9391", "--", "--lease-s", "3")
    assert "store --listen 127.0.0.1:1234 --metrics-port 9391 --lease-s 3 > /var/log/rpcps/store.log" in flags.stdout


def test_a_server_with_a_standby_joins_the_coordinator() -> None:
    result = dry("server", "--store", "10.0.0.9:29400", "--replicas", "2", "--metrics-port", "9401", "--control-port", "9501")
    assert result.returncode == 0, result.stderr
    assert "--metrics-port 9401 --control-port 9501 --store 10.0.0.9:29400 --replicas 2 --supervise off > " in result.stdout
    from_env = dry("server", env={"RPCPS_STORE": "10.0.0.9:29400", "RPCPS_REPLICAS": "2"})
    assert "--store 10.0.0.9:29400 --replicas 2 --supervise off > " in from_env.stdout
    alone = dry("server")
    assert "--store" not in alone.stdout and "--replicas" not in alone.stdout


def test_the_store_may_be_an_etcd_cluster_for_servers_and_workers() -> None:
    url = "etcd://10.0.0.5:2379,10.0.0.6:2379,[fd00::7]:2379/jobs/run-17"
    server = dry("server", "--store", url, "--replicas", "2")
    assert server.returncode == 0, server.stderr
    assert shlex.split(server.stdout.split(" > ")[0])[-6:] == ["--store", url, "--replicas", "2", "--supervise", "off"]
    workers = dry("workers", "--ps", url, "--count", "2")
    assert workers.returncode == 0, workers.stderr
    commands = [shlex.split(line.split(" > ")[0]) for line in workers.stdout.splitlines() if " worker " in line]
    assert len(commands) == 2 and all(c[c.index("--ps") + 1] == url for c in commands), workers.stdout


def test_torchrun_mode_builds_a_torchrun_command_with_a_rendezvous() -> None:
    result = dry("workers", "--torchrun", "--ps", "ps-0:29500", "--count", "4", "--nnodes", "2",
                 "--rdzv-endpoint", "node-0:29400", "--log-dir", "/l", "--", "--steps", "5")
    assert result.returncode == 0, result.stderr
    assert ("-m torch.distributed.run --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint node-0:29400 "
            "--rdzv-id rpcps --max-restarts 10 --log-dir /l/torchrun --tee 3") in result.stdout
    assert result.stdout.rstrip().endswith("trainer_entry.py worker --ps ps-0:29500 --steps 5 > /l/torchrun.log")
    single = dry("workers", "--torchrun", "--ps", "ps-0:29500", "--count", "2")
    assert "--standalone" in single.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["workers", "--count", "2"], "--ps HOST:PORT is required"),
        (["workers", "--ps", "nohost"], "--ps must be HOST:PORT, got 'nohost'"),
        (["server", "--listen", "0.0.0.0:70000"], "--listen's port must be a port in [0, 65535], got '70000'"),
        (["server", "--bogus", "1"], "unknown option --bogus for 'server'"),
        (["server", "--ps", "a:1"], "unknown option --ps for 'server'"),
        (["workers", "--ps", "a:1", "--first-index", "2"], "--num-workers is required"),
        (["workers", "--ps", "a:1", "--count", "3", "--num-workers", "2"], "slot 2 (--first-index 0 + local index 2) is not below --num-workers 2"),
        (["workers", "--ps", "a:1", "--count", "02"], "--count must be a whole number"),
        (["workers", "--ps", "a:1", "--torchrun", "--nnodes", "2"], "--rdzv-endpoint HOST:PORT is required"),
        (["workers", "--ps", "a:1", "--ifname", "no-such-if0"], "--ifname no-such-if0: no such network interface"),
        (["server", "--python", "/no/such/python"], "--python /no/such/python not found"),
        (["server", "--replicas", "2"], "--replicas 2 needs --store HOST:PORT"),
        (["server", "--store", "nohost", "--replicas", "2"], "--store must be HOST:PORT, got 'nohost'"),
        (["server", "--replicas", "0"], "--replicas must be >= 1"),
        (["server", "--store", "etcd://10.0.0.5:2379"], "--store must be etcd://HOST:PORT[,HOST:PORT...]/PREFIX (a prefix of the job's own), got 'etcd://10.0.0.5:2379'"),
        (["workers", "--ps", "etcd://a:2379,b/job"], "--ps: each etcd endpoint must be HOST:PORT, got 'b' in 'etcd://a:2379,b/job'"),
        (["workers", "--ps", "etcd://a:2379,b:99999/job"], "--ps's etcd port must be a port in [0, 65535], got '99999'"),
        (["store", "--ps", "a:1"], "unknown option --ps for 'store'"),
        (["store", "--listen", "a:99999"], "--listen's port must be a port in [0, 65535], got '99999'"),
        (["nonsense"], "unknown role 'nonsense'"),
    ],
)
def test_bad_settings_fail_with_one_line_naming_the_setting(args: list[str], message: str) -> None:
    result = dry(*args)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_no_supervise_with_several_workers_is_refused(stub: Stub) -> None:
    result = stub.run("workers", "--ps", "a:1", "--count", "2", "--no-supervise")
    assert result.returncode == 2 and "--no-supervise runs one process" in result.stderr
    assert stub.starts() == []


def test_help_lists_every_option_it_parses() -> None:
    help_text = subprocess.run(["bash", str(NODE), "--help"], capture_output=True, text=True, check=True).stdout
    source = NODE.read_text()
    flags = set()
    for line in source.splitlines():
        if line.startswith(("common_flags=", "server_flags=", "worker_flags=", "store_flags=")):
            flags.update(line.split("=", 1)[1].strip('" ').split())
    assert flags, "flag lists not found in the script"
    missing = sorted(f for f in flags if f"--{f}" not in help_text)
    assert missing == [], f"--help does not mention {missing}"


# ---- supervision ----

def test_a_crashing_process_is_restarted_until_it_finishes(stub: Stub) -> None:
    stub.script("ps", 1, 137, 0)
    result = stub.run("server", "--checkpoint-dir", "/ck")
    assert result.returncode == 0, result.stderr
    assert len(stub.starts("ps")) == 3
    log = (stub.logs / "ps.log").read_text()
    assert "exited with 1 (could not start: port in use, server unreachable or I/O error); restart 1/10" in log
    assert "exited with 137 (killed by signal 9); restart 2/10" in log
    assert log.count("stub ps exits") == 3 and "ps: finished" in log


def test_the_launcher_is_the_servers_only_restarter_and_reports_its_restarts_to_it(stub: Stub) -> None:
    """One layer of restarts (docs/DEPLOY.md, "Who restarts what"): rpcps ps runs without its own
    supervisor, and learns how often the launcher restarted it (rpcps_server_crash_restarts)."""
    stub.script("ps", 137, 1, 0)
    result = stub.run("server", "--checkpoint-dir", "/ck", env={"RPCPS_CRASH_RESTARTS": "9"})
    assert result.returncode == 0, result.stderr
    starts = stub.starts("ps")
    assert all("--supervise off" in s["args"] for s in starts), [s["args"] for s in starts]
    assert [[v for v in s["env"] if v.startswith("RPCPS_CRASH_RESTARTS=")] for s in starts] == [
        ["RPCPS_CRASH_RESTARTS=0"], ["RPCPS_CRASH_RESTARTS=1"], ["RPCPS_CRASH_RESTARTS=2"]]


def test_the_server_runs_in_a_session_of_its_own_and_the_workers_in_the_launchers(stub: Stub) -> None:
    """Under autogroup scheduling a session is a scheduling group: the server's bursts must not queue
    behind the workers' compute (ps/lifecycle/supervisor.py). Its restarts too; and the pid the
    launcher waits on and signals is the server's own (setsid execs in place)."""
    stub.script("ps", 137, 0)
    assert stub.run("server").returncode == 0
    servers = stub.starts("ps")
    assert len(servers) == 2 and all(s["sid"] == s["pid"] for s in servers), servers
    log = (stub.logs / "ps.log").read_text()
    assert all(f"started pid {s['pid']}:" in log for s in servers), log
    assert stub.run("workers", "--ps", "ps-0:29500").returncode == 0
    worker = stub.starts("0")[0]
    assert worker["sid"] != worker["pid"], worker


def test_backoff_doubles_up_to_its_maximum(stub: Stub) -> None:
    stub.script("ps", 1, 1, 1, 0)
    result = stub.run("server", "--backoff-s", "1", "--backoff-max-s", "2", timeout=60)
    assert result.returncode == 0, result.stderr
    assert [line.rsplit(" in ", 1)[1] for line in result.stderr.splitlines() if "; restart " in line] == ["1s", "2s", "2s"]


@pytest.mark.parametrize("code", [2, 4, 5])
def test_exit_codes_a_restart_cannot_fix_are_not_retried(stub: Stub, code: int) -> None:
    stub.script("0", code)
    result = stub.run("workers", "--ps", "ps-0:29500")
    assert result.returncode == code
    assert len(stub.starts("0")) == 1
    assert "not restarting it, a restart cannot fix this" in (stub.logs / "worker0.log").read_text()


def test_out_of_restarts_gives_up_with_the_last_code(stub: Stub) -> None:
    stub.script("0", 3, 3, 3, 3)
    result = stub.run("workers", "--ps", "ps-0:29500", "--max-restarts", "2")
    assert result.returncode == 3
    assert len(stub.starts("0")) == 3
    assert "is out of restarts (2 in a row)" in result.stderr


def test_each_worker_is_supervised_on_its_own_and_the_worst_code_is_returned(stub: Stub) -> None:
    stub.script("0", 0)
    stub.script("1", 1, 0)
    stub.script("2", 5)
    result = stub.run("workers", "--ps", "ps-0:29500", "--count", "3", "--ifname", "lo")
    assert result.returncode == 5
    assert [len(stub.starts(w)) for w in ("0", "1", "2")] == [1, 2, 1]
    for w in ("0", "1", "2"):
        start = stub.starts(w)[0]
        assert f"LOCAL_RANK={w}" in start["env"] and "TP_SOCKET_IFNAME=lo" in start["env"]
        assert (stub.logs / f"worker{w}.log").exists()


def test_sigterm_stops_the_processes_and_nothing_is_restarted(stub: Stub) -> None:
    stub.script("0", "hang")
    stub.script("1", "hang")
    launcher = subprocess.Popen(stub.argv("workers", "--ps", "ps-0:29500", "--count", "2"), env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until(lambda: len(stub.starts()) == 2 and all(
            "hanging" in (stub.logs / f"worker{w}.log").read_text() for w in ("0", "1")), 20, "both stubs to start")
        children = [s["pid"] for s in stub.starts()]
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=20)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 0, err
    assert err.count("stopped (exit 143)") == 2
    assert len(stub.starts()) == 2, "nothing restarted after a stop"
    assert not any(_alive(pid) for pid in children)


def test_no_supervise_runs_the_process_in_place(stub: Stub) -> None:
    stub.script("ps", 7)
    launcher = subprocess.Popen(stub.argv("server", "--no-supervise", "--log-dir", "-"), env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, _ = launcher.communicate(timeout=20)
    assert launcher.returncode == 7, "the process's own exit code, for systemd's Restart= and RestartPreventExitStatus="
    assert stub.starts("ps")[0]["pid"] == launcher.pid, "exec: same pid, so a supervisor signals rpcps itself"
    assert "stub ps exits 7" in out, "--log-dir - leaves the output on stdout (the journal)"


def test_torchrun_ranks_choose_their_slots_not_a_shared_env_file(stub: Stub, tmp_path: Path) -> None:
    env_file = tmp_path / "rpcps.env"
    env_file.write_text("RPCPS_WORKER_INDEX=3\nRPCPS_NUM_WORKERS=8\nRPCPS_METRICS_PORT=9999\nRPCPS_STEPS=100\n")
    result = stub.run("workers", "--torchrun", "--ps", "ps-0:29500", "--count", "2", "--env-file", str(env_file))
    assert result.returncode == 0, result.stderr
    (start,) = stub.starts("torchrun")
    assert start["pid"] == _pid_of(result), "torchrun runs in place: it supervises its ranks itself"
    assert "RPCPS_STEPS=100" in start["env"]
    assert not any(v.startswith(("RPCPS_WORKER_INDEX", "RPCPS_NUM_WORKERS", "RPCPS_METRICS_PORT")) for v in start["env"])


def test_log_dir_that_cannot_be_written_is_reported(stub: Stub, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = subprocess.run(["bash", str(NODE), "server", "--python", str(stub.python), "--log-dir", str(blocker / "logs")],
                            capture_output=True, text=True, timeout=30, env=_env(), check=False)
    assert result.returncode == 2
    assert f"cannot write to log directory {blocker}/logs" in result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="needs shellcheck (Debian: apt-get install shellcheck)")
def test_launcher_passes_shellcheck() -> None:
    result = subprocess.run(["shellcheck", str(NODE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout


def _alive(pid: int) -> bool:
    """True when ``pid`` still runs 30 s from now: a deadline for "it ends", generous for a loaded machine."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.05)
    return True


def _pid_of(result: subprocess.CompletedProcess[str]) -> int:
    # The launcher notes "exec ..." with its own pid in brackets before it execs.
    line = next(line for line in result.stderr.splitlines() if ": exec " in line)
    return int(line.split("[", 1)[1].split("]", 1)[0])
