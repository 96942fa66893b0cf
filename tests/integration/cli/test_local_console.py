"""What ``rpcps local`` tells its user, from real runs: the cause of a failure on the console at once,
progress and a last line that stay true across a server crash, quiet logs, and /metrics that fit the job.

Each run is as short as it can be and serves several assertions.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from cli.local import CHECKPOINTING_OFF
from harness.procs import ProcessGroup, try_scrape, wait_until
from rpcps.ports import free_port

pytestmark = pytest.mark.integration

LOCAL = ("local", "--workers", "2", "--progress-s", "1")
PACED = ("--data", "tests.integration.paced_data:paced_data")
"""At most 100 steps a second per worker: the run outlasts a scrape, or a kill, on any machine."""


def _children(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "children.json").read_text())
    except (OSError, ValueError):
        return None


def _final_version(stdout: str) -> int:
    done = [line for line in stdout.splitlines() if line.startswith("rpcps local: done in ")]
    assert len(done) == 1, stdout
    found = re.search(r": model version (\d+)", done[0])
    assert found, done[0]
    return int(found.group(1))


@pytest.mark.timeout(60)
def test_a_bad_model_is_said_on_the_console_at_once_and_nothing_starts(procs: ProcessGroup, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = procs.start("local", [*LOCAL, "--steps", "50", "--run-dir", run_dir, "--model", "rpcps.tasks:teacher_student_held_out"])
    assert local.wait(30) == 2
    assert local.stderr().strip() == (
        "rpcps local: error: --model 'rpcps.tasks:teacher_student_held_out' returned list, expected a torch.nn.Module"
    )
    assert not run_dir.exists() or not list(run_dir.glob("*.log")), "no child may start (or be restarted)"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("target", "said"), [
    ("not_iterable", "returned int, expected an iterable of (inputs, targets) batches"),
    ("labels_only", "returned a list whose first batch is int, expected an (inputs, targets) pair of tensors (or of objects with a .to(device) method)"),
])
def test_data_of_the_wrong_type_is_said_on_the_console_at_once_and_nothing_starts(
    procs: ProcessGroup, tmp_path: Path, target: str, said: str
) -> None:
    run_dir = tmp_path / "run"
    local = procs.start("local", [*LOCAL, "--steps", "50", "--run-dir", run_dir, "--data", f"tests.integration.cli.bad_plugins:{target}"])
    assert local.wait(30) == 2
    assert local.stderr().strip() == f"rpcps local: error: --data 'tests.integration.cli.bad_plugins:{target}' {said}"
    assert not run_dir.exists() or not list(run_dir.glob("*.log")), "no child may start (or be restarted)"


@pytest.mark.timeout(60)
def test_a_hand_started_worker_refuses_data_of_the_wrong_type_before_it_looks_for_its_server(
    procs: ProcessGroup, tmp_path: Path
) -> None:
    worker = procs.start("worker", ["worker", "--ps", f"127.0.0.1:{free_port()}", "--worker-index", "0", "--num-workers", "1",
                                    "--steps", "5", "--data", "tests.integration.cli.bad_plugins:labels_only"])
    assert worker.wait(30) == 2
    assert "waiting for the parameter server" not in worker.stderr(), "refused at start, not after looking for a server"
    assert worker.stderr().strip().splitlines()[-1] == (
        "rpcps worker: error: --data 'tests.integration.cli.bad_plugins:labels_only' returned a list whose first batch is int, "
        "expected an (inputs, targets) pair of tensors (or of objects with a .to(device) method)"
    )


@pytest.mark.timeout(90)
def test_a_child_that_exits_2_is_not_restarted_and_its_error_is_on_the_console(procs: ProcessGroup, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = procs.start("local", [*LOCAL, "--steps", "50", "--run-dir", run_dir, "--data", "tests.integration.cli.bad_plugins:too_short"])
    assert local.wait(60) == 2
    err, out = local.stderr(), local.stdout()
    assert re.search(r"rpcps local: worker[01] exited with 2 \(a bad flag or setting.*\); a restart cannot fix that", err), err
    assert re.search(r"  worker[01]: rpcps worker: error: --data 'tests.integration.cli.bad_plugins:too_short' \(slot [01] of 2\) "
                     r"ended before step 3 of --steps 50", err), err
    assert "restart 1/" not in out + err, "a child that exited 2 must not be restarted"
    assert all(n == 0 for n in (c["restarts"] for c in json.loads((run_dir / "children.json").read_text()).values()))


@pytest.mark.timeout(150)
def test_after_a_server_kill_the_console_says_resumed_and_counts_the_servers_version(procs: ProcessGroup, tmp_path: Path) -> None:
    run_dir, checkpoints = tmp_path / "run", tmp_path / "ckpt"
    local = procs.start("local", [*LOCAL, *PACED, "--steps", "600", "--run-dir", run_dir, "--checkpoint-dir", checkpoints,
                                  "--checkpoint-every-updates", "100"])
    children = wait_until(lambda: _children(run_dir), 30, "local's children.json")
    port = children["ps"]["metrics_port"]
    wait_until(lambda: try_scrape(port).get("rpcps_checkpoint_last_version", 0) >= 100 or not local.alive(), 60,
               "a checkpoint of version >= 100")
    assert local.alive(), local.tail()
    os.kill(children["ps"]["pid"], signal.SIGKILL)  # the server local started, named by local itself
    assert local.wait(120) == 0, local.tail()
    out = local.stdout()
    assert re.search(r"rpcps local: ps was killed by SIGKILL; restart 1/3 in 0\.5s", out), out
    resumed = re.findall(r"rpcps local: ps resumed from version (\d+) \(snapshot step-\d+\)", out)
    assert resumed and int(resumed[0]) >= 100, out
    server = json.loads((run_dir / "ps.summary.json").read_text())
    assert _final_version(out) == server["model_version"], (out, server)
    assert server["model_version"] >= 1200, "every step of both slots is held by the end"
    for i in range(2):  # the expected loss of the server is a line or two in a worker's log, not torch's C++ frames
        text = (run_dir / f"worker{i}.log").read_text()
        assert "frame #" not in text and "Traceback" not in text, text


@pytest.mark.timeout(90)
def test_without_checkpoints_local_says_so_once_and_its_children_do_not_warn(procs: ProcessGroup, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = procs.start("local", ["local", "--workers", "1", "--steps", "30", "--progress-s", "1", "--run-dir", run_dir])
    assert local.wait(60) == 0, local.tail()
    out = local.stdout()
    assert out.count(CHECKPOINTING_OFF) == 1, out
    assert "--checkpoint-dir DIR" in CHECKPOINTING_OFF, "it says how to turn checkpoints on"
    for log in sorted(run_dir.glob("*.log")):
        text = log.read_text()
        assert " WARNING " not in text, f"{log.name} warns about a choice local made and said:\n{text}"
    assert re.search(r" INFO .*checkpointing is off", (run_dir / "ps.log").read_text()), "still in the server's log, at INFO"


@pytest.mark.timeout(150)
def test_a_normal_run_logs_quietly_exports_only_its_series_and_a_rerun_says_nothing_is_left(
    procs: ProcessGroup, tmp_path: Path
) -> None:
    run_dir, checkpoints = tmp_path / "run", tmp_path / "ckpt"
    argv = [*LOCAL, *PACED, "--steps", "300", "--checkpoint-dir", checkpoints,
            "--eval-data", "rpcps.tasks:teacher_student_held_out", "--every-seconds", "1"]
    local = procs.start("local", [*argv, "--run-dir", run_dir])
    children = wait_until(lambda: _children(run_dir), 30, "local's children.json")
    # Every family is registered at start-up: any answer of the live server shows them all.
    metrics = wait_until(lambda: try_scrape(children["ps"]["metrics_port"]) or not local.alive(), 30, "the server's /metrics")
    assert local.alive(), local.tail()
    assert "rpcps_server_model_version" in metrics
    assert [k for k in metrics if k.startswith(("rpcps_sparse_", "rpcps_replica"))] == [], "a dense single-server job"
    port = children["worker0"]["metrics_port"]
    worker = wait_until(lambda: (m := try_scrape(port)).get("rpcps_worker_steps_total", 0) > 0 and m or not local.alive(), 30,
                        "a training step on worker0's /metrics")
    assert local.alive(), local.tail()
    assert [k for k in worker if k.startswith("rpcps_worker_sparse_")] == [], "a worker of a dense model"
    assert local.wait(120) == 0, local.tail()

    out = local.stdout()
    assert "\r" not in out, "stdout is a file here: plain lines, no progress bar"
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert progress, out
    for line in progress:
        assert "nan" not in line and "0.0000" not in line, f"a placeholder in the progress line {line!r}"
    final = out.splitlines()[-1]
    assert re.match(r"rpcps local: done in [\d.]+s: model version 600, loss [\d.]+ -> [\d.]+, .*; held-out loss [\d.]+, "
                    r"accuracy [\d.]+ at version 600$", final), final
    for log in sorted(run_dir.glob("*.log")):
        text = log.read_text()
        for noise in ("Traceback", " WARNING ", "[W", "frame #"):
            assert noise not in text, f"{log.name} holds {noise!r}:\n{text}"

    again = procs.start("local-again", [*argv, "--run-dir", tmp_path / "again"])
    assert again.wait(90) == 0, again.tail()
    out = again.stdout()
    assert re.search(r"rpcps local: ps resumed from version 600 \(snapshot step-0*600\)", out), out
    assert f"rpcps local: nothing left to train: the checkpoint in {checkpoints} already holds 300 steps" in out, out
    assert _final_version(out) == 600 and "(0 updates in this run)" in out, out
    assert "model version 0" not in out, "a server that is still restoring has no version to show yet"


@pytest.mark.timeout(150)
def test_under_log_level_warning_local_still_sees_its_servers_serve_and_counts_a_resumed_run(
    procs: ProcessGroup, tmp_path: Path
) -> None:
    """The servers' info lines (serving, resumed from) never come at WARNING: local learns both from
    the server's health and /metrics instead (it used to wait for the line 120 s and fail the run),
    and still tells its console what the run resumed from."""
    checkpoints = tmp_path / "ckpt"
    argv = ["local", "--workers", "1", "--checkpoint-dir", checkpoints, "--log-level", "WARNING"]
    first = procs.start("local", [*argv, "--steps", "20", "--run-dir", tmp_path / "first"])
    assert first.wait(90) == 0, first.tail()
    assert _final_version(first.stdout()) == 20
    assert " INFO " not in (tmp_path / "first" / "ps.log").read_text(), "the server kept to WARNING"
    again = procs.start("local-again", [*argv, "--steps", "40", "--run-dir", tmp_path / "again"])
    assert again.wait(90) == 0, again.tail()
    out = again.stdout()
    assert _final_version(out) == 40 and "(20 updates in this run)" in out, out
    assert "resumed from version 20" in out, "the console says the run resumed, though the server's log kept to warnings"
