"""A training loop of the user's own (``worker.api``) keeps every rpcps guarantee, with real processes.

``examples/own_loop.py`` (a dict-output transformer, two loss terms, accumulation 2, clipping, bf16
autocast) runs as ``rpcps local``'s workers (``--worker-script``). The server is killed -9 mid-run,
or the primary of a replicated shard; the audit ledger must show every (slot, step) applied exactly
once and the final version equal to workers x steps (``harness.ledger``). In bounded mode pushes are
refused as stale and come back as replays: the script logs each step once.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

import pytest

from harness.faults import ChaosPlan, Kill, run_chaos
from harness.procs import REPO, ProcessGroup, try_scrape
from tests.integration.conftest import model_version

pytestmark = pytest.mark.integration

SCRIPT = REPO / "examples" / "own_loop.py"
STEP_LINE = re.compile(r"^step (\d+) loss ", re.MULTILINE)


def own_loop(*script_args: str) -> tuple[str, ...]:
    """Flags of ``rpcps local`` that run the example (with ``script_args``) as the workers; small
    batches: these tests are about exactly-once, not about the loss."""
    return (
        "--worker-script", " ".join((str(SCRIPT), "--batch-size", "4", *script_args)),
        "--model", "rpcps.examples.charlm_hf:model", "--optimizer", "adam", "--optimizer-args", '{"lr": 0.001}',
    )


def _step_lines(run_dir: Path, workers: int) -> dict[int, collections.Counter[int]]:
    return {i: collections.Counter(int(m) for m in STEP_LINE.findall((run_dir / f"worker{i}.log").read_text())) for i in range(workers)}


@pytest.mark.timeout(420)
def test_own_loop_survives_kill_9_of_the_server_with_every_step_applied_once(tmp_path: Path) -> None:
    plan = ChaosPlan(workers=2, steps=40, checkpoint_every_updates=20, kills=(Kill("ps", 30),), timeout_s=360,
                     extra_args=own_loop("--log-every", "1"))
    result = run_chaos(plan, tmp_path / "run")
    log = (tmp_path / "run" / "local.log").read_text()[-3000:]
    assert result.problems(plan) == [], log
    assert result.ledger.restarts == 2, "the server was started once and restarted after the kill"
    assert all(w.get("durable") for w in result.summary["workers"]), result.summary["workers"]
    lines = _step_lines(tmp_path / "run", 2)
    assert all(set(c) >= set(range(40)) for c in lines.values()), "every step of every slot was logged"


@pytest.mark.timeout(420)
def test_own_loop_survives_the_loss_of_a_replicated_primary(tmp_path: Path) -> None:
    plan = ChaosPlan(workers=2, steps=40, checkpoint_every_updates=20, kills=(Kill("primary", 30),), replicas=2,
                     timeout_s=360, extra_args=own_loop())
    result = run_chaos(plan, tmp_path / "run")
    assert result.problems(plan) == [], (tmp_path / "run" / "local.log").read_text()[-3000:]


@pytest.mark.timeout(420)
def test_bounded_mode_replays_steps_and_the_script_logs_each_step_once(tmp_path: Path) -> None:
    plan = ChaosPlan(workers=2, steps=30, checkpoint_every_updates=20, timeout_s=360,
                     extra_args=(*own_loop("--log-every", "1"), "--mode", "bounded", "--max-staleness", "0"))
    result = run_chaos(plan, tmp_path / "run")
    assert result.problems(plan) == [], (tmp_path / "run" / "local.log").read_text()[-3000:]
    assert result.summary["server"]["pushes_stale"] > 0, "no push was refused: nothing was replayed, the test proves nothing"
    for slot, counts in _step_lines(tmp_path / "run", 2).items():
        assert sorted(counts) == list(range(30)), f"worker{slot} did not log every step"
        assert [s for s, n in counts.items() if n > 1] == [], f"worker{slot} logged a replayed step twice"


SERVER = ("--model", "rpcps.examples.charlm_hf:model", "--optimizer", "adam", "--optimizer-args", '{"lr": 0.001}')


@pytest.mark.timeout(240)
def test_fp16_steps_a_grad_scaler_skips_are_recorded_and_change_nothing(procs: ProcessGroup, tmp_path: Path) -> None:
    """A loss scale that overflows fp16 makes the GradScaler skip steps: the script ends them with
    ``step.skip()``, the server records them (no update), and the slot still finishes durable."""
    _, port, mport = procs.ps("ps", *SERVER, "--checkpoint-dir", str(tmp_path / "ckpt"))
    worker = procs.start("w0", ["--ps", f"127.0.0.1:{port}", "--steps", "6", "--batch-size", "2", "--metrics-port", "0",
                                "--precision", "fp16", "--init-scale", "1e30", "--summary-json", str(tmp_path / "w0.json")],
                         script=SCRIPT)
    assert worker.wait(180) == 0, worker.tail()
    metrics = try_scrape(mport)
    skipped = metrics["rpcps_server_pushes_skipped_total"]
    assert skipped >= 1, "the scale must overflow at least once, or the skip path is not exercised"
    assert metrics["rpcps_server_model_version"] + skipped == 6, "each step applied or skipped, once"
    assert json.loads((tmp_path / "w0.json").read_text())["durable"] is True


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["by-hand", "torchrun"])
def test_the_example_starts_by_hand_and_under_torchrun(launcher: str, procs: ProcessGroup, tmp_path: Path) -> None:
    """The same script, two launchers: slots from --worker-index/--num-workers, or from torchrun's
    RANK/WORLD_SIZE (``--ps`` names the server: torchrun's MASTER_PORT is its own store)."""
    _, port, mport = procs.ps("ps", *SERVER, "--checkpoint-dir", str(tmp_path / "ckpt"))
    common = ("--ps", f"127.0.0.1:{port}", "--steps", "6", "--batch-size", "2", "--log-every", "1", "--metrics-port", "0")
    if launcher == "by-hand":
        workers = [procs.start(f"w{i}", [*common, "--worker-index", str(i), "--num-workers", "2"], script=SCRIPT) for i in (0, 1)]
    else:
        run = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT))
        workers = [procs.start("torchrun", common, program=run)]
    for worker in workers:
        assert worker.wait(180) == 0, worker.tail()
    assert model_version(mport) == 12, "2 slots x 6 steps, each applied once"
    logged = "".join(w.stdout() for w in workers)
    assert sorted(int(s) for s in STEP_LINE.findall(logged)) == sorted([*range(6), *range(6)])
