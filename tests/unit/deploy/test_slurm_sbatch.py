"""deploy/slurm/rpcps.sbatch against stand-ins for srun, scontrol and the node launcher.

The stand-ins record what they are asked to do: which launcher command each task runs (slots,
server address, checkpoint directory), in which order steps are stopped, and whether the job
requeues itself when the time limit nears. No Slurm is needed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.procs import REPO, wait_until

SBATCH = REPO / "deploy" / "slurm" / "rpcps.sbatch"

SCONTROL = """
#!/usr/bin/env bash
case $1 in
    show) printf '%s\\n' n0 n1 n2 ;;
    requeue) echo "requeue $2" >> "$RECORD" ;;
esac
"""

# Runs the command once per task with SLURM_PROCID set and forwards SIGTERM to the tasks, as srun does.
SRUN = """
#!/usr/bin/env bash
echo "srun $*" >> "$RECORD"
ntasks=1
while [[ $1 == --* ]]; do
    case $1 in --ntasks=*) ntasks=${1#--ntasks=} ;; esac
    shift
done
term=0
trap 'term=1' TERM
pids=()
for ((i = 0; i < ntasks; i++)); do
    STANDIN_SRUN=$$ SLURM_PROCID=$i "$@" &
    pids+=($!)
done
# A SIGTERM that reaches a task before its first line ran would lose its record: forward signals
# only once every task has recorded its start (or is already gone).
for ((i = 0; i < ntasks; i++)); do
    while [ ! -e "$RECORD.started.$$.$i" ] && kill -0 "${pids[i]}" 2>/dev/null; do sleep 0.01; done
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
((term)) && kill -TERM "${pids[@]}" 2>/dev/null
rc=0
for pid in "${pids[@]}"; do
    while :; do
        wait "$pid"; r=$?
        if ((r > 128)) && kill -0 "$pid" 2>/dev/null; then continue; fi
        break
    done
    ((r > rc)) && rc=$r
done
exit $rc
"""

# The node launcher: records its arguments and the interpreter it was handed; a server or coordinator (and a worker when
# HANG_WORKERS is set) runs until SIGTERM and records that it was stopped.
NODE = """
#!/usr/bin/env bash
echo "node $* ckpt=$RPCPS_CHECKPOINT_DIR logs=$RPCPS_LOG_DIR python=$RPCPS_PYTHON" >> "$RECORD"
[ -n "${STANDIN_SRUN:-}" ] && : > "$RECORD.started.$STANDIN_SRUN.${SLURM_PROCID:-0}"
if [ "$1" = server ] || [ "$1" = store ] || [ -n "${HANG_WORKERS:-}" ]; then
    trap 'echo "stopped $1" >> "$RECORD"; exit 0' TERM
    while :; do sleep 0.1; done
fi
"""


@pytest.fixture
def slurm(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("rpcps-node.sh", NODE)):
        path = bin_dir / name
        path.write_text(textwrap.dedent(text).lstrip())
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RPCPS_", "SLURM_"))}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}", RECORD=str(tmp_path / "record"), SLURM_JOB_ID="42", SLURM_JOB_NAME="train",
        SLURM_JOB_NODELIST="n[0-2]", SLURM_SUBMIT_DIR=str(tmp_path), RPCPS_NODE_SH=str(bin_dir / "rpcps-node.sh"),
        # The interpreter running these tests, never whatever python3 PATH finds (it may lack rpcps).
        RPCPS_NODE_WORKERS="2", RPCPS_PYTHON=sys.executable,
    )
    return env


def record(env: dict[str, str]) -> list[str]:
    path = Path(env["RECORD"])
    return path.read_text().splitlines() if path.exists() else []


def test_server_on_the_first_node_workers_on_the_others_with_their_slots(slurm: dict[str, str], tmp_path: Path) -> None:
    result = subprocess.run(["bash", str(SBATCH)], env=slurm, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = record(slurm)
    run_dir = tmp_path / "rpcps-runs" / "train"
    tail = f"ckpt={run_dir}/checkpoints logs={run_dir}/logs python={sys.executable}"
    server = [line for line in lines if line.startswith("node server")]
    assert server == [f"node server --listen n0:29500 {tail}"]
    workers = sorted(line for line in lines if line.startswith("node workers"))
    assert workers == [f"node workers --ps n0:29500 --count 2 --first-index {k} --num-workers 4 {tail}" for k in (0, 2)]
    worker_srun = next(line for line in lines if line.startswith("srun") and "workers" in line)
    assert "--nodes=2 --ntasks=2 --ntasks-per-node=1 --exclude=n0" in worker_srun
    assert lines[-1] == "stopped server", "the server is stopped once the workers are done"
    assert "server on n0:29500, 4 workers on 2 nodes" in result.stdout


def test_near_the_time_limit_it_stops_workers_then_the_server_and_requeues(slurm: dict[str, str]) -> None:
    job = subprocess.Popen(["bash", str(SBATCH)], env={**slurm, "HANG_WORKERS": "1"}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until(lambda: sum(line.startswith("node ") for line in record(slurm)) == 3, 30, "server and 2 worker tasks")
        job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@180 sends
        out, err = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0, out + err
    stops = [line for line in record(slurm) if line.startswith(("stopped", "requeue"))]
    assert stops == ["stopped workers", "stopped workers", "stopped server", "requeue 42"]


def test_two_replicas_run_a_coordinator_and_a_server_on_each_of_the_first_two_nodes(slurm: dict[str, str], tmp_path: Path) -> None:
    result = subprocess.run(["bash", str(SBATCH)], env={**slurm, "RPCPS_REPLICAS": "2"}, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = record(slurm)
    run_dir = tmp_path / "rpcps-runs" / "train"
    tail = f"ckpt={run_dir}/checkpoints logs={run_dir}/logs python={sys.executable}"
    assert [line for line in lines if line.startswith("node store")] == [f"node store --listen n0:29400 {tail}"]
    servers = sorted(line for line in lines if line.startswith("node server"))
    assert servers == [f"node server --listen {n}:29500 --store n0:29400 --replicas 2 {tail}" for n in ("n0", "n1")]
    # Workers join the coordinator, on the one node left.
    assert [line for line in lines if line.startswith("node workers")] == [
        f"node workers --ps n0:29400 --count 2 --first-index 0 --num-workers 2 {tail}"]
    store_srun = next(line for line in lines if line.startswith("srun") and " store " in line)
    assert "--nodelist=n0 --overlap" in store_srun
    assert "--exclude=n0,n1" in next(line for line in lines if line.startswith("srun") and "workers" in line)
    stops = [line for line in lines if line.startswith("stopped")]
    assert stops == ["stopped server", "stopped server", "stopped store"], "servers first, then the coordinator"


@pytest.mark.parametrize(("replicas", "message"), [("3", "RPCPS_REPLICAS must be 1 or 2"), ("2", "needs at least 3 nodes")])
def test_replicas_that_cannot_be_placed_are_refused(slurm: dict[str, str], replicas: str, message: str) -> None:
    scontrol = Path(slurm["PATH"].split(":")[0]) / "scontrol"
    scontrol.write_text("#!/usr/bin/env bash\nprintf '%s\\n' n0 n1\n")
    result = subprocess.run(["bash", str(SBATCH)], env={**slurm, "RPCPS_REPLICAS": replicas}, capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert record(slurm) == []


def test_one_node_is_refused(slurm: dict[str, str]) -> None:
    scontrol = Path(slurm["PATH"].split(":")[0]) / "scontrol"
    scontrol.write_text("#!/usr/bin/env bash\necho n0\n")
    result = subprocess.run(["bash", str(SBATCH)], env=slurm, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2 and "needs at least 2 nodes" in result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="needs shellcheck (Debian: apt-get install shellcheck)")
def test_sbatch_passes_shellcheck() -> None:
    result = subprocess.run(["shellcheck", str(SBATCH)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout
