"""Recovery with real processes: kill -9, SIGSTOP, SIGTERM, stray connections, broken disks.

Each test asserts on what survives (ledger, snapshots on disk, metrics, exit codes); none sleeps to
synchronise: they poll metrics or files with deadlines.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.faults import ChaosPlan, FailPoint, Kill, run_chaos
from harness.procs import Proc, ProcessGroup, free_port, try_scrape, wait_until
from harness.snapshots import verify_all
from ps.checkpoints.snapshot_files import list_snapshots
from tests.integration.checkpoints import newest_snapshot, tensors_of
from tests.integration.conftest import UNTRAINED_LOSS
from tests.integration.conftest import model_version as version

pytestmark = pytest.mark.integration



# Recovery takes 3-4 s here (docs/BENCHMARKS.md, tools/chaos.py); the tests promise only that it
# happens, with a limit a loaded two-core machine keeps (a recovery once took 13.4 s under load).
RECOVERY_LIMIT_S = 60.0
EXACT = ("--mode", "sync", "--optimizer", "sgd", "--optimizer-args", '{"lr": 0.05, "momentum": 0.9}', "--threads", "1")
"""Deterministic training: one worker in sync mode computes every step on the parameters of the step
before it, so two runs of the same job end bit-identical, and anything a resume gets wrong shows.
Threads pinned: the host's budget otherwise follows the other tests' processes, and a worker that
computed some steps on 2 threads sums their gradients in another order (CI-like run, 2026-12-03:
the worker went 1 -> 2 -> 1 threads and the resumed run differed in the last bits; docs/DEPLOY.md)."""


@pytest.mark.timeout(300)
def test_kill_9_of_server_and_worker_mid_training_recovers_with_nothing_applied_twice(tmp_path: Path) -> None:
    plan = ChaosPlan(workers=2, steps=600, checkpoint_every_updates=100,
                     kills=(Kill("ps", 300), Kill("worker1", 600), Kill("ps", 900)), timeout_s=240)
    result = run_chaos(plan, tmp_path / "chaos")
    assert result.problems(plan) == [], (tmp_path / "chaos" / "local.log").read_text()[-3000:]
    assert result.ledger.restarts == 3, "the server was started once and restarted after each of its two kills"
    assert len(result.recovery_s) == 2 and all(r < RECOVERY_LIMIT_S for r in result.recovery_s), result.recovery_s
    assert result.summary["restarts"] == {"ps": 2, "worker0": 0, "worker1": 1}
    # Catches a run that recovered into garbage (NaN, diverged). It cannot catch a resume that lost
    # the trained state: the built-in task's loss is on its plateau (~1.2) within ~100 updates, so a
    # model reset at update 900 ends as low. The exact test below holds resume to the state itself.
    assert result.summary["final_loss"] < 0.75 * UNTRAINED_LOSS, result.summary


@pytest.mark.timeout(240)
def test_a_server_killed_mid_run_ends_bit_identical_to_an_undisturbed_run(tmp_path: Path) -> None:
    """kill -9 of the server, resume from its snapshot, the lost steps recomputed: the final parameters
    and momentum equal those of a run never disturbed, bit for bit.

    Catches a resume that restores the version but not the parameters or the optimizer state, a
    worker that resumes its data at another step than the snapshot recorded, and a step applied
    twice or skipped around the crash.
    """
    common = {"workers": 1, "steps": 200, "checkpoint_every_updates": 100, "extra_args": EXACT, "timeout_s": 180}
    baseline_plan = ChaosPlan(**common)
    baseline = run_chaos(baseline_plan, tmp_path / "baseline")
    assert baseline.problems(baseline_plan) == [], (tmp_path / "baseline" / "local.log").read_text()[-3000:]
    # The server kills itself as it applies update 130 (a signal sent on seeing version 130 came after
    # this 200-update run had finished once: 200 updates take about a second).
    plan = ChaosPlan(**common, kills=(FailPoint("server.after_apply", 130),))
    killed = run_chaos(plan, tmp_path / "killed")
    assert killed.problems(plan) == [], (tmp_path / "killed" / "local.log").read_text()[-3000:]
    assert killed.ledger.restarts == 2 and killed.ledger.updates_lost[0] > 0, "resumed from the snapshot at 100, then recomputed"

    _, expected = newest_snapshot(tmp_path / "baseline" / "checkpoints")
    _, actual = newest_snapshot(tmp_path / "killed" / "checkpoints")
    assert actual["version"] == expected["version"] == 200
    expected_tensors, actual_tensors = tensors_of(expected), tensors_of(actual)
    assert any("momentum_buffer" in key for key in expected_tensors), "the optimizer state is compared too"
    assert actual_tensors.keys() == expected_tensors.keys()
    differ = [key for key, value in expected_tensors.items() if not torch.equal(actual_tensors[key], value)]
    assert differ == [], f"the resumed run ended elsewhere in {differ}"


@pytest.mark.timeout(120)
def test_sigterm_writes_a_final_snapshot_of_the_last_version(procs: ProcessGroup, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ps, port, mport = procs.ps("ps", "--checkpoint-dir", str(ckpt), "--checkpoint-every-seconds", "3600",
                               "--summary-json", str(tmp_path / "ps.json"))
    procs.worker("w0", port, 0, 1, "--steps", "100000")
    wait_until(lambda: version(mport) >= 50, 60, "50 updates")
    ps.send(signal.SIGTERM)
    assert ps.wait(30) == 0
    import json

    final = json.loads((tmp_path / "ps.json").read_text())["model_version"]
    snapshots = list_snapshots(ckpt)
    assert snapshots and snapshots[0].name == f"step-{final:012d}"
    assert verify_all(ckpt) == {snapshots[0]: None}


@pytest.mark.timeout(150)
def test_hung_server_is_waited_out_not_treated_as_dead(procs: ProcessGroup) -> None:
    ps, port, mport = procs.ps("ps")
    w0, wport = procs.worker("w0", port, 0, 1, "--steps", "600", "--rpc-timeout-s", "1", "--max-retries", "40")
    wait_until(lambda: version(mport) >= 20, 60, "training to start")
    ps.freeze()
    try:
        wait_until(lambda: try_scrape(wport).get("rpcps_worker_retries_total", 0) >= 2, 30, "the worker to retry")
        assert w0.alive(), "a hung server must not make the worker exit"
    finally:
        ps.thaw()
    assert w0.wait(120) == 0
    metrics_after = try_scrape(mport)
    assert metrics_after["rpcps_server_model_version"] == 600, "every step applied exactly once despite the retries"
    assert "lost the server" not in w0.stderr(), "a hang is not a death: no reconnect"


@pytest.mark.timeout(150)
def test_stray_connections_to_every_port_do_not_take_the_system_down(procs: ProcessGroup, tmp_path: Path) -> None:
    control_port = free_port()
    ps, port, mport = procs.ps("ps", "--checkpoint-dir", str(tmp_path / "ckpt"), "--control-port", str(control_port),
                               "--control-addr", "127.0.0.1")
    w0, _ = procs.worker("w0", port, 0, 2, "--steps", "1500")
    wait_until(lambda: version(mport) >= 20, 60, "training to start")
    for target in (port, mport, control_port):  # store, metrics, control: a scanner and some garbage
        for payload in (b"", b"GET / HTTP/1.0\r\n\r\n", bytes(range(256)) * 4):
            with socket.create_connection(("127.0.0.1", target), timeout=5) as s:
                if payload:
                    s.sendall(payload)
    before = version(mport)
    wait_until(lambda: version(mport) > before + 20, 30, "training to go on after the scan")
    # TensorPipe's own listener closes on a bare connect; the server notices, keeps serving w0, and
    # restarts itself from a fresh snapshot (same pid: it re-executes) once a new process wants to
    # join (ps/lifecycle/listener_recovery.py); the workers rejoin.
    tp_port = _tensorpipe_port(ps.pid, exclude={port, mport, control_port})
    socket.create_connection(("127.0.0.1", tp_port), timeout=5).close()
    wait_until(lambda: "was closed by a stray connection" in ps.stderr(), 30, "the server to notice its closed listener")
    w1, _ = procs.worker("w1", port, 1, 2, "--steps", "30")
    assert w1.wait(90) == 0, "a new worker must still be able to join"
    assert "restarting this server to listen again: a process is trying to join" in ps.stderr()
    assert w0.wait(120) == 0
    assert ps.alive()
    # The restarted server went on from the snapshot it took, not from scratch: catches a restart
    # that loses the trained state (it would resume nothing, or from an older periodic snapshot).
    metrics = try_scrape(mport)
    assert metrics["rpcps_server_resumes_total"] == 1 and metrics["rpcps_server_resumed_from_version"] >= before + 20


@pytest.mark.timeout(90)
def test_a_lost_rpc_listener_stays_counted_after_the_server_restarts_itself(procs: ProcessGroup) -> None:
    ps, port, mport = procs.ps("ps")
    wait_until(lambda: "serving on" in ps.stderr(), 60, "the server to serve")
    tp_port = _tensorpipe_port(ps.pid, exclude={port, mport, _control_port(ps)})
    socket.create_connection(("127.0.0.1", tp_port), timeout=5).close()
    wait_until(lambda: "was closed by a stray connection" in ps.stderr(), 30, "the server to notice its closed listener")
    # The restart waits for a process that wants to join (ps/lifecycle/listener_recovery.py).
    procs.worker("w0", port, 0, 1, "--steps", "5")
    wait_until(lambda: try_scrape(mport).get("rpcps_server_resumes_total", 0) == 1, 60, "the server to restart itself")
    assert try_scrape(mport)["rpcps_server_rpc_listener_lost_total"] == 1, "the loss must stay visible to Prometheus"


def _control_port(ps: Proc) -> int:
    found = re.search(r"control plane on 127\.0\.0\.1:(\d+)", ps.stderr())
    assert found, ps.stderr()
    return int(found.group(1))


def _tensorpipe_port(pid: int, exclude: set[int]) -> int:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    ports = {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if f"pid={pid}," in line}
    (tp,) = ports - exclude
    return tp


@pytest.mark.timeout(120)
def test_resume_into_a_different_model_is_refused_with_a_clear_message(procs: ProcessGroup, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ps, port, mport = procs.ps("ps", "--checkpoint-dir", str(ckpt))
    procs.worker("w0", port, 0, 1, "--steps", "100000")
    wait_until(lambda: version(mport) >= 10, 60, "training to start")
    ps.send(signal.SIGTERM)
    assert ps.wait(30) == 0
    plugin = tmp_path / "plugins"
    plugin.mkdir()
    (plugin / "other_model.py").write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    """))
    other, _, _ = procs.ps("ps2", "--checkpoint-dir", str(ckpt), "--model", "other_model:build",
                           extra_pythonpath=[plugin])
    assert other.wait(60) == 2
    err = other.stderr()
    assert "different model" in err and "'0.weight'" in err and "Traceback" not in err


@pytest.mark.timeout(120)
def test_resume_skips_a_corrupt_newest_snapshot_and_says_so(procs: ProcessGroup, tmp_path: Path) -> None:
    """A real server resumes from the newest snapshot that verifies, names the one it skipped and why,
    and moves that one aside. Catches a resume that loads a corrupt file, gives up, or starts fresh."""
    ckpt = tmp_path / "ckpt"
    ps, port, _ = procs.ps("ps", "--checkpoint-dir", str(ckpt), "--checkpoint-every-updates", "10", "--keep-checkpoints", "5")
    worker, _ = procs.worker("w0", port, 0, 1, "--steps", "30")
    assert worker.wait(90) == 0, worker.tail()
    ps.send(signal.SIGTERM)
    assert ps.wait(30) == 0
    newest, older = list_snapshots(ckpt)[:2]
    assert newest.name == "step-000000000030", list_snapshots(ckpt)
    older_version = int(older.name.removeprefix("step-"))
    state = newest / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: the size still matches, only the checksum can tell
    state.write_bytes(bytes(data))

    resumed, _, mport = procs.ps("ps2", "--checkpoint-dir", str(ckpt))
    wait_until(lambda: "serving on" in resumed.stderr(), 60, "the second server to resume and serve")
    metrics = try_scrape(mport)
    assert metrics["rpcps_server_resumed_from_version"] == metrics["rpcps_server_model_version"] == older_version
    err = resumed.stderr()
    assert f"skipping snapshot {newest}: {state} fails its SHA-256 checksum (corrupted)" in err, err
    assert f"resumed from {older} at version {older_version}" in err, err
    assert not newest.exists() and [p.name.startswith(".invalid-step-000000000030") for p in ckpt.iterdir()].count(True) == 1


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: small enough to fill on purpose. Needs root (CI runs as root)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.timeout(150)
def test_full_then_read_only_disk_keeps_training_and_previous_snapshots(procs: ProcessGroup, tiny_disk: Path) -> None:
    ckpt = tiny_disk / "ckpt"
    ps, port, mport = procs.ps("ps", "--checkpoint-dir", str(ckpt), "--checkpoint-every-seconds", "0.5",
                               "--keep-checkpoints", "1")
    procs.worker("w0", port, 0, 1, "--steps", "100000")
    first = wait_until(lambda: list_snapshots(ckpt), 60, "a first snapshot")[0]
    failures = "rpcps_checkpoint_failures_total"

    filler = tiny_disk / "filler"
    with open(filler, "wb") as f:  # fill the disk to the last block
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    wait_until(lambda: try_scrape(mport).get(failures, 0) >= 2, 30, "snapshot writes to fail on a full disk")
    v = version(mport)
    wait_until(lambda: version(mport) > v + 20, 30, "training to go on with a full disk")
    assert all(why is None for why in verify_all(ckpt).values()), "failed writes must not damage what is there"
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp-")], "no half-written snapshot left behind"

    filler.unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True)
    seen = try_scrape(mport).get(failures, 0)
    wait_until(lambda: try_scrape(mport).get(failures, 0) > seen, 30, "writes to fail on a read-only disk")
    subprocess.run(["mount", "-o", "remount,rw", str(tiny_disk)], check=True)
    newest_before = list_snapshots(ckpt)[0]
    wait_until(lambda: list_snapshots(ckpt)[0] != newest_before, 30, "the next write to succeed once the disk is back")
    assert ps.alive()
    # Stopped before the last check: a snapshot every 0.5 s with --keep-checkpoints 1 replaces the
    # newest under a check made while it runs (CI once read a manifest that was pruned meanwhile).
    ps.send(signal.SIGTERM)
    assert ps.wait(60) == 0, ps.tail()
    assert first != list_snapshots(ckpt)[0]
    assert all(why is None for why in verify_all(ckpt).values())
